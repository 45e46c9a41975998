"""Sharded checkpoints for FSDP2 with torch.distributed.checkpoint (DCP).

Every rank writes only its own shards of the model and optimizer state into ``<dir>/dcp``
(files ``__<rank>_0.distcp`` plus a ``.metadata`` index written by the coordinator). The
index records each tensor's global shape and which slice each file holds, so a checkpoint
saved on N ranks loads on M ranks, or into a plain unsharded module on one process: on load
every rank asks for the slices its current layout owns and DCP reads them from whichever files
hold them.

``get_state_dict`` / ``set_state_dict`` (torch.distributed.checkpoint.state_dict) give model
and optimizer states keyed by parameter *names* (not by optimizer-internal indices), which is
what makes the optimizer state resharding-safe. A single process's checkpoint (``FULL_STATE_FILE``:
whole tensors, the optimizer's state numbered by position) is put under the same names and each
rank copies out its slices (``load_full_state``), so it too loads into any layout. Atomicity
comes from the caller: training/checkpoint.py hands us a temporary directory and renames it once
every rank is done.

Loading never runs code from the checkpoint. DCP's own reader unpickles ``.metadata`` with
plain ``pickle`` and non-tensor values (the optimizer's param groups) with
``torch.load(weights_only=False)``, so a crafted file would execute on resume. Here the index
is read through an unpickler that only builds DCP's metadata classes, its SHA-256 must match
the digest written next to it at save time (a swapped or damaged index is refused before it is
parsed), every data file it names must be a plain file name inside the directory, and
non-tensor values go through ``torch.load(weights_only=True)``. Tensors DCP already reads with
``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from common.errors import CheckpointError
from common.values import is_dtensor
from parallel.optim import stepping_groups

DCP_SUBDIR = "dcp"
FULL_STATE_FILE = "model_optim.pt"  # a single process's checkpoint: whole tensors, the optimizer's state by index
METADATA = ".metadata"
DIGEST = "metadata.sha256.json"  # written by the coordinator after DCP's own files

# What DCP's .metadata is made of (as torch 2.13 writes it): its dataclasses, torch.Size, dtypes,
# the layout helper torch pickles layouts with, and the Path it records as the checkpoint id.
# Building any of these runs no code beyond setting fields. A torch release that pickles more is
# refused in one line naming the class, never loaded unchecked.
_METADATA_CLASSES = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
})


Parts = list[tuple[nn.Module, torch.optim.Optimizer]]  # a model (or its pipeline stages) with their optimizers


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flat optimizer keys ("state.<param name>.exp_avg", "param_groups.<param name>.lr") merge
    # across pipeline stages, each with its own optimizer, into the one name space a whole
    # model has: any layout reads what any other wrote.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _states(parts: Parts, aliases: dict[str, str] | None = None) -> tuple[list[tuple[dict, dict, dict]], dict[str, Any]]:
    """Each part's model and flat optimizer state, and all of them merged into one name space.
    ``aliases`` (parameter name -> saved name) renames a parameter's optimizer entries: a pipeline's
    copy of a tied embedding keeps the tied model's names, so the state of the parameter it copies
    is written once (DCP keeps one of identical entries) and read back into both. Per part: its model
    state, its optimizer state under the saved names, and each saved optimizer key's own name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    per_part = []
    for module, optimizer in parts:
        model_state, optim_state = get_state_dict(module, optimizer, options=_options())
        names = {_saved_key(key, aliases or {}): key for key in optim_state}
        per_part.append((model_state, {saved: optim_state[key] for saved, key in names.items()}, names))
    merged: dict[str, Any] = {"model": {}, "optimizer": {}}
    for model_state, optim_state, _ in per_part:
        merged["model"].update(model_state)
        merged["optimizer"].update(optim_state)
    return per_part, merged


def _saved_key(key: str, aliases: dict[str, str]) -> str:
    """Flat optimizer keys are "state.<param>.<field>" and "param_groups.<param>.<field>"."""
    kind, _, rest = key.partition(".")
    for name, saved in aliases.items():
        if rest.startswith(name + "."):
            return f"{kind}.{saved}{rest[len(name):]}"
    return key


def save_model_optimizer(parts: Parts, path: Path, extra: dict[str, torch.Tensor] | None = None,
                         aliases: dict[str, str] | None = None) -> None:
    """Collective: every rank calls this with its model parts and the same ``path``."""
    import torch.distributed.checkpoint as dcp

    _, state = _states(parts, aliases)
    if extra:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=str(path))
    _write_metadata_digest(Path(path))


Writer = Callable[[], None]  # writes a staged state; runs on a background thread


def stage_model_optimizer(parts: Parts, path: Path, staging: Staging, extra: dict[str, torch.Tensor] | None = None,
                          aliases: dict[str, str] | None = None) -> Writer:
    """Collective: copy this rank's shards into host memory now (DCP's ``async_save`` stages them
    before it returns) and return the function that waits for DCP's background write.

    ``staging.group`` must be a group of all ranks with a CPU backend used for nothing else: DCP's
    writer thread runs its collectives on it while training runs its own on the default group,
    and two threads issuing collectives on one group would pair them up wrongly.
    """
    import torch.distributed.checkpoint as dcp

    _, state = _states(parts, aliases)
    if extra:
        state["extra"] = extra
    future = dcp.async_save(state, checkpoint_id=str(path), process_group=staging.group,
                            async_stager=staging.dcp_stager())

    def finish() -> None:
        future.result()  # re-raises the writer's error; every rank's files and the index are written
        _write_metadata_digest(Path(path), rank=torch.distributed.get_rank(staging.group), barrier=False)

    return finish


class Staging:
    """What background saves keep from one save to the next (``Engine.stage_save``): the host
    memory the state is copied into, so the second and later copies land in pages already
    allocated (and, on a GPU, pinned) instead of paying for fresh ones each time (about one
    checkpoint of host memory, held until ``close``), and the process group DCP's writer thread
    runs its collectives on (None in one process). Reusing the memory is safe because at most
    one save is in flight: the next copy starts only after the previous write finished."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.storages: dict[tuple, torch.UntypedStorage] = {}  # live storage -> its copy, for host_copy
        self._dcp_stager = None

    def dcp_stager(self):
        """DCP's stager, kept across saves: it caches each live storage's host copy the same way."""
        if self._dcp_stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Blocking copies: the writer thread starts reading as soon as async_save returns.
            self._dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                            use_shared_memory=False, use_async_staging=False,
                                                            use_non_blocking_copy=False))
        return self._dcp_stager

    def close(self) -> None:
        self.storages.clear()
        if self._dcp_stager is not None:
            self._dcp_stager.close()
            self._dcp_stager = None


def host_copy(state: Any, reuse: dict[tuple, torch.UntypedStorage] | None = None) -> Any:
    """A copy of a nested state (dicts, lists, tuples of tensors and plain values) in host memory,
    taken now, whatever the live tensors do next. Tensors that share storage share it in the copy
    too (a tied embedding stays one tensor, so ``torch.save`` writes the same file as from the
    live state). On a GPU the copies go to pinned memory and the device is synchronized once.
    ``reuse`` (``Staging.storages``) maps live storages to the copies of the previous call, which
    are overwritten in place; the copy must no longer be in use (its write finished)."""
    import copy

    storages: dict[tuple, torch.UntypedStorage] = {}
    previous = reuse if reuse is not None else {}
    cuda = False

    def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
        nonlocal cuda
        live = t.untyped_storage()
        key = (live.device, live.data_ptr(), live.nbytes())
        if key not in storages:
            cuda = cuda or live.device.type == "cuda"
            staged = previous.get(key)
            if staged is None:
                staged = torch.empty(live.nbytes(), dtype=torch.uint8, pin_memory=live.device.type == "cuda")
                staged = staged.untyped_storage()
            staged.copy_(live, non_blocking=live.device.type == "cuda")
            storages[key] = staged
        return storages[key]

    memo: dict[int, Any] = {}  # an object met twice (the betas tuple all param groups share) is copied once

    def walk(value: Any) -> Any:
        if id(value) not in memo:
            memo[id(value)] = copy_of(value)
        return memo[id(value)]

    def copy_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if is_dtensor(value):
                raise TypeError("host_copy takes plain tensors; DCP stages DTensors itself")
            out = torch.empty(0, dtype=value.dtype)
            return out.set_(storage_of(value), value.storage_offset(), value.size(), value.stride())
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps the mapping's type and attributes (a state dict's _metadata)
            for k, v in value.items():
                out[k] = walk(v)
            return out
        if type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return copy.deepcopy(value, memo)

    staged = walk(state)
    if cuda:
        torch.cuda.synchronize()
    if reuse is not None:  # keep this call's copies only: storages that are gone free their memory
        reuse.clear()
        reuse.update(storages)
    return staged


def load_model_optimizer(parts: Parts, path: Path, extra: dict[str, torch.Tensor] | None = None,
                         aliases: dict[str, str] | None = None) -> None:
    """Load in place into the model parts and their optimizers, whatever their current layout.

    DCP loads into existing tensors: ``get_state_dict`` first gives a fresh optimizer zero-filled
    state (a step with zero gradients and lr 0). ``extra`` tensors are filled in place.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _require_checkpoint(path)
    metadata = read_verified_metadata(Path(path))
    per_part, state = _states(parts, aliases)
    if extra:
        state["extra"] = extra
    _dcp_load(state, Path(path), metadata)  # fills the per-part tensors, which the merged dicts share
    for (module, optimizer), (model_state, optim_state, names) in zip(parts, per_part):
        set_state_dict(module, optimizer, model_state_dict={k: state["model"][k] for k in model_state},
                       optim_state_dict={names[k]: state["optimizer"][k] for k in optim_state}, options=_options())


def has_sharded_state(directory: Path) -> bool:
    """A checkpoint directory written by a sharded layout (DCP), which any layout can load."""
    return (Path(directory) / DCP_SUBDIR / METADATA).is_file()


def _require_checkpoint(path: Path) -> None:
    if not (Path(path) / METADATA).is_file():
        raise CheckpointError(f"no sharded (DCP) checkpoint in {path} (missing .metadata); was it saved with "
                              "parallel.strategy=fsdp?")


# --------------------------------------------------------------------------- loading without running code


def _write_metadata_digest(path: Path, rank: int | None = None, barrier: bool = True) -> None:
    """Record the index's SHA-256 next to it (coordinator only; with ``barrier`` the others wait so
    the checkpoint is complete when every rank returns)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = (dist.get_rank() if distributed else 0) if rank is None else rank
    if rank == 0:
        data = (path / METADATA).read_bytes()
        record = {"file": METADATA, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        tmp = path / f".{DIGEST}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path / DIGEST)
    if distributed and barrier:
        dist.barrier()


def read_verified_metadata(path: Path):
    """DCP's index of the checkpoint in ``path``, only if it is the one saved there and holds
    nothing but DCP metadata; otherwise a one-line ``CheckpointError``."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = path / METADATA
    data = meta_path.read_bytes()
    expected = _saved_digest(path)
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{meta_path} does not match the digest saved with it in {path / DIGEST}: the file "
                              "was replaced or damaged; refusing to read it (restore the checkpoint from a good copy)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _ForeignClass as exc:
        raise CheckpointError(f"{meta_path} refers to {exc}, which DCP metadata never holds: refusing to load "
                              "a crafted checkpoint") from None
    except Exception as exc:  # truncated or garbled pickle
        raise CheckpointError(f"cannot read {meta_path}: {_first_line(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{meta_path} holds a {type(metadata).__name__}, not DCP metadata")
    _check_storage_paths(metadata, meta_path)
    return metadata


def _saved_digest(path: Path) -> str:
    digest_path = path / DIGEST
    if not digest_path.is_file():
        raise CheckpointError(f"{path} has no {DIGEST}, so its {METADATA} cannot be verified; it was not saved by "
                              "this version of perfgpt (re-save it with this version from a trusted copy)")
    try:
        return str(json.loads(digest_path.read_text())["sha256"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{digest_path} is damaged (no sha256 entry)") from None


class _ForeignClass(pickle.UnpicklingError):
    """A global outside DCP's metadata classes; the message is 'module.name'."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _ForeignClass(f"{module}.{name}")


def _check_storage_paths(metadata, meta_path: Path) -> None:
    """DCP opens ``<dir>/<relative_path>`` for every item: only plain file names may appear."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
            raise CheckpointError(f"{meta_path} points outside its directory ({name!r}); refusing to load it")


def _dcp_load(state: dict[str, Any], path: Path, metadata) -> None:
    """``dcp.load`` with the verified index and weights-only reading of non-tensor values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=_verified_reader(path, metadata), planner=_weights_only_planner())
    except CheckpointException as exc:  # DCP wraps each rank's failure; report ours in one line
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        ours = next((f for f in failures if isinstance(f, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        raise CheckpointError(f"cannot load the DCP checkpoint in {path}: "
                              f"{_first_line(failures[0]) if failures else 'unknown error'}") from None


def _verified_reader(path: Path, metadata):
    """DCP's file reader, handed the index we already verified instead of unpickling it again."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            if hasattr(self, "load_id"):
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(str(path))


def _weights_only_planner():
    """DCP's default load planner, except that non-tensor values are unpickled weights-only."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn!r} {_unsafe_global(exc)}; "
                                      "refusing to load a crafted checkpoint") from None
            # DCP's own load_bytes unpickles without restrictions; it gets a re-serialization of
            # the object vetted above, so what it builds is only what weights_only allows.
            vetted = io.BytesIO()
            torch.save(obj, vetted)
            vetted.seek(0)
            super().load_bytes(read_item, vetted)

    return WeightsOnlyLoadPlanner()


def _unsafe_global(exc: BaseException) -> str:
    import re

    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return f"would call {found.group(1)}" if found else f"is not plain data ({_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


# --------------------------------------------------------------------------- the engines' hooks


def safe_torch_load(path: Path, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` with a one-line error naming the file when it is missing or damaged."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path} (the checkpoint is incomplete; pick another)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"cannot read checkpoint file {path}: {_first_line(exc)}") from None


def save_sharded(parts: Parts, scaler: torch.amp.GradScaler | None, directory: Path,
                 aliases: dict[str, str] | None = None) -> None:
    """Model parts with their optimizers (+ fp16 loss scale) into ``directory/dcp``."""
    save_model_optimizer(parts, Path(directory) / DCP_SUBDIR, _scaler_tensors(scaler), aliases)


def stage_sharded(parts: Parts, scaler: torch.amp.GradScaler | None, directory: Path, staging: Staging,
                  aliases: dict[str, str] | None = None) -> Writer:
    """``save_sharded`` in two halves: the state is staged in host memory now, and the returned
    function (run on a background thread) waits for its write (``stage_model_optimizer``)."""
    return stage_model_optimizer(parts, Path(directory) / DCP_SUBDIR, staging, _scaler_tensors(scaler), aliases)


def load_sharded(parts: Parts, scaler: torch.amp.GradScaler | None, directory: Path,
                 aliases: dict[str, str] | None = None) -> None:
    """Model parts with their optimizers (+ fp16 loss scale) from ``directory``: its DCP state, or,
    where a single process saved it, its ``FULL_STATE_FILE``, of which each rank takes its slices."""
    full = Path(directory) / FULL_STATE_FILE
    if not has_sharded_state(directory) and full.is_file():
        load_full_state(parts, scaler, safe_torch_load(full), aliases)
        return
    extra = _scaler_tensors(scaler)
    load_model_optimizer(parts, Path(directory) / DCP_SUBDIR, extra, aliases)
    if extra:
        scaler.load_state_dict(_scaler_state(scaler, extra))


def load_full_state(parts: Parts, scaler: torch.amp.GradScaler | None, state: dict[str, Any],
                    aliases: dict[str, str] | None = None) -> None:
    """A one-process checkpoint's state (whole tensors, the optimizer's state by index) into model
    parts of any layout: the state is put under the names DCP uses, and every tensor of the parts'
    state dicts takes its slice of the whole one, as DCP would fill it from sharded files."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    named = full_state_by_name(state)
    per_part, merged = _states(parts, aliases)
    for section in ("model", "optimizer"):
        for key, dest in merged[section].items():
            if key not in named[section]:
                raise CheckpointError(f"the one-process checkpoint has no {section} entry {key!r}: it was saved "
                                      "for another model")
            merged[section][key] = _fill(dest, named[section][key])
    for (module, optimizer), (model_state, optim_state, names) in zip(parts, per_part):
        set_state_dict(module, optimizer, model_state_dict={k: merged["model"][k] for k in model_state},
                       optim_state_dict={names[k]: merged["optimizer"][k] for k in optim_state}, options=_options())
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])


def full_state_by_name(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A one-process checkpoint (``TorchEngine.state_dict``) under DCP's flat names: model entries
    by parameter name (a tied head under both names; the fp32 masters' values where it kept
    masters) and optimizer entries "state.<param>.<field>" / "param_groups.<param>.<field>". Its
    optimizer numbers parameters in the order the engine handed them over: ``stepping_groups`` of
    the model's parameters, in the model's order (a shared weight once), Muon's hidden matrices
    first when its groups say Muon stepped them."""
    model = dict(state["model"])
    owner: dict[tuple, str] = {}  # where a tensor's data lives -> the first name that holds it
    first_of: dict[str, str] = {}  # each key's parameter: itself, or for a tied head the embedding
    params = []  # the model's parameters, in its order, each once
    for name, tensor in model.items():
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if where not in owner:
            owner[where] = name
            params.append(name)
        first_of[name] = owner[where]
    if "masters" in state:  # bf16 weights stepped through fp32 masters: the masters are the values
        model.update(zip(params, state["masters"]))
    model = {name: model[first_of[name]] for name in first_of}
    optim = state["optimizer"]
    muon = any(group.get("muon") for group in optim["param_groups"])
    groups = stepping_groups([(name, model[name]) for name in params], 0.0, muon=muon)
    by_id = {id(model[name]): name for name in params}
    order = [by_id[id(t)] for group in groups for t in group["params"]]
    stepped = sum(len(group["params"]) for group in optim["param_groups"])
    if stepped != len(order):
        raise CheckpointError(f"the one-process checkpoint's optimizer steps {stepped} parameters, its model "
                              f"has {len(order)}: the checkpoint is damaged")
    flat: dict[str, Any] = {}
    for group in optim["param_groups"]:
        for index in group["params"]:
            flat.update({f"param_groups.{order[index]}.{k}": v for k, v in group.items() if k != "params"})
    for index, fields in optim["state"].items():
        name = order[index]
        moment = fields.get("exp_avg", fields.get("momentum_buffer"))
        if moment is not None and moment.shape != model[name].shape:
            raise CheckpointError(f"the one-process checkpoint's optimizer state for {name} has shape "
                                  f"{tuple(moment.shape)}, the parameter {tuple(model[name].shape)}")
        flat.update({f"state.{name}.{k}": v for k, v in fields.items()})
    return {"model": model, "optimizer": flat}


def _fill(dest: Any, whole: Any) -> Any:
    """``dest`` (a tensor of this rank's state dict, a DTensor's local shard or a whole tensor) with
    its part of ``whole``; plain values are taken as they are."""
    if not isinstance(dest, torch.Tensor):
        return whole
    if is_dtensor(dest):
        local = dest.to_local()
        (chunk,) = dest.__create_chunk_list__()  # this rank's offsets and sizes in the whole tensor
        part = whole[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
        local.copy_(part.reshape(local.shape))
    else:
        dest.copy_(whole)
    return dest


def _scaler_tensors(scaler: torch.amp.GradScaler | None) -> dict[str, torch.Tensor] | None:
    """The fp16 GradScaler's state as tensors (DCP stores tensors; the scalars are the same on all ranks)."""
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


def read_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model of the sharded checkpoint in ``directory`` (``directory/dcp``), as plain
    CPU tensors keyed by parameter name, in one process and whatever layout saved it.

    The index gives every tensor's global shape and dtype, so the tensors are allocated from it
    and DCP fills them from whichever files hold their slices: tensor-parallel and FSDP shards
    join, and pipeline stages, which saved under the whole model's names, meet in one dict. The
    optimizer state is not read.
    """
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(directory) / DCP_SUBDIR
    _require_checkpoint(path)
    metadata = read_verified_metadata(path)
    model = {key[len("model."):]: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP notes that without a process group it reads in one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load({"model": model}, path, metadata)
    return model
