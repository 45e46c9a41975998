"""train.py end to end: it learns, resumes exactly, survives a crash mid-save, and rejects bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from parallel.checkpoint import safe_torch_load
from tests.conftest import ROOT, free_port, read_metrics, run_train, step_losses, tiny_overrides
from training import checkpoint as ckpt

TINY = "configs/tiny.yaml"


def test_tiny_run_learns_and_writes_its_outputs(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 30, "train.eval_interval": 30, "train.log_interval": 10, "optim.lr": 3e-3})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = read_metrics(run_dir)
    val = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert val and val[-1] < 5.545 - 1.0  # well below the uniform byte baseline ln(256)
    train_rows = [m for m in metrics if "loss" in m]
    for key in ("lr", "grad_norm", "tokens_per_s", "data_wait_frac", "host_peak_rss_gib"):
        assert key in train_rows[-1]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert "attention: sdpa (auto:" in proc.stdout and "MFU n/a" in proc.stdout


@pytest.mark.parametrize("extra, stop", [({}, "end of a shorter run"),
                                         ({"model.dropout": 0.1, "train.grad_accum_steps": 2}, "interval save")])
def test_resume_reproduces_the_uninterrupted_loss_sequence_exactly(tmp_path, corpus_cache, extra, stop):
    """8 steps straight, or 4 then a resume, give the same losses bit for bit. The 4 steps are
    either a run of their own resumed with --resume (latest), or the straight run's step-4
    interval checkpoint resumed by path into another run directory."""
    common = {"train.max_steps": 8, "optim.decay_steps": 8, **extra}
    full, split = tmp_path / "full", tmp_path / "split"
    interval = {"checkpoint.interval": 4} if stop == "interval save" else {}
    assert run_train(["--config", TINY, *tiny_overrides(full, corpus_cache, **common, **interval)]).returncode == 0
    if stop == "interval save":
        resume = ["--resume", str(full / "checkpoints" / "step_00000004")]
    else:
        first = run_train(["--config", TINY, *tiny_overrides(split, corpus_cache, **{**common, "train.max_steps": 4})])
        assert first.returncode == 0, first.stderr[-2000:]
        resume = ["--resume"]
    second = run_train(["--config", TINY, *resume, *tiny_overrides(split, corpus_cache, **common)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "continuing from" in second.stdout
    expected = {step: loss for step, loss in step_losses(full).items() if stop != "interval save" or step > 4}
    assert step_losses(split) == expected  # bit-for-bit: same floats in the JSONL


def test_checkpoint_killed_mid_write_leaves_the_previous_one_loadable(tmp_path):
    root = tmp_path / "ckpt"
    barrier = lambda: None  # noqa: E731 - single process
    model = torch.nn.Linear(4, 4)

    def write(d: Path) -> None:
        torch.save(model.state_dict(), d / "model_optim.pt")

    ckpt.save_checkpoint(root, 10, write, {"step": 10}, rank=0, world_size=1, strategy="none", barrier=barrier, keep_last=2)
    # A second save dies inside write_states: a real process killed with SIGKILL mid-write.
    script = f"""
import os, signal, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from training import checkpoint as ckpt
def write(d):
    with open(d / "model_optim.pt", "wb") as f:
        f.write(b"partial")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
ckpt.save_checkpoint(Path({str(root)!r}), 20, write, {{"step": 20}}, rank=0, world_size=1, strategy="none",
                     barrier=lambda: None, keep_last=2)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert (root / ".tmp-step_00000020").is_dir()  # the debris is there...
    latest = ckpt.find_latest(root)
    assert latest is not None and latest.name == "step_00000010"  # ...but never taken as a checkpoint
    state = safe_torch_load(latest / "model_optim.pt")
    torch.testing.assert_close(state["weight"], model.weight)
    # The next successful save cleans the debris.
    ckpt.save_checkpoint(root, 30, write, {"step": 30}, rank=0, world_size=1, strategy="none", barrier=barrier, keep_last=2)
    assert not (root / ".tmp-step_00000020").exists()
    assert ckpt.find_latest(root).name == "step_00000030"


def test_keep_last_prunes_old_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(root, step, lambda d: None, {}, rank=0, world_size=1, strategy="none",
                             barrier=lambda: None, keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, corpus_cache) -> Path:
    """A finished 2-step run of the tiny config; tests that damage or resume it work on a copy."""
    run_dir = tmp_path_factory.mktemp("two-step") / "run"
    assert run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 2})]).returncode == 0
    return run_dir


def test_corrupt_or_mismatched_checkpoints_give_clear_errors(tmp_path, corpus_cache, two_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    step_dir = run_dir / "checkpoints" / "step_00000002"
    (step_dir / "model_optim.pt").write_bytes(b"\x80\x02not a checkpoint")
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 4})])
    assert proc.returncode == 2
    assert "cannot read checkpoint file" in proc.stderr and "model_optim.pt" in proc.stderr
    assert "Traceback" not in proc.stderr

    meta = json.loads((step_dir / "meta.json").read_text())
    meta["strategy"] = "fsdp"
    (step_dir / "meta.json").write_text(json.dumps(meta))
    proc = run_train(["--config", TINY, "--resume", str(step_dir), *tiny_overrides(run_dir, corpus_cache)])
    assert proc.returncode == 2 and "was saved with parallel.strategy=fsdp" in proc.stderr

    proc = run_train(["--config", TINY, "--resume", str(tmp_path / "nowhere"), *tiny_overrides(run_dir, corpus_cache)])
    assert proc.returncode == 2 and "checkpoint not found" in proc.stderr


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_fresh_run_into_a_folder_holding_another_run_is_refused_and_touches_nothing(tmp_path, corpus_cache,
                                                                                       two_step_run):
    # Before, the second run saved its step 2 beside the first run's checkpoints, pruning kept the
    # highest step numbers (deleting its own save), and config.yaml and metrics.jsonl were mixed.
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    before = _tree_bytes(run_dir)
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 1})])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(run_dir) in error[0] and "step_00000002" in error[0] and "--resume" in error[0], error[0]
    assert _tree_bytes(run_dir) == before


def test_resume_with_a_different_model_shape_is_a_clear_error(tmp_path, corpus_cache, two_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{"model.d_model": 32})])
    assert proc.returncode == 2
    assert "does not match the model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "configs/nope.yaml"], "config file not found"),
        (["--config", TINY, "--precision.mode=fp8", "--model.layers=te"], "needs Transformer Engine"),
        (["--config", TINY, "--model.attention=flash_attn"], "flash_attn cannot run"),
        (["--config", TINY, "--train.device=cuda"], "no CUDA device is visible"),
        (["--config", TINY, "--data.format=mmap", "--data.path=/nonexistent"], "/nonexistent"),
        (["--config", TINY, "stray"], "config overrides look like --section.key=value"),
    ],
)
def test_bad_input_fails_fast_with_one_clear_line(args, message, tmp_path):
    proc = run_train(args + [f"--logging.run_dir={tmp_path}"] if "stray" not in args else args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr


# Runs train.main with a global forward hook that records, for every nn.Linear called while
# training, the dtype of its weight and of its output: the precision the model really computes in.
DTYPE_PROBE = """
import json, sys, torch
seen = set()
def probe(module, args, output):
    if isinstance(module, torch.nn.Linear) and module.training and torch.is_grad_enabled():
        seen.add((str(module.weight.dtype), str(output.dtype)))
torch.nn.modules.module.register_module_forward_hook(probe)
import train
code = train.main(sys.argv[1:])
print("LINEAR_DTYPES " + json.dumps(sorted(seen)))
sys.exit(code)
"""


@pytest.mark.parametrize("mode, weight, output", [
    ("bf16", "torch.float32", "torch.bfloat16"),  # autocast: fp32 weights, bf16 matmuls
    ("fp16", "torch.float32", "torch.float16"),
    ("bf16_master", "torch.bfloat16", "torch.bfloat16"),  # bf16 weights; fp32 masters live in the optimizer
])
def test_precision_modes_train_on_cpu(mode, weight, output, tmp_path, corpus_cache):
    run_dir = tmp_path / mode
    args = ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "precision.mode": mode, "train.max_steps": 12, "optim.lr": 3e-3})]
    proc = subprocess.run([sys.executable, "-c", DTYPE_PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    probed = [line for line in proc.stdout.splitlines() if line.startswith("LINEAR_DTYPES ")]
    assert probed and json.loads(probed[-1].split(" ", 1)[1]) == [[weight, output]]
    losses = step_losses(run_dir)
    assert losses[12] < losses[1] - 0.5


def test_nonfinite_loss_skips_or_stops_naming_the_step(tmp_path, corpus_cache):
    # An absurd learning rate drives the weights to inf within a few steps.
    skip_dir, stop_dir = tmp_path / "skip", tmp_path / "stop"
    bad = {"optim.lr": 1e30, "optim.weight_decay": 0.0, "optim.warmup_steps": 0, "optim.grad_clip": 0, "train.max_steps": 8,
           "precision.max_skipped_steps": 2}
    proc = run_train(["--config", TINY, *tiny_overrides(skip_dir, corpus_cache, **bad)])
    assert "non-finite loss or gradient norm; optimizer step skipped" in proc.stdout + proc.stderr
    assert "skipped in a row" in proc.stdout + proc.stderr and proc.returncode == 3
    proc = run_train(["--config", TINY, *tiny_overrides(stop_dir, corpus_cache, **bad, **{"precision.nonfinite": "stop"})])
    assert proc.returncode == 3 and "stopping (precision.nonfinite=stop)" in proc.stdout + proc.stderr


def test_profile_flag_writes_a_trace(tmp_path, corpus_cache):
    run_dir = tmp_path / "prof"
    proc = run_train(["--config", TINY, "--profile", *tiny_overrides(run_dir, corpus_cache, **{
        "train.profile_wait": 1, "train.profile_warmup": 1, "train.profile_active": 2})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    traces = list((run_dir / "profile").glob("trace_rank0_*.json"))
    assert traces and json.loads(traces[0].read_text())["traceEvents"]


@pytest.mark.timeout(300)
def test_torchrun_two_processes_on_cpu(tmp_path, corpus_cache):
    """Also a smoke run: 3 steps with the config's 50-step warm-up warm up over the 3 steps, with one
    warning line (rank 0's), and the config and the checkpoint record the warm-up used."""
    run_dir = tmp_path / "ddp"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "train.py",
         "--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 3, "optim.warmup_steps": 50})],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 (gloo)" in proc.stdout and "-> ddp" in proc.stdout
    assert "[rank 1 local 1 node 0]" in proc.stdout
    assert len(step_losses(run_dir)) == 3

    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if "optim.warmup_steps=50 is longer than train.max_steps=3" in line]
    assert len(warnings) == 1 and "warming up over 3 steps" in warnings[0], warnings
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["warmup_steps"] == 3
    meta = json.loads((run_dir / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["schedule"]["warmup_steps"] == 3 and meta["schedule"]["decay_steps"] == 3
    lrs = [r["lr"] for r in read_metrics(run_dir) if "lr" in r]
    assert lrs == pytest.approx([3e-3 / 3, 3e-3 * 2 / 3, 3e-3])  # the tiny config's optim.lr, reached at step 3


def test_wandb_offline_and_tensorboard_receive_the_metrics(tmp_path, corpus_cache):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'perfgpt[logging]')")
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'perfgpt[logging]')")
    run_dir = tmp_path / "logs"
    env = {"WANDB_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path / "wb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wb-config")}
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 2, "logging.wandb": "true", "logging.tensorboard": "true"})], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb"))
