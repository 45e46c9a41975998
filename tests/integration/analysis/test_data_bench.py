"""tools/bench_data.py run as a user runs it: the CLI writes its table, Markdown (with its rows as
JSON) and plot."""

import subprocess
import sys
from pathlib import Path

from common.report import read_results, rows_path

ROOT = Path(__file__).resolve().parents[3]


def test_cli_runs_a_tiny_grid_and_writes_markdown_and_plot(tmp_path):
    md, png = tmp_path / "bench.md", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "tools.bench_data", "--mb", "0.3", "--seq-len", "64",
           "--batch-sizes", "2", "--workers", "0", "--batches", "3", "--tokenizer", "byte",
           "--models", str(ROOT / "configs" / "tiny.yaml"), "--markdown", str(md), "--plot", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for fmt in ("naive", "mmap", "webdataset"):
        assert fmt in done.stdout
    assert "tiny (this CPU)" in done.stdout
    assert md.read_text().count("| naive |") == 1 and png.stat().st_size > 1000
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the rows as data next to the Markdown, which tools/reproduce.py and the chapter tables read
    document = read_results(rows_path(md))
    assert [(r["format"], r["workers"], r["batch"]) for r in document["rows"]] == [
        ("naive", 0, 2), ("mmap", 0, 2), ("webdataset", 0, 2)]
    assert all(r["tokens_per_s"] > 0 for r in document["rows"])
    assert f"{document['rows'][1]['tokens_per_s']:,.0f}" in md.read_text()
    assert [c["name"] for c in document["consumers"]] == ["tiny (this CPU)"]
    assert "seq_len 64, tokenizer byte" in document["setting"] and document["title"] in md.read_text()
