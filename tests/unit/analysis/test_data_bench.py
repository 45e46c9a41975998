"""tools/bench_data.py: the naive baseline yields the right windows, and the CLI writes its table, Markdown
(with its rows as JSON) and plot."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from analysis.data_bench import naive_stream
from common.report import read_results, rows_path
from data.config import DataConfig

ROOT = Path(__file__).resolve().parents[3]


def test_naive_baseline_packs_the_file_bytes_into_windows(tmp_path):
    files = []
    for i, text in enumerate(["abcdefghij", "klmnopqrstuvwxyz"]):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text)
    stream = naive_stream([str(f) for f in files], "byte", seq_len=4, batch_size=2, cfg=DataConfig(num_workers=0))
    x, y = next(stream)
    x2, _ = next(stream)
    tokens = np.frombuffer(b"abcdefghij\0klmnopqrstuvwxyz\0", dtype=np.uint8)
    assert x.tolist() == [tokens[0:4].tolist(), tokens[4:8].tolist()]
    assert y[0].tolist() == tokens[1:5].tolist()
    assert x2.tolist() == [tokens[8:12].tolist(), tokens[12:16].tolist()]


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
