"""A real SIGKILL while a checkpoint is written in the background (checkpoint.async_save).

train.py runs in a process of its own with the writer of step 4's checkpoint held at one of three
points, where it prints a marker; the test then kills the process with SIGKILL: before any file
of step 4 is written, after ``model_optim.pt`` but before the rank state and the checksums, and
after every file and checksum but before the checkpoint is published. Each time step 2 must be
complete and intact, ``latest`` must name it (``checkpoint.keep_last=1`` would prune it once step 4
were in place, so it must not have been pruned), and ``--resume`` must continue from it with the
losses the killed run had (one thread on both sides, so the sums are the same).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import ROOT, read_metrics, step_losses, tiny_overrides
from training import checkpoint as ckpt

TINY = "configs/tiny.yaml"
RUN = {"train.max_steps": 6, "checkpoint.interval": 2, "checkpoint.keep_last": 1, "checkpoint.async_save": "true"}

# train.main with step 4's background write held at sys.argv[1]: "before" (nothing written),
# "model" (model_optim.pt written), "all" (every file and its checksum written, not published).
HELD_WRITE = r"""
import sys, time
import train
from parallel.engine import TorchEngine
from training import checkpoint as ckpt

where = sys.argv[1]
real_stage, real_write = TorchEngine.stage_save, ckpt.SaveJob.write


def hold():  # one write: the loop's thread prints at the same time, a print's newline could come apart
    sys.stdout.write(f"\nHELD {where}\n")
    sys.stdout.flush()
    time.sleep(600)


def stage_save(self, directory, rank, staging):
    writer = real_stage(self, directory, rank, staging)
    if not directory.name.endswith("step_00000004"):
        return writer

    def write():
        if where == "before":
            hold()
        writer()
        if where == "model":
            hold()
    return write


def write(self, write_states, rank_state):
    error = real_write(self, write_states, rank_state)
    if self.step == 4 and where == "all":
        hold()
    return error


TorchEngine.stage_save, ckpt.SaveJob.write = stage_save, write
sys.exit(train.main(sys.argv[2:]))
"""


def _killed_run(run_dir: Path, corpus_cache: str, where: str) -> subprocess.Popen:
    args = ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **RUN)]
    proc = subprocess.Popen([sys.executable, "-c", HELD_WRITE, where, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == f"HELD {where}":
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-30:])
    return proc


@pytest.mark.timeout(600)
def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_and_resume_works(
        tmp_path, corpus_cache, one_thread):
    for where in ("before", "model", "all"):
        run_dir = tmp_path / where
        _killed_run(run_dir, corpus_cache, where)
        root = run_dir / "checkpoints"
        tmp = root / f"{ckpt.TMP_PREFIX}step_00000004"
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000002"]
        assert tmp.is_dir()  # the interrupted write, never published
        if where != "before":
            assert (tmp / "model_optim.pt").is_file()
        assert ckpt.incomplete_reason(root / "step_00000002") is None
        assert ckpt.verify_contents(root / "step_00000002") is None
        assert (root / "latest").read_text().strip() == "step_00000002"
        assert ckpt.find_latest(root).name == "step_00000002"

        killed = step_losses(run_dir)
        assert {3, 4} <= set(killed), read_metrics(run_dir)
        assert train.main(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **RUN), "--resume"]) == 0
        resumed = step_losses(run_dir)
        assert [resumed[s] for s in (3, 4)] == [killed[s] for s in (3, 4)], where
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000006"]  # keep_last=1, temp dir gone
        assert torch.load(root / "step_00000006" / "rank_00000.pt", weights_only=True)["step"] == 6
