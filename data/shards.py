"""The mmap token-shard format and the dataset directory that lists shards.

One shard file (``*.bin``), all integers little-endian::

    offset 0   header, 64 bytes:
               magic        8s   b"PGPTTOK\\0"
               version      u32  1
               itemsize     u32  2 (uint16 tokens, vocab <= 65536) or 4 (uint32)
               token_count  u64
               doc_count    u64
               vocab_size   u64  of the tokenizer that wrote it
               max_token_id u64  largest id in the file (0 when empty)
               crc32        u32  of the token bytes
               (12 bytes zero padding)
    offset 64  tokens: token_count * itemsize bytes, each document followed by end-of-text
               zero padding to a multiple of 8 bytes
    then       doc_offsets: (doc_count + 1) u64, where document i spans
               tokens[doc_offsets[i]:doc_offsets[i+1]] (its end-of-text included)

Both arrays are read with ``numpy.memmap``, so opening a shard costs no reads beyond the header.
Opening checks the magic, version, itemsize and that the file size matches the header exactly
(a truncated or padded file is an error naming it). ``verify()`` additionally checks the CRC and
recomputes the maximum id; loaders also check each window they read against the model's vocab.

A dataset directory holds ``meta.json`` (tokenizer, vocab size, end-of-text id, the shard files
of each split) and the shards. Shard contents are never unpickled: they are raw integers.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.errors import DataError

MAGIC = b"PGPTTOK\0"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQQQQI12x")
assert HEADER.size == 64
META_FILE = "meta.json"
DATASET_FORMATS = ("mmap", "webdataset")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise DataError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _aligned8(n: int) -> int:
    return (n + 7) // 8 * 8


class TokenShardWriter:
    """Streams documents into a shard; the file appears (atomically renamed) only on ``close()``."""

    def __init__(self, path: str | os.PathLike, vocab_size: int, eot_id: int):
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.eot_id = eot_id
        self.dtype = token_dtype(vocab_size)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file = open(self._tmp, "wb")
        self._file.write(b"\0" * HEADER.size)
        self._offsets = [0]
        self._crc = 0
        self._max_id = 0

    @property
    def token_count(self) -> int:
        return self._offsets[-1]

    def add_document(self, ids: np.ndarray) -> None:
        """Append one document's ids; the end-of-text token is added here."""
        ids = np.asarray(ids)
        if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            raise DataError(f"{self.path}: token id outside [0, {self.vocab_size}) in a document being written")
        doc = np.empty(ids.size + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = self.eot_id
        raw = doc.tobytes()
        self._file.write(raw)
        self._crc = zlib.crc32(raw, self._crc)
        self._max_id = max(self._max_id, int(doc.max()))
        self._offsets.append(self._offsets[-1] + doc.size)

    def close(self) -> Path:
        tokens = self.token_count
        pad = _aligned8(tokens * self.dtype.itemsize) - tokens * self.dtype.itemsize
        self._file.write(b"\0" * pad)
        self._file.write(np.asarray(self._offsets, dtype="<u8").tobytes())
        self._file.seek(0)
        self._file.write(
            HEADER.pack(
                MAGIC, FORMAT_VERSION, self.dtype.itemsize, tokens, len(self._offsets) - 1,
                self.vocab_size, self._max_id, self._crc,
            )
        )
        self._file.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class ShardHeader:
    itemsize: int
    token_count: int
    doc_count: int
    vocab_size: int
    max_token_id: int
    crc32: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.itemsize == 2 else np.dtype("<u4")

    def expected_file_size(self) -> int:
        return HEADER.size + _aligned8(self.token_count * self.itemsize) + 8 * (self.doc_count + 1)


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and check a shard header against the file's size; every problem names the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except OSError as e:
        raise DataError(f"cannot read token shard {path}: {e.strerror}") from e
    if len(raw) < HEADER.size:
        raise DataError(f"{path}: truncated token shard ({size} bytes, the header alone is {HEADER.size})")
    magic, version, itemsize, tokens, docs, vocab, max_id, crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(
            f"{path}: not a perfgpt token shard (bad magic {magic!r}); rebuild it with tools/prepare_data.py"
        )
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path}: token shard format version {version}, this code reads version {FORMAT_VERSION}; "
            f"rebuild it with tools/prepare_data.py"
        )
    if itemsize not in (2, 4):
        raise DataError(f"{path}: corrupt header (token itemsize {itemsize}, expected 2 or 4)")
    header = ShardHeader(itemsize, tokens, docs, vocab, max_id, crc)
    if size != header.expected_file_size():
        raise DataError(
            f"{path}: file is {size} bytes but its header describes {header.expected_file_size()} "
            f"({tokens} tokens, {docs} documents): truncated or corrupt, rebuild it"
        )
    if tokens and max_id >= vocab:
        raise DataError(f"{path}: corrupt header (max token id {max_id} >= its vocab size {vocab})")
    return header


class TokenShard:
    """A validated, memory-mapped shard: ``tokens`` and ``doc_offsets`` are numpy memmaps."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header = read_header(self.path)
        h = self.header
        if h.token_count:
            self.tokens = np.memmap(self.path, dtype=h.dtype, mode="r", offset=HEADER.size, shape=(h.token_count,))
        else:
            self.tokens = np.zeros(0, dtype=h.dtype)
        offsets_at = HEADER.size + _aligned8(h.token_count * h.itemsize)
        self.doc_offsets = np.memmap(self.path, dtype="<u8", mode="r", offset=offsets_at, shape=(h.doc_count + 1,))

    def __len__(self) -> int:
        return self.header.token_count

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` without its end-of-text."""
        return np.asarray(self.tokens[int(self.doc_offsets[i]) : int(self.doc_offsets[i + 1]) - 1])

    def verify(self, chunk_tokens: int = 1 << 24) -> None:
        """Full check: CRC of the token bytes, true maximum id and a monotone document index."""
        crc, max_id = 0, 0
        for start in range(0, len(self), chunk_tokens):
            chunk = np.asarray(self.tokens[start : start + chunk_tokens])
            crc = zlib.crc32(chunk.tobytes(), crc)
            max_id = max(max_id, int(chunk.max()))
        if crc != self.header.crc32:
            raise DataError(f"{self.path}: token data fails its CRC check (corrupt); rebuild the shard")
        if max_id != self.header.max_token_id:
            raise DataError(
                f"{self.path}: max token id {max_id} disagrees with the header ({self.header.max_token_id})"
            )
        offsets = np.asarray(self.doc_offsets)
        if offsets[0] != 0 or offsets[-1] != len(self) or np.any(np.diff(offsets.astype(np.int64)) < 1):
            raise DataError(f"{self.path}: corrupt document index (offsets not increasing from 0 to the token count)")


# ---------------------------------------------------------------------------- dataset directory


@dataclass(frozen=True)
class DatasetMeta:
    """What ``meta.json`` records about a prepared dataset directory."""

    root: Path
    format: str  # "mmap" | "webdataset"
    tokenizer: str
    vocab_size: int
    eot_id: int
    splits: dict  # split name -> list of {"file": relative path, "tokens": int, ...}
    extra: dict  # format-specific fields (e.g. seq_len and samples for webdataset)

    def files(self, split: str) -> list[Path]:
        """Shard paths of a split; entries must stay inside the dataset directory."""
        paths = []
        for entry in self.splits.get(split, []):
            rel = Path(str(entry["file"]))
            if rel.is_absolute() or ".." in rel.parts:
                raise DataError(
                    f"{self.root / META_FILE}: shard entry {str(rel)!r} must be a path inside the dataset directory"
                )
            paths.append(self.root / rel)
        return paths

    def tokens(self, split: str) -> int:
        return sum(int(entry.get("tokens", 0)) for entry in self.splits.get(split, []))


def write_meta(root: str | os.PathLike, *, format: str, tokenizer: str, vocab_size: int, eot_id: int,
               splits: dict, **extra) -> Path:
    root = Path(root)
    body = {
        "format": format, "version": FORMAT_VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size,
        "eot_id": eot_id, "splits": splits, **extra,
    }
    tmp = root / f".{META_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / META_FILE)
    return root / META_FILE


def read_meta(root: str | os.PathLike) -> DatasetMeta:
    root = Path(root)
    file = root / META_FILE
    if not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist; create it with tools/prepare_data.py")
    if not file.is_file():
        raise DataError(f"{root} has no {META_FILE}: not a dataset directory written by tools/prepare_data.py")
    try:
        body = json.loads(file.read_text())
        fmt = body["format"]
        known = {"format", "version", "tokenizer", "vocab_size", "eot_id", "splits"}
        meta = DatasetMeta(
            root=root, format=fmt, tokenizer=str(body["tokenizer"]), vocab_size=int(body["vocab_size"]),
            eot_id=int(body["eot_id"]), splits=dict(body["splits"]),
            extra={k: v for k, v in body.items() if k not in known},
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(
            f"{file} is corrupt or incomplete ({e.__class__.__name__}: {e}); re-run tools/prepare_data.py"
        ) from e
    if fmt not in DATASET_FORMATS:
        raise DataError(f"{file}: unknown dataset format {fmt!r}; valid: {', '.join(DATASET_FORMATS)}")
    if int(body.get("version", -1)) != FORMAT_VERSION:
        raise DataError(
            f"{file}: dataset version {body.get('version')}, this code reads {FORMAT_VERSION}; "
            f"re-run tools/prepare_data.py"
        )
    return meta
