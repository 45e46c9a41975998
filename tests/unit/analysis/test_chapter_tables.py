"""tools/reproduce.py: every chapter table is produced, with the figures the corrections call for;
what the tables print comes from this run or from measured files in the repository."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from analysis import estimator as est
from analysis.chapter_measurements import measure_formats
from analysis.chapter_tables import (
    BENCH_TRAIN_CPU,
    CHAPTER_FORMATS,
    PARALLEL_CPU,
    Measured,
    build_tables,
    format_from_layout,
    priority_table,
)
from common.hardware import DEVICES
from common.report import read_results, rows_path, write_results

ROOT = Path(__file__).resolve().parents[3]
TABLES = ("numeric_formats", "precision_modes", "activation_recompute", "attention", "data_formats",
          "communication", "priority")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_reuse_without_saved_measurements_is_a_one_line_error(tmp_path):
    from tools import reproduce

    with pytest.raises(SystemExit, match="cpu_measurements.json does not exist; run once without it"):
        reproduce.main(["--reuse-measurements", "--out", str(tmp_path), "--device", "cpu"])


def test_format_formulas_equal_torch_finfo():
    measured = measure_formats()
    for label, (bits, _, exponent, mantissa, _, _) in CHAPTER_FORMATS.items():
        got = measured[label]
        assert (got["bits"], got["exponent_bits"], got["mantissa_bits"]) == (bits, exponent, mantissa)
        analytic = format_from_layout(exponent, mantissa, finite_only=label == "FP8 (E4M3)")
        for key in ("max", "min_normal", "min_subnormal"):
            assert analytic[key] == got[key], (label, key)
    # docs/chapter_corrections.md, 1: E4M3 448 / 2^-6 / 2^-9, no inf; E5M2 57344 / 2^-14 / 2^-16
    assert (measured["FP8 (E4M3)"]["max"], measured["FP8 (E4M3)"]["min_subnormal"]) == (448.0, 2.0**-9)
    assert (measured["FP8 (E5M2)"]["max"], measured["FP8 (E5M2)"]["min_subnormal"]) == (57344.0, 2.0**-16)
    assert measured["FP8 (E4M3)"]["inf_casts_to"] != float("inf")


def test_tables_without_measurements_say_what_is_missing():
    tables = {t.name: t for t in build_tables(Measured(formats=measure_formats()))}
    assert set(tables) == set(TABLES)
    for table in tables.values():
        assert table.rows and all(len(row) == len(table.columns) for row in table.rows), table.name
    precision = tables["precision_modes"].markdown()
    assert "does not fit in 80 GiB" in precision and "needs GPU" in precision
    assert "run tools/bench_memory.py" in tables["activation_recompute"].markdown()
    communication = tables["communication"].markdown()
    assert "126 steps" in communication and "leader-based (chapter)" in communication


def test_saved_gpu_results_fill_the_needs_gpu_cells():
    gpu_attention = {
        "hardware": "NVIDIA H200", "date": "2026-01-01", "setup": "b=4, heads=16, s=4096, d_head=128, bfloat16",
        "saved_bytes": {"reference": 8, "sdpa": 1}, "saved_ratio": 8.0,
        "seconds": {"reference": 0.004, "sdpa": 0.001}, "speedup": 4.0,
    }
    tables = {t.name: t for t in build_tables(Measured(formats=measure_formats(), gpu={"attention": gpu_attention}))}
    attention = tables["attention"].markdown()
    assert "4.00 ms / 1.00 ms (4.0×)" in attention and "NVIDIA H200, 2026-01-01" in attention
    assert "needs GPU" not in attention


# --------------------------------------------------------------------------- provenance of what is printed

# The rows tools/bench_train.py and tools/bench_parallel.py write as JSON next to their Markdown.
BENCH_TRAIN_ROWS = {
    "title": "bench_train: configs/tiny.yaml on CPU, torch 9.9, 2030-01-01; median of 10 steps",
    "rows": [
        {"variant": "precision.mode=fp32", "step_s": 0.2, "tokens_per_s": 1000.0, "status": "ok"},
        {"variant": "precision.mode=bf16", "step_s": 0.1, "tokens_per_s": 2000.0, "status": "ok"},
        {"variant": "precision.mode=bf16 train.compile=true", "step_s": 0.08, "tokens_per_s": 2500.0, "status": "ok"},
    ],
}


def _states(kib: float) -> dict:
    return {"params": kib * 1024 / 4, "grads": kib * 1024 / 4, "optimizer": kib * 1024 / 2, "buffers": 0}


PARALLEL_ROWS = {
    "title": "Data-parallel strategies on CPU (gloo, 2 processes, 2030-01-01)",
    "rows": [
        {"strategy": "ddp", "loss": 3.7, "delta": -1.0e-07, "measured": _states(1000), "formula": _states(1000),
         "status": "ok"},
        {"strategy": "fsdp", "loss": 3.7, "delta": -2.0e-07, "measured": _states(250), "formula": _states(250),
         "status": "ok"},
    ],
}


def _row(table, technique: str) -> list[str]:
    return next(row for row in table.rows if row[1] == technique)


def test_priority_table_quotes_measured_files_or_says_not_measured():
    documents = {BENCH_TRAIN_CPU: BENCH_TRAIN_ROWS, PARALLEL_CPU: PARALLEL_ROWS}
    quoted = priority_table(Measured(formats={}, documents=documents))
    compile_cell = _row(quoted, "torch.compile")[-1]
    # the compiled bf16 variant against its eager twin (2,500 / 2,000), not against the first row
    assert "1.25× tokens/s for precision.mode=bf16 train.compile=true" in compile_cell
    assert BENCH_TRAIN_CPU in compile_cell and "2030-01-01" in compile_cell
    sharding = _row(quoted, "FSDP / ZeRO")[-1]
    assert "250 KiB (fsdp) vs 1,000 KiB (ddp), 0.25×" in sharding and PARALLEL_CPU in sharding
    bare = priority_table(Measured(formats={}))
    assert _row(bare, "torch.compile")[-1].startswith("not measured")
    assert _row(bare, "FSDP / ZeRO")[-1].startswith("not measured")


def test_data_formats_table_quotes_the_loader_rows_of_bench_data():
    document = {
        "title": "Data loader throughput vs model consumption (CPU, torch 9.9, 2030-01-01)",
        "setting": "seq_len 1024, tokenizer byte, 20 timed batches per row",
        "rows": [{"format": "mmap", "workers": 0, "batch": 8, "tokens_per_s": 1234567.8},
                 {"format": "naive", "workers": 2, "batch": 8, "tokens_per_s": 1000.0}],
    }
    table = {t.name: t for t in build_tables(Measured(formats=measure_formats(), data_bench=document))}["data_formats"]
    cells = {row[0]: row[-1] for row in table.rows}
    assert cells["MMAP Binary"] == "1,234,568 tokens/s (workers 0, batch 8)"
    assert cells["CSV/JSON"] == "raw text tokenized on the fly: 1,000 tokens/s (workers 2, batch 8)"
    assert cells["WebDataset (TAR)"] == "run tools/bench_data.py"
    assert "Loader throughput (seq_len 1024, tokenizer byte, 20 timed batches per row)" in table.markdown()


def test_reproduce_reads_the_rows_other_tools_wrote_never_their_markdown(tmp_path):
    from tools import reproduce

    write_results(tmp_path / BENCH_TRAIN_CPU, "| variant |\n|---|\n| not read |\n", BENCH_TRAIN_ROWS["title"],
                  BENCH_TRAIN_ROWS["rows"])
    (tmp_path / PARALLEL_CPU).write_text("# a Markdown table without its rows is not read\n")
    documents = reproduce.read_measured_documents(tmp_path)
    assert documents[BENCH_TRAIN_CPU] == BENCH_TRAIN_ROWS
    # no rows in --out: the repository's committed ones
    assert documents[PARALLEL_CPU] == read_results(rows_path(ROOT / "docs" / "results" / PARALLEL_CPU))


def test_committed_priority_table_quotes_the_committed_measurements():
    results = ROOT / "docs" / "results"
    documents = {name: read_results(rows_path(results / name)) for name in (BENCH_TRAIN_CPU, PARALLEL_CPU)}
    expected = priority_table(Measured(formats={}, documents=documents))
    committed = (results / "priority.md").read_text()
    for technique in ("torch.compile", "FSDP / ZeRO"):
        assert _row(expected, technique)[-1] in committed, technique


def test_committed_tables_are_what_the_code_and_its_yaml_render_from_the_saved_measurements():
    """docs/results/ as `python -m tools.reproduce --reuse-measurements` rebuilds it; the formats
    table is left out (its measured column is this machine's torch.finfo and torch version)."""
    from tools import reproduce

    results = ROOT / "docs" / "results"
    measurements = json.loads((results / reproduce.CPU_RESULTS).read_text())
    measured = reproduce.assemble(measurements, torch.device("cpu"), {}, results)
    tables = [t for t in build_tables(measured) if t.name != "numeric_formats"]
    assert len(tables) == len(TABLES) - 1
    for table in tables:
        assert table.markdown() == (results / f"{table.name}.md").read_text(), table.name


def test_regenerated_docs_state_the_planners_gpu_count():
    gpt3 = est.preset("gpt3-175b")
    need = est.min_gpus_to_fit(gpt3.model, gpt3.seq_len, DEVICES["H100"], "bf16_master")
    text = (ROOT / "docs" / "results" / "precision_modes.md").read_text()
    assert f"(FSDP, full recompute, micro-batch 1): {need} " in text


# Names of material that lives outside this repository; nothing in it may point there. Assembled
# from pieces so that this file does not match itself.
OUTSIDE_REFERENCES = ["CORRECTIONS" + ".md", "FIELD" + "-NOTES", "FIELD" + "_NOTES", "chapter" + ".txt",
                      ".." + "/shared", "shared/" + "seed", "seed" + "/"]
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", "runs", "build", "wandb", "gpu_results"}


def _repository_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split("\n")
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
            files += [Path(folder) / n for n in names]
        return files


def test_no_file_in_the_repository_refers_to_material_outside_it():
    offenders = []
    for path in _repository_files():
        data = path.read_bytes()
        if b"\0" in data[:4096]:
            continue  # binary (PNG)
        text = data.decode("utf-8", errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {ref}" for ref in OUTSIDE_REFERENCES if ref in text]
    assert not offenders, offenders


def _test_functions(path: Path) -> set[str]:
    """Names pytest collects as tests in ``path``: test_* functions, also inside Test* classes."""
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")):
        methods = (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test"))
        names |= {f"{cls.name}::{n.name}" for n in methods}
    return names


def test_every_chapter_correction_names_tests_that_exist():
    text = (ROOT / "docs" / "chapter_corrections.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    assert len(sections) >= 5
    for section in sections:
        title = section.splitlines()[0]
        ids = re.findall(r"`(tests/[\w/]+\.py)::([\w:]+)`", section)
        assert ids, f"correction {title!r} names no test"
        for file, name in ids:
            assert (ROOT / file).is_file(), f"{title!r}: {file} does not exist"
            assert name in _test_functions(ROOT / file), f"{title!r}: {file}::{name} is not a test there"
    # the tables' module points at this list
    assert "docs/chapter_corrections.md" in (ROOT / "analysis" / "chapter_tables.py").read_text()


def test_measurements_saved_before_a_key_was_renamed_still_load():
    # cpu_measurements.json files written before model.checkpointing became model.recompute
    from tools.reproduce import saved_model_config

    cfg = saved_model_config({"n_layer": 2, "checkpointing": "full", "checkpoint_every_k": 3})
    assert (cfg.n_layer, cfg.recompute, cfg.recompute_every_k) == (2, "full", 3)
    # and before the flat model.moe_* keys became the model.moe section
    cfg = saved_model_config({"n_layer": 2, "moe_experts": 4, "moe_top_k": 1, "moe_backend": "loop"})
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.backend, cfg.moe.d_ff) == (4, 1, "loop", None)
