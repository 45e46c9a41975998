"""Checkpoints written in the background (checkpoint.async_save) keep every promise of the synchronous save.

train.py runs in this process on the tiny config (seconds). The one-file layout is checked here:
the files equal the synchronous run's byte for byte and a resume from them is bit-exact; a write
that fails in the background (a full disk) is one line and leaves the previous checkpoint; a
SIGTERM while a write is in flight waits for it, then saves the current step. The tensor-for-tensor
check of FSDP2's DCP files, the real SIGKILLs during a write and the real full disk run in
processes of their own: tests/integration/test_sharded_checkpoints.py,
tests/integration/test_async_checkpoint_kills.py and tests/unit/training/test_checkpoints.py.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import train
from common.errors import ConfigError
from parallel.checkpoint import host_copy
from parallel.engine import TorchEngine
from tests.conftest import step_losses, tiny_overrides
from training import checkpoint as ckpt
from training import loop as loop_module
from training.config import load_config

TINY = "configs/tiny.yaml"
RUN = {"train.max_steps": 6, "checkpoint.interval": 2, "checkpoint.keep_last": 0}


def _train(run_dir: Path, corpus_cache: str, *extra: str, **overrides) -> int:
    return train.main(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{**RUN, **overrides}), *extra])


def _log(capsys) -> str:
    out = capsys.readouterr()
    return out.out + out.err


def test_background_checkpoints_equal_synchronous_ones_byte_for_byte_and_resume_bit_exact(tmp_path, corpus_cache,
                                                                                           capsys):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    assert _train(sync_dir, corpus_cache) == 0
    capsys.readouterr()
    assert _train(async_dir, corpus_cache, **{"checkpoint.async_save": "true"}) == 0
    log = _log(capsys)
    for step in (2, 4):
        assert f"checkpoint: step {step} staged in" in log
        assert f"checkpoint: saved {async_dir / 'checkpoints' / ckpt.step_dir_name(step)} (written in the background)" \
            in log
    for step in (2, 4, 6):  # 6: the final save, synchronous either way
        name = ckpt.step_dir_name(step)
        a, s = async_dir / "checkpoints" / name, sync_dir / "checkpoints" / name
        assert ckpt.incomplete_reason(a) is None and ckpt.verify_contents(a) is None
        assert (a / "model_optim.pt").read_bytes() == (s / "model_optim.pt").read_bytes()
        ra, rs = (torch.load(d / "rank_00000.pt", weights_only=True) for d in (a, s))
        # Python's and numpy's generators are not seeded by the run: only torch's and the data position are
        assert ra["step"] == rs["step"] == step and ra["data"] == rs["data"]
        assert torch.equal(ra["rng"]["torch"], rs["rng"]["torch"])
    assert step_losses(async_dir) == step_losses(sync_dir)

    # resume from the background-written step 4: steps 5-6 as the uninterrupted run had them
    resumed = tmp_path / "resumed"
    assert _train(resumed, corpus_cache, f"--resume={async_dir / 'checkpoints' / 'step_00000004'}") == 0
    assert [step_losses(resumed)[s] for s in (5, 6)] == [step_losses(sync_dir)[s] for s in (5, 6)]


def _writer_at(step: int, make_writer):
    """TorchEngine.stage_save whose writer for ``step``'s checkpoint is ``make_writer(real_writer)``."""
    real = TorchEngine.stage_save

    def stage_save(self, directory: Path, rank: int, staging):
        writer = real(self, directory, rank, staging)
        return make_writer(writer) if directory.name.endswith(ckpt.step_dir_name(step)) else writer

    return stage_save


def test_a_background_write_that_fills_the_disk_is_one_line_and_the_previous_checkpoint_survives(
        tmp_path, corpus_cache, capsys, monkeypatch):
    def full_disk(writer):
        def write() -> None:
            raise OSError(errno.ENOSPC, "No space left on device", "model_optim.pt")
        return write

    monkeypatch.setattr(TorchEngine, "stage_save", _writer_at(4, full_disk))
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert _train(run_dir, corpus_cache, **{"checkpoint.async_save": "true", "checkpoint.keep_last": 1}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    root = run_dir / "checkpoints"
    assert err[-1] == ("error: step 4: cannot save the checkpoint: no space left on device (ENOSPC) writing "
                       "model_optim.pt; the previous checkpoint is untouched"), err[-3:]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]  # no temp dir left
    assert ckpt.verify_contents(root / "step_00000002") is None
    assert (root / "latest").read_text().strip() == "step_00000002"


def test_sigterm_during_a_background_write_waits_for_it_then_saves_the_current_step(
        tmp_path, corpus_cache, capsys, monkeypatch):
    # Deterministic: step 4's writer holds until the loop starts waiting for it, and SIGTERM
    # arrives during step 5, while that write is still in flight.
    release = threading.Event()

    def held(writer):
        def write() -> None:
            assert release.wait(timeout=120)
            writer()
        return write

    real_finish, real_step = ckpt.BackgroundSave.finish, loop_module.train_step
    steps = []

    def finish(self, *, wait):
        if wait and self.job is not None and self.job.step == 4:
            release.set()
        return real_finish(self, wait=wait)

    def train_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(TorchEngine, "stage_save", _writer_at(4, held))
    monkeypatch.setattr(ckpt.BackgroundSave, "finish", finish)
    monkeypatch.setattr(loop_module, "train_step", train_step)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert _train(run_dir, corpus_cache, **{"checkpoint.async_save": "true",
                                            "train.max_steps": 8}) == 128 + signal.SIGTERM
    log = _log(capsys)
    root = run_dir / "checkpoints"
    events = ["checkpoint: step 4 staged in", "checkpoint: waited",
              f"checkpoint: saved {root / 'step_00000004'} (written in the background)",
              f"checkpoint: saved {root / 'step_00000005'} in",
              f"stopped by SIGTERM at step 5: saved {root / 'step_00000005'}"]
    at = [log.find(e) for e in events]
    assert all(i >= 0 for i in at) and at == sorted(at), (at, log[-3000:])
    for step in (4, 5):
        assert ckpt.verify_contents(root / ckpt.step_dir_name(step)) is None
    assert (root / "latest").read_text().strip() == "step_00000005"


def test_background_saves_are_refused_for_deepspeed_in_one_line():
    with pytest.raises(ConfigError, match="checkpoint.async_save=true cannot write parallel.strategy=zero3"):
        load_config(Path(TINY), ["--checkpoint.async_save=true", "--parallel.strategy=zero3"])


def test_a_background_save_checks_the_weights_before_staging_anything(tmp_path):
    job = ckpt.SaveJob(tmp_path / "ckpt", 3, 0, 1, "none", lambda: None, keep_last=0)
    staged: list[Path] = []
    background = ckpt.BackgroundSave()
    with pytest.raises(ckpt.CheckpointError, match="step 3: the model's weights hold NaN or inf"):
        background.start(job, lambda d, staging: staged.append(d), {}, [torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert staged == [] and not background.in_flight and not (tmp_path / "ckpt").exists()


def test_host_copies_reuse_their_memory_from_save_to_save_and_are_copies_of_the_moment():
    weight = torch.arange(6.0)
    state = {"a": weight, "tied": weight, "b": torch.ones(2)}
    reuse: dict = {}
    first = host_copy(state, reuse)
    assert first["a"].data_ptr() == first["tied"].data_ptr() != weight.data_ptr()  # tying kept, memory its own
    weight.add_(1)
    assert torch.equal(first["a"], torch.arange(6.0))  # what the weights were at the copy
    again = host_copy(state, reuse)
    assert again["a"].data_ptr() == first["a"].data_ptr() and torch.equal(again["a"], weight)  # same memory, new values
    del state["b"]
    host_copy(state, reuse)
    assert len(reuse) == 1  # the copy of a storage no longer in the state is let go
