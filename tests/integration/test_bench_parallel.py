"""tools/bench_parallel.py end to end: one real layout row (tp=2 on two gloo processes) against its
single process. The other rows run the same code under other layouts; their committed results are
docs/results/parallel_strategies_cpu.* (see the file's Command line)."""

from __future__ import annotations

import pytest

from common.report import read_results, rows_path
from tools import bench_parallel


def test_one_layout_row_matches_one_process_and_reports_its_traffic(tmp_path, corpus_cache):
    """tp=2 (two gloo processes) trains the single process's loss and writes its memory and traffic columns."""
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
