"""Atomic, resumable checkpoints.

Layout under the checkpoint root::

    step_00000200/           a complete checkpoint (meta.json is written last, inside the temp dir)
        meta.json            step, world size, strategy, format version
        model_optim.pt       (or dcp/ for FSDP2, or DeepSpeed's own files for ZeRO)
        rank_00000.pt        per-rank trainer state: RNG states, data position
    latest                   text file naming the newest complete checkpoint (replaced atomically)

A save writes everything into ``.tmp-step_XXXXXXXX`` and renames it into place only once all
ranks have finished, so a crash mid-save leaves the previous checkpoint untouched; leftovers of
an interrupted save are ignored by ``find_latest`` and removed by the next save. Loading uses
``torch.load(weights_only=True)``: a checkpoint cannot run code, and a damaged one gives a
one-line error naming the file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

FORMAT_VERSION = 1
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def safe_torch_load(path: Path, map_location: Any = "cpu") -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path} (the checkpoint is incomplete; pick another)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read checkpoint file {path}: {first_line[:200]}") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    root: Path,
    step: int,
    write_states: Callable[[Path], None],
    rank_state: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    strategy: str,
    barrier: Callable[[], None],
    keep_last: int,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint for ``step`` atomically; every rank calls this."""
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()
    write_states(tmp)
    torch.save(rank_state, tmp / f"rank_{rank:05d}.pt")
    barrier()
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size, "strategy": strategy,
                **(extra_meta or {})}
        _write_text_atomic(tmp / META, json.dumps(meta, indent=2))
        if final.exists():  # re-saving the same step (e.g. final save right after an interval save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_text_atomic(root / "latest", final.name + "\n")
        _prune(root, keep_last)
    barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in root.glob("step_*") if (p / META).is_file())
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(root: Path) -> Path | None:
    """Newest complete checkpoint under root (ignores interrupted .tmp- saves)."""
    complete = sorted(p for p in root.glob("step_*") if (p / META).is_file())
    return complete[-1] if complete else None


def resolve_resume(spec: str, root: Path) -> Path | None:
    """'' -> None; 'latest' -> newest complete checkpoint (None if there is none yet); else a path."""
    if not spec:
        return None
    if spec == "latest":
        return find_latest(root)
    path = Path(spec)
    if path.is_dir() and not (path / META).is_file() and find_latest(path) is not None:
        return find_latest(path)  # a checkpoint root was given
    return path


def read_meta(path: Path, world_size: int, strategy: str, model: dict[str, Any] | None = None) -> dict[str, Any]:
    meta_path = path / META
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path} (pass --resume latest or a step_XXXXXXXX directory)")
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {META}); it may be an interrupted save")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"{meta_path} is corrupt (not JSON)") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format version {meta.get('format_version')}, this code reads {FORMAT_VERSION}")
    if meta.get("strategy") != strategy:
        raise CheckpointError(
            f"{path} was saved with parallel.strategy={meta.get('strategy')}, this run uses {strategy}; "
            "resume with the same strategy"
        )
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            f"{path} was saved by {meta.get('world_size')} ranks, this run has {world_size}; per-rank data "
            "positions and RNG states cannot be mapped exactly (start the same number of ranks)"
        )
    saved_model = meta.get("model")
    if model is not None and saved_model is not None and saved_model != model:
        diff = [f"model.{k}: {saved_model.get(k)!r} -> {model.get(k)!r}" for k in model if saved_model.get(k) != model.get(k)]
        raise CheckpointError(f"{path} does not match the model of this run ({'; '.join(diff[:3])})")
    return meta


# ----------------------------------------------------------------------- RNG states


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
