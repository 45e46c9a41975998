"""Sweeps: a grid file becomes points whose configs are checked before anything runs; a sweep of
tiny models trains every point (train.py's own main, in this process), writes the table the fit
reads, and started again runs only what is not finished."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
import yaml

import train
from analysis.sweep import POINT_FILE, load_sweep, read_points, run_sweep, seconds_model, write_table
from common.errors import ConfigError
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import read_metrics
from tools import fit_scaling
from tools import sweep as sweep_tool

TINY = {"model.n_layer": 1, "model.max_seq_len": 32, "train.micro_batch_size": 2, "train.eval_sequences": 4,
        "train.log_interval": 1, "optim.warmup_steps": 1, "checkpoint.interval": 0, "checkpoint.save_final": False,
        "data.default_corpus_max_mb": 2.0}


def write_spec(path: Path, corpus_cache: str, widths: list[int], steps: list[int], **extra) -> Path:
    spec = {"config": "configs/tiny.yaml", "overrides": {**TINY, "data.cache_dir": corpus_cache, **extra},
            "axes": {"width": [{"model.d_model": w, "model.n_head": 2} for w in widths], "train.max_steps": steps}}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class InProcess:
    """A launcher that runs train.py's main in this process (the same run a train.py process
    makes), counting the points it trains."""

    def __init__(self):
        self.launched: list[str] = []

    def __call__(self, args: list[str], config: str, log_path: Path, threads: int) -> tuple[int, float, float]:
        self.launched.append(log_path.parent.name)
        wall, cpu = time.perf_counter(), time.process_time()
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = train.main(["--config", config, *args])
        return code, time.perf_counter() - wall, time.process_time() - cpu


def test_the_grid_is_the_product_of_the_axes_with_the_fixed_keys_in_every_point(tmp_path):
    sweep = load_sweep(write_spec(tmp_path / "s.yaml", str(tmp_path), [16, 32], [3, 5, 7]))
    assert [p.name for p in sweep.points] == [f"d_model{w}-n_head2-max_steps{s}" for w in (16, 32) for s in (3, 5, 7)]
    for point in sweep.points:
        assert point.overrides["model.n_layer"] == 1 and point.overrides["data.cache_dir"] == str(tmp_path)
    assert sweep.points[4].overrides["model.d_model"] == 32 and sweep.points[4].overrides["train.max_steps"] == 5


@pytest.mark.parametrize("change, message", [
    ({"axes": {"width": [{"model.d_model": 16, "model.n_head": 3}]}},
     "point d_model16-n_head3: model.n_head=3 must divide model.d_model=16"),
    ({"axes": {"train.max_stepz": [3]}}, "unknown key train.max_stepz"),
    ({"axes": {"train.max_steps": []}}, "axis train.max_steps must be a non-empty list"),
    ({"axes": {"w": [{"model.d_model": 16}, 32]}}, "all scalars"),
    ({"overrides": {"logging.run_dir": "x"}}, "logging.run_dir is set by the sweep"),
    ({"grid": {}}, "unknown key 'grid'"),
    ({"config": "configs/nope.yaml"}, "config must name the base job config"),
])
def test_a_bad_sweep_file_is_one_line_before_any_run(tmp_path, change, message):
    spec = {"config": "configs/tiny.yaml", "overrides": {"model.n_layer": 1}, "axes": {"train.max_steps": [3]}}
    spec.update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=message) as info:
        load_sweep(path)
    assert "\n" not in str(info.value)


def test_time_left_model_separates_start_up_from_the_rate():
    startup, rate = seconds_model([(1e9, 12.0), (3e9, 16.0), (5e9, 20.0)])
    assert startup == pytest.approx(10.0) and rate == pytest.approx(2e-9)
    assert seconds_model([(2e9, 10.0)]) == (0.0, pytest.approx(5e-9))  # one size: all of it is rate


def test_a_sweep_trains_every_point_writes_the_table_and_started_again_runs_only_what_is_new(
        tmp_path, corpus_cache, capsys, one_thread):
    out = tmp_path / "sweep"
    spec = write_spec(tmp_path / "s.yaml", corpus_cache, [16, 32], [2, 4])
    launcher = InProcess()
    outcomes = run_sweep(load_sweep(spec), out, launcher=launcher, report=lambda line: None)
    assert len(launcher.launched) == 4 and all(o.row is not None and not o.skipped for o in outcomes)
    for outcome in outcomes:
        row, run_dir = outcome.row, out / "runs" / outcome.point
        cfg = ModelConfig(vocab_size=256, max_seq_len=32, n_layer=1, n_head=2, d_model=row.overrides["model.d_model"])
        model = GPT(cfg)
        # N of 6ND: every parameter but the learned positions (the tied token table counts once, as the head).
        assert row.params == sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
        assert row.params_total == sum(p.numel() for p in model.parameters())
        assert row.tokens == row.overrides["train.max_steps"] * 2 * 32
        final = [m for m in read_metrics(run_dir) if m.get("val_loss") is not None]
        assert final[-1]["step"] == row.overrides["train.max_steps"] and row.val_loss == final[-1]["val_loss"]
        assert row.wall_s > 0 and row.cpu_s > 0
    table = out / "sweep.md"
    write_table([o.row for o in outcomes], table, "tiny", ["a test"])
    points = read_points(table.with_suffix(".json"))
    assert points == read_points(table.with_suffix(".csv"))
    assert [p["val_loss"] for p in points] == [o.row.val_loss for o in outcomes]

    # Four points cannot determine a law of five parameters: the fit says so in one line.
    assert fit_scaling.main([str(table.with_suffix(".json"))]) == 2
    assert "at least 5 points" in capsys.readouterr().err

    # A third width joins the grid and one finished point loses its record: only those three run.
    finished = out / "runs" / "d_model32-n_head2-max_steps4" / POINT_FILE
    kept = (out / "runs" / "d_model16-n_head2-max_steps2" / POINT_FILE).read_text()
    (out / "runs" / "d_model16-n_head2-max_steps4" / POINT_FILE).unlink()
    spec = write_spec(tmp_path / "s.yaml", corpus_cache, [16, 32, 48], [2, 4])
    launcher = InProcess()
    lines: list[str] = []
    outcomes = run_sweep(load_sweep(spec), out, launcher=launcher, report=lines.append)
    assert sorted(launcher.launched) == ["d_model16-n_head2-max_steps4", "d_model48-n_head2-max_steps2",
                                         "d_model48-n_head2-max_steps4"]
    assert [o.skipped for o in outcomes] == [True, False, True, True, False, False]
    assert (out / "runs" / "d_model16-n_head2-max_steps2" / POINT_FILE).read_text() == kept
    assert finished.is_file()
    assert any("3/6 done" in line for line in lines) and lines[-1].startswith("sweep [6/6 done, 0 running, 0 failed")

    # Six points: the fit runs, and its report's fitted losses are the law's at each point.
    write_table([o.row for o in outcomes], table, "tiny", ["a test"])
    report, plot = tmp_path / "fit.md", tmp_path / "fit.png"
    assert fit_scaling.main([str(table.with_suffix(".json")), "--bootstrap", "20", "--markdown", str(report),
                             "--plot", str(plot)]) == 0
    fitted = json.loads(report.with_suffix(".json").read_text())
    law = fitted["law"]
    for row in fitted["rows"]:
        expected = law["E"] + law["A"] / row["params"] ** law["alpha"] + law["B"] / row["tokens"] ** law["beta"]
        assert row["fit"] == pytest.approx(expected, rel=1e-9)
    assert plot.stat().st_size > 10_000 and "| d_model48-n_head2-max_steps4 |" in report.read_text()


def test_the_sweep_tool_refuses_a_bad_file_in_one_line_and_exit_code_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"config": "configs/tiny.yaml", "axes": {"model.d_model": [16, 0]}}))
    assert sweep_tool.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and "point d_model0: model.d_model must be >= 1" in err
    assert not (tmp_path / "out").exists()
