"""tools/bench_train.py measures each variant with the real engine and reports ratios to the first."""

from __future__ import annotations

import re

from common.report import read_results, rows_path
from tools import bench_train


def test_bench_train_table_markdown_and_plot(tmp_path, capsys):
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    args = ["--config", "configs/tiny.yaml", "--steps", "2", "--warmup", "1",
            "--variants", "precision.mode=fp32", "precision.mode=bf16", "precision.mode=fp8 model.layers=te",
            "--markdown", str(md), "--plot", str(png),
            "--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=32", "--train.micro_batch_size=2"]
    assert bench_train.main(args) == 0
    table = md.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| precision")]
    assert len(rows) == 3
    assert "| 1.00x |" in rows[0]
    assert re.search(r"\| \d+\.\d\dx \|", rows[1])
    assert "skipped: precision.mode=fp8 needs Transformer Engine" in rows[2]
    assert png.stat().st_size > 1000
    assert table.splitlines()[0] in capsys.readouterr().out
    # the rows as data next to the table: what tools/reproduce.py and the chapter tables read
    document = read_results(rows_path(md))
    assert document["title"] == table.splitlines()[0]
    assert [r["variant"] for r in document["rows"]] == ["precision.mode=fp32", "precision.mode=bf16",
                                                         "precision.mode=fp8 model.layers=te"]
    assert f"{document['rows'][1]['tokens_per_s']:,.0f}" in rows[1]
    assert document["rows"][2]["step_s"] is None and document["rows"][2]["status"].startswith("skipped")
