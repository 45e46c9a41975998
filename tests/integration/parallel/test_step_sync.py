"""No host sync per training step for the non-finite check.

The engine used to read ``bool(isfinite(grad_norm) & isfinite(loss))`` on the host every step, a
device sync that stalls the CPU until the GPU has finished the step. With fused AdamW the flag
stays on the device as the optimizer's ``found_inf`` (the kernel leaves weights, moments and step
count untouched when it is 1), and the loop reads the flags of all steps since its last read at
once: at log intervals, before a save and on a stop.

A CPU has no device to wait for, so these tests check the mechanism, not time: train.py runs
with every read of a tensor's value on the host counted per step (``aten._local_scalar_dense``,
which ``.item()``, ``bool()`` and ``float()`` dispatch to, ``nonzero``, and ``Tensor.tolist``),
and with a NaN planted in one step's gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, read_metrics, run_train, tiny_overrides

TINY = "configs/tiny.yaml"
MAX_STEPS, NAN_STEP = 6, 3

# Runs train.py in this process with host reads counted per step and a NaN planted in the
# gradients of step NAN_STEP; prints one JSON line of findings at the end.
COUNTING_RUN = r"""
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from parallel import engine as engine_module
from training import loop as loop_module

NAN_STEP = int(sys.argv[1])
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}
reads, now = {}, {"step": 0, "loading": False}  # reads[step]: while step ran, and the loop's handling after


def count_read():
    if not now["loading"]:
        reads[now["step"]] = reads.get(now["step"], 0) + 1


class CountHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            count_read()
        return func(*args, **(kwargs or {}))


real_tolist = torch.Tensor.tolist


def tolist(self):  # on CPU tolist reads memory without dispatching an op
    count_read()
    return real_tolist(self)


torch.Tensor.tolist = tolist
real_run, real_step = loop_module.TrainingLoop.run, loop_module.train_step


def run(self):
    with CountHostReads():
        return real_run(self)


class Loading:
    # The batch iterator, not counted: it reads host tensors of its own (the DataLoader's seed),
    # which are no device sync; on a GPU batches come from host memory.

    def __init__(self, batches):
        self.batches = batches

    def __next__(self):
        now["loading"] = True
        try:
            return next(self.batches)
        finally:
            now["loading"] = False


def train_step(engine, batches, *args, **kwargs):
    now["step"] += 1
    return real_step(engine, Loading(batches), *args, **kwargs)


real_forward_backward, real_optimizer_step = engine_module.TorchEngine.forward_backward, engine_module.TorchEngine.optimizer_step
seen = {}


def forward_backward(self, *args):
    loss = real_forward_backward(self, *args)
    if now["step"] == NAN_STEP:
        with torch.no_grad():
            next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    return loss


def snapshot(engine):
    [part] = engine.optimized_parts()
    params = [p for group in part.optimizer.param_groups for p in group["params"]]
    state = [{k: v.clone() for k, v in part.optimizer.state[p].items()} for p in params]
    return [p.detach().clone() for p in params], state


def optimizer_step(self, lr, loss):
    step = now["step"]
    if step in (NAN_STEP, NAN_STEP + 1):  # the next step, applied, shows the comparison can see a change
        seen[step, "before"] = snapshot(self)
    result = real_optimizer_step(self, lr, loss)
    if step in (NAN_STEP, NAN_STEP + 1):
        seen[step, "after"] = snapshot(self)
        seen[step, "flag"] = type(result.skipped).__name__
    return result


def unchanged(step):
    (w0, s0), (w1, s1) = seen[step, "before"], seen[step, "after"]
    weights = all(torch.equal(a, b) for a, b in zip(w0, w1))
    state = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(s0, s1))
    return weights, state


loop_module.TrainingLoop.run, loop_module.train_step = run, train_step
engine_module.TorchEngine.forward_backward, engine_module.TorchEngine.optimizer_step = forward_backward, optimizer_step
code = train.main(sys.argv[2:])
print(json.dumps({"code": code, "reads": reads, "flag": seen[NAN_STEP, "flag"],
                  "nan_step_unchanged": unchanged(NAN_STEP), "next_step_unchanged": unchanged(NAN_STEP + 1)}))
"""


def _counting_run(tmp_path, corpus_cache, **extra) -> tuple[dict, str, list[dict]]:
    """COUNTING_RUN on the tiny config: (its findings, its output, the metrics rows)."""
    run_dir = tmp_path / "run"
    args = ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": MAX_STEPS, "train.log_interval": 100, "checkpoint.interval": 0, **extra})]
    proc = subprocess.run([sys.executable, "-c", COUNTING_RUN, str(NAN_STEP), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=280, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return found, proc.stdout + proc.stderr, read_metrics(run_dir)


def test_steps_between_log_lines_never_read_the_device_and_a_nan_step_is_still_skipped(tmp_path, corpus_cache):
    found, out, rows = _counting_run(tmp_path, corpus_cache, **{"optim.fused": "on"})
    assert found["code"] == 0, out[-3000:]
    reads = {int(step): n for step, n in found["reads"].items()}
    # Steps 1..5 log nothing and save nothing: not one host read. Step 6 logs (and saves):
    # the counter does see reads, so the zeros above are not blindness.
    assert all(reads.get(step, 0) == 0 for step in range(1, MAX_STEPS)), reads
    assert reads.get(MAX_STEPS, 0) > 0, reads
    # The NaN step was skipped on the device: weights and AdamW state exactly as before it.
    assert found["flag"] == "Tensor"
    assert found["nan_step_unchanged"] == [True, True], found  # weights, optimizer state
    assert found["next_step_unchanged"] == [False, False], found
    # ... and the loop, reading the flags at the log line, counts and reports it as before.
    assert f"step {NAN_STEP}: non-finite loss or gradient norm; optimizer step skipped" in out
    (row,) = [r for r in rows if "skipped_in_window" in r]
    assert (row["step"], row["skipped_in_window"], row["skipped_steps"]) == (MAX_STEPS, 1, 1)
    assert row["loss"] is not None and row["loss"] > 1.0  # the mean over the 5 applied steps, not NaN
    saved = tmp_path / "run" / "checkpoints" / f"step_{MAX_STEPS:08d}" / "meta.json"
    assert json.loads(saved.read_text())["healthy"] is True


def test_a_skip_streak_still_holds_back_interval_saves_when_flags_stay_on_the_device(tmp_path, corpus_cache):
    """tests/unit/training/test_checkpoints.py's skip-streak run with the flags on the device and no
    log line until the end: step 1 is applied (lr 1e30), every later step has an inf loss. Each
    interval save reads the flags first, so it waits, and keep_last=1 keeps step 1."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "optim.fused": "on", "optim.lr": 1e30, "optim.weight_decay": 0.0, "optim.warmup_steps": 0, "optim.grad_clip": 0,
        "train.max_steps": 5, "train.log_interval": 100, "precision.max_skipped_steps": 10,
        "checkpoint.interval": 1, "checkpoint.keep_last": 1})])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # The flags were read before each save decision, so the log reads as a per-step read made it.
    skipped = out.index("step 2: non-finite loss or gradient norm; optimizer step skipped")
    assert skipped < out.index("step 2: checkpoint postponed until a step is applied again")
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000005"]
    assert json.loads((root / "step_00000001" / "meta.json").read_text())["healthy"] is True
    assert json.loads((root / "step_00000005" / "meta.json").read_text())["healthy"] is False
