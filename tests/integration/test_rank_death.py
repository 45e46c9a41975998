"""A rank that stops answering makes the others fail within parallel.timeout_s instead of hanging.

Two torchrun agents act as two nodes (``--nnodes=2 --rdzv-backend=c10d``, one process each),
as on a cluster. Node 1's worker is frozen with SIGSTOP mid-run: its sockets stay open, so
nothing tells node 0 it is gone (the hard case; a crashed process closes its sockets and gloo
fails at once with "Connection closed by peer"), and node 0's agent cannot see node 1's worker.
Node 0's worker must give up on its collective after ``parallel.timeout_s`` (the process
group's timeout) and its agent must exit non-zero. Then node 1's worker is thawed and finds its
peer gone. Both workers must say so in one line with their rank prefix, without a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, tiny_overrides
from tests.gloo import run_workers

TIMEOUT_S = 10
SLACK_S = 20  # torchrun's monitor interval, worker teardown and a loaded CI machine


def _start_node(node: int, port: int, run_dir: Path, corpus_cache: str, log: Path) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rank-death-test", "--max-restarts=0",
        "train.py", "--config", "configs/tiny.yaml",
        *tiny_overrides(run_dir / f"node{node}", corpus_cache, **{
            "train.max_steps": 100_000, "parallel.strategy": "ddp", "parallel.timeout_s": TIMEOUT_S,
            "checkpoint.save_final": "false"}),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _children(pid: int) -> list[int]:
    task_dir = Path(f"/proc/{pid}/task")
    kids: list[int] = []
    for task in task_dir.iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to find torchrun's worker")
def test_a_frozen_rank_makes_the_other_node_exit_within_the_timeout(tmp_path, corpus_cache):
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_start_node(n, port, tmp_path, corpus_cache, logs[n]) for n in (0, 1)]
    frozen: list[int] = []
    try:
        _wait_for(lambda: "step 2/" in logs[0].read_text(), 120, "node 0 to train two steps")
        assert nodes[0].poll() is None and nodes[1].poll() is None
        frozen = _children(nodes[1].pid)
        assert len(frozen) == 1, f"expected one worker under node 1's agent, found {frozen}"
        os.kill(frozen[0], signal.SIGSTOP)
        t0 = time.monotonic()
        rc = nodes[0].wait(timeout=TIMEOUT_S + SLACK_S + 30)
        elapsed = time.monotonic() - t0
        out = logs[0].read_text()
        assert rc != 0
        assert elapsed < TIMEOUT_S + SLACK_S, f"node 0 needed {elapsed:.1f}s to give up"
        # The collective that timed out reports it; gloo then fails the rank's other pending ones
        # with a bare "pair closure" text, and which of them reaches the training loop is a race.
        assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out or "Application timeout caused pair closure" in out, \
            out[-3000:]
        assert "[rank 0 local 0 node 0]" in out  # the per-rank log prefix names rank, local rank and node
        # gloo raises a plain RuntimeError, not a DistError: still one prefixed line, no worker traceback.
        assert "[rank 0 local 0 node 0] error: a peer rank failed or timed out (parallel.timeout_s)" in out
        assert "[rank0]: Traceback" not in out
        # Thawed, node 1's worker finds its peer gone ("Connection closed by peer"), or, frozen past
        # its own deadline, its pending receive times out first (or reports the pair that timeout
        # closed): either way one prefixed line. Or
        # node 1's agent notices first that node 0's agent (which hosted the rendezvous store) is
        # gone, and stops the worker before it reports anything: then there is no worker line.
        os.kill(frozen[0], signal.SIGCONT)
        nodes[1].wait(timeout=60)
        out1 = logs[1].read_text()
        assert nodes[1].returncode != 0 and "[rank1]: Traceback" not in out1, out1[-3000:]
        if "[rank 1 local 0 node 1] error:" in out1:
            assert "[rank 1 local 0 node 1] error: a peer rank failed or timed out" in out1, out1[-3000:]
            assert any(m in out1 for m in ("by peer", "Timed out waiting", "pair closure")), out1[-3000:]
        else:
            assert "The connection to the C10d store has failed" in out1, out1[-3000:]
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)



def _time_out_two_pending_collectives(rank: int, world: int) -> list[str]:
    import datetime

    import torch
    import torch.distributed as dist

    from common.errors import describe_peer_failure, is_peer_failure

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    if rank == 1:  # the silent peer: alive, sockets open, never joins
        time.sleep(6)
        return []
    # The second collective starts 1 s after the first, so the first one's deadline comes first and
    # the second is pending when gloo closes the pairs (issued together, which one reports the
    # timeout is a race a loaded machine decides either way).
    pending = [dist.all_reduce(torch.ones(4), group=group, async_op=True)]
    time.sleep(1)
    pending.append(dist.broadcast(torch.ones(4), src=1, group=group, async_op=True))
    seen = []
    for work in pending:
        with pytest.raises(RuntimeError) as caught:
            work.wait()
        assert is_peer_failure(caught.value), str(caught.value)
        seen.append(describe_peer_failure(caught.value))
    return seen


def test_both_errors_gloo_gives_pending_collectives_on_a_timeout_are_peer_failures():
    # gloo itself, not a copied message: the first pending collective reports its timeout, and the
    # second gets the bare text gloo sends every pair it closed (what node 0 above may see instead).
    first, second = run_workers(_time_out_two_pending_collectives, 2)[0]
    assert "Timed out waiting 2000ms" in first and "unbound_buffer.cc" not in first
    assert "parallel.timeout_s): Application timeout caused pair closure;" in second
    assert "\n" not in first + second
