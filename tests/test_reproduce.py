"""tools/reproduce.py: every chapter table is produced, with the figures the corrections call for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from analysis.chapter_tables import CHAPTER_FORMATS, Measured, build_tables, format_from_layout
from analysis.measure import measure_formats

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("numeric_formats", "precision_modes", "activation_recompute", "attention", "data_formats",
          "communication", "priority")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.timeout(180)
def test_quick_run_writes_every_table(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "reproduce.py"), "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in TABLES:
        text = (out / f"{name}.md").read_text()
        assert "chapter's claim" in text and "measured here" in text, name
        assert "| " in text and "**Verdict**" in text, name
    assert (out / "README.md").is_file()
    pngs = {p.stem for p in out.glob("*.png")}
    assert pngs == set(TABLES) - {"data_formats", "priority"}
    assert all((out / f"{name}.png").read_bytes()[:4] == b"\x89PNG" for name in pngs)
    recompute = (out / "activation_recompute.md").read_text()
    assert "1,940 GiB" in recompute and "340 GiB" in recompute and "20.0 GiB" in recompute
    assert "~80 GB" in recompute  # the chapter's claim stays next to ours
    if not torch.cuda.is_available():
        assert "needs GPU" in (out / "attention.md").read_text()


def test_format_formulas_equal_torch_finfo():
    measured = measure_formats()
    for label, (bits, _, exponent, mantissa, _, _) in CHAPTER_FORMATS.items():
        got = measured[label]
        assert (got["bits"], got["exponent_bits"], got["mantissa_bits"]) == (bits, exponent, mantissa)
        analytic = format_from_layout(exponent, mantissa, finite_only=label == "FP8 (E4M3)")
        for key in ("max", "min_normal", "min_subnormal"):
            assert analytic[key] == got[key], (label, key)
    # CORRECTIONS.md: E4M3 448 / 2^-6 / 2^-9, no inf; E5M2 57344 / 2^-14 / 2^-16
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
