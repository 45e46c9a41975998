"""Two gloo ranks under torchrun with a rank that fails on purpose (training/faults.py).

One launch (``frozen_run``) makes rank 1 slow (1 s of sleep in every forward) and then freezes it
(SIGSTOP, its watchdog thread included) in step 5's optimizer phase: the straggler report must
name rank 1, and rank 0, left waiting in the next collective, must write its stack file and exit
with the hang code within its timeout. Its losses for steps 1-4 are an uninterrupted run's, since
sleeping changes no number. The other launch (``restarted_run``) has rank 1 SIGKILL itself at
step 3 under ``torchrun --max-restarts=1 ... --resume auto``: the job must finish with exit 0 and
its losses after the restart point equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, read_metrics, step_losses, tiny_overrides
from training.watchdog import HANG_EXIT_CODE

HANG_TIMEOUT_S = 5
SLACK_S = 15  # the watchdog's poll, a loaded 2-core machine
FAULT = re.compile(r"fault: rank 1 pid (\d+) (\w+) at step (\d+) phase (\w+) time ([\d.]+)")


def _launch(run_dir: Path, log: Path, faults: str, *extra_args: str, max_restarts: int = 0,
            **overrides) -> subprocess.Popen:
    # Both runs share every setting that changes a number (the schedule is pinned by decay_steps).
    args = ["--config", "configs/tiny.yaml", *tiny_overrides(run_dir, overrides.pop("corpus_cache"), **{
        "optim.decay_steps": 8, "checkpoint.save_final": "false", **overrides})]
    # A fresh rendezvous store per restart: with the shared one, a restarted gloo rank can read the failed
    # attempt's peer addresses and hang or fail connecting (here 3 of 5 restarts did; with this, 0 of 5).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PERFGPT_FAULTS": faults,
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(
        # The c10d rendezvous, as on several nodes (docs/reliability.md).
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--max-restarts={max_restarts}", "train.py", *args, *extra_args],
        cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("frozen")
    log = tmp / "torchrun.log"
    proc = _launch(tmp / "run", log, "slow:rank=1:phase=forward:seconds=1;freeze:rank=1:step=5:phase=optimizer",
                   corpus_cache=corpus_cache, **{"train.max_steps": 50, "train.hang_timeout_s": HANG_TIMEOUT_S,
                                                 "train.hang_grace_s": 120, "train.straggler_threshold": 0.3})
    stack_file = tmp / "run" / "hang" / "rank0.txt"
    deadline = time.monotonic() + 240
    try:
        while not stack_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # rank 0 writes the file, then its line, then exits
        frozen = FAULT.search(log.read_text())
        if frozen:  # a stopped process ignores torchrun's SIGTERM: end it as a node's failure would
            os.kill(int(frozen.group(1)), signal.SIGKILL)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"rc": rc, "log": log.read_text(), "run_dir": tmp / "run", "stack_file": stack_file, "fault": frozen}


@pytest.mark.timeout(400)
def test_a_rank_waiting_for_a_frozen_peer_writes_its_stack_and_exits_within_the_timeout(frozen_run):
    out, fault = frozen_run["log"], frozen_run["fault"]
    assert fault is not None and fault.group(2) == "freeze", out[-3000:]
    assert frozen_run["rc"] != 0
    text = frozen_run["stack_file"].read_text()
    header = text.splitlines()[0]
    assert "rank 0" in header and "last completed step 5" in header and "phase collective" in header, header
    assert "all_reduce" in text and "Thread" in text  # the collective it waits in, from every thread's stack
    waited = float(re.search(r"finished no step for (\d+)s", header).group(1))
    assert HANG_TIMEOUT_S <= waited <= HANG_TIMEOUT_S + SLACK_S
    written_after = frozen_run["stack_file"].stat().st_mtime - float(fault.group(5))
    assert written_after < HANG_TIMEOUT_S + SLACK_S
    assert re.search(r"\[rank 0[^\]]*\] hang: rank 0 finished no step", out)  # the one line, rank-prefixed
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}", out), out[-3000:]  # torchrun saw the hang code


@pytest.mark.timeout(400)
def test_the_slowed_rank_is_named_as_the_straggler(frozen_run):
    out = frozen_run["log"]
    named = re.findall(r"straggler rank (\d+) on (\S+): (\d+)% slower than the median", out)
    assert named and {rank for rank, _, _ in named} == {"1"}, out[-3000:]
    assert len(named) == len(set(re.findall(r"step (\d+): straggler", out)))  # one line per report, from rank 0
    times = {r["step"]: r["rank_own_time_s"] for r in read_metrics(frozen_run["run_dir"]) if "rank_own_time_s" in r}
    assert sorted(times) == [1, 2, 3, 4]
    # Step 2's forward holds DDP's bucket rebuild, a collective that waits for the slow rank: steps 3-4 show
    # each rank's own work alone.
    assert all(times[s][1] > times[s][0] + 0.5 for s in (3, 4)), times


@pytest.mark.timeout(400)
def test_torchrun_restarts_a_killed_rank_and_resume_auto_continues_exactly(frozen_run, tmp_path, corpus_cache):
    log = tmp_path / "torchrun.log"
    proc = _launch(tmp_path / "run", log, "kill:rank=1:step=3:phase=forward", "--resume", "auto", max_restarts=1,
                   corpus_cache=corpus_cache, **{"train.max_steps": 4, "checkpoint.interval": 2})
    try:
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert FAULT.search(out) and "kill at step 3" in out  # the first attempt did die
    assert "resume auto: no checkpoint under" in out  # first attempt: a fresh start
    assert re.search(r"resume auto: continuing from \S+step_00000002 at step 2 \(torchrun restart 1\)", out)
    restarted, reference = step_losses(tmp_path / "run"), step_losses(frozen_run["run_dir"])
    assert sorted(restarted) == [1, 2, 3, 4]
    assert {s: restarted[s] for s in (3, 4)} == {s: reference[s] for s in (3, 4)}  # bit for bit
