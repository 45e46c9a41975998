"""The prepared sources a mixture draws from: mmap token shards and WebDataset tar shards, local or
at a URL (the Hugging Face source, tokenized on the fly, is ``data/hf_source.py``).

Each source numbers its training samples 0, 1, 2, ... across epochs, and sample ``n`` is a
pure function of ``(seed, source index, n)``, so a source is read at random:

mmap
    Windows of ``T + 1`` tokens as in ``data/loader.py``; epoch ``e`` visits every window once in
    a permutation seeded by ``(seed, source, e)``. A remote dataset's ``meta.json`` is read at
    start-up and each shard is downloaded into ``data.cache_dir/remote/`` the first time a
    process reads from it (into a directory named after a hash of the URL and its meta.json, so a
    changed dataset never reuses stale shards), then memory-mapped and checked as a local one.
WebDataset
    Epoch ``e`` reads the shards in a permutation seeded by ``(seed, source, e)`` and the samples
    of each shard in a permutation seeded by ``(seed, source, e, shard)``: a shard is fetched
    whole (local file or URL), decoded and held while its samples are used. Its sample count must
    match meta.json; a bad shard stops the run with a line naming it (leaving it out mid-run
    would change every later sample of the stream).

An epoch boundary of one source changes nothing for the others: each keeps its own count.
Validation reads the ``val`` split's windows (samples) in file order.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from common.errors import DataError
from common.log import get_logger
from data.remote import RemotePolicy, RemoteReader, is_url, join, local_path
from data.shards import META_FILE, DatasetMeta, ShardWindows, open_shards, parse_dataset_meta
from data.wds_format import decode_tokens, iter_tar_samples
from data.webdataset_loader import shard_sample_counts

log = get_logger("data")
SOURCE_TAG = 0x53524345


def epoch_permutation(seed: int, source: int, epoch: int, n: int, *extra: int) -> np.ndarray:
    return np.random.default_rng([seed, SOURCE_TAG, source, epoch, *extra]).permutation(n)


def read_meta(location: str, reader: RemoteReader) -> tuple[DatasetMeta, str]:
    """A dataset's meta.json, local or remote, and its text (remote caches are keyed by it)."""
    if is_url(location):
        url = join(location, META_FILE)
        text = reader.fetch(url).decode("utf-8", errors="replace")
        return parse_dataset_meta(text, location.rstrip("/"), url), text
    root = local_path(location)
    if not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist; create it with tools/prepare_data.py")
    file = root / META_FILE
    if not file.is_file():
        raise DataError(f"{root} has no {META_FILE}: not a dataset directory written by tools/prepare_data.py")
    text = file.read_text()
    return parse_dataset_meta(text, root, str(file)), text


def tokenizer_identity(meta: DatasetMeta) -> dict:
    return {"name": meta.tokenizer, "vocab_size": meta.vocab_size, "eot_id": meta.eot_id,
            "sha256": meta.tokenizer_sha256}


class RemoteShards:
    """Shard URL -> a local copy in the cache (downloaded once per file; shared by processes)."""

    def __init__(self, directory: Path, policy: RemotePolicy, source: str):
        self.directory, self.policy, self.source = directory, policy, source
        self._reader: RemoteReader | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}

    def __call__(self, url: str) -> str:
        dest = self.directory / hashlib.sha256(url.encode()).hexdigest()[:16] / url.rsplit("/", 1)[-1]
        if not dest.is_file():
            if self._reader is None:
                self._reader = RemoteReader(self.policy)
            before = self._reader.retries_used
            self._reader.fetch_to_file(url, dest)
            if self._reader.retries_used > before:
                log.warning("data: source %s: fetched %s after %d retr%s (%d so far): %s", self.source, url,
                            self._reader.retries_used - before, "y" if self._reader.retries_used - before == 1
                            else "ies", self._reader.retries_used, self._reader.last_retry)
        return str(dest)


def remote_cache_dir(cache_dir: str, location: str, meta_text: str) -> Path:
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "perfgpt"
    key = hashlib.sha256(f"{location}\n{meta_text}".encode()).hexdigest()[:20]
    return root / "remote" / key


class MmapSource:
    """Random-access windows over a prepared mmap dataset (local or remote)."""

    sequential = False

    def __init__(self, name: str, index: int, location: str, *, seq_len: int, seed: int, vocab_size: int,
                 verify: str, on_bad_shard: str, eval_split: str, policy: RemotePolicy, cache_dir: str):
        self.name, self.index, self.seq_len, self.seed, self.vocab_size = name, index, seq_len, seed, vocab_size
        meta, text = open_prepared(name, location, "mmap", eval_split, vocab_size, policy)
        self.tokenizer = tokenizer_identity(meta)
        self.location, self.skipped = location, []
        if is_url(location):
            if verify == "full":
                raise DataError(f"source {name}: data.verify=full would download every shard of {location} at "
                                f"start-up; use verify=lazy (each chunk checked on first read)")
            cache = RemoteShards(remote_cache_dir(cache_dir, location, text), policy, name)
            check = verify == "lazy"
            self.train = ShardWindows(meta.locations("train"), _entry_tokens(meta, "train"), seq_len,
                                      check_chunks=check, locate=cache)
            self.val = ShardWindows(meta.locations(eval_split), _entry_tokens(meta, eval_split), seq_len,
                                    check_chunks=check, locate=cache)
        else:
            self.train = self._local_windows(meta, "train", verify, on_bad_shard)
            self.val = self._local_windows(meta, eval_split, verify, on_bad_shard)
        self.samples_per_epoch = self.train.total
        if self.train.total == 0:
            raise DataError(f"source {name}: the train split of {location} holds {meta.tokens('train'):,} tokens, "
                            f"not one window of {seq_len + 1}; it is empty for this seq_len")
        self.val_available = self.val.total
        self._order_epoch, self._order = -1, None

    def _local_windows(self, meta: DatasetMeta, split: str, verify: str, on_bad: str) -> ShardWindows:
        shards, skipped = open_shards(meta.files(split), self.vocab_size, verify, on_bad)
        self.skipped += skipped
        return ShardWindows([str(s.path) for s in shards], [len(s) for s in shards], self.seq_len,
                            check_chunks=verify == "lazy")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_order_epoch": -1, "_order": None}

    def sample(self, n: int) -> np.ndarray:
        epoch, k = divmod(n, self.train.total)
        if epoch != self._order_epoch:
            self._order = epoch_permutation(self.seed, self.index, epoch, self.train.total)
            self._order_epoch = epoch
        return self.train.tokens(int(self._order[k]))

    def val_windows(self):
        for window in range(self.val.total):
            yield self.val.tokens(window)

    def describe(self) -> str:
        where = "remote, cached on first read" if is_url(self.location) else "local"
        text = f"mmap {self.location} ({where}), {self.train.total:,} windows/epoch"
        if self.skipped:
            text += f", SKIPPED {len(self.skipped)} bad shard(s): {self.skipped[0]}"
        return text


class WebDatasetSource:
    """Random-access samples over prepared WebDataset tar shards (local or remote)."""

    sequential = False

    def __init__(self, name: str, index: int, location: str, *, seq_len: int, seed: int, vocab_size: int,
                 eval_split: str, policy: RemotePolicy):
        self.name, self.index, self.seq_len, self.seed, self.vocab_size = name, index, seq_len, seed, vocab_size
        self.location, self.policy = location, policy
        meta, _ = open_prepared(name, location, "webdataset", eval_split, vocab_size, policy)
        self.tokenizer = tokenizer_identity(meta)
        prepared = int(meta.extra["seq_len"])
        if seq_len > prepared:
            raise DataError(f"source {name}: samples of {location} were prepared for seq_len {prepared}, the run needs "
                            f"{seq_len}; set data.seq_len <= {prepared} or prepare it again with --seq-len {seq_len}")
        self.sample_tokens = prepared + 1
        self.train_urls, self.train_counts = meta.locations("train"), shard_sample_counts(meta, "train")
        self.val_urls, self.val_counts = meta.locations(eval_split), shard_sample_counts(meta, eval_split)
        self.samples_per_epoch = sum(self.train_counts)
        if self.samples_per_epoch == 0:
            raise DataError(f"source {name}: the train split of {location} has no samples")
        self.val_available = sum(self.val_counts)
        if not is_url(location):
            missing = [u for u in self.train_urls + self.val_urls if not Path(u).is_file()]
            if missing:
                raise DataError(f"source {name}: {missing[0]} is listed in meta.json but missing "
                                f"({len(missing)} missing in all)")
        self._reset()

    def _reset(self) -> None:
        self._reader: RemoteReader | None = None
        self._epoch, self._order, self._ends = -1, None, None
        self._held: tuple[int, int, np.ndarray, np.ndarray] | None = None  # (epoch, shard, samples, order)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_reader=None, _epoch=-1, _order=None, _ends=None, _held=None)
        return state

    def load_shard(self, url: str, expected: int) -> np.ndarray:
        """All samples of one shard as a (count, T + 1) array, checked against meta.json and the vocab."""
        if self._reader is None:
            self._reader = RemoteReader(self.policy)
        before = self._reader.retries_used
        raw = self._reader.fetch(url)
        if self._reader.retries_used > before:
            log.warning("data: source %s: read %s after %d retr%s (%d so far): %s", self.name, url,
                        self._reader.retries_used - before, "y" if self._reader.retries_used - before == 1 else "ies",
                        self._reader.retries_used, self._reader.last_retry)
        try:
            rows = [decode_tokens(s, url, self.sample_tokens)[: self.seq_len + 1]
                    for s in iter_tar_samples(io.BytesIO(raw), url, 0, expected)]
        except DataError:
            raise
        except Exception as e:  # tarfile and webdataset raise their own types for a damaged archive
            raise DataError(f"{url}: corrupt or truncated WebDataset shard ({e.__class__.__name__}: {e})") from e
        samples = np.stack(rows) if rows else np.zeros((0, self.seq_len + 1), dtype=np.uint16)
        if samples.size and int(samples.max()) >= self.vocab_size:
            raise DataError(f"{url}: token id {int(samples.max())} is outside model.vocab_size={self.vocab_size}")
        return samples

    def sample(self, n: int) -> np.ndarray:
        epoch, k = divmod(n, self.samples_per_epoch)
        if epoch != self._epoch:
            self._order = epoch_permutation(self.seed, self.index, epoch, len(self.train_urls))
            self._ends = np.cumsum(np.asarray(self.train_counts)[self._order])
            self._epoch = epoch
        position = int(np.searchsorted(self._ends, k, side="right"))
        offset = k - (int(self._ends[position - 1]) if position else 0)
        shard = int(self._order[position])
        if self._held is None or self._held[:2] != (epoch, shard):
            samples = self.load_shard(self.train_urls[shard], self.train_counts[shard])
            self._held = (epoch, shard, samples, epoch_permutation(self.seed, self.index, epoch, len(samples), shard))
        _, _, samples, order = self._held
        return samples[order[offset]]

    def val_windows(self):
        for url, count in zip(self.val_urls, self.val_counts):
            yield from self.load_shard(url, count)

    def describe(self) -> str:
        where = "remote" if is_url(self.location) else "local"
        return (f"webdataset {self.location} ({where}), {self.samples_per_epoch:,} samples/epoch in "
                f"{len(self.train_urls)} shard(s)")


def _entry_tokens(meta: DatasetMeta, split: str) -> list[int]:
    try:
        return [int(entry["tokens"]) for entry in meta.splits.get(split, [])]
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{meta.root}/{META_FILE}: a {split} shard entry has no token count; prepare it again") from None


def open_prepared(name: str, location: str, fmt: str, eval_split: str, vocab_size: int,
                  policy: RemotePolicy) -> tuple[DatasetMeta, str]:
    """A prepared dataset's meta.json (and its text), checked: its format, its splits, its vocabulary."""
    meta, text = read_meta(location, RemoteReader(policy))
    if meta.format != fmt:
        raise DataError(f"source {name}: {location} holds a {meta.format} dataset; set its format: {meta.format}")
    for needed in ("train", eval_split):
        if needed not in meta.splits:
            raise DataError(f"source {name}: {meta.root} has no split {needed!r}; its splits: "
                            f"{', '.join(sorted(meta.splits))}")
    if meta.vocab_size > vocab_size:
        raise DataError(f"source {name}: tokenizer {meta.tokenizer} of {meta.root} has {meta.vocab_size} ids but "
                        f"model.vocab_size={vocab_size}; set model.vocab_size >= {meta.vocab_size}")
    return meta, text
