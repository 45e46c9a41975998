"""Sharded checkpoints for FSDP2 with torch.distributed.checkpoint (DCP).

Every rank writes only its own shards of the model and optimizer state into ``<dir>/dcp``
(files ``__<rank>_0.distcp`` plus a ``.metadata`` index written by the coordinator). The
index records each tensor's global shape and which slice each file holds, so a checkpoint
saved on N ranks loads on M ranks, or into a plain unsharded module on one process: on load
every rank asks for the slices its current layout owns and DCP reads them from whichever files
hold them.

``get_state_dict`` / ``set_state_dict`` (torch.distributed.checkpoint.state_dict) give model
and optimizer states keyed by parameter *names* (not by optimizer-internal indices), which is
what makes the optimizer state resharding-safe. Atomicity comes from the caller:
training/checkpoint.py hands us a temporary directory and renames it once every rank is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

DCP_SUBDIR = "dcp"


def save_model_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Collective: every rank of the model's mesh calls this with the same ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    if extra:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=str(path))


def load_model_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Load in place into ``model`` and ``optimizer``, whatever their current sharding.

    DCP loads into existing tensors: ``get_state_dict`` first gives a fresh optimizer zero-filled
    state (a step with zero gradients and lr 0). ``extra`` tensors are filled in place.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _require_checkpoint(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    if extra:
        state["extra"] = extra
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _require_checkpoint(path: Path) -> None:
    from training.checkpoint import CheckpointError

    if not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"no sharded (DCP) checkpoint in {path} (missing .metadata); was it saved with "
                              "parallel.strategy=fsdp?")


# --------------------------------------------------------------------------- the engine's hooks


def save_sharded(engine, directory: Path) -> None:
    """TorchEngine.save under FSDP2: model + optimizer (+ fp16 loss scale) into ``directory/dcp``."""
    save_model_optimizer(engine.model, engine.optimizer, Path(directory) / DCP_SUBDIR, _scaler_tensors(engine))


def load_sharded(engine, directory: Path) -> None:
    extra = _scaler_tensors(engine)
    load_model_optimizer(engine.model, engine.optimizer, Path(directory) / DCP_SUBDIR, extra)
    if extra:
        engine.scaler.load_state_dict(_scaler_state(engine.scaler, extra))


def _scaler_tensors(engine) -> dict[str, torch.Tensor] | None:
    """The fp16 GradScaler's state as tensors (DCP stores tensors; the scalars are the same on all ranks)."""
    scaler = getattr(engine, "scaler", None)
    if scaler is None:
        return None
    state = scaler.state_dict()
    return {"scale": torch.tensor(float(state["scale"]), dtype=torch.float64),
            "growth_tracker": torch.tensor(int(state["_growth_tracker"]), dtype=torch.int64)}


def _scaler_state(scaler, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state = scaler.state_dict()
    state["scale"] = float(tensors["scale"])
    state["_growth_tracker"] = int(tensors["growth_tracker"])
    return state
