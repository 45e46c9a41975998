"""tools/bench_parallel.py's report: the Markdown table and the same rows as JSON, which the chapter's
priority table reads (no Markdown parsing between tools). The measuring itself runs torchrun and is
exercised by the committed docs/results/parallel_strategies_cpu.* (see the file's Command line)."""

from __future__ import annotations

import math

from analysis.chapter_tables import PARALLEL_CPU, Measured, priority_table
from common.report import read_results, rows_path
from tools import bench_parallel


def _states(kib: float) -> dict[str, float]:
    return {"params": kib * 256, "grads": kib * 256, "optimizer": kib * 512}


def test_rows_written_as_json_are_what_the_priority_table_quotes(tmp_path):
    rows = [
        bench_parallel.Row("single process", 3.72, 0.0, {**_states(800), "buffers": 0}, _states(800)),
        bench_parallel.Row("ddp", 3.72, -1e-7, {**_states(800), "buffers": 0}, _states(800)),
        bench_parallel.Row("fsdp", 3.72, -2e-7, {**_states(400), "buffers": 0}, _states(400)),
        bench_parallel.Row("zero3", math.nan, math.nan, {}, {}, status="zero3: exit 1: boom"),
    ]
    md = tmp_path / PARALLEL_CPU
    written = bench_parallel.write_markdown(rows, "2 ranks, 3 steps", 2, "python tools/bench_parallel.py", md)
    assert written == [md, rows_path(md)]
    text = md.read_text()
    assert "| fsdp | 3.720000 | -2.0e-07 | 100 | 100 |" in text and "failed: zero3: exit 1: boom" in text
    document = read_results(rows_path(md))
    assert document["title"] in text and "gloo, 2 processes" in document["title"]
    assert document["rows"][3]["loss"] is None and document["rows"][2]["measured"]["optimizer"] == 400 * 512
    cell = next(r for r in priority_table(Measured(formats={}, documents={PARALLEL_CPU: document})).rows
                if r[1] == "FSDP / ZeRO")[-1]
    assert "model states per rank 400 KiB (fsdp) vs 800 KiB (ddp), 0.50×, loss vs one process -2.0e-07" in cell
    assert document["title"] in cell
