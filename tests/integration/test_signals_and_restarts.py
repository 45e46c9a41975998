"""The training loop under signals, restarts and runs that cannot learn.

Signals: SIGTERM (what Slurm sends before killing a job) and Ctrl-C finish the current step, save
it and exit 143 / 130 with one line; torchrun forwards SIGTERM to every worker and all of them
save the same step. Restarts: a resumed run leaves one metrics row per step. Logs: a window of
skipped steps logs null, never a perfect-looking 0.0, and metrics.jsonl is strict JSON; fp16 runs
whose loss scale zeroes or overflows every gradient are named as such. Errors: each rank's line
names the rank, and a checkpoint of another rank count says so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.checkpoint import safe_torch_load
from tests.conftest import ROOT, free_port, run_train, tiny_overrides
from training import checkpoint as ckpt

TINY = "configs/tiny.yaml"
STOPPED = re.compile(r"stopped by (SIG\w+) at step (\d+): saved (\S+); resume with --resume")


def _strict_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON: NaN / Infinity, which Python's json accepts, fail here."""

    def reject(constant: str):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=reject) for line in text.splitlines() if line.strip()]


def _start(args: list[str], log: Path, torchrun: bool = False) -> subprocess.Popen:
    """train.py (or torchrun) in its own session, as a terminal or a batch system starts it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "train.py"] if torchrun else [sys.executable, "train.py"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*launcher, *args], cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_for_text(proc: subprocess.Popen, log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before printing {text!r}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {text!r} after {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _long_run(run_dir: Path, corpus_cache: str, **extra) -> list[str]:
    return ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 100_000, "optim.decay_steps": 100_000, "checkpoint.interval": 0, **extra})]


# --------------------------------------------------------------------------- signals


@pytest.mark.timeout(240)
def test_sigterm_finishes_the_step_saves_it_and_resume_continues_from_it(tmp_path, corpus_cache):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(_long_run(run_dir, corpus_cache), log)
    _wait_for_text(proc, log, "step 3/")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    out = log.read_text()
    assert rc == 143, out[-2000:]
    match = STOPPED.search(out)
    assert match and match.group(1) == "SIGTERM", out[-2000:]
    step = int(match.group(2))
    assert step >= 3 and match.group(3).endswith(ckpt.step_dir_name(step))
    assert ckpt.find_latest(run_dir / "checkpoints").name == ckpt.step_dir_name(step)
    assert "Traceback" not in out

    resumed = run_train(["--resume", *_long_run(run_dir, corpus_cache, **{"train.max_steps": step + 2})])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {step}" in resumed.stdout and f"step {step + 2}/{step + 2}" in resumed.stdout
    assert [r["step"] for r in _strict_rows(run_dir) if "loss" in r] == list(range(1, step + 3))


@pytest.mark.timeout(240)
def test_ctrl_c_saves_without_a_traceback(tmp_path, corpus_cache):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(_long_run(run_dir, corpus_cache), log)
    _wait_for_text(proc, log, "step 2/")
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole process group
    rc = proc.wait(timeout=60)
    out = log.read_text()
    assert rc == 130, out[-2000:]
    match = STOPPED.search(out)
    assert match and match.group(1) == "SIGINT", out[-2000:]
    assert (run_dir / "checkpoints" / ckpt.step_dir_name(int(match.group(2))) / "meta.json").is_file()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out


def test_ctrl_c_during_set_up_exits_with_one_line(tmp_path, corpus_cache):
    log = tmp_path / "run.log"
    proc = _start(_long_run(tmp_path / "run", corpus_cache), log)
    _wait_for_text(proc, log, "resolved config:")  # printed before the model is built
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
    out = log.read_text()
    assert rc == 130, out[-2000:]
    # Almost always still in set-up; on a fast machine the first step may have begun (then it is saved).
    assert "interrupted (SIGINT) before the first step; nothing to save" in out or STOPPED.search(out), out[-2000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out


# Set-up code that cannot let a KeyboardInterrupt through: C++ called from Python (torch's and
# Triton's extensions during an import) aborts the process when the exception reaches it. Here a
# handler that swallows it stands in for that code: a signal raised *into* set-up would be caught
# and set-up would go on; taken away from set-up code, it ends the process with one line.
SIGNAL_IN_SET_UP = f"""
import os, signal, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
from training.signals import StopRequest

with StopRequest("[rank 0] "):
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            sum(range(10_000))
        except BaseException as exc:
            print("set-up swallowed", type(exc).__name__, flush=True)
    print("set-up went on", flush=True)
"""


def test_a_signal_during_set_up_never_enters_set_up_code():
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_SET_UP], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip() == "[rank 0] interrupted (SIGINT) before the first step; nothing to save"


SECOND_SIGNAL = f"""
import datetime, os, signal, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
import torch.distributed as dist
from training.signals import StopRequest

def send():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # one request delivered twice (Slurm and torchrun)
    time.sleep(0.6)
    print("still running after a duplicate", stop.requested, flush=True)
    os.kill(os.getpid(), signal.SIGINT)

with StopRequest("[rank 0] ") as stop:
    stop.arm()
    threading.Thread(target=send, daemon=True).start()
    # Blocked in C++ as a rank waiting on a hung peer is: Python-level handlers cannot run here.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    store.wait(["a key no peer will ever set"])
print("not reached", flush=True)
"""


def test_a_second_signal_exits_at_once_with_one_line():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # at once, not when the 60 s wait gives up
    assert proc.stdout.strip() == f"still running after a duplicate {int(signal.SIGTERM)}"
    assert proc.stderr.strip() == "[rank 0] second SIGINT: exiting at once without saving"


@pytest.mark.timeout(300)
def test_torchrun_forwards_sigterm_and_every_rank_saves_the_same_step(tmp_path, corpus_cache):
    run_dir, log = tmp_path / "ddp", tmp_path / "ddp.log"
    # With DataLoader workers: torchrun signals each worker's whole process group, loader workers included.
    proc = _start(_long_run(run_dir, corpus_cache, **{"data.num_workers": 2}), log, torchrun=True)
    _wait_for_text(proc, log, "step 3/", timeout=200)
    proc.send_signal(signal.SIGTERM)  # to the torchrun agent only; it forwards the signal to the workers
    rc = proc.wait(timeout=90)
    out = log.read_text()
    assert rc != 0
    match = STOPPED.search(out)
    assert match and match.group(1) == "SIGTERM", out[-3000:]
    step_dir = run_dir / "checkpoints" / ckpt.step_dir_name(int(match.group(2)))
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == int(match.group(2))
    states = [safe_torch_load(step_dir / f"rank_{r:05d}.pt") for r in (0, 1)]
    assert [s["step"] for s in states] == [meta["step"]] * 2  # both ranks stopped after the same step
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out

    # a two-rank checkpoint resumed by one process names the rank count, not the strategy
    # (strategy none was promoted to ddp under two processes, so the strategies differ as well).
    one = run_train(["--resume", str(step_dir), *_long_run(run_dir, corpus_cache)])
    assert one.returncode == 2
    assert "saved by 2 rank(s), this run has 1" in one.stderr and "parallel.strategy" not in one.stderr


# --------------------------------------------------------------------------- metrics after a restart


def test_resume_leaves_one_metrics_row_per_step(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    # A run that ends at step 5 with its last checkpoint at step 3 leaves the state a crash at step 5
    # leaves; the torn line is what a kill in the middle of a write adds.
    common = {"train.max_steps": 5, "optim.decay_steps": 7, "checkpoint.interval": 3, "checkpoint.save_final": "false",
              "train.eval_interval": 5}
    assert run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **common)]).returncode == 0
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 4.1')
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{
        **common, "train.max_steps": 7})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = _strict_rows(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 8))
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 7]  # 5 from the resumed run, 7: its last step
    assert "metrics: dropped 4 row(s) after step 3" in proc.stdout  # steps 4, 5, val at 5, the torn line


# --------------------------------------------------------------------------- runs that cannot learn


def test_an_all_skipped_window_logs_null_and_the_overflowing_scaler_is_named(tmp_path, corpus_cache):
    run_dir = tmp_path / "overflow"
    # Every fp16 step overflows at this scale; the scaler halves it each step and needs ~85 steps.
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "precision.mode": "fp16", "precision.fp16_init_scale": 1e30, "precision.max_skipped_steps": 100,
        "train.max_steps": 6, "train.log_interval": 3, "checkpoint.save_final": "false"})])
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-2000:]
    rows = [r for r in _strict_rows(run_dir) if "lr" in r]
    assert [(r["step"], r["loss"], r["grad_norm"], r["skipped_in_window"]) for r in rows] == [
        (3, None, None, 3), (6, None, None, 3)]
    assert "step 3/6 | loss skipped (3/3 steps skipped)" in out
    assert "the fp16 loss scaler skipped 3 steps in a row" in out and "lower precision.fp16_init_scale" in out


def test_gradients_underflowed_to_zero_are_reported(tmp_path, corpus_cache):
    run_dir = tmp_path / "underflow"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "precision.mode": "fp16", "precision.fp16_init_scale": 1e-30, "train.max_steps": 4, "train.log_interval": 2,
        "checkpoint.save_final": "false"})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in _strict_rows(run_dir) if "lr" in r]
    assert [r["grad_norm"] for r in rows] == [0.0, 0.0] and all(r["loss"] > 1.0 for r in rows)
    out = proc.stdout + proc.stderr
    assert out.count("gradient norm is exactly 0") == 1  # once, not at every log line
    assert "loss scale 1e-30 underflows them to zero; raise precision.fp16_init_scale" in out


# --------------------------------------------------------------------------- messages


def test_peer_failures_are_recognised_narrowly():
    from common.errors import describe_peer_failure, is_peer_failure

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:3509. This is typically caused by a remote worker crashing.")
    assert is_peer_failure(gloo)
    line = describe_peer_failure(gloo)
    assert "Connection closed by peer [127.0.0.1]:3509" in line and "pair.cc" not in line and "\n" not in line
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_peer_failure(ValueError("[x/gloo/y.cc:1] not a RuntimeError"))


def test_every_rank_prefixes_its_one_line_error(tmp_path):
    # What torchrun sets for the second worker of one node; the config error comes before any rendezvous.
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    proc = run_train(["--config", TINY, "--precision.mode=fp9", f"--logging.run_dir={tmp_path}"], env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "[rank 1 local 1 node 0] config error: precision.mode='fp9' is not valid; choose one of: fp32, bf16, fp16, "
        "bf16_master, fp8"]


def test_a_rank_count_change_is_named_before_the_strategy(tmp_path):
    root = tmp_path / "ckpt"
    ckpt.save_checkpoint(root, 4, lambda d: None, {"step": 4}, rank=0, world_size=1, strategy="none",
                         barrier=lambda: None, keep_last=0)
    with pytest.raises(ckpt.CheckpointError, match=r"saved by 1 rank\(s\), this run has 2.*start 1 rank\(s\)"):
        ckpt.read_checkpoint_meta(root / ckpt.step_dir_name(4), world_size=2, strategy="ddp")  # none -> ddp under torchrun
