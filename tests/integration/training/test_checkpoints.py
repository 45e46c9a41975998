"""Checkpoints under hostile conditions, through train.py and on gloo ranks: an infinite learning
rate, diverged weights, skip streaks, a kill inside a re-save, full or unwritable disks, a resumed
run whose LR schedule changed, and the finite check collective under FSDP2 and ZeRO-3 (a NaN on
one rank must stop the save on every rank).

The train.py runs share one short healthy run (``base_run``) that each test copies before resuming
from it, so they stay independent of each other's order. The checks that call training.checkpoint
directly (milliseconds): tests/unit/training/test_checkpoints.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.checkpoint import safe_torch_load
from tests.conftest import ROOT, can_mount_tmpfs, run_train, tiny_overrides
from tests.unit.training.test_checkpoints import TINY, _save, _steps
from training import checkpoint as ckpt


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus_cache) -> Path:
    """Two healthy steps with the default schedule (decay_steps = max_steps = 2), saved at step 2."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 2})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def _copy(base_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)  # resumed through its own logging.run_dir, so nothing points back
    return run_dir


def test_an_infinite_learning_rate_stops_before_any_work(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{"optim.lr": "inf"})])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: optim.lr must be a finite number within float32 range (got inf)"
    assert not run_dir.exists()


def test_a_diverged_model_is_never_saved_and_the_last_good_checkpoint_stays(base_run, tmp_path, corpus_cache):
    # Weights that went NaN without the step noticing (what lr=inf did before it was refused): here
    # planted in the checkpoint a run resumes from. Every later step is skipped (NaN loss), the
    # interval saves wait, and the final save must refuse rather than write NaN weights again.
    run_dir = _copy(base_run, tmp_path)
    root = run_dir / "checkpoints"
    step_dir = root / "step_00000002"
    state = safe_torch_load(step_dir / "model_optim.pt")
    state["model"]["tok_emb.weight"][0, 0] = float("nan")
    torch.save(state, step_dir / "model_optim.pt")
    meta = json.loads((step_dir / "meta.json").read_text())
    # the manifest must keep describing the file (its size and content checksum)
    meta["files"]["model_optim.pt"] = (step_dir / "model_optim.pt").stat().st_size
    meta["checksums"]["files"]["model_optim.pt"] = ckpt.file_digest(step_dir / "model_optim.pt")
    (step_dir / "meta.json").write_text(json.dumps(meta))
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 4, "optim.decay_steps": 2, "checkpoint.interval": 1})])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "Traceback" not in proc.stderr
    assert error[0].startswith("error: step 4: the model's weights hold NaN or inf") and "step_00000002 is kept" in error[0]
    assert _steps(root) == ["step_00000002"]  # nothing written, not even a temp dir
    assert (root / "latest").read_text().strip() == "step_00000002"


def test_a_skip_streak_neither_saves_nor_prunes_the_checkpoint_from_before_it(tmp_path, corpus_cache):
    # Step 1 applies an update of size lr to the weights (finite: 1e30 fits in float32); from step 2
    # on the loss is inf and every step is skipped. Interval saves must wait, the final save is
    # marked unhealthy, and keep_last=1 must not rotate step 1 away.
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "optim.lr": 1e30, "optim.weight_decay": 0.0, "optim.warmup_steps": 0, "optim.grad_clip": 0, "train.max_steps": 5,
        "precision.max_skipped_steps": 10, "checkpoint.interval": 1, "checkpoint.keep_last": 1})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "optimizer step skipped" in proc.stdout + proc.stderr
    assert "checkpoint postponed until a step is applied again" in proc.stdout + proc.stderr
    assert _steps(root) == ["step_00000001", "step_00000005"]
    assert json.loads((root / "step_00000001" / "meta.json").read_text())["healthy"] is True
    assert json.loads((root / "step_00000005" / "meta.json").read_text())["healthy"] is False


KILL_IN_RESAVE = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from pathlib import Path
from training import checkpoint as ckpt
root = Path({ckpt_root!r})
real_replace = os.replace
def replace(src, dst):
    # SIGKILL at the worst moment: the new copy is complete, the old one is no longer at step_N.
    if Path(src).name.startswith(".tmp-") and Path(dst).name == "step_00000010":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = replace
model = torch.nn.Linear(4, 4)
torch.nn.init.constant_(model.weight, 2.0)
ckpt.save_checkpoint(root, 10, lambda d: torch.save(model.state_dict(), d / "model_optim.pt"), {{"step": 10}},
                     rank=0, world_size=1, strategy="none", barrier=lambda: None, keep_last=2)
"""


def test_a_resave_killed_between_the_renames_leaves_a_complete_copy_to_resume(tmp_path):
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, 1.0)
    _save(root, 10, model, keep_last=2)
    proc = subprocess.run([sys.executable, "-c", KILL_IN_RESAVE.format(root=str(ROOT), ckpt_root=str(root))],
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    warnings: list[str] = []
    found = ckpt.resolve_resume("latest", root, warn=warnings.append)
    assert found is not None and ckpt.read_checkpoint_meta(found, 1, "none")["step"] == 10
    weight = safe_torch_load(found / "model_optim.pt")["weight"]
    assert torch.equal(weight, torch.ones(4, 4))  # the old copy, whole
    assert any("was being replaced when a save was interrupted" in w for w in warnings), warnings
    # The next save puts the old copy back under its name before it cleans up.
    _save(root, 20, keep_last=2)
    assert _steps(root) == ["step_00000010", "step_00000020"]
    assert ckpt.incomplete_reason(root / "step_00000010") is None


@pytest.mark.parametrize("key", ["checkpoint.dir", "logging.run_dir"])
def test_an_unwritable_directory_fails_at_start_up_in_one_line(key, tmp_path, corpus_cache):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "sub"  # root can write anywhere, but not below a regular file
    run_dir = tmp_path / "run" if key == "checkpoint.dir" else target
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{key: str(target)})])
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {key}={target} is not writable: not a directory (ENOTDIR) at {target}; " \
                                  "choose another directory", proc.stderr[-2000:]
    assert "step 1/" not in proc.stdout  # before any training


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare -rm and tmpfs mounts (user namespaces)")
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_really_full_disk_mid_run_is_named_and_the_previous_checkpoint_survives(async_save, tmp_path, corpus_cache):
    # A private 2 MiB tmpfs (mount namespace of this one command): one 1.5 MB checkpoint fits, a
    # second does not, so the save at step 4 runs out of space inside torch.save (with
    # checkpoint.async_save on the writer thread, and the error comes at a later step, the same line).
    ckpt_dir = tmp_path / "small_disk"
    ckpt_dir.mkdir()
    args = ["--config", TINY, *tiny_overrides(tmp_path / "run", corpus_cache, **{
        "train.max_steps": 6, "checkpoint.interval": 2, "checkpoint.keep_last": 1, "checkpoint.dir": str(ckpt_dir),
        "checkpoint.async_save": async_save})]
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c",
         f'mount -t tmpfs -o size=2m tmpfs "$0" || exit 99; "$@"; rc=$?; cp -r "$0" "{tmp_path}/after"; exit $rc',
         str(ckpt_dir), sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: step 4: cannot save the checkpoint: no space left on device (ENOSPC) " \
                                  f"writing {ckpt_dir}/.tmp-step_00000004; the previous checkpoint is untouched"
    after = tmp_path / "after"  # the tmpfs as the run left it
    assert _steps(after) == ["step_00000002"]
    assert ckpt.incomplete_reason(after / "step_00000002") is None
    assert (after / "latest").read_text().strip() == "step_00000002"


def test_resume_refuses_a_changed_lr_schedule_naming_the_keys(base_run, tmp_path, corpus_cache):
    run_dir = _copy(base_run, tmp_path)
    # The usual accident: a longer max_steps moves the default decay_steps (2 -> 4).
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 4})])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "different LR schedule (optim.decay_steps 2 -> 4)" in line
    assert "--optim.decay_steps=2" in line and "checkpoint.allow_schedule_change=true" in line
    # Stating the saved schedule resumes; opting in resumes with the new one and says so.
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 3, "optim.decay_steps": 2})])
    assert proc.returncode == 0 and "continuing from" in proc.stdout, proc.stderr[-2000:]
    proc = run_train(["--config", TINY, "--resume", *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 4, "optim.lr": 1e-3, "checkpoint.allow_schedule_change": "true"})])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "WARNING: resume:" in out and "optim.lr 0.003 -> 0.001" in out and "optim.decay_steps 2 -> 4" in out


def _finite_check_worker(rank: int, world: int, root: str) -> dict:
    from parallel.config import ParallelConfig
    from tests.gloo import data_parallel_engine, gloo_context

    ctx = gloo_context(rank, world)
    out: dict = {}
    # FSDP2: DTensor parameters; each rank checks its own shards.
    from model.config import ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, d_model=32, n_head=2, max_seq_len=16, vocab_size=256))
    out["full_numel"] = sum(p.numel() for p in model.parameters())
    engine = data_parallel_engine(model, ParallelConfig(strategy="fsdp"), ctx)
    model = engine.model
    out["fsdp_local_numel"] = sum(t.numel() for t in engine.local_weights())
    out["fsdp"] = _try_save(Path(root) / "fsdp", engine, rank, world)
    with torch.no_grad():
        if rank == 1:
            model.blocks["0"].attn.qkv.weight.to_local().view(-1)[0] = float("nan")
    out["fsdp_nan_on_rank1"] = _try_save(Path(root) / "fsdp", engine, rank, world)
    # ZeRO-3: param.data is empty; the rank's slice is param.ds_tensor, padded at the end.
    out.update(_zero3_checks(rank, world, root))
    return out


def _zero3_checks(rank: int, world: int, root: str) -> dict:
    from parallel.config import ParallelConfig
    from parallel.optim import OptimConfig
    from parallel.precision import PrecisionConfig, precision_policy
    from parallel.zero import ZeroEngine, deepspeed_config, import_deepspeed

    deepspeed = import_deepspeed(torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)  # 9 weights over 2 ranks: 5 + 4 and one padding element on rank 1
    parallel = ParallelConfig(strategy="zero3")
    policy = precision_policy(PrecisionConfig(), "zero3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_config = deepspeed_config(parallel, policy, OptimConfig(), micro_batch_size=8, grad_accum_steps=1,
                                 world_size=world)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                         dist_init_required=False)
    engine = ZeroEngine(ds_engine, policy, torch.device("cpu"))
    weight = ds_engine.module.weight
    out = {"zero3_data_numel": weight.data.numel(),
           "zero3_local_numel": sum(t.numel() for t in engine.local_weights())}
    with torch.no_grad():
        if rank == 1:
            weight.ds_tensor[-1] = float("nan")  # padding: garbage there must not count
    out["zero3_nan_in_padding"] = _try_save(Path(root) / "zero3", engine, rank, world)
    with torch.no_grad():
        if rank == 1:
            weight.ds_tensor[0] = float("nan")
    out["zero3_nan_on_rank1"] = _try_save(Path(root) / "zero3", engine, rank, world)
    return out


def _try_save(root: Path, engine, rank: int, world: int) -> str:
    step = 1 + len(list(root.glob("step_*"))) if root.is_dir() else 1
    torch.distributed.barrier()  # every rank counts before any rank saves
    try:
        ckpt.save_checkpoint(root, step, lambda d: None, {}, rank=rank, world_size=world, strategy="x",
                             barrier=torch.distributed.barrier, keep_last=0, weights=engine.local_weights())
        return "saved"
    except ckpt.CheckpointError as exc:
        return str(exc)


@pytest.mark.timeout(240)
def test_the_finite_check_is_collective_under_fsdp2_and_zero3(tmp_path):
    from tests.gloo import run_workers

    results = run_workers(_finite_check_worker, 2, str(tmp_path))
    assert sum(r["fsdp_local_numel"] for r in results) == results[0]["full_numel"]  # shards, not replicas
    for rank, r in enumerate(results):
        assert r["fsdp"] == "saved"
        assert r["fsdp_nan_on_rank1"].startswith("step 2: the model's weights hold NaN or inf"), (rank, r)
        assert r["zero3_data_numel"] == 0  # the check cannot read param.data here
        assert r["zero3_local_numel"] == (5 if rank == 0 else 4) + (2 if rank == 0 else 1)  # weight + bias slices
        assert r["zero3_nan_in_padding"] == "saved", (rank, r)
        assert r["zero3_nan_on_rank1"].startswith("step 2: the model's weights hold NaN or inf"), (rank, r)
    assert _steps(tmp_path / "fsdp") == ["step_00000001"] and _steps(tmp_path / "zero3") == ["step_00000001"]
