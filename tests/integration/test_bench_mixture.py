"""tools/bench_mixture.py: a tiny run over its three sources (one served over HTTP by its own
http.server process) prints its tables and writes Markdown, the rows as JSON, and a plot."""

import subprocess
import sys
from pathlib import Path

from common.report import read_results, rows_path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_measures_a_small_mixture_and_writes_its_results(tmp_path):
    md, png = tmp_path / "mixture.md", tmp_path / "mixture.png"
    cmd = [sys.executable, "-m", "tools.bench_mixture", "--mb", "0.6", "--rounds", "2", "--batches", "3",
           "--wait-steps", "2", "--steps", "50", "--workers", "0", "--models", "configs/tiny.yaml",
           "--markdown", str(md), "--plot", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Loader throughput vs consumption" in done.stdout and "http-wds" in done.stdout
    document = read_results(rows_path(md))
    (row,) = document["rows"]
    assert row["model"] == "tiny" and row["workers"] == 0 and len(row["tokens_per_s"]) == 2
    assert all(t > 0 for t in row["tokens_per_s"]) and row["consumes_tokens_per_s"] > 0
    shares = document["shares"]
    assert [s["source"] for s in shares] == ["local-mmap", "local-wds", "http-wds"]
    assert sum(s["samples"] for s in shares) == 50 * 16  # every sample of 50 steps of 16
    assert abs(sum(s["share"] for s in shares) - 1) < 1e-9
    assert "python -m tools.bench_mixture --mb 0.6" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"
