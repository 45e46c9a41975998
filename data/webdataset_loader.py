"""The WebDataset loader: tar shards of token windows, split by rank and worker, resumable.

The on-disk sample format and the writer are in ``data/wds_format.py``: each sample is one
window of ``seq_len + 1`` tokens, decoded without pickle.

Splitting and order (one-pass mode, ``data.resampled=false``)
    Epoch ``e`` of every reader starts from the same shard order (shuffled with ``(seed, e)``
    when ``data.shuffle_shards``). Rank ``r`` of ``W`` takes shards ``r, r + W, ...`` (split by
    node) and DataLoader worker ``w`` of ``N`` takes every N-th of those (split by worker), the
    same slicing as ``webdataset.split_by_node`` / ``split_by_worker``, done here with the
    rank passed in explicitly instead of read from environment variables or a process group.
    Samples then pass through webdataset's shuffle buffer (seeded per rank, worker and epoch,
    drained at the end of each epoch) and are batched per worker; the DataLoader interleaves
    workers' batches in order. Each worker loops over epochs forever, so the training stream
    never ends. Every rank and worker reads disjoint shards; over an epoch all shards are read
    once.

Resampled mode (``data.resampled=true``)
    Each reader draws shards with replacement from the whole list with its own seeded generator,
    forever. Samples are not disjoint across readers (that is what sampling with replacement
    means); it suits very large datasets where epochs are meaningless.

Resume granularity: shard plus offset
    A batch carries its worker's reading position: epoch (or draw count), shard position and the
    number of samples already read from that shard. The stream's state holds the position of
    every worker as of the last batch handed to the caller, plus the number of batches, which
    fixes which worker continues. A resumed stream reopens each worker's shard and skips to the
    saved offset. With ``data.shuffle_buffer=0`` this is exact: the resumed stream yields exactly
    the batches an uninterrupted one would have. With a shuffle buffer, the samples sitting in a
    worker's buffer at save time (at most ``shuffle_buffer`` per worker) are not replayed:
    nothing is repeated, and those samples come back in the next epoch. The number of workers
    must stay the same across a resume (it decides the shard split).

Bad shards
    A truncated or corrupt tar, a shard that yields a different number of samples than meta.json
    records (tarfile ends a tar quietly at a damaged header or a cut on a member boundary, so
    the count is the only sign), a sample of the wrong length or dtype, or a token id outside the
    model's vocabulary raises a DataError naming the shard; with ``data.on_bad_shard=skip`` the
    rest of that shard is skipped, the skip is counted in the stream state and logged, and a
    reader whose shards all fail raises instead of spinning. A short shard is only known to be
    short at its end, so in skip mode the samples before the damage have been used.

Validation (``WebDatasetVal``, a ``data.bundle.ValSource``) reads the val shards in order and
applies the same checks. Every rank reads every sample, so with ``skip`` all ranks see the same
samples missing: the validation set is the first ``n`` samples that remain, the same on every
rank, and all ranks still run the same number of batches (a collective per batch, as with FSDP,
must not hang).
"""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from common.errors import DataError
from common.log import get_logger
from data.bundle import DataBundle, TrainStream, ValSource
from data.config import DataConfig
from data.shards import DatasetMeta, read_dataset_meta
from data.wds_format import decode_tokens, import_webdataset, iter_shard_samples

log = get_logger("data")


def corrupt_shard_error(path: str, error: Exception) -> DataError:
    return DataError(f"{path}: corrupt or truncated WebDataset shard ({error.__class__.__name__}: {error})")


class WebDatasetBatches(IterableDataset):
    """Batches from WebDataset shards for one rank; see the module docstring for the contract."""

    def __init__(self, shard_paths: list[str], *, sample_tokens: int, seq_len: int, batch_size: int, rank: int,
                 world_size: int, num_workers: int, vocab_size: int, seed: int, shuffle_shards: bool,
                 shuffle_buffer: int, resampled: bool, on_bad_shard: str, shard_samples: list[int]):
        self.paths = list(shard_paths)
        self.expected = dict(zip(self.paths, shard_samples))  # samples per shard, from meta.json
        total_samples = sum(shard_samples)
        self.sample_tokens, self.seq_len, self.batch_size = sample_tokens, seq_len, batch_size
        self.rank, self.world_size, self.readers = rank, world_size, max(1, num_workers)
        self.vocab_size, self.seed = vocab_size, seed
        self.shuffle_shards, self.shuffle_buffer, self.resampled = shuffle_shards, shuffle_buffer, resampled
        self.on_bad_shard = on_bad_shard
        self.batches_per_epoch = max(1, total_samples // world_size // batch_size)  # an estimate (shards vary)
        needed = world_size * self.readers
        if not resampled and len(self.paths) < needed:
            raise DataError(
                f"{len(self.paths)} WebDataset shard(s) cannot feed {world_size} rank(s) x {self.readers} "
                f"reader(s) = {needed}; write smaller shards (tools/prepare_data.py --samples-per-shard) or "
                f"lower data.num_workers"
            )
        self._start: dict = self.initial_state()

    def identity(self) -> dict:
        return {
            "kind": "webdataset", "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
            "readers": self.readers, "batch_size": self.batch_size, "seq_len": self.seq_len,
            "shards": len(self.paths), "shuffle_shards": self.shuffle_shards, "resampled": self.resampled,
        }

    # ---- resumable-stream protocol (driven by data.loader.TrainStream)

    def initial_state(self) -> dict:
        return {"batches": 0, "workers": [None] * self.readers, "skipped": 0}

    def set_start(self, state: dict) -> None:
        self._start = copy.deepcopy(state)

    def advance(self, state: dict, cursor: tuple) -> dict:
        virtual, position = cursor
        workers = list(state["workers"])
        workers[virtual] = position
        skipped = sum(p["skipped"] for p in workers if p is not None)
        if skipped > state["skipped"]:
            log.warning("data: skipped a bad WebDataset shard (%d so far): %s", skipped, position["last_skipped"])
        return {"batches": state["batches"] + 1, "workers": workers, "skipped": skipped}

    # ---- reading

    def _epoch_shards(self, epoch: int, virtual: int) -> list[str]:
        order = list(range(len(self.paths)))
        if self.shuffle_shards:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.paths)).tolist()
        mine = order[self.rank :: self.world_size][virtual :: self.readers]
        return [self.paths[i] for i in mine]

    def _resampled_shard(self, virtual: int, draw: int) -> str:
        rng = np.random.default_rng([self.seed, self.rank, virtual, draw, 1])
        return self.paths[int(rng.integers(len(self.paths)))]

    def _samples(self, virtual: int, start: dict | None, position: dict):
        """This reader's samples forever, shuffled within each epoch; ``position`` tracks reading."""
        epoch, shard_pos, offset = (0, 0, 0) if start is None else (start["epoch"], start["shard"], start["offset"])
        while True:
            samples = self._epoch_samples(virtual, epoch, shard_pos, offset, position)
            # The buffer drains at the end of each epoch, so an epoch yields each of its samples once.
            yield from self._shuffled(samples, virtual, [epoch, shard_pos, offset])
            epoch, shard_pos, offset = epoch + 1, 0, 0
            position.update(epoch=epoch, shard=0, offset=0)

    def _epoch_samples(self, virtual: int, epoch: int, shard_pos: int, offset: int, position: dict):
        """One epoch of this reader's shards from (shard_pos, offset); resampled mode never ends."""
        shards = None if self.resampled else self._epoch_shards(epoch, virtual)
        whole_epoch = shard_pos == 0 and offset == 0
        produced_in_epoch, empty_draws = 0, 0
        while self.resampled or shard_pos < len(shards):
            path = self._resampled_shard(virtual, shard_pos) if self.resampled else shards[shard_pos]
            position.update(epoch=epoch, shard=shard_pos, offset=offset)
            produced_by_shard = 0
            for sample in self._checked_samples(path, offset, position):
                position["offset"] += 1
                produced_by_shard += 1
                yield sample
            produced_in_epoch += produced_by_shard
            empty_draws = 0 if produced_by_shard else empty_draws + 1
            if self.resampled and empty_draws > max(100, 3 * len(self.paths)):
                raise DataError(
                    f"WebDataset reader {virtual} of rank {self.rank} drew {empty_draws} shards in a row without "
                    f"a usable sample (last: {path}); the shards are empty or corrupt"
                )
            shard_pos, offset = shard_pos + 1, 0
            position.update(shard=shard_pos, offset=0)
        if whole_epoch and produced_in_epoch == 0:
            raise DataError(
                f"WebDataset reader {virtual} of rank {self.rank} got no samples in a whole epoch from "
                f"{len(shards)} shard(s) (first: {shards[0] if shards else 'none'}); all empty or skipped"
            )

    def _checked_samples(self, path: str, offset: int, position: dict):
        try:
            for sample in iter_shard_samples(path, offset, self.expected[path]):
                tokens = decode_tokens(sample, path, self.sample_tokens)
                if tokens.size and int(tokens.max()) >= self.vocab_size:
                    raise DataError(
                        f"{path}: sample {sample.get('__key__')} has token id {int(tokens.max())} outside "
                        f"model.vocab_size={self.vocab_size}"
                    )
                yield tokens
        except Exception as e:
            problem = e if isinstance(e, DataError) else corrupt_shard_error(path, e)
            if self.on_bad_shard != "skip":
                raise problem from e
            position["skipped"] += 1
            position["last_skipped"] = str(problem)

    def _shuffled(self, samples, virtual: int, epoch_start: list[int]):
        if self.shuffle_buffer <= 1:
            return samples
        shuffle = import_webdataset().filters._shuffle
        seed = int(np.random.default_rng([self.seed, self.rank, virtual, *epoch_start]).integers(2**63))
        return shuffle(samples, bufsize=self.shuffle_buffer, initial=self.shuffle_buffer, rng=random.Random(seed))

    def __iter__(self):
        import_webdataset()
        info = get_worker_info()
        worker = info.id if info is not None else 0
        # Resuming after b batches: the DataLoader asks worker 0 first, so worker 0 plays the
        # reader that was next in turn before the interruption.
        virtual = (worker + self._start["batches"]) % self.readers
        start = self._start["workers"][virtual]
        position = {"epoch": 0, "shard": 0, "offset": 0, "skipped": 0, "last_skipped": ""}
        if start is not None:
            position.update(skipped=start["skipped"], last_skipped=start["last_skipped"])
        samples = self._samples(virtual, start, position)
        T = self.seq_len
        while True:
            rows = [next(samples)[: T + 1] for _ in range(self.batch_size)]
            yield torch.from_numpy(np.stack(rows).astype(np.int64)), (virtual, dict(position))


class WebDatasetVal(ValSource):
    """The validation set over the val shards' samples in order; a bad shard's lost samples are
    left out of the order (the same on every rank, since every rank reads them all)."""

    def __init__(self, shard_paths: list[str], *, sample_tokens: int, seq_len: int, batch_size: int, rank: int,
                 world_size: int, vocab_size: int, shard_samples: list[int], on_bad_shard: str = "error",
                 split: str = "val"):
        self.paths, self.sample_tokens, self.vocab_size = list(shard_paths), sample_tokens, vocab_size
        self.shard_samples, self.on_bad_shard = list(shard_samples), on_bad_shard
        self.skipped: dict[str, str] = {}  # path -> why, for each bad shard skipped so far
        total_samples = sum(self.shard_samples)
        if total_samples == 0:
            raise DataError(f"{split} split ({self.paths[0] if self.paths else 'no shards'} ...) has no samples; "
                            "prepare more validation data")
        super().__init__(self._samples, available=total_samples, seq_len=seq_len, batch_size=batch_size,
                         rank=rank, world_size=world_size, split=split)

    def _decode(self, sample: dict, path: str) -> np.ndarray:
        tokens = decode_tokens(sample, path, self.sample_tokens)
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DataError(f"{path}: token id {int(tokens.max())} outside model.vocab_size={self.vocab_size}")
        return tokens[: self.seq_len + 1]

    def _samples(self):
        """Every readable val sample in order."""
        for path, expected in zip(self.paths, self.shard_samples):
            try:
                for sample in iter_shard_samples(path, 0, expected):
                    yield self._decode(sample, path)
            except Exception as e:
                problem = e if isinstance(e, DataError) else corrupt_shard_error(path, e)
                if self.on_bad_shard != "skip":
                    raise problem from e
                if path not in self.skipped:
                    self.skipped[path] = str(problem)
                    log.warning("data: skipped the rest of a bad validation shard (%d so far): %s",
                                len(self.skipped), problem)


def shard_sample_counts(meta: DatasetMeta, split: str) -> list[int]:
    """Samples per shard of a split as meta.json records them (the reference a short shard fails)."""
    counts = []
    for entry in meta.splits.get(split, []):
        try:
            counts.append(int(entry["samples"]))
        except (KeyError, TypeError, ValueError):
            raise DataError(
                f"{meta.root}/meta.json: {split} shard entry {entry!r} has no sample count; "
                f"re-run tools/prepare_data.py"
            ) from None
    return counts


def build_webdataset_data(cfg: DataConfig, *, seq_len: int, micro_batch_size: int, seed: int, rank: int,
                          world_size: int, vocab_size: int, eval_split: str = "val") -> DataBundle:
    import_webdataset()
    meta = read_dataset_meta(cfg.path)
    if eval_split not in meta.splits:
        raise DataError(f"{meta.root} has no split {eval_split!r}; its splits: {', '.join(sorted(meta.splits))}")
    if meta.format != "webdataset":
        raise DataError(
            f"{meta.root} holds a {meta.format} dataset but data.format=webdataset; set data.format={meta.format}"
        )
    if meta.vocab_size > vocab_size:
        raise DataError(
            f"{meta.root}: tokenizer {meta.tokenizer} has {meta.vocab_size} ids but model.vocab_size={vocab_size}; "
            f"set model.vocab_size >= {meta.vocab_size}"
        )
    prepared = int(meta.extra["seq_len"])
    if seq_len > prepared:
        raise DataError(
            f"{meta.root}: samples were prepared for seq_len {prepared}, the run needs {seq_len}; set data.seq_len <= "
            f"{prepared} or re-run tools/prepare_data.py --seq-len {seq_len}"
        )
    per_shard = {s: shard_sample_counts(meta, s) for s in ("train", eval_split)}
    counts = {s: sum(n) for s, n in per_shard.items()}
    train_paths = [str(p) for p in meta.files("train")]
    missing = [p for p in train_paths + [str(p) for p in meta.files(eval_split)] if not os.path.isfile(p)]
    if missing:
        raise DataError(f"{missing[0]} is listed in {meta.root}/meta.json but missing ({len(missing)} missing in all)")
    if counts["train"] == 0:
        raise DataError(f"{meta.root}: the train split has no samples; prepare more data")
    common = dict(sample_tokens=prepared + 1, seq_len=seq_len, batch_size=micro_batch_size, rank=rank,
                  world_size=world_size, vocab_size=vocab_size)
    train_set = WebDatasetBatches(
        train_paths, num_workers=cfg.num_workers, seed=seed, shuffle_shards=cfg.shuffle_shards,
        shuffle_buffer=cfg.shuffle_buffer, resampled=cfg.resampled, on_bad_shard=cfg.on_bad_shard,
        shard_samples=per_shard["train"], **common,
    )
    val = WebDatasetVal([str(p) for p in meta.files(eval_split)], shard_samples=per_shard[eval_split],
                        on_bad_shard=cfg.on_bad_shard, split=eval_split, **common)
    crop = f", cropped from {prepared}" if seq_len < prepared else ""
    description = (
        f"data: format=webdataset path={meta.root} tokenizer={meta.tokenizer} (vocab {meta.vocab_size}, eot "
        f"{meta.eot_id}) | train {counts['train']:,} samples of {seq_len + 1} tokens{crop} in {len(train_paths)} "
        f"shards, ~{train_set.batches_per_epoch:,} batches/epoch/rank, "
        f"{'resampled' if cfg.resampled else 'one-pass'}, shuffle buffer {cfg.shuffle_buffer} | {eval_split} "
        f"{counts[eval_split]:,} samples | workers={cfg.num_workers} | "
        f"verify: each shard's sample count against meta.json, on_bad_shard={cfg.on_bad_shard}"
    )
    return DataBundle(train=TrainStream(train_set, cfg, seed=seed, rank=rank), val=val, description=description,
                      tokenizer=meta.tokenizer, eot_id=meta.eot_id, tokenizer_sha256=meta.tokenizer_sha256,
                      seq_len=seq_len)
