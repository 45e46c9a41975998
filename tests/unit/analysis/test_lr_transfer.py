"""Learning-rate transfer read off a sweep table (analysis/lr_transfer.py, tools/lr_transfer.py): on
rows made here from known loss curves (a parabola in log LR per curve, a seed offset, a diverged
point, a failed point), the curves, their seed means, best LRs, grid shifts and edge flags are the
ones the curves were made with; the tool writes the report, its rows and the figure."""

from __future__ import annotations

import json
import math

import pytest

from analysis.lr_transfer import lr_curves, report_lines
from common.errors import DataError
from common.report import write_results
from tools import lr_transfer as tool

GRID = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
# curve keys -> the LR at the bottom of its parabola
CURVES = {
    (32, False): 1e-2,  # the reference (first in the table)
    (128, False): 3e-3,  # the optimum moves one grid step lower
    (128, True): 1e-2,  # the optimum stays
}


def loss(lr: float, optimum: float, seed: int) -> float:
    return 2.0 + 0.3 * (math.log10(lr) - math.log10(optimum)) ** 2 + 0.01 * seed


def sweep_rows(drop: tuple = (), diverge: tuple = ()) -> list[dict]:
    """The rows tools.sweep writes for the grid (only the fields the analysis reads, plus N)."""
    rows = []
    for (width, mup), optimum in CURVES.items():
        for lr in GRID:
            for seed in (1, 2):
                key = (width, mup, lr, seed)
                if key in drop:
                    continue
                overrides = {"model.n_layer": 2, "model.d_model": width, "optim.lr": lr, "train.seed": seed}
                if mup:
                    overrides |= {"model.mup": True, "model.mup_base_width": 32}
                value = None if key in diverge else loss(lr, optimum, seed)  # a results file writes NaN as null
                rows.append({"point": f"p{len(rows)}", "params": width**2, "val_loss": value, "overrides": overrides})
    return rows


def test_curves_are_told_apart_by_the_keys_that_vary_and_averaged_over_seeds():
    transfer = lr_curves(sweep_rows())
    assert transfer.grid == GRID and transfer.seeds == 2
    assert [c.label for c in transfer.curves] == ["d_model=32", "d_model=128", "d_model=128, mup=True, mup_base_width=32"]
    for curve, optimum in zip(transfer.curves, CURVES.values()):
        for lr in GRID:
            assert curve.mean(lr) == pytest.approx((loss(lr, optimum, 1) + loss(lr, optimum, 2)) / 2)
            assert curve.spread(lr) == pytest.approx((loss(lr, optimum, 1), loss(lr, optimum, 2)))
        assert transfer.best(curve) == optimum
        assert not transfer.at_edge(curve)
    assert [transfer.shift(c) for c in transfer.curves] == [0, -1, 0]
    assert transfer.margin(transfer.curves[0]) == pytest.approx(0.3 * math.log10(3) ** 2)


def test_diverged_and_failed_points_lose_and_an_optimum_on_the_edge_is_flagged():
    # the reference diverges at its best LR (one seed) and fails at the next: its best moves to 3e-3;
    # the third curve's points above 1e-3 all diverge, so its best is the grid's first point
    diverge = {(32, False, 1e-2, 2)} | {(128, True, lr, s) for lr in GRID[1:] for s in (1, 2)}
    transfer = lr_curves(sweep_rows(drop={(32, False, 3e-2, 1), (32, False, 3e-2, 2)}, diverge=diverge))
    reference, sp, mup = transfer.curves
    assert math.isinf(reference.mean(1e-2)) and math.isinf(reference.mean(3e-2))
    assert transfer.best(reference) == 3e-3
    assert transfer.best(mup) == 1e-3 and transfer.at_edge(mup) and transfer.shift(mup) == -1
    lines = report_lines(transfer)
    table = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| 0.")}
    assert "diverged (1 of 2)" in table["0.01"] and "diverged (2 of 2)" in table["0.03"]
    assert f"**{reference.mean(3e-3):.4f}" in table["0.003"]
    assert any(line.startswith(f"- {mup.label}: best LR 0.001, 1 grid step(s) lower") and "edge of the grid" in line
               for line in lines)
    assert any(line.startswith(f"- {sp.label}: best LR 0.003, the same grid point") for line in lines)


def test_a_table_without_the_lr_key_or_the_sweeps_keys_is_one_line():
    rows = sweep_rows()
    with pytest.raises(DataError, match="not every row sets optim.lr") as info:
        lr_curves([{**r, "overrides": {k: v for k, v in r["overrides"].items() if k != "optim.lr"}} for r in rows])
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="has no 'overrides'"):
        lr_curves([{"point": "a", "val_loss": 2.0}])
    with pytest.raises(DataError, match="no rows"):
        lr_curves([])


def test_the_tool_writes_the_report_its_rows_and_the_figure(tmp_path, capsys):
    table = tmp_path / "sweep.md"
    write_results(table, "# sweep\n", "sweep", sweep_rows())
    md, png = tmp_path / "out" / "lr.md", tmp_path / "out" / "lr.png"
    assert tool.main([str(table.with_suffix(".json")), "--markdown", str(md), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "](lr.png)" in text and "python -m tools.lr_transfer" in text
    document = json.loads(md.with_suffix(".json").read_text())
    assert document["best_lr"] == {label: lr for label, lr in zip(document["best_lr"], CURVES.values())}
    assert len(document["rows"]) == len(CURVES) * len(GRID)
    assert "the optimum moved" in capsys.readouterr().out


def test_the_tool_says_what_is_wrong_with_its_table_in_one_line(tmp_path, capsys):
    assert tool.main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing.json" in err[0]
