"""Checkpoints under hostile conditions: diverged weights, skip streaks, a kill inside a re-save,
torn directories, full or unwritable disks, and a resumed run whose LR schedule changed.

The checks here call training.checkpoint directly (milliseconds). The train.py runs, and the gloo
launch that checks the finite check is collective under FSDP2 and ZeRO-3, are in
tests/integration/training/test_checkpoints.py.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from parallel.engine import TorchEngine
from parallel.optim import OptimConfig
from parallel.precision import PrecisionConfig, precision_policy
from training import checkpoint as ckpt
from training.config import load_config

TINY = "configs/tiny.yaml"


def _save(root: Path, step: int, model: torch.nn.Module | None = None, **kwargs):
    """A one-process save of ``model``'s weights, as TorchEngine writes them."""
    model = model if model is not None else torch.nn.Linear(4, 4)

    def write(d: Path) -> None:
        torch.save(model.state_dict(), d / "model_optim.pt")

    kwargs = {"keep_last": 0, **kwargs}
    return ckpt.save_checkpoint(root, step, write, {"step": step}, rank=0, world_size=1, strategy="none",
                                barrier=lambda: None, **kwargs)


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


# ----------------------------------------------------------------------------- 1: non-finite values


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optim.lr=inf", "optim.lr must be a finite number within float32 range"),
        ("--optim.lr=nan", "optim.lr must be a finite number within float32 range"),
        ("--optim.lr=1e39", "optim.lr must be a finite number within float32 range"),
        ("--optim.min_lr=nan", "optim.min_lr must be a finite number within float32 range"),
        ("--optim.grad_clip=inf", "optim.grad_clip must be a finite number within float32 range"),
        ("--optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
        ("--optim.beta1=1.0", "optim.beta1 must be in [0, 1)"),
        ("--optim.beta2=-0.5", "optim.beta2 must be in [0, 1)"),
        ("--optim.eps=0", "optim.eps must be > 0"),
        ("--optim.decay_steps=-1", "optim.decay_steps must be >= 0"),
        ("--optim.decay_steps=1", "optim.decay_steps=1 ends the decay before optim.warmup_steps=50"),
        ("--checkpoint.interval=-5", "checkpoint.interval must be >= 0"),
        ("--checkpoint.keep_last=-1", "checkpoint.keep_last must be >= 0"),
        ("--precision.fp16_init_scale=0", "precision.fp16_init_scale must be > 0"),
        ("--precision.fp16_init_scale=inf", "precision.fp16_init_scale must be a finite number within float32 range"),
        ("--train.peak_tflops=-1", "train.peak_tflops must be > 0"),
    ],
)
def test_out_of_range_values_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_warmup_longer_than_the_run_is_kept_when_the_schedule_is_stated():
    cfg = load_config(TINY, ["--train.max_steps=10", "--optim.decay_steps=600"])
    assert cfg.lr_schedule() == {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 50, "decay_steps": 600}
    assert cfg.optim.for_run(10) == (cfg.optim, None)


def test_a_smoke_run_warms_up_within_the_run_and_says_so():
    cfg = load_config(TINY, ["--train.max_steps=10"])  # the config's warm-up is 50 steps
    assert cfg.lr_schedule() == {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 10, "decay_steps": 10}
    optim, note = cfg.optim.for_run(10)
    assert optim.warmup_steps == 10 and optim.schedule(10) == cfg.lr_schedule()
    assert "optim.warmup_steps=50" in note and "train.max_steps=10" in note and "optim.decay_steps" in note
    assert "\n" not in note
    assert load_config(TINY).optim.for_run(600)[1] is None  # a warm-up within the run is left alone


def test_the_finite_check_looks_at_every_weight_and_refuses_before_writing(tmp_path):
    root = tmp_path / "ckpt"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    engine = TorchEngine(model, precision_policy(PrecisionConfig(), "none"), OptimConfig(), torch.device("cpu"))
    _save(root, 1, model, weights=engine.local_weights())
    with torch.no_grad():
        model[1].bias[2] = float("nan")  # one element of the last, smallest tensor
    with pytest.raises(ckpt.CheckpointError, match=r"^step 2: .*NaN or inf.*step_00000001 is kept"):
        _save(root, 2, model, weights=engine.local_weights())
    assert _steps(root) == ["step_00000001"]
    # Huge but finite weights are not mistaken for overflow (a 2-norm of them would be inf).
    with torch.no_grad():
        model[1].bias.fill_(3e38)
    _save(root, 3, model, weights=engine.local_weights())


# ----------------------------------------------------------------------------- 2: skip streaks


def test_a_fresh_start_is_refused_where_another_run_left_checkpoints_or_logged_steps(tmp_path):
    run_dir = tmp_path / "run"

    def check(resume: str = "") -> None:
        ckpt.refuse_another_run(run_dir, run_dir / "checkpoints", resume, world_size=1, device=torch.device("cpu"))

    check()  # no folder yet
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: tiny\n")
    (run_dir / "metrics.jsonl").write_text("")
    check()  # a run that stopped before its first step left nothing to lose

    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    with pytest.raises(ckpt.CheckpointError) as info:
        check()
    assert "2 logged step(s)" in str(info.value) and "--resume" in str(info.value)

    _save(run_dir / "checkpoints", 4)
    _save(run_dir / "checkpoints", 6)
    with pytest.raises(ckpt.CheckpointError) as info:
        check()
    message = str(info.value)
    assert "\n" not in message and "step_00000004" in message and "step_00000006" in message
    assert "--logging.run_dir" in message and "--name" in message
    check(resume="latest")  # continuing the run in the folder is what the folder is for
    check(resume="auto")

    # checkpoint.dir shared with another run: a fresh run would prune that run's checkpoints
    (run_dir / "metrics.jsonl").unlink()
    with pytest.raises(ckpt.CheckpointError, match="checkpoint.dir"):
        ckpt.refuse_another_run(tmp_path / "new", run_dir / "checkpoints", "", world_size=1,
                                device=torch.device("cpu"))


def test_pruning_always_keeps_the_newest_healthy_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1, keep_last=1, healthy=True)
    _save(root, 2, keep_last=1, healthy=False)
    _save(root, 3, keep_last=1, healthy=False)
    assert _steps(root) == ["step_00000001", "step_00000003"]
    assert json.loads((root / "step_00000001" / "meta.json").read_text())["healthy"] is True
    _save(root, 4, keep_last=1, healthy=True)
    assert _steps(root) == ["step_00000004"]


# ----------------------------------------------------------------------------- 3: atomic re-save


def test_latest_falls_back_past_a_torn_checkpoint_with_a_warning(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    _save(root, 2)
    meta = json.loads((root / "step_00000002" / "meta.json").read_text())
    assert set(meta["files"]) == {"model_optim.pt", "rank_00000.pt"}  # the manifest
    (root / "step_00000002" / "rank_00000.pt").unlink()  # e.g. a partial copy to another file system
    warnings: list[str] = []
    assert ckpt.resolve_resume("latest", root, warn=warnings.append) == root / "step_00000001"
    assert any("step_00000002" in w and "rank_00000.pt" in w for w in warnings), warnings
    assert any("latest" in w and "names step_00000002" in w for w in warnings), warnings
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint: checkpoint file missing"):
        ckpt.read_checkpoint_meta(root / "step_00000002", 1, "none")
    # Truncation is caught too, and with nothing complete left, resuming is an error, not step 0.
    (root / "step_00000001" / "model_optim.pt").write_bytes(b"trunc")
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint under .*5 bytes"):
        ckpt.resolve_resume("latest", root)


# ----------------------------------------------------------------------------- 6: unwritable, full disk


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("failure", ["oserror", "torch_runtime_error"])
def test_a_save_on_a_full_disk_is_one_line_and_the_previous_checkpoint_survives(failure, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _save(root, 1)

    def write(d: Path) -> None:
        (d / "model_optim.pt").write_bytes(b"partial")
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(d / "model_optim.pt"))
        # What torch.save raises from C++ when the disk fills: no errno, no path.
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    # The probe write succeeds on this disk; the free space it reports is what says "full".
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 0))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_checkpoint(root, 2, write, {}, rank=0, world_size=1, strategy="none", barrier=lambda: None,
                             keep_last=1)
    message = str(info.value)
    assert message.startswith("step 2: cannot save the checkpoint: no space left on device (ENOSPC) writing ")
    assert ".tmp-step_00000002" in message and "\n" not in message
    assert _steps(root) == ["step_00000001"] and ckpt.find_latest(root).name == "step_00000001"


# Layouts as an earlier version's config spelled them (its parallel.dp_shard left the ep ranks out), today's
# words for the same ranks, and the layout its checkpoints recorded (meta.json "layout"), which counted them.
EARLIER_LAYOUTS = [
    (dict(ep=2, dp_shard=2), dict(ep=2, dp_shard=4), 4,
     {"tp": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 4, "pp_virtual_stages": 1, "ep": 2}),
    (dict(ep=4, cp=2, dp_shard=2), dict(ep=4, cp=2, dp_shard=4), 8,
     {"tp": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 4, "pp_virtual_stages": 1, "cp": 2, "ep": 4}),
    (dict(ep=2, cp=2, dp_shard=2), dict(ep=2, cp=2, dp_shard=2), 4,
     {"tp": 1, "pp": 1, "dp_replicate": 1, "dp_shard": 2, "pp_virtual_stages": 1, "cp": 2, "ep": 2}),
    (dict(ep=2, dp_replicate=2, dp_shard=2), dict(ep=2, dp_replicate=2, dp_shard=4), 8,
     {"tp": 1, "pp": 1, "dp_replicate": 2, "dp_shard": 4, "pp_virtual_stages": 1, "ep": 2}),
]


@pytest.mark.parametrize("earlier, today, world, recorded", EARLIER_LAYOUTS)
def test_checkpoints_of_the_earlier_dp_shard_match_the_same_ranks_in_todays_words(earlier, today, world, recorded):
    from common.errors import LayoutError
    from parallel.config import ParallelConfig
    from parallel.layout import Layout

    layout = Layout.of(ParallelConfig(strategy="fsdp", **today), world, world)
    assert ckpt.layout_record(layout) == recorded  # resuming with today's words passes the layout check
    if earlier != today:  # the earlier words no longer multiply to the world size: one line says how to count
        with pytest.raises(LayoutError, match="dp_shard counts every data-parallel rank the dense weights shard over"):
            Layout.of(ParallelConfig(strategy="fsdp", **earlier), world, world)
