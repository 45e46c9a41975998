"""Atomic, resumable checkpoints that never hold a diverged model and never lose the last good one.

Layout under the checkpoint root::

    step_00000200/           a complete checkpoint (meta.json is written last, inside the temp dir)
        meta.json            step, world size, strategy, format version, LR schedule, whether the
                             save was healthy, and a manifest of every other file with its size
                             and its SHA-256 (``checksums``)
        model_optim.pt       (or dcp/ for FSDP2, or DeepSpeed's own files for ZeRO)
        rank_00000.pt        per-rank trainer state: RNG states, data position
    latest                   text file naming the newest complete checkpoint (replaced atomically)

A save writes everything into ``.tmp-step_XXXXXXXX`` and renames it into place only once all
ranks have finished, so a crash mid-save leaves the previous checkpoint untouched. Re-saving a
step that exists renames the old copy aside (``.old-step_XXXXXXXX``) before the new one goes in
and deletes it only afterwards: at every instant one complete copy exists under a known name.
"Complete" means meta.json is there and every file its manifest lists has the listed size;
resolving ``latest`` walks back to the newest complete checkpoint (warning about each one it
passes over), so a torn directory is never loaded and never hides an older good one.

Damage that keeps a file's size (a flipped block on disk, a bad copy) is caught by the content
checksums: each rank hashes the files it wrote right after writing them (their names carry its
rank; rank 0 writes the shared ones), so no rank reads the whole checkpoint, and rank 0 puts the
digests into meta.json. Whatever reads a checkpoint checks them first (``verify_contents``):
resume and the tools that take a run directory pass over a damaged checkpoint as they pass over
a torn one, and a checkpoint named explicitly is refused in one line naming the file.
Checkpoints saved before checksums existed still load, with a note that their contents were not
checked.

A save is refused, with nothing written, when any rank's weights hold NaN or inf. Each save
records whether the step before it was applied ("healthy") or skipped as non-finite, and
pruning by ``keep_last`` always keeps the newest healthy checkpoint, so a divergence cannot
rotate the last pre-blow-up state away. File-system errors become one line naming the path
and the errno. Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run code,
and a damaged one gives a one-line error naming the file.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from common.errors import CheckpointError
from common.files import (
    file_size_limit,
    file_size_limit_note,
    member_problem,
    name_problem,
    open_regular,
    os_error_words,
    read_json,
    short_repr,
)
from model.config import ModelConfig
from parallel.checkpoint import Staging, host_copy
from parallel.layout import Layout
from training.config import upgrade_renamed
from training.metrics import METRICS_FILE

# 2: the model stores qkv rows grouped per key/value head, a separate SwiGLU gate and the MLP bias
# inside fc (model/gpt.py), so version-1 weights would load into the new shapes with the wrong
# meaning; they are refused instead. New meta keys stay optional within a version.
FORMAT_VERSION = 2
META = "meta.json"
CHECKSUM = "sha256"
DIGESTS_PREFIX = ".digests-rank_"  # each rank's digests of the files it hashed, merged into meta.json
TMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
_STEP_RE = re.compile(r"^(?:\.old-)?step_(\d+)$")

Warn = Callable[[str], None]


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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


# ----------------------------------------------------------------------- agreement between ranks


def _any_rank(flag: bool, world_size: int, device: torch.device) -> bool:
    """True if ``flag`` is set on any rank; a collective (and so a barrier) under a process group.

    Every decision that ends a save early must be taken by all ranks together: a rank that gave
    up alone would leave the others waiting in the save's next collective until the timeout.
    """
    if world_size <= 1 or not torch.distributed.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _agree(error: CheckpointError | None, world_size: int, device: torch.device, barrier: Callable[[], None],
           what: str, cleanup: Path | None = None) -> None:
    """Synchronize the ranks after a save phase; raise on every rank if the phase failed on any.

    The partial checkpoint is removed only here, once no rank can still be writing into it.
    """
    if world_size > 1 and torch.distributed.is_initialized():
        failed_somewhere = _any_rank(error is not None, world_size, device)
    else:
        barrier()
        failed_somewhere = error is not None
    if failed_somewhere and cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if error is not None:
        raise error
    if failed_somewhere:
        raise CheckpointError(f"{what} failed on another rank (its own error line says why); "
                              "the previous checkpoint is untouched")


# ----------------------------------------------------------------------- the finite check


def _weights_nonfinite(tensors: Iterable[torch.Tensor], world_size: int, device: torch.device) -> bool:
    """True if any rank holds a NaN or inf weight: one fused reduction per device and dtype, one
    all-reduce of the flag, one host sync in all. Collective under a process group.

    The max-abs (inf) norm is NaN or inf exactly when an element is: unlike the 2-norm it cannot
    overflow on large but finite weights.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flag = torch.zeros((), device=device)
    for ts in groups.values():
        norms = torch.stack([n.float() for n in torch._foreach_norm(ts, float("inf"))])
        flag = torch.maximum(flag, (~norms.isfinite()).any().float().to(device))
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


# ----------------------------------------------------------------------- writable directories


def ensure_writable_dir(path: Path, key: str, *, rank: int = 0, world_size: int = 1,
                        device: torch.device = torch.device("cpu")) -> None:
    """Create ``path`` and prove this rank can write into it, at start-up rather than at the first save.

    Every rank writes its own files into a checkpoint, so every rank probes (on a shared file
    system this also catches a node that mounted it read-only). Collective when world_size > 1.
    """
    error = None
    probe = path / f".write-test-rank{rank}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        error = f"{key}={path} is not writable: {_os_error_text(exc, path)}; choose another directory"
    if _any_rank(error is not None, world_size, device):
        raise CheckpointError(error or f"{key}={path} is not writable on another rank (its own error line says why)")


def refuse_another_run(run_dir: Path, ckpt_root: Path, resume: str, *, world_size: int = 1,
                       device: torch.device = torch.device("cpu")) -> None:
    """A fresh start (no ``checkpoint.resume``) into a folder where another run left checkpoints or
    logged steps is refused, before anything is written: its saves would sit among that run's, pruning
    (which keeps the highest step numbers) would delete them, and config.yaml and metrics.jsonl would
    mix two runs. A run that stopped before its first step left nothing to lose. Refusing beats a new
    folder beside it: the tools that read ``runs/<name>`` would go on reading the old run without a
    word. Collective when world_size > 1 (every rank reads the same folder)."""
    found = [] if resume else [p.name for p in sorted(ckpt_root.glob("*step_*"), key=_step_of)
                               if p.is_dir() and _step_of(p) is not None]
    rows = 0
    if not resume:
        with contextlib.suppress(OSError):
            rows = sum(1 for line in (run_dir / METRICS_FILE).read_text().splitlines() if '"step"' in line)
    error = None
    if found or rows:
        held = [f"checkpoint(s) {', '.join(found)}" if found else "", f"{rows} logged step(s)" if rows else ""]
        where = (f"logging.run_dir={run_dir}" if ckpt_root.is_relative_to(run_dir)
                 else f"checkpoint.dir={ckpt_root} (or logging.run_dir={run_dir})")
        error = (f"{where} holds another run ({' and '.join(h for h in held if h)}); a fresh start there would "
                 "prune and mix its files: continue it with --resume, or train into a new folder "
                 "(--logging.run_dir=<new folder> or --name=<new name>)")
    if _any_rank(error is not None, world_size, device):
        raise CheckpointError(error or "the run folder holds another run (rank 0's error line says which)")


def _os_error_text(exc: OSError, fallback: Path, *, own_path: bool = True) -> str:
    where = (exc.filename if own_path else None) or fallback
    if exc.errno == errno_codes.ENOSPC:
        return f"no space left on device (ENOSPC) writing {where}"
    if exc.errno == errno_codes.EFBIG:
        return f"{os.strerror(errno_codes.EFBIG)} (EFBIG) writing {where}{file_size_limit_note()}"
    return f"{os_error_words(exc)} at {where}"


def _write_failure(exc: BaseException, directory: Path) -> str:
    """One line for a failed write, with the errno even when torch hides it.

    torch.save reports a failed write from C++ as ``RuntimeError: [enforce fail at
    inline_container.cc] ... unexpected pos`` with no errno, and DCP wraps each rank's error
    in a CheckpointException. When no OSError is at hand, a small probe write into the same
    directory recovers the cause (a full disk fails it with ENOSPC); it runs before the partial
    checkpoint is deleted, while the disk is still as full as it was when the write failed.
    """
    os_error = _find_os_error(exc)
    if os_error is not None:
        return _os_error_text(os_error, directory)
    cut = _cut_at_size_limit(directory)
    if cut is not None:  # torch says "unexpected pos": the file stopped at the process's file-size limit
        return _os_error_text(OSError(errno_codes.EFBIG, os.strerror(errno_codes.EFBIG), str(cut)), directory)
    probe = directory / ".write-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:  # name the checkpoint, not the probe
        return _os_error_text(probe_error, directory, own_path=False)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    try:
        if shutil.disk_usage(directory).free < 2**20:
            return f"no space left on device (ENOSPC) writing {directory}"
    except OSError:
        pass
    lines = str(exc).strip().splitlines()
    return f"writing {directory} failed: {(lines[0] if lines else type(exc).__name__)[:200]}"


def _cut_at_size_limit(directory: Path) -> Path | None:
    """A file under ``directory`` that has reached the process's file-size limit (``ulimit -f``),
    where a write past it failed with EFBIG; None without a limit or such a file."""
    limit = file_size_limit()
    if limit is None:
        return None
    with contextlib.suppress(OSError):
        for dirpath, _, names in os.walk(directory):
            for name in names:
                if os.lstat(os.path.join(dirpath, name)).st_size >= limit:
                    return Path(dirpath) / name
    return None


def _find_os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    pending = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        pending += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # DCP: rank -> (exception, traceback)
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def _is_write_failure(exc: BaseException) -> bool:
    """File-system trouble, as opposed to a dead peer (DistError) or a bug: only these get one line."""
    if isinstance(exc, torch.distributed.DistError):
        return False
    if isinstance(exc, OSError):
        return True
    text = str(exc)
    if type(exc).__name__ == "CheckpointException":  # torch.distributed.checkpoint, a BaseException
        return _find_os_error(exc) is not None or any(marker in text for marker in _TORCH_WRITE_ERRORS)
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _TORCH_WRITE_ERRORS)


# How torch.save's C++ writer words a failed open or write (it raises RuntimeError, not OSError).
_TORCH_WRITE_ERRORS = ("inline_container", "PytorchStreamWriter", "Parent directory")


# ----------------------------------------------------------------------- saving


@dataclass
class SaveJob:
    """One save of ``step``, as every rank sees it: where it goes and what meta.json will say."""

    root: Path
    step: int
    rank: int
    world_size: int
    strategy: str
    barrier: Callable[[], None]
    keep_last: int
    extra_meta: dict[str, Any] | None = None
    healthy: bool = True
    device: torch.device = torch.device("cpu")
    # Filled by ``write`` for the benchmark (analysis/checkpoint_bench.py): seconds this rank spent
    # writing, of which hashing, and the bytes it hashed.
    write_s: float = 0.0
    checksum_s: float = 0.0
    checksum_bytes: int = 0

    @property
    def final(self) -> Path:
        return self.root / step_dir_name(self.step)

    @property
    def tmp(self) -> Path:
        return self.root / f"{TMP_PREFIX}{self.final.name}"

    @property
    def label(self) -> str:
        return f"step {self.step}: cannot save the checkpoint"

    def begin(self, weights: Iterable[torch.Tensor] | None) -> None:
        """The finite check, then rank 0 creates the temporary directory. Collective."""
        if weights is not None and _weights_nonfinite(weights, self.world_size, self.device):
            previous = find_latest(self.root) if self.root.is_dir() else None
            kept = f"{previous.name} is kept" if previous else "no earlier checkpoint exists"
            raise CheckpointError(
                f"step {self.step}: the model's weights hold NaN or inf, refusing to save them as a checkpoint "
                f"({kept}); the run diverged: lower optim.lr, or resume from an earlier checkpoint"
            )
        error = _attempt(lambda: _prepare(self.root, self.tmp), self.tmp, self.label) if self.rank == 0 else None
        _agree(error, self.world_size, self.device, self.barrier, f"step {self.step}: preparing {self.tmp}")

    def write(self, write_states: Callable[[Path], None], rank_state: dict[str, Any]) -> CheckpointError | None:
        """This rank's files, then the checksums of those it wrote. Local: no collective, so a
        background thread may run it; a file-system failure is returned as one line."""
        def write() -> None:
            t0 = time.perf_counter()
            write_states(self.tmp)
            torch.save(rank_state, self.tmp / f"rank_{self.rank:05d}.pt")
            t1 = time.perf_counter()
            self.checksum_bytes = write_digests(self.tmp, self.rank, self.world_size)
            self.write_s, self.checksum_s = time.perf_counter() - t0, time.perf_counter() - t1

        return _attempt(write, self.tmp, self.label)

    def finish(self, error: CheckpointError | None) -> Path:
        """Once every rank's write returned: agree on its outcome, then rank 0 publishes. Collective."""
        owned = self.tmp if self.rank == 0 else None  # rank 0 publishes and on failure removes the temp dir
        _agree(error, self.world_size, self.device, self.barrier, f"step {self.step}: writing {self.tmp}",
               cleanup=owned)
        if self.rank == 0:
            meta = {"format_version": FORMAT_VERSION, "step": self.step, "world_size": self.world_size,
                    "strategy": self.strategy, "healthy": self.healthy, **(self.extra_meta or {})}
            error = _attempt(lambda: _publish(self.root, self.tmp, self.final, meta, self.keep_last), self.tmp,
                             self.label)
        _agree(error, self.world_size, self.device, self.barrier, f"step {self.step}: publishing {self.final}",
               cleanup=owned)
        return self.final


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
    healthy: bool = True,
    weights: Iterable[torch.Tensor] | None = None,
    device: torch.device = torch.device("cpu"),
) -> Path:
    """Write a checkpoint for ``step`` atomically; every rank calls this.

    ``healthy``: the last optimizer step was applied (not skipped as non-finite); pruning
    always keeps the newest healthy checkpoint. ``weights``: this rank's parameter tensors
    (``local_weights``); if any rank's hold NaN or inf, nothing is written and every rank raises.
    """
    job = SaveJob(root, step, rank, world_size, strategy, barrier, keep_last, extra_meta, healthy, device)
    job.begin(weights)
    return job.finish(job.write(write_states, rank_state))


class BackgroundSave:
    """Checkpoints written on a background thread (checkpoint.async_save): the training loop pays
    for the finite check and for copying the state into host memory; the files are written while
    training goes on, and the checkpoint is published at a later step, once every rank's write
    finished. At most one save is in flight.

    Everything the synchronous save promises holds: the write goes into the temporary directory,
    which rank 0 renames into place only when every rank's write (and its checksums) completed, so
    a crash before that leaves the previous checkpoint complete and ``latest`` naming it; the
    finite check runs before anything is staged; pruning runs only at publication, after the new
    checkpoint is in place. A write error (a full disk) becomes the same one-line
    CheckpointError, raised by the ``finish`` that publishes, on every rank.
    """

    def __init__(self) -> None:
        self.job: SaveJob | None = None
        self._thread: threading.Thread | None = None
        self._outcome: BaseException | None = None  # the write's error; a CheckpointError when it is the disk's
        self._staging: Staging | None = None  # host memory and process group kept from save to save

    @property
    def in_flight(self) -> bool:
        return self.job is not None

    def start(self, job: SaveJob, stage: Callable[[Path, Staging], Callable[[], None]], rank_state: dict[str, Any],
              weights: Iterable[torch.Tensor] | None) -> None:
        """Collective: the finite check, the temporary directory, then ``stage(tmp, staging)``
        copies this rank's state into host memory and gives the function that writes it, which
        runs on a thread. The caller finished the previous save first (``finish(wait=True)``)."""
        if self.job is not None:
            raise RuntimeError("a background checkpoint write is still in flight; finish it first")
        job.begin(weights)
        writers: list[Callable[[], None]] = []
        error = _attempt(lambda: writers.append(stage(job.tmp, self._staging_for(job.world_size))), job.tmp,
                         job.label)
        if error is not None:
            job.finish(error)  # agrees with the other ranks, removes the temp dir, raises
        staged_rank_state = host_copy(rank_state)
        self.job, self._outcome = job, None

        def write() -> None:
            try:
                self._outcome = job.write(lambda _: writers[0](), staged_rank_state)
            except BaseException as exc:  # noqa: BLE001 -- a bug: re-raised with its traceback by finish
                self._outcome = exc

        self._thread = threading.Thread(target=write, name=f"checkpoint-step-{job.step}", daemon=True)
        self._thread.start()

    def finish(self, *, wait: bool) -> tuple[Path, float | None] | None:
        """Collective: publish the save in flight once every rank's write completed. Without
        ``wait``, only if they all have already (otherwise None: try again later); with it, after
        waiting. Returns (the checkpoint, seconds this rank waited, or None when it did not)."""
        job, thread = self.job, self._thread
        if job is None or thread is None:
            return None
        if not wait and _any_rank(thread.is_alive(), job.world_size, job.device):
            return None
        waited = None
        if thread.is_alive():
            t0 = time.perf_counter()
            thread.join()
            waited = time.perf_counter() - t0
        outcome, self.job, self._thread, self._outcome = self._outcome, None, None, None
        if outcome is not None and not isinstance(outcome, CheckpointError):  # a bug: keep its traceback,
            with contextlib.suppress(CheckpointError):  # after the other ranks heard the save failed
                job.finish(CheckpointError(f"step {job.step}: the background checkpoint write failed"))
            raise outcome
        return job.finish(outcome), waited

    def _staging_for(self, world_size: int) -> Staging:
        """Created at the first save, with a gloo group of all ranks for DCP's writer thread alone
        (collectives from two threads on one group would pair up wrongly): ``new_group`` is a
        collective, which every rank reaches at the same step."""
        if self._staging is None:
            distributed = world_size > 1 and torch.distributed.is_initialized()
            self._staging = Staging(torch.distributed.new_group(backend="gloo") if distributed else None)
        return self._staging


def _attempt(action: Callable[[], Any], directory: Path, label: str) -> CheckpointError | None:
    """Run a save phase; a file-system failure becomes a one-line CheckpointError, returned rather
    than raised so that the ranks agree on it before anyone leaves the save."""
    try:
        action()
        return None
    except BaseException as exc:  # DCP raises CheckpointException, which is not an Exception
        if not _is_write_failure(exc):
            raise
        message = _write_failure(exc, directory if directory.is_dir() else directory.parent)
    return CheckpointError(f"{label}: {message}; the previous checkpoint is untouched")


def _prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _recover_asides(root)
    for stale in root.glob(f"{TMP_PREFIX}step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def _recover_asides(root: Path) -> None:
    """Finish a re-save that a crash interrupted, before anything else touches the root.

    ``.old-step_N`` exists only between "old copy renamed aside" and "aside deleted". If
    ``step_N`` is complete the swap went through and the aside is garbage; if it is missing,
    the aside is the only complete copy of step N and goes back under its name.
    """
    for aside in root.glob(f"{ASIDE_PREFIX}step_*"):
        final = root / aside.name[len(ASIDE_PREFIX):]
        if final.is_dir() and incomplete_reason(final) is None:
            shutil.rmtree(aside, ignore_errors=True)
        elif incomplete_reason(aside) is None:
            if final.exists():
                shutil.rmtree(final)
            os.replace(aside, final)
            _fsync_dir(root)


def _manifest(directory: Path) -> dict[str, int]:
    """Every file of the checkpoint with its size, so a torn or half-copied directory is recognized."""
    return {rel: (directory / rel).stat().st_size for rel in _checkpoint_files(directory)}


def _checkpoint_files(directory: Path) -> list[str]:
    """The checkpoint's own files (relative, sorted): not meta.json, not the digests on their way into it."""
    files = []
    for dirpath, _, names in os.walk(directory):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel != META and not name.startswith(DIGESTS_PREFIX):
                files.append(rel)
    return sorted(files)


# ----------------------------------------------------------------------- content checksums

_RANK_IN_NAME = re.compile(r"(?:^__|rank_)(\d+)")  # DCP's __<rank>_0.distcp, rank_<rank>.pt, DeepSpeed's *_rank_<r>_*


def file_digest(path: Path, chunk: int = 8 << 20, size: int | None = None) -> str:
    """SHA-256 of a regular file, read in chunks (hashlib releases the GIL on each, so a background
    thread hashing does not stall the training thread). With ``size``, a file holding more bytes
    than that is refused (ValueError) after reading at most ``size`` + 1 of them."""
    h = hashlib.sha256()
    left = size
    with open_regular(path) as f:
        while block := f.read(chunk if left is None else min(chunk, left + 1)):
            if left is not None:
                left -= len(block)
                if left < 0:
                    raise ValueError(f"{path} holds more than the {size} bytes its meta.json records")
            h.update(block)
    return h.hexdigest()


def _writer_of(rel: str, world_size: int) -> int:
    """The rank that wrote ``rel`` and so hashes it (at save time it may still be in that rank's
    page cache): the one whose number the file name carries (DCP's ``__<rank>_0.distcp``,
    ``rank_<rank>.pt``, DeepSpeed's ``*_rank_<rank>_*``), else rank 0, which writes the shared files
    (``model_optim.pt``, DCP's index)."""
    found = _RANK_IN_NAME.search(Path(rel).name)
    return int(found.group(1)) % world_size if found else 0


def write_digests(directory: Path, rank: int, world_size: int) -> int:
    """Hash the checkpoint files this rank wrote into ``<directory>/.digests-rank_R.json``, right
    after writing them: no other rank has to finish first, as no rank hashes another's files.
    Returns the bytes hashed."""
    mine = [rel for rel in _checkpoint_files(directory) if _writer_of(rel, world_size) == rank]
    digests = {rel: file_digest(directory / rel) for rel in mine}
    path = directory / f"{DIGESTS_PREFIX}{rank:05d}.json"
    with open(path, "w") as f:
        json.dump(digests, f)
        f.flush()
        os.fsync(f.fileno())
    return sum((directory / rel).stat().st_size for rel in mine)


def _collect_digests(directory: Path, files: Iterable[str]) -> dict[str, str]:
    """The digests every rank wrote, merged (the rank files are removed); every file must have one."""
    merged: dict[str, str] = {}
    for part in sorted(directory.glob(f"{DIGESTS_PREFIX}*.json")):
        merged.update(json.loads(part.read_text()))
        part.unlink()
    missing = [rel for rel in files if rel not in merged]
    if missing:  # a rank saw another listing than rank 0: the file system is not shared by all ranks
        raise CheckpointError(f"no rank checksummed {directory / missing[0]}; is checkpoint.dir on a file system "
                              "that every rank shares?")
    return {rel: merged[rel] for rel in files}


def verify_contents(path: Path, warn: Warn | None = None, *, rank: int = 0, world_size: int = 1) -> str | None:
    """None when every file of checkpoint ``path`` has the content its meta.json recorded, else one
    line naming the first damaged file. Each rank hashes its share (as at save time); collective
    when world_size > 1 under a process group. A checkpoint that records no checksums (saved by an
    older perfgpt) passes, and ``warn`` hears so. Only the regular files inside ``path`` that the
    manifest lists with their sizes are opened (``_member_reason``), and none is read past its size."""
    meta, reason = _read_meta(path)
    if meta is not None and meta.get("checksums") is None:
        if warn:
            warn(f"{path} records no content checksums (saved before perfgpt wrote them); loading it without "
                 "checking its contents")
        return None
    distributed = world_size > 1 and torch.distributed.is_initialized()
    if meta is not None:
        sums, sizes = meta["checksums"], meta.get("files") or {}
        recorded: dict[str, str] = sums["files"]
        mine = sorted(rel for rel in recorded if not distributed or _writer_of(rel, world_size) == rank)
        for rel in mine:
            reason = _member_reason(path, rel, sizes[rel])
            if reason is not None:
                break
            file = path / rel
            try:
                ok = file_digest(file, size=sizes[rel]) == recorded[rel]
            except OSError as exc:
                reason = f"cannot read checkpoint file {file}: {_os_error_text(exc, file)}"
                break
            except ValueError as exc:
                reason = f"cannot read checkpoint file {file}: {exc}"
                break
            if not ok:
                reason = (f"checkpoint file {file} does not match its recorded {CHECKSUM} checksum (damaged after "
                          "it was written)")
                break
    if distributed:
        reasons: list[str | None] = [None] * world_size
        torch.distributed.all_gather_object(reasons, reason)
        reason = next((r for r in reasons if r is not None), None)
    return reason


# ----------------------------------------------------------------------- publishing


def _publish(root: Path, tmp: Path, final: Path, meta: dict[str, Any], keep_last: int) -> None:
    files = _manifest(tmp)
    checksums = {"algorithm": CHECKSUM, "files": _collect_digests(tmp, files)}
    _write_text_atomic(tmp / META, json.dumps({**meta, "files": files, "checksums": checksums}, indent=2))
    aside = root / f"{ASIDE_PREFIX}{final.name}"
    if final.exists():  # re-saving the same step (e.g. a resumed run that ends where it started)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)  # the old copy stays whole until the new one is in place
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(root / "latest", final.name + "\n")
    shutil.rmtree(aside, ignore_errors=True)
    _prune(root, keep_last)


def _prune(root: Path, keep_last: int) -> None:
    """Keep the ``keep_last`` newest complete checkpoints and, always, the newest healthy one."""
    if keep_last <= 0:
        return
    complete = [p for p in _step_dirs(root) if incomplete_reason(p) is None]
    keep = set(complete[-keep_last:])
    healthy = [p for p in complete if _meta_of(p).get("healthy", True)]
    if healthy:
        keep.add(healthy[-1])
    for old in complete:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------- finding and checking


def _step_of(path: Path) -> int | None:
    match = _STEP_RE.match(path.name)
    return int(match.group(1)) if match else None


def _step_dirs(root: Path) -> list[Path]:
    """``step_*`` directories, oldest first (complete or not)."""
    found = [p for p in root.glob("step_*") if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=lambda p: _step_of(p))


def _meta_of(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, or {} when it cannot be used (``incomplete_reason`` says why)."""
    return _read_meta(path)[0] or {}


def _read_meta(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(meta.json of checkpoint ``path``, None), or (None, why it cannot be used).

    meta.json is read as any file of a checkpoint is: a regular file inside it, of bounded size
    and nesting; then its shape is checked (``_meta_shape_problem``), so that no reader meets a
    list where it expects an object.
    """
    file = path / META
    try:
        problem = member_problem(path, file)
        meta = read_json(file) if problem is None else None
    except FileNotFoundError:
        return None, f"no {META} in {path} (an interrupted save)"
    except OSError as exc:
        return None, f"cannot read {file}: {_os_error_text(exc, file)}"
    except ValueError as exc:  # not a regular file, too large, not JSON
        return None, str(exc)
    except RuntimeError as exc:  # a symbolic-link loop (Python < 3.13)
        return None, f"cannot read {file}: {exc}"
    if problem is not None:
        return None, f"{file} {problem}; refusing to read it"
    problem = _meta_shape_problem(meta)
    if problem is not None:
        return None, f"{file} is damaged or was not written by perfgpt: {problem}"
    return meta, None


# What each meta.json key holds, where a reader relies on its type (new keys stay optional).
_META_KEYS = {"format_version": int, "step": int, "world_size": int, "strategy": str, "healthy": bool,
              "tokenizer": str, "eot_id": int, "layout": dict, "model": dict, "schedule": dict, "files": dict,
              "checksums": dict}
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _meta_shape_problem(meta: Any) -> str | None:
    """Why a parsed meta.json is not one a reader can rely on, or None: the types of its keys, a
    file manifest of sizes, and content checksums only for files the manifest lists."""
    if not isinstance(meta, dict):
        return f"it holds a JSON {_json_type(meta)}, not an object"
    for key, kind in _META_KEYS.items():
        value = meta.get(key)
        if value is not None and not (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
            return f"{key!r} is a JSON {_json_type(value)}, not {_json_type(kind())}"
    if meta.get("model") is not None:
        try:  # as read_checkpoint_meta reads it: keys renamed since, moved into their sections
            upgrade_renamed(ModelConfig, meta["model"])
        except (TypeError, ValueError):
            return "its 'model' section does not have the shape of a model config"
    files = meta.get("files") or {}
    for rel, size in files.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"'files' gives {short_repr(rel)} the size {short_repr(size)}, not a byte count"
    sums = meta.get("checksums")
    if sums is None:
        return None
    if sums.get("algorithm", CHECKSUM) != CHECKSUM:
        return f"its checksums are {short_repr(sums.get('algorithm'))}; this perfgpt checks {CHECKSUM}"
    digests = sums.get("files")
    if not isinstance(digests, dict):
        return f"'checksums' holds a JSON {_json_type(digests)} of files, not an object"
    for rel, digest in digests.items():
        if rel not in files:
            return f"'checksums' lists {short_repr(rel)}, which its file manifest ('files') does not"
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            return f"the checksum of {short_repr(rel)} is {short_repr(digest)}, not a {CHECKSUM} digest"
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _member_reason(path: Path, rel: Any, size: int) -> str | None:
    """None when ``rel``, a file the manifest of checkpoint ``path`` lists, is a regular file inside
    ``path`` of the recorded ``size``; else why not (missing, cut short, or a name that leads
    elsewhere: ``..``, an absolute path, a symbolic link out, a FIFO or device)."""
    problem = name_problem(rel)
    if problem is not None:
        return f"{path / META} lists {short_repr(rel)}, which {problem}; refusing to read it"
    file = path / rel
    try:
        problem = member_problem(path, file)
        actual = file.stat().st_size
    except FileNotFoundError:
        return f"checkpoint file missing: {file}"
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic-link loop (Python < 3.13)
        return f"cannot read checkpoint file {file}: {exc}"
    if problem is not None:
        return f"{path / META} lists {file}, which {problem}; refusing to read it"
    if actual != size:
        return f"cannot read checkpoint file {file}: {actual} bytes, {size} were written (damaged)"
    return None


def incomplete_reason(path: Path) -> str | None:
    """None for a complete checkpoint directory, else why it is not one (or cannot be trusted to be).

    Checkpoints written before manifests existed count as complete when meta.json is there.
    """
    meta, problem = _read_meta(path)
    if problem is not None:
        return problem
    for rel, size in (meta.get("files") or {}).items():
        problem = _member_reason(path, rel, size)
        if problem is not None:
            return problem
    return None


Verify = Callable[[Path], "str | None"]  # a checkpoint -> None if its contents are intact, else why not


def find_latest(root: Path, warn: Warn | None = None, verify: Verify | None = None, *,
                who: str = "resume") -> Path | None:
    """Newest complete checkpoint under root (and intact, when ``verify`` checks contents);
    ``warn`` hears about every newer one passed over, ``who`` names the reader in those lines."""
    return scan_checkpoints(root, warn, verify, who)[0]


def scan_checkpoints(root: Path, warn: Warn | None, verify: Verify | None = None, who: str = "resume"
          ) -> tuple[Path | None, list[str]]:
    """(newest complete checkpoint, why each newer candidate was passed over).

    Candidates are ``step_*`` directories and the copies a crashed re-save left aside
    (``.old-step_*``) when no complete ``step_*`` of that step exists. ``verify`` (a collective
    when it checks on several ranks) runs only on checkpoints whose files are all there.
    """
    if not root.is_dir():
        return None, []
    candidates = {_step_of(p): p for p in _step_dirs(root)}
    for aside in root.glob(f"{ASIDE_PREFIX}step_*"):
        step = _step_of(aside)
        if step is not None and (step not in candidates or incomplete_reason(candidates[step]) is not None):
            if incomplete_reason(aside) is None:
                candidates[step] = aside
    skipped = []
    for step in sorted(candidates, reverse=True):
        path = candidates[step]
        reason = incomplete_reason(path)
        if reason is None and verify is not None:
            reason = verify(path)
        if reason is None:
            if path.name.startswith(ASIDE_PREFIX) and warn:
                warn(f"{who}: {path.name[len(ASIDE_PREFIX):]} was being replaced when a save was interrupted; "
                     f"using its complete previous copy {path}")
            if skipped and warn:
                warn(f"{who}: skipping incomplete or damaged checkpoint(s): {'; '.join(skipped)}; using {path.name}")
            return path, skipped
        skipped.append(f"{path.name} ({reason})")
    return None, skipped


def resolve_resume(spec: str, root: Path, warn: Warn | None = None, verify: Verify | None = None) -> Path | None:
    """'' -> None; 'latest' -> newest complete checkpoint (None if none was ever saved); else a path.

    The ``latest`` pointer is advisory: the directory scan decides, so a pointer that names a
    torn, missing or older checkpoint (a crash between rename and pointer update) is reported
    and passed over rather than followed. Checkpoints that all turned out incomplete are an
    error, not a fresh start: training from step 0 would quietly discard the run. ``verify``
    checks contents (``verify_contents``): 'latest' passes over a damaged checkpoint, a named
    one is refused.
    """
    if not spec:
        return None
    path = Path(spec)
    if spec == "latest" or (path.is_dir() and not (path / META).is_file() and _step_dirs(path)):
        root = root if spec == "latest" else path  # a checkpoint root may be given too
        found, skipped = scan_checkpoints(root, warn, verify)
        if found is None and skipped:
            raise CheckpointError(f"--resume {spec}: no complete checkpoint under {root}: {'; '.join(skipped)}; "
                                  "resume from a copy you trust, or start without --resume")
        pointer = _read_pointer(root)
        if found is not None and pointer and warn and pointer != found.name.removeprefix(ASIDE_PREFIX):
            warn(f"resume: {root / 'latest'} names {pointer}, which is not the newest complete checkpoint; "
                 f"using {found}")
        return found
    if verify is not None and path.is_dir() and incomplete_reason(path) is None:
        reason = verify(path)
        if reason is not None:
            raise CheckpointError(f"--resume {path}: {reason}; resume from another checkpoint (--resume latest "
                                  "passes over damaged ones)")
    return path


def _read_pointer(root: Path) -> str | None:
    try:
        return (root / "latest").read_text().strip() or None
    except OSError:
        return None


def read_checkpoint_meta(path: Path, world_size: int, strategy: str, model: dict[str, Any] | None = None, *,
                         layout: dict[str, int] | None = None, reshard: bool = False) -> dict[str, Any]:
    """The checkpoint's meta.json, after checking it fits this run: same model always; same rank
    count, strategy and parallel layout unless ``reshard`` (checkpoint.reshard)."""
    meta_path = path / META
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path} (pass --resume latest or a step_XXXXXXXX directory)")
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {META}); it may be an interrupted save")
    meta, problem = _read_meta(path)
    if meta is None:
        raise CheckpointError(f"{path} cannot be used: {problem}; use another checkpoint")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: checkpoint format version {meta.get('format_version')}, this code reads "
                              f"version {FORMAT_VERSION} only (its weight layout changed); resume with the perfgpt "
                              "version that wrote it, or start a new run")
    if not reshard:
        _check_same_layout(path, meta, world_size, strategy, layout)
    saved_model = meta.get("model")
    if isinstance(saved_model, dict):  # written before a key was renamed: read under today's names
        meta["model"] = saved_model = upgrade_renamed(ModelConfig, saved_model)
    if model is not None and saved_model is not None and saved_model != model:
        saved_keys, keys = _dotted(saved_model), _dotted(model)
        diff = [f"model.{k}: {saved_keys.get(k)!r} -> {v!r}" for k, v in keys.items() if saved_keys.get(k) != v]
        raise CheckpointError(f"{path} does not match the model of this run ({'; '.join(diff[:3])})")
    reason = incomplete_reason(path)  # after the cheaper mismatches, which need no look at the files
    if reason is not None:
        raise CheckpointError(f"{path} is not a complete checkpoint: {reason}; resume from another one")
    return meta


def _dotted(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config section's keys, nested sections flattened to dotted keys (``moe.top_k``)."""
    out = {}
    for key, value in section.items():
        out.update(_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def layout_record(layout: Layout) -> dict[str, int]:
    """The parallel layout a checkpoint records (its shards and per-rank states depend on it), in the
    layout's words: dp_shard counts the ep ranks, as it always has here (before the config counted
    them the same way, its ep ranks were added in). cp and ep are absent at 1 and pp_virtual_stages
    is 1 without a pipeline, so checkpoints from before those keys existed still match."""
    record = {"tp": layout.tp, "pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
              "pp_virtual_stages": layout.pp_virtual_stages if layout.pp > 1 else 1}
    return record | ({"cp": layout.cp} if layout.cp > 1 else {}) | ({"ep": layout.ep} if layout.ep > 1 else {})


def _check_same_layout(path: Path, meta: dict[str, Any], world_size: int, strategy: str,
                       layout: dict[str, int] | None) -> None:
    hint = "; or set checkpoint.reshard=true to load it into this layout (the data stream restarts)"
    # Ranks first: several processes run strategy none as ddp or fsdp (parallel/layout.py resolve_strategy),
    # so a rank-count change also shows up as a strategy change, and only the rank count is the fix.
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            f"{path} was saved by {meta.get('world_size')} rank(s), this run has {world_size}; per-rank data "
            f"positions and RNG states cannot be mapped exactly (start {meta.get('world_size')} rank(s)){hint}"
        )
    if meta.get("strategy") != strategy:
        raise CheckpointError(
            f"{path} was saved with parallel.strategy={meta.get('strategy')}, this run uses {strategy}; "
            f"resume with the same strategy{hint}"
        )
    saved = meta.get("layout")
    if layout is not None and saved is not None and saved != layout:
        diff = ", ".join(f"parallel.{k} {saved.get(k)} -> {layout.get(k)}" for k in layout if saved.get(k) != layout.get(k))
        raise CheckpointError(f"{path} was saved with another parallel layout ({diff}){hint}")


def check_schedule(path: Path, meta: dict[str, Any], schedule: dict[str, Any], *, allow_change: bool,
                   warn: Warn | None = None) -> None:
    """Refuse (or, when allowed, warn about) a resumed run whose LR schedule differs from the saved one.

    The schedule is a function of the step, so changing it mid-run silently changes every later
    learning rate; the usual cause is a smaller train.max_steps, which optim.decay_steps follows
    by default. Checkpoints from before schedules were recorded are not checked.
    """
    saved = meta.get("schedule")
    if not isinstance(saved, dict):
        return
    diff = [f"optim.{k} {saved.get(k)!r} -> {v!r}" for k, v in schedule.items() if saved.get(k) != v]
    if not diff:
        return
    what = f"{path} was saved with a different LR schedule ({'; '.join(diff)})"
    if allow_change:
        if warn:
            warn(f"resume: {what}; continuing with the new one (checkpoint.allow_schedule_change=true)")
        return
    hint = ""
    if saved.get("decay_steps") != schedule.get("decay_steps"):
        hint = (f" (decay_steps defaults to train.max_steps; pass --optim.decay_steps={saved.get('decay_steps')} "
                "to keep it)")
    raise CheckpointError(f"{what}{hint}; set checkpoint.allow_schedule_change=true to change it on purpose")


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
