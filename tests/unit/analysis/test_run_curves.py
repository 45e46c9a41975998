"""Loss curves from run directories (analysis/run_curves.py, python -m tools.plot): the series read
back from a synthetic metrics.jsonl as the trainer writes it, the figure's plotted lines equal to
them, several runs overlaid, and bad input in one line."""

from __future__ import annotations

import json
import math
import statistics

import matplotlib
import pytest

from analysis import run_curves
from tools import plot


def write_run(run_dir, steps: int, *, seed: float, restart_at: int | None = None) -> dict:
    """A metrics.jsonl as training/metrics.py writes it (step rows every 2 steps, validation every 4,
    a skipped window, a restart that re-logs steps, a torn last line); the values expected back."""
    run_dir.mkdir(parents=True)
    rows, expected = [], {"loss": {}, "val_loss": {}, "lr": {}, "tokens_per_s": {}}
    for step in range(2, steps + 1, 2):
        loss = None if step == 6 else seed + 4.0 / step  # a window with every step skipped
        row = {"step": step, "time": 1e9 + step, "loss": loss, "lr": 1e-3 * min(1.0, step / 4),
               "grad_norm": 1.0, "tokens_per_s": 1000.0 * seed + step}
        rows.append(row)
        for key in ("loss", "lr", "tokens_per_s"):
            if row[key] is not None:
                expected[key][step] = row[key]
        if step % 4 == 0:
            rows.append({"step": step, "time": 1e9 + step, "val_loss": seed + 5.0 / step})
            expected["val_loss"][step] = seed + 5.0 / step
    if restart_at is not None:  # the restart logs the steps after its checkpoint again: the last row counts
        rows.append({"step": restart_at, "time": 2e9, "loss": seed + 1.0, "lr": 5e-4, "tokens_per_s": 7.0})
        expected["loss"][restart_at], expected["lr"][restart_at], expected["tokens_per_s"][restart_at] = \
            seed + 1.0, 5e-4, 7.0
    lines = [json.dumps(r) for r in rows] + ['{"step": 99, "loss": 1.2']  # cut short by a kill
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))
    return expected


def test_the_series_are_the_rows_the_trainer_wrote(tmp_path):
    expected = write_run(tmp_path / "tiny", 12, seed=2.0, restart_at=8)
    curves = run_curves.read_run(tmp_path / "tiny")
    assert curves.series == expected and 6 not in curves.series["loss"] and 6 in curves.series["lr"]
    rate = statistics.median(expected["tokens_per_s"].values())  # 7 (the restart's) and 2002 ... 2012
    assert curves.summary() == (f"tiny: 12 steps, last loss {2.0 + 4.0 / 12:.4f}, best val_loss {2.0 + 5.0 / 12:.4f}, "
                                f"median {rate:,.0f} tokens/s")


def test_the_figure_plots_each_run_and_its_validation_loss(tmp_path, monkeypatch):
    plotted = {}
    real_save = run_curves.save_figure

    def keep(fig, path):
        for ax, (key, _) in zip(fig.axes, run_curves.PANELS):
            plotted[key] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
        real_save(fig, path)

    monkeypatch.setattr(run_curves, "save_figure", keep)
    a, b = write_run(tmp_path / "a", 8, seed=1.0), write_run(tmp_path / "b", 12, seed=3.0)
    out = tmp_path / "both.png"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.get_backend().lower() == "agg"
    for name, expected in (("a", a), ("b", b)):
        for key in ("lr", "tokens_per_s"):
            assert plotted[key][name] == (sorted(expected[key]), [expected[key][s] for s in sorted(expected[key])])
        assert plotted["loss"][name] == (sorted(expected["loss"]), [expected["loss"][s] for s in sorted(expected["loss"])])
        val = expected["val_loss"]
        assert plotted["loss"][f"{name} (val)"] == (sorted(val), [val[s] for s in sorted(val)])


def test_one_run_writes_into_its_directory_and_prints_its_summary(tmp_path, capsys):
    write_run(tmp_path / "tiny", 8, seed=2.0)
    assert plot.main([str(tmp_path / "tiny")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["tiny: 8 steps, last loss 2.5000, best val_loss 2.6250, median 2,005 tokens/s",
                   f"wrote {tmp_path / 'tiny' / 'curves.png'}"]
    assert (tmp_path / "tiny" / "curves.png").stat().st_size > 0


def test_two_runs_of_the_same_name_are_told_apart_by_their_paths(tmp_path):
    write_run(tmp_path / "x" / "run", 4, seed=1.0)
    write_run(tmp_path / "y" / "run", 4, seed=2.0)
    names = [r.name for r in run_curves.read_runs([tmp_path / "x" / "run", tmp_path / "y" / "run"])]
    assert names == [str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")]


@pytest.mark.parametrize("make, args, message", [
    (lambda root: None, ["missing"], "missing does not exist"),
    (lambda root: (root / "empty").mkdir(), ["empty"], "empty has no metrics.jsonl"),
    (lambda root: (root / "new").mkdir() or (root / "new" / "metrics.jsonl").write_text(""), ["new"],
     "holds no loss, learning-rate or throughput rows yet"),
    (lambda root: write_run(root / "r", 4, seed=1.0), ["r", "--out", "r/curves.svg"], "must be a .png file"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, args, message):
    make(tmp_path)
    argv = [str(tmp_path / a) if i == 0 or args[i - 1] == "--out" else a for i, a in enumerate(args)]
    assert plot.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_nan_and_infinite_values_are_left_out(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 2.0, "lr": 0.1}, {"step": 2, "loss": math.inf, "lr": 0.1}, {"step": 3, "loss": None}]))
    assert run_curves.read_run(tmp_path / "r").series == {"loss": {1: 2.0}, "lr": {1: 0.1, 2: 0.1}}
