"""WebDataset token samples on disk: the writer, and the safe per-sample decoder.

Each sample is one window of ``seq_len + 1`` tokens stored as ``<key>.u16`` / ``<key>.u32``
(raw little-endian) or ``<key>.npy``, plus ``<key>.json`` (``{"index", "tokens", "dtype"}``).
Shards are ``<split>/shard-000000.tar, ...`` written by ``webdataset.ShardWriter`` with a fixed
owner, mode and mtime so the same input gives the same bytes. Reading uses webdataset's tar
iterator on a file we open ourselves (its URL opener would also run ``pipe:`` commands), and
decoding uses ``numpy.frombuffer`` / ``numpy.load(allow_pickle=False)``: never pickle or
``torch.load``. No torch import here, so preparation stays light.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from common.errors import DataError
from data.shards import token_dtype

TOKEN_EXTENSIONS = {"u16": np.dtype("<u2"), "u32": np.dtype("<u4")}


def import_webdataset():
    """The webdataset package with the submodules used here; the one place that imports it."""
    try:
        import webdataset
        import webdataset.filters
        import webdataset.tariterators
    except ImportError as e:
        raise DataError("data.format=webdataset needs the webdataset package: pip install webdataset") from e
    return webdataset


# -------------------------------------------------------------------------------------- writing


class TokenSampleWriter:
    """Packs a stream of documents into fixed windows of ``seq_len + 1`` tokens and writes shards.

    A shard is closed when it holds ``samples_per_shard`` samples (``shard_closed`` then says so)
    or on ``flush()``; ``state()`` after either is everything a resumed writer needs (``state=``
    to the constructor), so preparation can continue after an interruption. A document whose
    windows run past a full shard leaves the rest in the carried tokens until the next document
    (or ``close()``), so that a closed shard is a point to resume from without cutting the next
    shard short: the bytes are those of writing every window at once.
    """

    def __init__(self, directory: str | os.PathLike, *, seq_len: int, vocab_size: int, samples_per_shard: int,
                 encoding: str = "raw", state: dict | None = None):
        import_webdataset()
        if encoding not in ("raw", "npy"):
            raise DataError(f"webdataset sample encoding must be raw or npy, got {encoding!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.seq_len, self.encoding, self.samples_per_shard = seq_len, encoding, samples_per_shard
        self.dtype = token_dtype(vocab_size)
        self.extension = "npy" if encoding == "npy" else {2: "u16", 4: "u32"}[self.dtype.itemsize]
        self._tar = None
        self.shard_closed = False
        state = state or {}
        self.samples = int(state.get("samples", 0))
        self.shard_samples: list[int] = list(state.get("shard_samples", []))
        pending = np.asarray(state.get("pending", []), dtype=self.dtype)
        self._pending: list[np.ndarray] = [pending] if pending.size else []
        self._pending_tokens = int(pending.size)

    def state(self) -> dict:
        """Plain values (after ``flush()`` or a closed shard: no tar is open)."""
        pending = np.concatenate(self._pending) if self._pending else np.zeros(0, dtype=self.dtype)
        return {"samples": self.samples, "shard_samples": list(self.shard_samples), "pending": pending.tolist()}

    def add_document(self, ids: np.ndarray, eot_id: int) -> None:
        doc = np.empty(len(ids) + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = eot_id
        self._pending.append(doc)
        self._pending_tokens += doc.size
        if self._pending_tokens >= self.seq_len + 1:
            self._flush_windows(stop_at_shard_end=True)

    def _flush_windows(self, stop_at_shard_end: bool) -> None:
        tokens = np.concatenate(self._pending)
        T = self.seq_len
        count, written = (tokens.size - 1) // T, 0
        while written < count:
            self._write_sample(tokens[written * T : written * T + T + 1])
            written += 1
            if stop_at_shard_end and self._tar is None:
                break  # the sample filled its shard
        rest = tokens[written * T :]  # the last token of the last window starts the next one
        self._pending, self._pending_tokens = [rest], rest.size

    def _write_sample(self, window: np.ndarray) -> None:
        if self._tar is None:
            wds = import_webdataset()
            path = self.directory / f"shard-{len(self.shard_samples):06d}.tar"
            self._tar = wds.TarWriter(str(path), encoder=False, mtime=0.0, user="perfgpt", group="perfgpt",
                                      mode=0o644)
            self.shard_samples.append(0)
        if self.encoding == "npy":
            buf = io.BytesIO()
            np.save(buf, window, allow_pickle=False)
            payload = buf.getvalue()
        else:
            payload = window.tobytes()
        record = {"index": self.samples, "tokens": int(window.size), "dtype": self.dtype.name}
        self._tar.write({"__key__": f"{self.samples:010d}", self.extension: payload,
                         "json": json.dumps(record, sort_keys=True).encode()})
        self.shard_samples[-1] += 1
        self.samples += 1
        if self.shard_samples[-1] == self.samples_per_shard:
            self.flush()
            self.shard_closed = True

    def flush(self) -> None:
        """Close the shard being written (the next sample starts a new one)."""
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def close(self) -> tuple[list[dict], int]:
        """Finish the shards; returns their meta entries and the count of tail tokens dropped."""
        if self._pending_tokens >= self.seq_len + 1:
            self._flush_windows(stop_at_shard_end=False)
        dropped = self._pending_tokens if self._pending_tokens > 1 else 0
        self.flush()
        entries = [
            {"file": f"{self.directory.name}/shard-{i:06d}.tar", "samples": n, "tokens": n * (self.seq_len + 1)}
            for i, n in enumerate(self.shard_samples)
        ]
        return entries, dropped


# -------------------------------------------------------------------------------------- reading


def decode_tokens(sample: dict, url: str, sample_tokens: int) -> np.ndarray:
    """The token window of one sample, checked for type and length (no pickle, ever)."""
    key = sample.get("__key__", "?")
    if "npy" in sample:
        try:
            arr = np.load(io.BytesIO(sample["npy"]), allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{url}: sample {key}: unreadable .npy ({e})") from e
        if arr.ndim != 1 or arr.dtype.kind != "u":
            raise DataError(f"{url}: sample {key}: expected a 1-D unsigned token array, got {arr.dtype} {arr.shape}")
    else:
        ext = next((e for e in TOKEN_EXTENSIONS if e in sample), None)
        if ext is None:
            found = sorted(k for k in sample if not k.startswith("__"))
            raise DataError(f"{url}: sample {key} has no token file (.u16, .u32 or .npy), only {found}")
        raw = sample[ext]
        if len(raw) % TOKEN_EXTENSIONS[ext].itemsize:
            raise DataError(f"{url}: sample {key}: .{ext} payload of {len(raw)} bytes is not whole tokens")
        arr = np.frombuffer(raw, dtype=TOKEN_EXTENSIONS[ext])
    if arr.size != sample_tokens:
        raise DataError(f"{url}: sample {key} has {arr.size} tokens, the dataset's samples have {sample_tokens}")
    return arr


def iter_shard_samples(path: str, skip: int, expected: int | None = None):
    """Samples of one tar shard via webdataset's tar iterator, after the first ``skip``.

    Python's tarfile ends an archive quietly at an unreadable header after the first member and
    at a cut on a member boundary, so a damaged shard just looks shorter. ``expected`` (the count
    in meta.json) turns that into a DataError once the shard is exhausted.
    """
    with open(path, "rb") as stream:  # opened here: webdataset's gopen would also accept pipe: URLs
        yield from iter_tar_samples(stream, path, skip, expected)


def iter_tar_samples(stream, url: str, skip: int = 0, expected: int | None = None):
    """``iter_shard_samples`` over an open binary stream (a file, or a shard fetched into memory)."""
    tariterators = import_webdataset().tariterators
    count = 0
    files = tariterators.tar_file_expander([{"url": url, "stream": stream}])
    for index, sample in enumerate(tariterators.group_by_keys(files)):
        count = index + 1
        if index >= skip:
            yield sample
    if expected is not None and count != expected:
        raise DataError(
            f"{url}: WebDataset shard holds {count} readable sample(s), meta.json records {expected}: "
            f"{'truncated or corrupt' if count < expected else 'not the shard meta.json describes'}; re-run "
            f"tools/prepare_data.py, or set data.on_bad_shard=skip to read past it"
        )
