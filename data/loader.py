"""``build_data``: the one entry point train.py calls for its training and validation batches.

Every format yields the same thing: ``(x, y)`` int64 CPU tensors of shape ``(B, T)`` where
``y`` is ``x`` shifted left by one token (both cut from one window of ``T + 1`` tokens).

mmap and default (exact resume)
    The training split is cut into non-overlapping windows: window ``i`` of a shard starts at
    token ``i * T`` and spans ``T + 1`` tokens, so each token is predicted once per epoch. For
    epoch ``e`` all windows are put in one order (a permutation seeded by ``(seed, e)``, or file
    order with ``data.sampling=sequential``); rank ``r`` of ``W`` takes every W-th window
    starting at ``r`` (the remainder is dropped so all ranks take the same number of steps), and
    cuts its windows into consecutive batches. Batch ``g`` of the stream (counting across
    epochs) is a pure function of ``(seed, rank, W, B, T, g)``; DataLoader worker ``w`` of ``N``
    computes batches ``g = w, w + N, ...`` and the DataLoader hands them back in order, so the
    stream is the same for any number of workers. The stream's state is the count of batches
    *handed to the caller* (batches that workers prefetched are not counted), and a resumed
    stream continues with exactly the next batch.

Validation (both formats): ``ValSource`` in ``data/bundle.py``, the first ``n`` windows of the
split in file order, shared out among the ranks, so the figure does not depend on the layout.

WebDataset (``data.format=webdataset``): see ``data/webdataset_loader.py``; same stream and
state interface, resume at shard-plus-offset granularity.

Each batch is checked against the model's vocabulary; an id outside it is an error naming the
shard file. Shards that fail their checks on open either stop the run (``data.on_bad_shard=
error``) or are skipped and named in the description line (``skip``). With ``data.verify=lazy``
(the default) each CRC chunk of a shard is verified the first time a window of this process
touches it (``TokenShard.check_tokens``), before its tokens reach a batch; a failure there stops
the run with a DataError naming the shard and the chunk whatever ``on_bad_shard`` says, since
leaving a shard out mid-epoch would change every later batch of the deterministic stream
(``verify=full`` with ``on_bad_shard=skip`` leaves corrupt shards out at start-up instead).
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from common.errors import DataError
from data.bundle import STATE_VERSION, DataBundle, TrainStream, ValSource, seed_worker, split_windows
from data.config import DataConfig
from data.default_corpus import ensure_default_corpus
from data.mixture import build_mixture_data
from data.shards import DatasetMeta, ShardWindows, TokenShard, open_shards, read_dataset_meta
from data.webdataset_loader import build_webdataset_data

# Re-exported: callers import the stream pieces from here.
__all__ = [
    "STATE_VERSION", "DataBundle", "MmapBatches", "TrainStream", "ValSource", "build_data", "open_shards",
    "seed_worker", "split_windows",
]

VERIFY_MODES = {
    "header": "verify=header (header and file size only; token data unchecked)",
    "lazy": "verify=lazy (each shard chunk's CRC checked on first read, per process)",
    "full": "verify=full (every shard's CRCs checked at start-up)",
}


def build_data(
    cfg: DataConfig, *, seq_len: int, micro_batch_size: int, seed: int, rank: int, world_size: int, vocab_size: int,
    eval_split: str = "val", grad_accum_steps: int = 1, val_limit: int = 0,
) -> DataBundle:
    """Open (or, for data.format=default, build once and cache) the dataset and return its streams:
    the train split as the training stream, ``eval_split`` as the validation source. A mixture
    (``data.sources``, ``data/mixture.py``) draws its steps of ``micro_batch_size x grad_accum_steps
    x world_size`` samples; ``val_limit`` caps the validation windows a streaming source reads
    ahead: the run's validation set size (0: 1000)."""
    if seq_len < 1 or micro_batch_size < 1 or grad_accum_steps < 1:
        raise DataError(f"seq_len, micro_batch_size and grad_accum_steps must be >= 1, got {seq_len}, "
                        f"{micro_batch_size} and {grad_accum_steps}")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world_size {world_size}")
    if cfg.sources:
        return build_mixture_data(cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, rank=rank,
                                  world_size=world_size, vocab_size=vocab_size, grad_accum_steps=grad_accum_steps,
                                  eval_split=eval_split, val_limit=val_limit or 1000)
    if cfg.format == "webdataset":
        return build_webdataset_data(
            cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, rank=rank,
            world_size=world_size, vocab_size=vocab_size, eval_split=eval_split,
        )
    meta = _open_mmap_dataset(cfg)
    check_split(meta, eval_split)
    _check_vocab(meta, vocab_size)
    layout = dict(seq_len=seq_len, batch_size=micro_batch_size, rank=rank, world_size=world_size, vocab_size=vocab_size)
    train_shards, skipped = open_shards(meta.files("train"), vocab_size, cfg.verify, cfg.on_bad_shard)
    val_shards, skipped_val = open_shards(meta.files(eval_split), vocab_size, cfg.verify, cfg.on_bad_shard)
    layout["check_chunks"] = cfg.verify == "lazy"
    train_set = MmapBatches(
        train_shards, seed=seed, shuffle=cfg.sampling == "random", drop_last=cfg.drop_last, split_name="train", **layout
    )
    # The validation set is defined over the whole split, the same for every layout: ValSource
    # shares it out among the ranks, so its window source is the one-rank view.
    val_set = MmapBatches(val_shards, seed=seed, shuffle=False, drop_last=False, split_name=eval_split,
                          **{**layout, "batch_size": 1, "rank": 0, "world_size": 1})
    train = TrainStream(train_set, cfg, seed=seed, rank=rank)
    val = ValSource(val_set.in_order, available=val_set.total_windows, seq_len=seq_len,
                    batch_size=micro_batch_size, rank=rank, world_size=world_size, split=eval_split)
    skipped = skipped + skipped_val
    description = (
        f"data: format={cfg.format} path={meta.root} tokenizer={meta.tokenizer} (vocab {meta.vocab_size}, "
        f"eot {meta.eot_id}) | train {train_set.token_count:,} tokens in {len(train_shards)} shard(s), "
        f"{train_set.batches_per_epoch:,} batches/epoch/rank of {micro_batch_size}x{seq_len} "
        f"({cfg.sampling}) | {eval_split} {val_set.token_count:,} tokens, {val_set.total_windows:,} windows | "
        f"workers={cfg.num_workers} | {verify_description(cfg.verify, train_shards + val_shards)}"
    )
    if skipped:
        description += f" | SKIPPED {len(skipped)} bad shard(s): {skipped[0]}" + (" ..." if len(skipped) > 1 else "")
    return DataBundle(train=train, val=val, description=description, skipped_shards=skipped,
                      tokenizer=meta.tokenizer, eot_id=meta.eot_id, tokenizer_sha256=meta.tokenizer_sha256,
                      seq_len=seq_len)


def check_split(meta, split: str) -> None:
    if split not in meta.splits:
        raise DataError(f"{meta.root} has no split {split!r}; its splits: {', '.join(sorted(meta.splits))}")


def verify_description(mode: str, shards: list[TokenShard]) -> str:
    """Which check ran, for the log; lazy mode also names version-1 shards, checked whole on first read."""
    text = VERIFY_MODES[mode]
    legacy = [s for s in shards if s.header.version < 2]
    if mode == "lazy" and legacy:
        text += (
            f"; {len(legacy)} version-1 shard(s) such as {legacy[0].path.name} have one CRC, checked over the "
            f"whole shard on its first read: rebuild them with tools/prepare_data.py for per-chunk checks"
        )
    return text


def _open_mmap_dataset(cfg: DataConfig) -> DatasetMeta:
    if cfg.format == "default":
        root = ensure_default_corpus(cfg.cache_dir, cfg.default_corpus_max_mb, cfg.val_fraction)
    else:
        root = Path(cfg.path)
    meta = read_dataset_meta(root)
    if meta.format != "mmap":
        raise DataError(
            f"{root} holds a {meta.format} dataset but data.format={cfg.format}; set data.format={meta.format}"
        )
    return meta


def _check_vocab(meta: DatasetMeta, vocab_size: int) -> None:
    if meta.vocab_size > vocab_size:
        raise DataError(
            f"{meta.root}: tokenizer {meta.tokenizer} has {meta.vocab_size} ids but model.vocab_size={vocab_size}; "
            f"set model.vocab_size >= {meta.vocab_size}"
        )


# ---------------------------------------------------------------------------- mmap batch source


class MmapBatches(IterableDataset):
    """Batch ``g`` of a rank's stream over memory-mapped shards; iterable from DataLoader workers.

    Holds only paths and small arrays, so it pickles cheaply to spawned workers; the memmaps are
    reopened lazily in whichever process reads them.
    """

    def __init__(self, shards: list[TokenShard], *, seq_len: int, batch_size: int, rank: int, world_size: int,
                 vocab_size: int, seed: int, shuffle: bool, drop_last: bool, split_name: str,
                 check_chunks: bool = True):
        self.paths = [str(s.path) for s in shards]
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.drop_last, self.split_name = shuffle, drop_last, split_name
        self.token_count = sum(len(s) for s in shards)
        self._windows = ShardWindows(self.paths, [len(s) for s in shards], seq_len, check_chunks=check_chunks)
        self.window_starts = self._windows.starts
        self.total_windows = self._windows.total
        self.windows_per_rank = self.total_windows // world_size
        full, partial = divmod(self.windows_per_rank, batch_size)
        self.batches_per_epoch = full + (1 if partial and not drop_last else 0)
        if self.batches_per_epoch == 0:
            where = ", ".join(self.paths[:3]) + (" ..." if len(self.paths) > 3 else "") or "no shards"
            raise DataError(
                f"{split_name} split ({where}) is too small: {self.token_count:,} tokens make "
                f"{self.total_windows} windows of {seq_len + 1} tokens, {self.windows_per_rank} per rank "
                f"over {world_size} rank(s), fewer than one batch of {batch_size}; use more data or a "
                f"smaller seq_len / micro_batch_size"
            )
        self._order_epoch = -1
        self._order: np.ndarray | None = None
        self.start_batch = 0

    def identity(self) -> dict:
        """What a saved stream position depends on; a resume must match it."""
        return {
            "kind": "mmap", "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
            "batch_size": self.batch_size, "seq_len": self.seq_len, "total_windows": self.total_windows,
            "shuffle": self.shuffle, "drop_last": self.drop_last,
        }

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_order"], state["_order_epoch"] = None, -1
        return state

    def _rank_windows(self, epoch: int) -> np.ndarray:
        """This rank's windows of one epoch, in the order they are batched."""
        if epoch != self._order_epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.total_windows)
            else:
                order = np.arange(self.total_windows)
            self._order = order[self.rank :: self.world_size][: self.windows_per_rank]
            self._order_epoch = epoch
        return self._order

    def window_ids(self, g: int) -> np.ndarray:
        """Global window ids of batch ``g`` of this rank's stream (g counts across epochs)."""
        epoch, k = divmod(g, self.batches_per_epoch)
        return self._rank_windows(epoch)[k * self.batch_size : (k + 1) * self.batch_size]

    def batch(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return split_windows(self.windows(g))

    def windows(self, g: int) -> torch.Tensor:
        """Batch ``g`` as one (B, T + 1) int64 tensor of token windows."""
        ids = self.window_ids(g)
        buf = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, window in enumerate(ids.tolist()):
            buf[row] = self.window_tokens(window)
        if buf.max() >= self.vocab_size or buf.min() < 0:
            self._raise_bad_token(buf, ids)
        return torch.from_numpy(buf)

    def window_tokens(self, window: int) -> np.ndarray:
        """The ``T + 1`` tokens of global window ``window`` (the shard's dtype), its CRC chunk checked
        on this process's first read of it (``data.verify=lazy``); the vocabulary is the caller's check."""
        return self._windows.tokens(window)

    def in_order(self):
        """Every window of the split in file order (the validation set's order), each checked."""
        for window in range(self.total_windows):
            tokens = self.window_tokens(window)
            if tokens.max() >= self.vocab_size or tokens.min() < 0:
                self._raise_bad_token(tokens[None], np.array([window]))
            yield tokens

    def _raise_bad_token(self, buf: np.ndarray, ids: np.ndarray) -> None:
        row = int(np.argmax((buf >= self.vocab_size).any(axis=1) | (buf < 0).any(axis=1)))
        shard = bisect.bisect_right(self.window_starts, int(ids[row])) - 1
        bad = int(buf[row][(buf[row] >= self.vocab_size) | (buf[row] < 0)][0])
        raise DataError(
            f"{self.paths[shard]}: token id {bad} is outside model.vocab_size={self.vocab_size} "
            f"(corrupt shard, or a dataset prepared with a different tokenizer)"
        )

    # The resumable-stream protocol TrainStream drives (shared with the WebDataset source).

    def initial_state(self) -> dict:
        return {"position": 0}

    def set_start(self, state: dict) -> None:
        self.start_batch = int(state["position"])

    def advance(self, state: dict, cursor: int) -> dict:
        return {"position": int(cursor)}

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        g = self.start_batch + worker
        while True:  # epochs repeat forever; the trainer decides when to stop
            yield self.windows(g), g + 1  # the stream position after this batch
            g += workers
