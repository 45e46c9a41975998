"""The mmap token-shard format and the dataset directory that lists shards.

One shard file (``*.bin``), version 2, all integers little-endian::

    offset 0   header, 64 bytes:
               magic        8s   b"PGPTTOK\\0"
               version      u32  2
               itemsize     u32  2 (uint16 tokens, vocab <= 65536) or 4 (uint32)
               token_count  u64
               doc_count    u64
               vocab_size   u64  of the tokenizer that wrote it
               max_token_id u64  largest id in the file (0 when empty)
               crc32        u32  of all the token bytes
               chunk_tokens u32  tokens per CRC chunk (the last chunk may be shorter)
               index_crc    u32  of the doc_offsets bytes
               header_crc   u32  of the 60 header bytes before it
    offset 64  tokens: token_count * itemsize bytes, each document followed by end-of-text
               zero padding to a multiple of 8 bytes
    then       doc_offsets: (doc_count + 1) u64, where document i spans
               tokens[doc_offsets[i]:doc_offsets[i+1]] (its end-of-text included)
    then       chunk_crcs: ceil(token_count / chunk_tokens) u32, the CRC32 of each chunk's token
               bytes, zero padding to a multiple of 8 bytes

Version 1 (still read) has the same layout up to ``crc32``, 12 zero bytes where version 2 keeps
``chunk_tokens`` .. ``header_crc``, and no chunk table; it is treated as one chunk covering all
tokens, checked by ``crc32``.

Both arrays are read with ``numpy.memmap``, so opening a shard costs no reads beyond the header.
Opening checks the magic, version, itemsize, the header CRC (version 2) and that the file size
matches the header exactly (a truncated or padded file is an error naming it). What else is
checked depends on ``data.verify``:

- ``header``: nothing more.
- ``lazy`` (default): ``TokenShard.check_tokens`` verifies each chunk's CRC the first time a
  reader touches it (once per process), before the tokens are used; a version-1 shard's one chunk
  is the whole shard, so its first read checks all of it.
- ``full``: ``verify()`` at start-up checks every CRC, recomputes the maximum id and the document
  index.

Loaders also check each window they read against the model's vocab.

A dataset directory holds ``meta.json`` (tokenizer, vocab size, end-of-text id, the shard files
of each split) and the shards. Shard contents are never unpickled: they are raw integers.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from common.errors import DataError

MAGIC = b"PGPTTOK\0"
SHARD_VERSION = 2  # what the writer produces
READABLE_SHARD_VERSIONS = (1, 2)
META_VERSION = 1  # of meta.json, independent of the shard files' version
HEADER = struct.Struct("<8sIIQQQQIIII")
HEADER_V1 = struct.Struct("<8sIIQQQQI12x")
assert HEADER.size == HEADER_V1.size == 64
HEADER_CRC_AT = HEADER.size - 4
# 64 Ki tokens (128 KiB of uint16) per CRC: the first read of a window verifies at most a few
# such chunks, and the table costs 4 bytes per chunk.
DEFAULT_CHUNK_TOKENS = 1 << 16
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

    def __init__(self, path: str | os.PathLike, vocab_size: int, eot_id: int,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        if not 1 <= chunk_tokens < 2**32:
            raise DataError(f"chunk_tokens must be in [1, 2**32), got {chunk_tokens}")
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.eot_id = eot_id
        self.chunk_tokens = chunk_tokens
        self.dtype = token_dtype(vocab_size)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file = open(self._tmp, "wb")
        self._file.write(b"\0" * HEADER.size)
        self._offsets = [0]
        self._crc = 0
        self._chunk_crcs: list[int] = []
        self._chunk_crc = 0
        self._chunk_fill = 0  # tokens in the chunk being written
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
        self._add_to_chunks(memoryview(raw))
        self._max_id = max(self._max_id, int(doc.max()))
        self._offsets.append(self._offsets[-1] + doc.size)

    def _add_to_chunks(self, raw: memoryview) -> None:
        """Fold token bytes into the per-chunk CRCs; a document may span chunk boundaries."""
        itemsize = self.dtype.itemsize
        while len(raw):
            take = min(len(raw) // itemsize, self.chunk_tokens - self._chunk_fill)
            self._chunk_crc = zlib.crc32(raw[: take * itemsize], self._chunk_crc)
            self._chunk_fill += take
            raw = raw[take * itemsize :]
            if self._chunk_fill == self.chunk_tokens:
                self._chunk_crcs.append(self._chunk_crc)
                self._chunk_crc, self._chunk_fill = 0, 0

    def close(self) -> Path:
        if self._chunk_fill:
            self._chunk_crcs.append(self._chunk_crc)
            self._chunk_crc, self._chunk_fill = 0, 0
        tokens = self.token_count
        pad = _aligned8(tokens * self.dtype.itemsize) - tokens * self.dtype.itemsize
        self._file.write(b"\0" * pad)
        offsets = np.asarray(self._offsets, dtype="<u8").tobytes()
        self._file.write(offsets)
        table = np.asarray(self._chunk_crcs, dtype="<u4").tobytes()
        self._file.write(table + b"\0" * (_aligned8(len(table)) - len(table)))
        header = HEADER.pack(
            MAGIC, SHARD_VERSION, self.dtype.itemsize, tokens, len(self._offsets) - 1, self.vocab_size,
            self._max_id, self._crc, self.chunk_tokens, zlib.crc32(offsets), 0,
        )
        self._file.seek(0)
        self._file.write(header[:HEADER_CRC_AT] + struct.pack("<I", zlib.crc32(header[:HEADER_CRC_AT])))
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
    version: int = SHARD_VERSION
    chunk_tokens: int = 0  # 0 in version 1: the whole token payload is one chunk
    index_crc: int = 0  # version 2 only

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.itemsize == 2 else np.dtype("<u4")

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens each CRC covers (version 1: all of them)."""
        return self.chunk_tokens if self.version >= 2 else max(1, self.token_count)

    @property
    def chunk_count(self) -> int:
        return -(-self.token_count // self.tokens_per_chunk)

    def offsets_at(self) -> int:
        return HEADER.size + _aligned8(self.token_count * self.itemsize)

    def chunk_table_at(self) -> int:
        return self.offsets_at() + 8 * (self.doc_count + 1)

    def expected_file_size(self) -> int:
        table = _aligned8(4 * self.chunk_count) if self.version >= 2 else 0
        return self.chunk_table_at() + table


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
    magic, version = struct.unpack_from("<8sI", raw)
    if magic != MAGIC:
        raise DataError(
            f"{path}: not a perfgpt token shard (bad magic {magic!r}); rebuild it with tools/prepare_data.py"
        )
    if version not in READABLE_SHARD_VERSIONS:
        raise DataError(
            f"{path}: token shard format version {version}, this code reads versions "
            f"{', '.join(map(str, READABLE_SHARD_VERSIONS))}; rebuild it with tools/prepare_data.py"
        )
    if version == 1:
        _, _, itemsize, tokens, docs, vocab, max_id, crc = HEADER_V1.unpack(raw)
        header = ShardHeader(itemsize, tokens, docs, vocab, max_id, crc, version=1)
    else:
        _, _, itemsize, tokens, docs, vocab, max_id, crc, chunk, index_crc, header_crc = HEADER.unpack(raw)
        if zlib.crc32(raw[:HEADER_CRC_AT]) != header_crc or chunk == 0:
            raise DataError(
                f"{path}: corrupt header (fails its CRC check); rebuild the shard with tools/prepare_data.py"
            )
        header = ShardHeader(itemsize, tokens, docs, vocab, max_id, crc, version, chunk, index_crc)
    if itemsize not in (2, 4):
        raise DataError(f"{path}: corrupt header (token itemsize {itemsize}, expected 2 or 4)")
    if size != header.expected_file_size():
        raise DataError(
            f"{path}: file is {size} bytes but its header describes {header.expected_file_size()} "
            f"({tokens} tokens, {docs} documents): truncated or corrupt, rebuild it"
        )
    if tokens and max_id >= vocab:
        raise DataError(f"{path}: corrupt header (max token id {max_id} >= its vocab size {vocab})")
    return header


class TokenShard:
    """A validated, memory-mapped shard: ``tokens`` and ``doc_offsets`` are numpy memmaps.

    ``check_tokens`` remembers which chunks passed their CRC in this object, so each process
    that opens the shard verifies what it reads once (DataLoader workers open their own).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header = read_header(self.path)
        h = self.header
        if h.token_count:
            self.tokens = np.memmap(self.path, dtype=h.dtype, mode="r", offset=HEADER.size, shape=(h.token_count,))
        else:
            self.tokens = np.zeros(0, dtype=h.dtype)
        self.doc_offsets = np.memmap(self.path, dtype="<u8", mode="r", offset=h.offsets_at(), shape=(h.doc_count + 1,))
        if h.version >= 2 and h.chunk_count:
            self.chunk_crcs = np.memmap(self.path, dtype="<u4", mode="r", offset=h.chunk_table_at(),
                                        shape=(h.chunk_count,))
        else:
            self.chunk_crcs = np.asarray([h.crc32] * h.chunk_count, dtype="<u4")
        self._verified: set[int] = set()
        self._per = h.tokens_per_chunk  # read once: check_tokens runs for every window
        self.all_verified = h.chunk_count == 0  # once True, readers can skip check_tokens

    def __len__(self) -> int:
        return self.header.token_count

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` without its end-of-text."""
        return np.asarray(self.tokens[int(self.doc_offsets[i]) : int(self.doc_offsets[i + 1]) - 1])

    def check_tokens(self, start: int, stop: int) -> None:
        """Verify the CRC of every chunk overlapping tokens [start, stop) not verified yet here."""
        per = self._per
        for chunk in range(start // per, (min(max(start, stop - 1), len(self) - 1)) // per + 1):
            if chunk not in self._verified:
                self._check_chunk(chunk, self._chunk_crc(chunk))

    def _chunk_crc(self, chunk: int) -> int:
        per = self.header.tokens_per_chunk
        return zlib.crc32(np.ascontiguousarray(self.tokens[chunk * per : (chunk + 1) * per]))

    def _check_chunk(self, chunk: int, crc: int) -> None:
        if crc != int(self.chunk_crcs[chunk]):
            per = self.header.tokens_per_chunk
            where = (
                f"token chunk {chunk} (tokens {chunk * per:,} to {min(len(self), (chunk + 1) * per):,})"
                if self.header.version >= 2 else "token data (version-1 shard, one CRC for all tokens)"
            )
            raise DataError(
                f"{self.path}: {where} fails its CRC check: the shard is corrupt; rebuild it with "
                f"tools/prepare_data.py (or set data.verify=full data.on_bad_shard=skip to leave it out at start-up)"
            )
        self._verified.add(chunk)
        self.all_verified = len(self._verified) == self.header.chunk_count

    def verify(self, block_tokens: int = 1 << 24) -> None:
        """Full check: every CRC, the true maximum id and a monotone document index."""
        h = self.header
        per = h.tokens_per_chunk if h.version >= 2 else block_tokens
        crc, max_id = 0, 0
        for start in range(0, len(self), per):
            block = np.ascontiguousarray(self.tokens[start : start + per])
            if h.version >= 2:
                self._check_chunk(start // per, zlib.crc32(block))
            crc = zlib.crc32(block, crc)
            max_id = max(max_id, int(block.max()))
        if crc != h.crc32:
            raise DataError(f"{self.path}: token data fails its CRC check (corrupt); rebuild the shard")
        self._verified.update(range(h.chunk_count))
        self.all_verified = True
        if max_id != h.max_token_id:
            raise DataError(f"{self.path}: max token id {max_id} disagrees with the header ({h.max_token_id})")
        offsets = np.asarray(self.doc_offsets)
        if h.version >= 2 and zlib.crc32(np.ascontiguousarray(offsets)) != h.index_crc:
            raise DataError(f"{self.path}: document index fails its CRC check (corrupt); rebuild the shard")
        if offsets[0] != 0 or offsets[-1] != len(self) or np.any(np.diff(offsets.astype(np.int64)) < 1):
            raise DataError(f"{self.path}: corrupt document index (offsets not increasing from 0 to the token count)")


def open_shards(paths: list[Path], vocab_size: int, verify: str, on_bad: str) -> tuple[list[TokenShard], list[str]]:
    """Open and check each shard; a bad one raises, or with on_bad='skip' is left out and reported."""
    shards, skipped = [], []
    for path in paths:
        try:
            shard = TokenShard(path)
            if verify == "full":
                shard.verify()
            if len(shard) and shard.header.max_token_id >= vocab_size:
                raise DataError(
                    f"{path}: token id {shard.header.max_token_id} is outside model.vocab_size={vocab_size}"
                )
        except DataError as e:
            if on_bad != "skip":
                raise
            skipped.append(str(e))
            continue
        shards.append(shard)
    return shards, skipped


class ShardWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a list of shards, numbered across them.

    Window ``i`` of a shard starts at token ``i * seq_len`` (so each token is predicted once per
    pass). Holds names and counts only, so it pickles cheaply to DataLoader workers; each process
    opens the shards it reads on first use, through ``locate`` (name -> local file; a remote
    source downloads there) when given. With ``check_chunks`` each CRC chunk is verified on this
    process's first read of it, before its tokens are used (``data.verify=lazy``).
    """

    def __init__(self, names: list[str], token_counts: list[int], seq_len: int, *, check_chunks: bool = True,
                 locate=None):
        self.names, self.seq_len, self.check_chunks, self.locate = list(names), seq_len, check_chunks, locate
        self.token_counts = [int(n) for n in token_counts]
        windows = [max(0, (n - 1) // seq_len) for n in self.token_counts]
        self.starts = np.concatenate([[0], np.cumsum(windows, dtype=np.int64)]).tolist()
        self.total = self.starts[-1]
        self._open: dict[int, TokenShard] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}

    def shard_of(self, window: int) -> int:
        return bisect.bisect_right(self.starts, window) - 1

    def tokens(self, window: int) -> np.ndarray:
        """The ``T + 1`` tokens of window ``window`` (the shard's dtype); the vocabulary is the caller's check."""
        T = self.seq_len
        shard = self.shard_of(window)
        source = self._open.get(shard)
        if source is None:
            name = self.names[shard]
            source = TokenShard(self.locate(name) if self.locate is not None else name)
            if len(source) != self.token_counts[shard]:
                raise DataError(f"{name}: holds {len(source):,} tokens, its dataset's meta.json records "
                                f"{self.token_counts[shard]:,}; prepare the dataset again")
            self._open[shard] = source
        start = (window - self.starts[shard]) * T
        if self.check_chunks and not source.all_verified:
            source.check_tokens(start, start + T + 1)
        return source.tokens[start : start + T + 1]


# ---------------------------------------------------------------------------- dataset directory


@dataclass(frozen=True)
class DatasetMeta:
    """What ``meta.json`` records about a prepared dataset directory (local, or at a URL)."""

    root: Path | str  # a Path for a local directory, the URL string for a remote one
    format: str  # "mmap" | "webdataset"
    tokenizer: str
    vocab_size: int
    eot_id: int
    splits: dict  # split name -> list of {"file": relative path, "tokens": int, ...}
    extra: dict  # format-specific fields (e.g. seq_len and samples for webdataset)

    def names(self, split: str) -> list[str]:
        """Shard names of a split relative to the root; entries must stay inside the dataset directory."""
        names = []
        for entry in self.splits.get(split, []):
            rel = PurePosixPath(str(entry["file"]))
            if rel.is_absolute() or ".." in rel.parts:
                raise DataError(
                    f"{self.root}/{META_FILE}: shard entry {str(rel)!r} must be a path inside the dataset directory"
                )
            names.append(rel.as_posix())
        return names

    def files(self, split: str) -> list[Path]:
        """Shard paths of a split (a local dataset)."""
        return [Path(self.root) / name for name in self.names(split)]

    def locations(self, split: str) -> list[str]:
        """Shard paths or URLs of a split, local or remote alike."""
        root = str(self.root)
        return [f"{root.rstrip('/')}/{name}" for name in self.names(split)]

    def tokens(self, split: str) -> int:
        return sum(int(entry.get("tokens", 0)) for entry in self.splits.get(split, []))

    @property
    def tokenizer_sha256(self) -> str | None:
        """The tokenizer's definition hash (data.tokenizer.identity); None in datasets from before it was recorded."""
        value = self.extra.get("tokenizer_sha256")
        return str(value) if value else None


def write_meta(root: str | os.PathLike, *, format: str, tokenizer: str, vocab_size: int, eot_id: int,
               splits: dict, **extra) -> Path:
    root = Path(root)
    body = {
        "format": format, "version": META_VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size,
        "eot_id": eot_id, "splits": splits, **extra,
    }
    tmp = root / f".{META_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / META_FILE)
    return root / META_FILE


def read_dataset_meta(root: str | os.PathLike) -> DatasetMeta:
    root = Path(root)
    file = root / META_FILE
    if not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist; create it with tools/prepare_data.py")
    if not file.is_file():
        raise DataError(f"{root} has no {META_FILE}: not a dataset directory written by tools/prepare_data.py")
    return parse_dataset_meta(file.read_text(), root, str(file))


def parse_dataset_meta(text: str, root: Path | str, where: str) -> DatasetMeta:
    """``meta.json``'s text, read from ``where`` (a file or a URL), for the dataset at ``root``."""
    try:
        body = json.loads(text)
        fmt = body["format"]
        known = {"format", "version", "tokenizer", "vocab_size", "eot_id", "splits"}
        meta = DatasetMeta(
            root=root, format=fmt, tokenizer=str(body["tokenizer"]), vocab_size=int(body["vocab_size"]),
            eot_id=int(body["eot_id"]), splits=dict(body["splits"]),
            extra={k: v for k, v in body.items() if k not in known},
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(
            f"{where} is corrupt or incomplete ({e.__class__.__name__}: {e}); re-run tools/prepare_data.py"
        ) from e
    if fmt not in DATASET_FORMATS:
        raise DataError(f"{where}: unknown dataset format {fmt!r}; valid: {', '.join(DATASET_FORMATS)}")
    if int(body.get("version", -1)) != META_VERSION:
        raise DataError(
            f"{where}: dataset version {body.get('version')}, this code reads {META_VERSION}; "
            f"re-run tools/prepare_data.py"
        )
    return meta
