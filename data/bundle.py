"""What every data format hands to train.py: the bundle, the resumable train stream, validation.

Both batch sources (``data/loader.py`` for mmap shards, ``data/webdataset_loader.py`` for tar
shards) build on this module, and it imports neither, so the two loaders never import each other.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import random
import signal
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from common.errors import DataError
from data.config import DataConfig

if TYPE_CHECKING:
    from data.schedule import MixturePlan

STATE_VERSION = 1


@dataclass
class DataBundle:
    train: "TrainStream"
    val: "ValSource"
    description: str  # one line for the log
    skipped_shards: list[str] = field(default_factory=list)  # "path: reason" for each skipped shard
    tokenizer: str = ""  # the dataset's tokenizer spec (data.tokenizer.build_tokenizer), for sampling later
    eot_id: int | None = None  # its end-of-text id
    tokenizer_sha256: str | None = None  # its definition hash, where the data records one
    val_sources: dict[str, "ValSource"] = field(default_factory=dict)  # a mixture: each source's validation set
    mixture: "MixturePlan | None" = None  # a mixture: its weights by step
    seq_len: int = 0

    def position_metrics(self, state: dict) -> dict[str, float]:
        """Samples, tokens and share read per source up to a stream state (a mixture; else nothing)."""
        if self.mixture is None or "taken" not in state:
            return {}
        return self.mixture.metrics(state["taken"], self.seq_len)


def split_windows(windows: torch.Tensor, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 1) windows -> contiguous inputs x and next-token labels y, both (B, T)."""
    if not pin:
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    shape = (windows.shape[0], windows.shape[1] - 1)
    x = torch.empty(shape, dtype=windows.dtype, pin_memory=True)  # from torch's caching host allocator
    y = torch.empty(shape, dtype=windows.dtype, pin_memory=True)
    x.copy_(windows[:, :-1])
    y.copy_(windows[:, 1:])
    return x, y


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed Python and NumPy from the worker's torch seed.

    DataLoader gives worker ``w`` the torch seed ``base_seed + w`` with ``base_seed`` drawn from
    the loader's own generator (seeded from the run seed and rank), so augmentation-style
    randomness in workers is reproducible and differs between workers.
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    # SIGTERM / Ctrl-C are for the trainer, which finishes its step and saves (training/signals.py);
    # torchrun and Slurm signal the workers too, and a worker killed mid-step would crash the trainer.
    # Workers still end with it: the trainer shuts them down, and they exit when it is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def one_line(error: DataError) -> DataError:
    """A DataError re-raised by DataLoader from a worker, cut back to its own one-line message.

    DataLoader rebuilds a worker's exception with the worker's traceback in the message; the
    last line of that is ``common.errors.DataError: <the original message>``.
    """
    text = str(error).strip()
    if "\n" not in text:
        return error
    last = text.splitlines()[-1]
    prefix = f"{DataError.__module__}.{DataError.__qualname__}: "
    return DataError(last[len(prefix):] if last.startswith(prefix) else last)


class TrainStream:
    """Infinite iterator of training batches with a resumable position.

    Wraps a batch dataset whose iterator yields ``(windows, cursor)``: a (B, T + 1) int64 tensor
    and the reading position just after that batch. Workers send the windows as one tensor
    (at these sizes the cost of passing a batch between processes is mostly per tensor, so one
    is about twice as fast as two) and the stream cuts ``x`` and ``y`` from it, into pinned
    memory when pinning is on. The stream folds each cursor into its state as it hands the batch
    to the caller, so batches prefetched by workers never leak into the state.
    The dataset supplies ``identity()``, ``initial_state()``, ``set_start(state)`` and
    ``advance(state, cursor)``.
    """

    def __init__(self, dataset: IterableDataset, cfg: DataConfig, *, seed: int, rank: int):
        self._dataset = dataset
        self._cfg = cfg
        self._seed, self._rank = seed, rank
        self._state = dataset.initial_state()
        self._iterator = None
        self._pin = bool(cfg.pin_memory and torch.cuda.is_available())

    @property
    def batches_per_epoch(self) -> int:
        return self._dataset.batches_per_epoch

    @property
    def layout_free(self) -> bool:
        """Whether a saved state means the same for every rank layout (the mixture's global stream),
        so that a checkpoint resumes it exactly in another layout."""
        return bool(getattr(self._dataset, "layout_free", False))

    def _make_iterator(self):
        self._dataset.set_start(self._state)
        cfg = self._cfg
        workers = cfg.num_workers
        extra = {}
        if workers > 0:
            extra = dict(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor,
                         worker_init_fn=seed_worker, timeout=cfg.timeout)
        loader = DataLoader(
            self._dataset,
            batch_size=None,  # the dataset yields whole batches
            num_workers=workers,
            pin_memory=False,  # x and y are cut into pinned buffers in __next__ instead
            # A private generator: creating the iterator must not consume the global torch RNG.
            generator=torch.Generator().manual_seed(self._seed * 1_000_003 + self._rank),
            **extra,
        )
        iterator = iter(loader)
        if workers > 0:
            # Registered after torch's and multiprocessing's own exit hooks, so it runs before them
            # (last in, first out); a weak reference, so that it keeps nothing alive: see close().
            atexit.register(_stop_workers, weakref.ref(iterator))
        return iterator

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        try:
            windows, cursor = next(self._iterator)
        except DataError as e:
            self.close()
            short = one_line(e)
            if short is e:
                raise
            raise short from e
        self._state = self._dataset.advance(self._state, cursor)
        return split_windows(windows, pin=self._pin)

    def state_dict(self) -> dict:
        """Plain ints, strings, lists and dicts (safe for ``torch.load(weights_only=True)``)."""
        return {"version": STATE_VERSION, "identity": self._dataset.identity(), **copy.deepcopy(self._state)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data stream state version {state.get('version')} is not {STATE_VERSION}: cannot resume it"
            )
        mine = self._dataset.identity()
        theirs = state.get("identity", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            pretty = ", ".join(f"{k}: saved {a} now {b}" for k, (a, b) in sorted(diff.items()))
            raise DataError(f"cannot resume the data stream: the data layout changed ({pretty})")
        self.close()
        self._state = {k: copy.deepcopy(v) for k, v in state.items() if k not in ("version", "identity")}

    def close(self) -> None:
        """Stop worker processes now (they restart on the next batch).

        Not left to garbage collection: the iterator can outlive the stream (a traceback that
        holds its frames, as a DataError's does), and its workers ignore SIGTERM (seed_worker),
        so multiprocessing's exit hook, which terminates daemonic children with SIGTERM and
        then joins them, would wait for them forever and the process would never exit. For
        iterators still alive at exit, a hook registered with each stops their workers first.
        """
        iterator, self._iterator = self._iterator, None
        _stop_workers(lambda: iterator)


def _stop_workers(get_iterator) -> None:
    """Stop the worker processes of a DataLoader iterator (if it is still alive and has any)."""
    shutdown = getattr(get_iterator(), "_shutdown_workers", None)  # only the multi-process iterator has workers
    if shutdown is not None:
        shutdown()


IGNORE_INDEX = -100  # a target the loss leaves out (torch's cross_entropy default): validation padding rows


class ValSource:
    """The validation set: the first ``n`` windows of the split in order, the same for every layout.

    Window ``i`` of the set belongs to data-parallel rank ``i mod W``, and batch ``k`` of every
    rank holds that rank's windows among ``[k·B·W, (k+1)·B·W)``. Every rank reads each such chunk
    (so all ranks agree where the set ends without talking) and yields the same number of batches
    of exactly ``B`` rows: an engine that gathers weights in forward (FSDP, ZeRO-3) needs as many
    forwards on every rank, and a pipeline keeps the shapes of its first batch. Rows past the end
    of a rank's share are padding (token 0 in, ``IGNORE_INDEX`` as every target), which the loss
    leaves out. Summing ``loss x real targets`` over ranks and dividing by the real targets
    (``training.loop.evaluate``) then gives the mean over the same sequences for any ``W`` and
    ``B``. Ranks of one tensor-parallel group or pipeline get the same ``rank`` and read alike.

    ``windows`` starts a fresh pass over the split's windows in order (int arrays of ``T + 1``
    tokens); ``available`` is how many the split holds (an upper bound where a full read decides).
    Read in the calling process, no workers.
    """

    def __init__(self, windows: Callable[[], Iterator[np.ndarray]], *, available: int, seq_len: int,
                 batch_size: int, rank: int, world_size: int, split: str = "val"):
        self._windows = windows
        self.available, self.seq_len, self.batch_size = available, seq_len, batch_size
        self.rank, self.world_size, self.split = rank, world_size, split

    def size(self, n: int | None) -> int:
        """Windows in the set of ``n`` (None or 0: the whole split)."""
        return self.available if not n else min(n, self.available)

    def num_batches(self, n: int | None) -> int:
        """Batches each rank runs for the set of ``n`` windows."""
        return -(-self.size(n) // (self.batch_size * self.world_size))

    def describe(self, n: int | None, key: str = "train.eval_sequences") -> str:
        """One log line: which windows the set holds and how the ranks share them."""
        size, T = self.size(n), self.seq_len
        what = (f"the first {size:,} of {self.available:,} windows" if size < self.available
                else f"all {size:,} windows")
        line = (f"validation: {what} of the {self.split} split ({T + 1} tokens each, {T} targets), "
                f"{self.num_batches(n):,} batch(es) of {self.batch_size} on each of {self.world_size} "
                f"data-parallel rank(s)")
        if n and n > self.available:
            line += f"; {key}={n} asks for more than the split holds"
        return line

    def batches(self, n: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``(x, y)`` batches of the first ``n`` windows (None or 0: all of them)."""
        B, W = self.batch_size, self.world_size
        stream = itertools.islice(self._windows(), n or None)
        while chunk := list(itertools.islice(stream, B * W)):
            mine = chunk[self.rank :: W]
            windows = torch.zeros((B, self.seq_len + 1), dtype=torch.int64)
            if mine:
                windows[: len(mine)] = torch.from_numpy(np.stack(mine).astype(np.int64))
            x, y = windows[:, :-1].clone(), windows[:, 1:].clone()  # own storage: y's padding must not reach x
            y[len(mine):] = IGNORE_INDEX
            yield x, y
