"""tools/gpu_bench.sh cannot rot between GPU sessions: its --dry-run runs every stage's set-up on
the CPU with tiny shapes (kernels interpreted), and without --dry-run it refuses a CPU machine."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import ROOT

STAGES = ("gpu-tests", "kernels", "train-124m", "train-1.3b", "attention", "chapter")


@pytest.mark.timeout(600)
def test_dry_run_runs_every_stage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "tools/gpu_bench.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=580, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for stage in STAGES:
        assert f"== {stage}: exit 0" in proc.stdout, stage
    assert "all stages passed" in proc.stdout
    assert "DRY RUN on the CPU" in (tmp_path / "env.txt").read_text()
    for name in ("gpu_kernels", "gpu_train_124m", "gpu_train_1.3b", "gpu_attention"):
        assert (tmp_path / f"{name}.md").is_file(), name
    assert "| ok |" in (tmp_path / "gpu_train_1.3b.md").read_text()


def test_without_a_gpu_the_real_run_refuses(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", "tools/gpu_bench.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 1 and "no CUDA device visible" in proc.stdout


@pytest.mark.timeout(600)
def test_dry_run_stages_have_no_time_limit_on_a_busy_machine(tmp_path):
    # A stand-in interpreter whose attention stage outlasts that stage's GPU limit (90 s), as
    # pytest's collection outlasted the gpu-tests limit at load 13: the dry run must still pass.
    python = tmp_path / "python"
    python.write_text('#!/usr/bin/env bash\ncase "$*" in *bench_memory*) sleep 95 ;; esac\nexit 0\n')
    python.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python)}
    proc = subprocess.run(["bash", "tools/gpu_bench.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=580, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "== attention: exit 0" in proc.stdout and "all stages passed" in proc.stdout
