"""tools/sweep.py as a user runs it: two workers, each point its own train.py process, a table,
and the same command again skips every finished point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from tests.conftest import ROOT, read_metrics


def sweep(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "tools.sweep", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)


def test_two_workers_run_every_point_in_its_own_process_and_a_second_start_runs_none(tmp_path, corpus_cache):
    spec = tmp_path / "grid.yaml"
    spec.write_text(yaml.safe_dump({
        "config": "configs/tiny.yaml",
        "overrides": {"model.n_layer": 1, "model.max_seq_len": 32, "train.micro_batch_size": 2,
                      "train.eval_sequences": 4, "optim.warmup_steps": 1, "checkpoint.interval": 0,
                      "checkpoint.save_final": False, "data.cache_dir": corpus_cache, "data.default_corpus_max_mb": 2.0},
        "axes": {"model.d_model": [16, 32], "train.max_steps": [2, 3]},
    }))
    out, table = tmp_path / "out", tmp_path / "table.md"
    args = [str(spec), "--out", str(out), "--workers", "2", "--threads", "1", "--table", str(table)]
    proc = sweep(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("sweep: start ") == 4 and "[4/4 done, 0 running, 0 failed" in proc.stdout
    rows = json.loads(table.with_suffix(".json").read_text())["rows"]
    assert sorted(r["point"] for r in rows) == ["d_model16-max_steps2", "d_model16-max_steps3",
                                               "d_model32-max_steps2", "d_model32-max_steps3"]
    for row in rows:
        run_dir = out / "runs" / row["point"]
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["model"]["d_model"] == row["overrides"]["model.d_model"]
        last = [m for m in read_metrics(run_dir) if m.get("val_loss") is not None][-1]
        assert last["step"] == config["train"]["max_steps"] and last["val_loss"] == row["val_loss"]
        assert row["cpu_s"] > 0 and row["threads"] == 1
    assert table.with_suffix(".csv").read_text().count("\n") == 5

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")}
    proc = sweep(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep: start " not in proc.stdout and proc.stdout.count("finished earlier") == 4
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")} == stamps
    assert json.loads(table.with_suffix(".json").read_text())["rows"] == rows
