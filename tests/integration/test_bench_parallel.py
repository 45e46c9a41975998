"""tools/bench_parallel.py: its report (the Markdown tables and the same rows as JSON, which the
chapter's priority table reads: no Markdown parsing between tools), its per-rank formulas, and
one real layout row (tp=2 on two gloo processes) against its single process. The other rows run
the same code under other layouts; their committed results are docs/results/parallel_strategies_cpu.*
(see the file's Command line)."""

from __future__ import annotations

import math

import pytest

from analysis.chapter_tables import PARALLEL_CPU, Measured, priority_table
from analysis.estimator import stage_parameters
from common.report import read_results, rows_path
from tools import bench_parallel
from training.config import load_config


def _states(kib: float) -> dict[str, float]:
    return {"params": kib * 256, "grads": kib * 256, "optimizer": kib * 512}


def test_rows_written_as_json_are_what_the_priority_table_quotes(tmp_path):
    rows = [
        bench_parallel.Row("single process", 3.72, 0.0, {**_states(800), "buffers": 0}, _states(800)),
        bench_parallel.Row("ddp", 3.72, -1e-7, {**_states(800), "buffers": 0}, _states(800), ranks=2),
        bench_parallel.Row("fsdp", 3.72, -2e-7, {**_states(400), "buffers": 0}, _states(400), ranks=2),
        bench_parallel.Row("zero3", math.nan, math.nan, {}, {}, status="zero3: exit 1: boom", ranks=2),
    ]
    md = tmp_path / PARALLEL_CPU
    written = bench_parallel.write_markdown(rows, "2 ranks, 3 steps", 2, "python -m tools.bench_parallel", md)
    assert written == [md, rows_path(md)]
    text = md.read_text()
    assert "| fsdp | 2 | 3.720000 | -2.0e-07 | 100 | 100 |" in text and "failed: zero3: exit 1: boom" in text
    document = read_results(rows_path(md))
    assert document["title"] in text and "gloo, 2 processes" in document["title"]
    assert document["rows"][3]["loss"] is None and document["rows"][2]["measured"]["optimizer"] == 400 * 512
    cell = next(r for r in priority_table(Measured(formats={}, documents={PARALLEL_CPU: document})).rows
                if r[1] == "FSDP / ZeRO")[-1]
    assert "model states per rank 400 KiB (fsdp) vs 800 KiB (ddp), 0.50×, loss vs one process -2.0e-07" in cell
    assert document["title"] in cell


def test_layout_rows_keep_the_global_batch_and_split_the_model_as_the_estimator_does():
    for layout in bench_parallel.LAYOUTS.values():
        words = dict(o.lstrip("-").split("=") for o in layout.overrides(8))
        sequences = int(words["train.micro_batch_size"]) * int(words["train.grad_accum_steps"]) * layout.dp_shard
        assert sequences == 8, layout
        assert int(words["train.grad_accum_steps"]) >= layout.pp  # a pipeline's micro-batches
    # Two pipeline ranks hold the whole untied model between them; the estimator's stage split agrees.
    cfg = load_config("configs/tiny.yaml", [bench_parallel.UNTIED, "--parallel.pp=2", "--train.grad_accum_steps=2"])
    whole = stage_parameters(cfg.model)
    assert bench_parallel.rank_parameters(cfg, 0) + bench_parallel.rank_parameters(cfg, 1) == whole
    # Each pipeline rank sends one b x s x h fp32 activation (or its gradient) per micro-batch.
    sent = bench_parallel.formula_comm(cfg, 0, 1)
    b, s, h = cfg.train.micro_batch_size, cfg.seq_len, cfg.model.d_model
    assert sent == {"tp": 0.0, "dp": 0.0, "pp": 2 * b * s * h * 4, "other": 0.0}
    # Under the pipeline FSDP2 gathers a stage in each of the m=2 micro-batches' forwards and once in
    # backward (as measured in docs/results/parallel_strategies_cpu.md), and reduce-scatters once: fp32.
    fsdp = load_config("configs/tiny.yaml", [bench_parallel.UNTIED, "--parallel.pp=2", "--parallel.strategy=fsdp",
                                             "--train.grad_accum_steps=2"])
    n = bench_parallel.rank_parameters(fsdp, 0)
    assert bench_parallel.formula_comm(fsdp, 0, 2)["dp"] == 1 / 2 * n * (3 * 4 + 1 * 4)


def test_one_layout_row_matches_one_process_and_reports_its_traffic(tmp_path, corpus_cache):
    """tp=2 (two gloo processes) trains the single process's loss and writes the new columns."""
    md = tmp_path / "bench.md"
    small = ["--model.n_layer=2", "--model.d_model=64", "--model.max_seq_len=64", f"--data.cache_dir={corpus_cache}",
             "--data.default_corpus_max_mb=2.0"]
    code = bench_parallel.main(["--strategies", "", "--layouts", "tp", "--steps", "2", "--markdown", str(md),
                                "--", *small])
    rows = {r["strategy"]: r for r in read_results(rows_path(md))["rows"]}
    assert code == 0, [r["status"] for r in rows.values()]
    single, tp = rows["single process, untied"], rows["tp=2"]
    assert tp["ranks"] == 2 and tp["reference"] == "single process, untied"
    assert abs(tp["loss"] - single["loss"]) <= 1e-5 and tp["delta"] == pytest.approx(tp["loss"] - single["loss"])
    # Weights and optimizer state: exactly the estimator's tp split (tensor parallelism pads nothing),
    # plus AdamW's step counters (one fp32 scalar per parameter tensor: 12 per block + 5 outside).
    counters = 4 * (12 * 2 + 5)
    assert tp["measured"]["params"] == tp["formula"]["params"] == single["formula"]["params"] / 2 + _whole_bytes() / 2
    assert tp["measured"]["optimizer"] - counters == tp["formula"]["optimizer"] == 2 * tp["formula"]["params"]
    # Bytes sent: every one a tensor-parallel collective, at least the formula's, plus small extras.
    assert tp["comm"]["dp"] == tp["comm"]["pp"] == tp["comm"]["other"] == 0
    assert tp["comm_formula"]["tp"] <= tp["comm"]["tp"] <= 1.05 * tp["comm_formula"]["tp"]
    assert len(tp["comm_by_rank"]) == 2 and {"tp all_gather", "tp reduce_scatter"} <= set(tp["comm_by_rank"][0])
    assert single["comm"] == {"tp": 0, "dp": 0, "pp": 0, "other": 0}
    assert "| tp=2 | 2 |" in md.read_text()


def _whole_bytes() -> float:
    """fp32 bytes of what tp=2 keeps whole on both ranks in the small model (2 layers, d_model 64,
    max_seq_len 64): 2 layers x (2 layer norms x 2 x 64 + 2 output biases x 64), the final norm and
    the 64 x 64 learned positions."""
    return 4 * (2 * (2 * 2 * 64 + 2 * 64) + 2 * 64 + 64 * 64)
