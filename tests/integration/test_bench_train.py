"""tools/bench_train.py measures each variant with the real engine, in interleaved rounds, and
reports medians with their spread and ratios to the first variant taken round by round."""

from __future__ import annotations

import re
import statistics

from analysis.chapter_tables import BENCH_TRAIN_CPU, Measured, priority_table
from common.measure import NO_DIFFERENCE
from common.report import read_results, rows_path
from tools import bench_train

TINY = ["--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=32", "--train.micro_batch_size=2"]


def test_bench_train_interleaves_rounds_and_writes_spread_table_and_rows(tmp_path, capsys, monkeypatch):
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    order = []  # the engine of every step, in the order the steps ran
    real_step = bench_train.train_step

    def recorded_step(engine, *args, **kwargs):
        order.append(engine)
        return real_step(engine, *args, **kwargs)

    monkeypatch.setattr(bench_train, "train_step", recorded_step)
    args = ["--config", "configs/tiny.yaml", "--rounds", "3", "--steps", "1", "--warmup", "1", "--threads", "1",
            "--variants", "precision.mode=fp32", "precision.mode=bf16", "precision.mode=fp8 model.layers=te",
            "--markdown", str(md), "--plot", str(png), *TINY]
    assert bench_train.main(args) == 0
    # one warm-up step per variant (on CUDA one more, for the memory peak), then A B, A B, A B
    fp32, bf16 = order[0], order[1]
    assert fp32 is not bf16 and order == [fp32, bf16] * 4
    table = md.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| precision")]
    assert len(rows) == 3
    assert "| baseline |" in rows[0]
    assert re.search(r"\| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)(: no difference measured)? \|", rows[1])
    assert "skipped: precision.mode=fp8 needs Transformer Engine" in rows[2]
    assert "command: `python -m tools.bench_train --config configs/tiny.yaml --rounds 3" in table
    assert png.stat().st_size > 1000
    assert table.splitlines()[0] in capsys.readouterr().out
    # the rows as data next to the table: what tools/reproduce.py and the chapter tables read
    document = read_results(rows_path(md))
    assert document["title"] == table.splitlines()[0] and "3 interleaved rounds" in document["title"]
    assert [r["variant"] for r in document["rows"]] == ["precision.mode=fp32", "precision.mode=bf16",
                                                         "precision.mode=fp8 model.layers=te"]
    first, second, skipped = document["rows"]
    for row in (first, second):
        assert len(row["rounds_s"]) == 3
        assert row["step_s"] == statistics.median(row["rounds_s"])
        assert row["step_s_min"] == min(row["rounds_s"]) and row["step_s_max"] == max(row["rounds_s"])
    assert f"{second['tokens_per_s']:,.0f} ({second['tokens_per_s_min']:,.0f}-" in rows[1]
    ratios = [a / b for a, b in zip(first["rounds_s"], second["rounds_s"])]
    assert second["vs_first"]["median"] == statistics.median(ratios) and second["vs_first"]["text"] in rows[1]
    assert first["vs_first"] is None
    assert skipped["step_s"] is None and skipped["status"].startswith("skipped")


def test_bad_rounds_or_a_repeated_variant_is_one_line_and_exit_2(capsys):
    assert bench_train.main(["--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rounds must be >= 1 (got 0)"
    assert bench_train.main(["--variants", "precision.mode=fp32", "precision.mode=fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --variants lists 'precision.mode=fp32' twice; each variant is timed once per round already"


def _rows(compiled_rounds: list[float]) -> dict:
    eager = [0.2, 0.2, 0.2]
    return {"title": "bench_train: configs/tiny.yaml on CPU, torch 9.9, 2030-01-01; 3 rounds", "rows": [
        {"variant": "precision.mode=fp32", "step_s": 0.2, "tokens_per_s": 1000.0, "status": "ok", "rounds_s": eager},
        {"variant": "precision.mode=fp32 train.compile=true", "step_s": statistics.median(compiled_rounds),
         "tokens_per_s": 200 / statistics.median(compiled_rounds), "status": "ok", "rounds_s": compiled_rounds},
    ]}


def _compile_cell(document: dict) -> str:
    table = priority_table(Measured(formats={}, documents={BENCH_TRAIN_CPU: document}))
    return next(row for row in table.rows if row[1] == "torch.compile")[-1]


def test_priority_table_takes_the_compile_ratio_per_round_and_says_when_it_is_no_difference():
    clear = _compile_cell(_rows([0.1, 0.1, 0.1]))
    assert "2.00× (2.00-2.00) tokens/s for precision.mode=fp32 train.compile=true vs without compile" in clear
    assert NO_DIFFERENCE not in clear
    # medians say 1.05x faster, but one round was slower: no difference was measured
    noisy = _compile_cell(_rows([0.25, 0.19, 0.18]))
    assert f"1.05× (0.80-1.11) tokens/s for precision.mode=fp32 train.compile=true vs without compile: {NO_DIFFERENCE}" in noisy
