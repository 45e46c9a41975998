"""A disk that fills up or a file-size limit under a running job: the run never dies of its log
file, and a checkpoint that cannot be written is named in one line.

metrics.jsonl is made to fail as the kernel fails it: ``os.write`` on that file's descriptor
(and no other) writes part of a row and then raises ENOSPC, for a few steps or for the rest of
the run. The checkpoint's file-size failure is the kernel's own: a real RLIMIT_FSIZE in this
process with SIGXFSZ ignored, so that torch's writer meets EFBIG. The same limit on a whole
train.py process is in tests/integration/test_disk_limits.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import tiny_overrides
from training import checkpoint as ckpt

TINY = "configs/tiny.yaml"


class FullDisk:
    """``os.write`` that fails on metrics.jsonl as a full disk does: from the first row of step
    ``first_step`` on, for ``attempts`` tries to write a row (None: for good). The first try of an
    outage writes half the row and returns (a short write); the next call raises ENOSPC."""

    def __init__(self, monkeypatch, first_step: int, attempts: int | None):
        self.first_step, self.attempts, self.failures = first_step, attempts, 0
        self._tries = 0  # row writes tried since the disk filled
        self._real = os.write
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd: int, data) -> int:
        link = f"/proc/self/fd/{fd}"
        if not (os.path.islink(link) and os.readlink(link).endswith("metrics.jsonl")):
            return self._real(fd, data)
        row = re.match(rb'\{"step": (\d+)', bytes(data))
        if row is not None and (self._tries or int(row.group(1)) >= self.first_step):
            self._tries += 1
        full = self._tries and (self.attempts is None or self._tries <= self.attempts)
        if not full:
            return self._real(fd, data)
        self.failures += 1
        if row is not None and self._tries == 1:
            return self._real(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _train(run_dir: Path, corpus_cache: str, **overrides) -> int:
    args = tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 8, "checkpoint.interval": 4, **overrides})
    return train.main(["--config", TINY, *args])


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # each row whole


def test_metrics_rows_held_through_a_full_disk_reach_the_file_in_order(tmp_path, corpus_cache, capsys, monkeypatch):
    disk = FullDisk(monkeypatch, first_step=3, attempts=3)  # rows 3, 4 and 5 arrive on a full disk
    assert _train(tmp_path / "run", corpus_cache) == 0
    out = capsys.readouterr()
    err = out.out + out.err  # the run's log lines, warnings included
    assert disk.failures >= 2
    cannot = [line for line in err.splitlines() if "metrics: cannot write" in line]
    assert len(cannot) == 1 and "step 3" in cannot[0] and "no space left on device (ENOSPC)" in cannot[0], err
    assert err.count("takes rows again; the held rows of steps 3-6 are written, in order") == 1, err
    assert [row["step"] for row in _rows(tmp_path / "run") if "loss" in row] == list(range(1, 9))
    assert ckpt.find_latest(tmp_path / "run" / "checkpoints").name == "step_00000008"
    assert "Traceback" not in err


def test_a_disk_full_to_the_end_neither_stops_training_nor_loses_a_checkpoint(tmp_path, corpus_cache, capsys,
                                                                              monkeypatch):
    FullDisk(monkeypatch, first_step=3, attempts=None)
    assert _train(tmp_path / "run", corpus_cache) == 0
    out = capsys.readouterr()
    log = out.out + out.err
    assert log.count("metrics: cannot write step 3") == 1, log
    assert log.count("6 row(s) (steps 3-8) never reached") == 1, log
    assert "step 8/8 | loss" in log and "Traceback" not in log  # the numbers are in the log lines
    assert [row["step"] for row in _rows(tmp_path / "run")] == [1, 2]  # no torn third row
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").glob("step_*"))] == ["step_00000004",
                                                                                           "step_00000008"]


def test_a_save_past_the_file_size_limit_says_file_too_large_and_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"

    def write(d: Path) -> None:
        torch.save({"w": torch.zeros(1 << 18)}, d / "model_optim.pt")  # 1 MiB

    def save(step: int) -> Path:
        return ckpt.save_checkpoint(root, step, write, {}, rank=0, world_size=1, strategy="none",
                                    barrier=lambda: None, keep_last=1)

    save(1)
    before, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, before[1]))
    try:
        with pytest.raises(ckpt.CheckpointError) as info:
            save(2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)
    assert str(info.value) == (
        f"step 2: cannot save the checkpoint: File too large (EFBIG) writing {root}/.tmp-step_00000002/model_optim.pt: "
        "the process's file-size limit (ulimit -f) is 262,144 bytes; the previous checkpoint is untouched")
    assert ckpt.find_latest(root).name == "step_00000001" and ckpt.incomplete_reason(root / "step_00000001") is None
    assert not (root / ".tmp-step_00000002").exists()
