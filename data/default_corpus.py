"""The built-in corpus: the Python standard library's own ``.py`` files as byte-level tokens.

It needs no download and exists on every machine that runs perfgpt, so ``configs/tiny.yaml``
trains out of the box. The corpus is built once into the mmap dataset format (``data/shards.py``)
under ``data.cache_dir`` (default ``$XDG_CACHE_HOME/perfgpt`` or ``~/.cache/perfgpt``), in a
directory named after a hash of everything that determines its bytes: the Python version, the
list of source files with their sizes, the size cap and the validation fraction. A different
interpreter or setting therefore gets its own directory rather than a stale one.

Build safety with several processes (e.g. two ranks from torchrun starting together): each
builder writes a private temporary directory and renames it into place. ``rename`` of a directory
onto an existing non-empty one fails, so the first finisher wins and later ones discard their
identical copy; a reader never sees a half-written corpus.

Documents are whole files in sorted path order (deterministic); tests and ``site-packages`` are
left out, as are files containing a NUL byte (NUL is the end-of-text token). A file goes to the
validation split when a hash of its relative path falls under ``val_fraction``, so the split is
stable and independent of the file order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import uuid
import zlib
from pathlib import Path

import numpy as np

from common.errors import DataError
from data.shards import META_FILE, TokenShardWriter, write_meta
from data.tokenizer import ByteTokenizer

CORPUS_VERSION = 2  # bump when the selection or layout changes, so old caches are not reused (2: chunk CRCs)
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "perfgpt"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path, max_bytes: int) -> list[tuple[str, int]]:
    """(relative posix path, size) of the stdlib's .py files in sorted order, up to max_bytes."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
    found.sort()
    selected, total = [], 0
    for rel, size in found:
        if total + size > max_bytes:
            break
        selected.append((rel, size))
        total += size
    return selected


def corpus_key(files: list[tuple[str, int]], max_mb: float, val_fraction: float) -> str:
    identity = {
        "corpus_version": CORPUS_VERSION,
        "python": list(sys.version_info[:3]),
        "implementation": sys.implementation.name,
        "max_mb": max_mb,
        "val_fraction": val_fraction,
        "files": files,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def is_validation_document(rel_path: str, val_fraction: float) -> bool:
    return zlib.crc32(rel_path.encode()) % 1_000_000 < val_fraction * 1_000_000


def ensure_default_corpus(cache_dir: str = "", max_mb: float = 30.0, val_fraction: float = 0.05) -> Path:
    """Return the corpus directory, building it first if this exact corpus is not cached yet."""
    root = stdlib_root()
    files = list_source_files(root, int(max_mb * 1e6))
    if not files:
        raise DataError(f"no Python source files found under {root} within data.default_corpus_max_mb={max_mb}")
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    target = cache / f"stdlib-{tag}-{corpus_key(files, max_mb, val_fraction)}"
    if (target / META_FILE).is_file():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create the corpus cache {cache}: {e.strerror}; set data.cache_dir to a writable directory"
        ) from e
    tmp = cache / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _build(root, files, val_fraction, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process published the same corpus first (rename onto a non-empty directory
        # fails); its bytes equal ours, so use it. Anything else is a real error.
        if not (target / META_FILE).is_file():
            raise


def _build(root: Path, files: list[tuple[str, int]], val_fraction: float, out: Path) -> None:
    out.mkdir(parents=True)
    tok = ByteTokenizer()
    docs = {"train": [], "val": []}
    for rel, _size in files:
        raw = (root / rel).read_bytes()
        if b"\0" in raw or not raw:
            continue
        split = "val" if is_validation_document(rel, val_fraction) else "train"
        docs[split].append(raw)
    if not docs["train"] or not docs["val"]:
        _move_one_document(docs)
    splits = {}
    for split, raws in docs.items():
        writer = TokenShardWriter(out / f"{split}-000000.bin", tok.vocab_size, tok.eot_id)
        for raw in raws:
            writer.add_document(np.frombuffer(raw, dtype=np.uint8))
        splits[split] = [{"file": f"{split}-000000.bin", "tokens": writer.token_count, "documents": len(raws)}]
        writer.close()
    write_meta(
        out, format="mmap", tokenizer=tok.name, vocab_size=tok.vocab_size, eot_id=tok.eot_id, splits=splits,
        source=f"python {sys.version.split()[0]} stdlib ({root})",
    )


def _move_one_document(docs: dict) -> None:
    """A tiny corpus may hash every file to one side: keep both splits non-empty."""
    total = len(docs["train"]) + len(docs["val"])
    if total < 2:
        raise DataError("the default corpus needs at least 2 source files; raise data.default_corpus_max_mb")
    if not docs["val"]:
        docs["val"].append(docs["train"].pop())
    else:
        docs["train"].append(docs["val"].pop())
