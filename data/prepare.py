"""Turn text into token datasets: the logic behind ``tools/prepare_data.py``.

Inputs (in the order given; folders are walked in sorted order):
- a text file: one document, or one per paragraph / line with ``text_split``;
- a folder: every file matching ``glob`` (default ``**/*.txt``), each read as above, except that
  ``.jsonl`` and ``.parquet`` files are read as below;
- JSONL (``.jsonl``): one JSON object per line, the document in ``text_field``; a ``.json``
  file is read by its content: JSON lines (the first line is a whole object), or one list of
  records;
- Parquet (``.parquet``, via pyarrow): the ``text_field`` column, read a record batch at a time.

Invalid UTF-8 in text and JSONL input is never replaced silently: with ``on_invalid_utf8=replace``
(the default) each invalid byte sequence becomes U+FFFD, as ``bytes.decode(errors="replace")``
does, and the count and the first few places are reported (``Utf8Report``); with ``error`` the
first one stops preparation, naming the file and byte offset. Parquet strings are UTF-8 by type;
pyarrow rejects invalid ones (reported as corrupt Parquet data).

Documents are tokenized in worker processes (``imap`` keeps their order), each followed by the
tokenizer's end-of-text token (and, with ``bos``, preceded by its beginning-of-sequence token).
Document ``i`` goes to the validation split when the running count ``round(i * val_fraction)``
steps up, so about ``val_fraction`` of documents, evenly spread, are held out. Output is
deterministic: the same inputs and options give the same bytes, however many workers.

Nothing half-written, and resumable: the shards are written under ``<out>/.partial/`` and moved
into ``<out>`` (``meta.json`` last) only when everything succeeded. Each time a training shard is
complete, the validation shard being written is closed too and a journal records how far the
inputs were read; an interrupted preparation continues from there with ``resume`` (the same
inputs and options; the result is the bytes an uninterrupted run writes). A preparation that
fails on its input (a bad file, an empty split) removes ``.partial`` and leaves ``<out>`` as it
found it.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from common.errors import DataError
from common.log import get_logger
from data.shards import DEFAULT_CHUNK_TOKENS, META_FILE, TokenShardWriter, write_meta
from data.tokenizer import build_tokenizer, check_separators, identity, with_separators
from data.wds_format import TokenSampleWriter

TEXT_SPLITS = ("file", "paragraph", "line")
OUTPUTS = ("mmap", "webdataset")
UTF8_POLICIES = ("replace", "error")

log = get_logger("data")
PARTIAL = ".partial"  # the staging directory inside --out
JOURNAL = "progress.json"
JOURNAL_VERSION = 1


@dataclass
class PrepareOptions:
    inputs: list[str]
    out_dir: str
    output: str = "mmap"  # mmap | webdataset
    tokenizer: str = "byte"
    val_fraction: float = 0.05
    text_field: str = "text"
    text_split: str = "file"
    glob: str = "**/*.txt"
    workers: int = 1
    shard_tokens: int = 100_000_000  # mmap: tokens per shard file (documents are never split)
    seq_len: int = 1024  # webdataset: each sample holds seq_len + 1 tokens
    samples_per_shard: int = 10_000  # webdataset
    wds_encoding: str = "raw"  # raw | npy
    on_invalid_utf8: str = "replace"  # replace (with U+FFFD, counted and reported) | error
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # mmap: tokens per CRC chunk (lazy verification unit)
    overwrite: bool = False
    resume: bool = False  # continue an interrupted preparation of the same inputs and options
    bos: bool = False  # put the tokenizer's beginning-of-sequence token before each document
    progress: bool = True

    def validate(self) -> None:
        if not self.inputs:
            raise DataError("no inputs given: pass text files, folders, .jsonl or .parquet files")
        if self.output not in OUTPUTS:
            raise DataError(f"unknown output {self.output!r}; valid: {', '.join(OUTPUTS)}")
        if self.on_invalid_utf8 not in UTF8_POLICIES:
            raise DataError(
                f"unknown invalid-UTF-8 policy {self.on_invalid_utf8!r}; valid: {', '.join(UTF8_POLICIES)}"
            )
        if self.text_split not in TEXT_SPLITS:
            raise DataError(f"unknown text split {self.text_split!r}; valid: {', '.join(TEXT_SPLITS)}")
        if not 0.0 < self.val_fraction < 0.5:
            raise DataError(f"val fraction must be in (0, 0.5), got {self.val_fraction}")
        if not 1 <= self.chunk_tokens < 2**32:
            raise DataError(f"crc-chunk-tokens must be in [1, 2**32), got {self.chunk_tokens}")
        for key in ("workers", "shard_tokens", "seq_len", "samples_per_shard"):
            if getattr(self, key) < 1:
                raise DataError(f"{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")


@dataclass
class SplitSummary:
    documents: int = 0
    tokens: int = 0
    shards: int = 0
    samples: int = 0  # webdataset only
    dropped_tail_tokens: int = 0  # webdataset only


# ------------------------------------------------------------------------------------- reading


@dataclass
class Utf8Report:
    """Invalid UTF-8 replaced while reading: how many sequences, in how many places, the first few."""

    replacements: int = 0
    places: int = 0  # files (or JSONL lines) with at least one replacement
    examples: list[str] = field(default_factory=list)
    max_examples: int = 5

    def add(self, where: str, first_offset: int, count: int) -> None:
        self.replacements += count
        self.places += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{where} (byte {first_offset}, {count} replaced)")

    def summary(self) -> str:
        more = f" and {self.places - len(self.examples)} more" if self.places > len(self.examples) else ""
        return (
            f"replaced {self.replacements} invalid UTF-8 sequence(s) with U+FFFD in {self.places} file(s)/line(s): "
            f"{', '.join(self.examples)}{more}; pass --on-invalid-utf8 error to stop at the first one instead"
        )


def decode_utf8(raw: bytes) -> tuple[str, int, int]:
    """``raw`` decoded as ``raw.decode(errors="replace")`` would, plus the replacement count and the
    byte offset of the first invalid sequence (-1 when there is none)."""
    view = memoryview(raw)
    parts, count, first, pos = [], 0, -1, 0
    while True:
        try:
            parts.append(codecs.utf_8_decode(view[pos:], "strict", True)[0])
            break
        except UnicodeDecodeError as e:  # start and end are relative to view[pos:]
            parts.append(codecs.utf_8_decode(view[pos : pos + e.start], "strict", True)[0])
            parts.append("\ufffd")
            first = pos + e.start if first < 0 else first
            count += 1
            pos += e.end
    return "".join(parts), count, first


class Utf8Decoder:
    """Applies ``on_invalid_utf8`` to each raw text it decodes; replacements go into ``report``."""

    def __init__(self, policy: str = "replace", report: Utf8Report | None = None):
        self.policy = policy
        self.report = report if report is not None else Utf8Report()

    def decode(self, raw: bytes, where: str, base_offset: int = 0) -> str:
        text, count, first = decode_utf8(raw)
        if count and self.policy == "error":
            raise DataError(
                f"{where}: invalid UTF-8 at byte offset {base_offset + first}; fix the file, or pass "
                f"--on-invalid-utf8 replace to replace each invalid sequence with U+FFFD"
            )
        if count:
            self.report.add(where, base_offset + first, count)
        return text


def expand_inputs(inputs: list[str], glob: str) -> list[Path]:
    files = []
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.glob(glob) if p.is_file() and not p.name.startswith("."))
            if not found:
                raise DataError(f"folder {path} has no files matching {glob!r}; pass --glob")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {spec} does not exist")
    return files


def iter_documents(files: list[Path], text_field: str, text_split: str, decoder: Utf8Decoder | None = None,
                   start: tuple[int, int] = (0, 0)) -> Iterator[tuple[tuple[int, int], str]]:
    """``((file index, document index in the file), text)`` of every document from ``start`` on;
    files before ``start[0]`` are not read, and the first ``start[1]`` documents of that file are
    read but passed over (a resumed preparation)."""
    decoder = decoder if decoder is not None else Utf8Decoder()
    for f in range(start[0], len(files)):
        path = files[f]
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            docs = _jsonl_documents(path, text_field, decoder)
        elif suffix == ".json":
            docs = _json_documents(path, text_field, decoder)
        elif suffix == ".parquet":
            docs = _parquet_documents(path, text_field)
        else:
            docs = _text_documents(path, text_split, decoder)
        skip = start[1] if f == start[0] else 0
        for k, text in enumerate(docs):
            if k >= skip:
                yield (f, k), text


def _json_documents(path: Path, text_field: str, decoder: Utf8Decoder) -> Iterator[str]:
    """A ``.json`` file by its content: JSON lines when its first line is a whole JSON object (the
    naming of, e.g., the c4 files), else one JSON list of records."""
    try:
        with open(path, "rb") as f:
            first = next((line for line in f if line.strip()), b"")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from e
    try:
        is_lines = isinstance(json.loads(first), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        is_lines = False
    if is_lines:
        yield from _jsonl_documents(path, text_field, decoder)
        return
    try:
        records = json.loads(decoder.decode(path.read_bytes(), str(path)))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: neither JSON lines nor one JSON document (line {e.lineno}: {e.msg})") from e
    if not isinstance(records, list):
        raise DataError(f"{path}: a single JSON {type(records).__name__}; expected JSON lines (one object per line) "
                        f"or a list of records with the field {text_field!r}")
    for i, record in enumerate(records):
        text = _field_text(record, text_field, f"{path}: record {i}")
        if text:
            yield text


def _field_text(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no field {text_field!r} (found {fields}); set --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
    return text


def _text_documents(path: Path, text_split: str, decoder: Utf8Decoder) -> Iterator[str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from e
    # The same newline translation as reading in text mode: \r\n and \r become \n.
    text = decoder.decode(raw, str(path)).replace("\r\n", "\n").replace("\r", "\n")
    if text_split == "file":
        parts = [text]
    elif text_split == "line":
        parts = text.splitlines()
    else:
        parts = [p.strip("\n") for p in text.split("\n\n")]
    yield from (p for p in parts if p.strip())


def _jsonl_documents(path: Path, text_field: str, decoder: Utf8Decoder) -> Iterator[str]:
    with open(path, "rb") as f:  # bytes, so an invalid sequence can be placed at its file offset
        offset = 0
        for lineno, raw in enumerate(f, 1):
            line = decoder.decode(raw, f"{path}:{lineno}", offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            text = _field_text(record, text_field, f"{path}:{lineno}")
            if text:
                yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError for broken files
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path}: no column {text_field!r} (columns: {columns}); set --text-field")
    try:
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text if isinstance(text, str) else str(text)
    except Exception as e:
        raise DataError(f"{path}: corrupt Parquet data ({e})") from e


# ---------------------------------------------------------------------------------- tokenizing

_worker_tokenizer = None  # set once per pool worker by _init_worker (process-local, not shared state)


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    return [_worker_tokenizer.encode(t) for t in texts]


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def encoded_documents(docs: Iterator[tuple[tuple[int, int], str]], spec: str, workers: int):
    """``(position, ids)`` of the documents, in order, tokenized by ``workers`` processes."""
    if workers <= 1:
        tok = build_tokenizer(spec)
        for position, text in docs:
            yield position, tok.encode(text)
        return
    chunks = _chunks(docs, 64)
    positions: list[list] = []

    def texts():
        for chunk in chunks:
            positions.append([position for position, _ in chunk])
            yield [text for _, text in chunk]

    with multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        for encoded in pool.imap(_encode_chunk, texts(), chunksize=1):
            yield from zip(positions.pop(0), encoded)


def is_validation_index(i: int, val_fraction: float) -> bool:
    return round((i + 1) * val_fraction) > round(i * val_fraction)


# ----------------------------------------------------------------------------------- writing


class _MmapSplitWriter:
    def __init__(self, out: Path, split: str, vocab_size: int, eot_id: int, shard_tokens: int,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, state: dict | None = None):
        self.out, self.split, self.shard_tokens, self.chunk_tokens = out, split, shard_tokens, chunk_tokens
        self.vocab_size, self.eot_id = vocab_size, eot_id
        self.entries: list[dict] = list((state or {}).get("entries", []))
        self._writer: TokenShardWriter | None = None
        self._docs = 0
        self.shard_closed = False

    def add(self, ids: np.ndarray) -> None:
        if self._writer is None:
            name = f"{self.split}-{len(self.entries):06d}.bin"
            self._writer = TokenShardWriter(self.out / name, self.vocab_size, self.eot_id, self.chunk_tokens)
            self._docs = 0
        self._writer.add_document(ids)
        self._docs += 1
        if self._writer.token_count >= self.shard_tokens:
            self.flush()
            self.shard_closed = True

    def flush(self) -> None:
        """Close the shard being written (the next document starts a new one)."""
        if self._writer is not None:
            path = self._writer.close()
            self.entries.append({"file": path.name, "tokens": self._writer.token_count, "documents": self._docs})
            self._writer = None

    def state(self) -> dict:
        return {"entries": list(self.entries)}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    def close(self) -> list[dict]:
        self.flush()
        return self.entries


def _fingerprint(opts: PrepareOptions, files: list[Path], tokenizer: dict) -> str:
    """Everything the output's bytes depend on: a resumed preparation must match it."""
    inputs = []
    for path in files:
        stat = path.stat()
        inputs.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    options = {k: getattr(opts, k) for k in ("output", "val_fraction", "text_field", "text_split", "shard_tokens",
                                             "seq_len", "samples_per_shard", "wds_encoding", "on_invalid_utf8",
                                             "chunk_tokens", "bos")}
    body = json.dumps({"inputs": inputs, "options": options, "tokenizer": tokenizer["sha256"]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def _previous_output(out: Path) -> list[Path]:
    ours = [out / META_FILE, *out.glob("train-*.bin"), *out.glob("val-*.bin"),
            *out.glob("train/shard-*.tar"), *out.glob("val/shard-*.tar")]
    return [p for p in ours if p.exists()]


def _open_staging(out: Path, opts: PrepareOptions, fingerprint: str) -> dict | None:
    """Check ``out`` and return the journal of an interrupted preparation to continue (``resume``),
    or None to start afresh in an empty staging directory."""
    stage = out / PARTIAL
    existing = _previous_output(out)
    if existing and not opts.overwrite:
        raise DataError(
            f"{out} already holds a prepared dataset ({existing[0].name}, ...); pass --overwrite or another --out"
        )
    journal = None
    if stage.is_dir() and not opts.overwrite:
        if not opts.resume:
            raise DataError(f"{out} holds an interrupted preparation ({PARTIAL}/); pass --resume to continue it or "
                            f"--overwrite to start again")
        journal = _read_journal(stage / JOURNAL)
        if journal is not None and journal.get("fingerprint") != fingerprint:
            raise DataError(f"{out}: the interrupted preparation used other inputs or options (or an input file "
                            f"changed since); pass --overwrite to start again")
    if opts.overwrite:
        for p in existing:
            p.unlink()
    others = [p for p in out.iterdir() if p.name not in ("train", "val", PARTIAL)] if out.exists() else []
    if others and not existing:
        raise DataError(f"{out} is not empty ({others[0].name}, ...); choose an empty or new output directory")
    if journal is None:
        shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True, exist_ok=True)
    return journal


def _read_journal(path: Path) -> dict | None:
    if not path.is_file():
        return None  # interrupted before its first training shard was complete: nothing to keep
    try:
        journal = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return journal if journal.get("version") == JOURNAL_VERSION else None


def _write_journal(stage: Path, body: dict) -> None:
    tmp = stage / f".{JOURNAL}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(body, sort_keys=True))
    os.replace(tmp, stage / JOURNAL)


def _publish(stage: Path, out: Path, meta: dict) -> None:
    """Move the finished shards from the staging directory into ``out``, ``meta.json`` last."""
    for item in sorted(stage.iterdir()):
        if item.name == JOURNAL or item.name.startswith("."):
            continue
        target = out / item.name
        if item.is_dir():
            target.mkdir(exist_ok=True)
            for shard in sorted(item.iterdir()):
                os.replace(shard, target / shard.name)
        else:
            os.replace(item, target)
    write_meta(out, **meta)
    shutil.rmtree(stage, ignore_errors=True)


def prepare(opts: PrepareOptions, utf8_report: Utf8Report | None = None) -> dict[str, SplitSummary]:
    """Tokenize the inputs into ``opts.out_dir``; returns per-split counts.

    Replaced invalid UTF-8 is recorded in ``utf8_report`` for the caller to print; without one it
    is logged as a warning, so it is never silent.
    """
    opts.validate()
    tok = build_tokenizer(opts.tokenizer)  # fails fast (e.g. tiktoken needing a download)
    check_separators(tok, bos=opts.bos, where="--bos")
    files = expand_inputs(opts.inputs, opts.glob)
    out = Path(opts.out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(opts, files, identity(tok))
    journal = _open_staging(out, opts, fingerprint)
    stage = out / PARTIAL
    writers = _make_writers(opts, stage, tok.vocab_size, tok.eot_id, (journal or {}).get("writers", {}))
    try:
        summary, extra = _tokenize_into(opts, tok, files, stage, writers, journal, fingerprint, utf8_report)
    except DataError:
        # A problem with the input: nothing of this run stays, and --out is as it was.
        for writer in writers.values():
            getattr(writer, "abort", writer.flush)()
        shutil.rmtree(stage, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    _publish(stage, out, dict(format=opts.output, tokenizer=tok.name, vocab_size=tok.vocab_size, eot_id=tok.eot_id,
                              tokenizer_sha256=tok.sha256, bos_id=tok.bos_id, bos=opts.bos, **extra))
    return summary


def _tokenize_into(opts: PrepareOptions, tok, files: list[Path], stage: Path, writers: dict, journal: dict | None,
                   fingerprint: str, utf8_report: Utf8Report | None) -> tuple[dict[str, SplitSummary], dict]:
    journal = journal or {}
    summary = {k: SplitSummary(**v) for k, v in journal.get("summary", {}).items()} or {
        "train": SplitSummary(), "val": SplitSummary()}
    report = utf8_report if utf8_report is not None else Utf8Report()
    for key, value in journal.get("utf8", {}).items():
        setattr(report, key, value)
    decoder = Utf8Decoder(opts.on_invalid_utf8, report)
    start, i = tuple(journal.get("next", (0, 0))), int(journal.get("documents", 0))
    encoded = encoded_documents(iter_documents(files, opts.text_field, opts.text_split, decoder, start),
                                opts.tokenizer, opts.workers)
    bar = _progress(opts.progress, initial=i, files=len(files))
    if i:
        log.info("prepare_data: resuming after %d documents (file %d of %d)", i, start[0] + 1, len(files))
    for (f, k), ids in encoded:
        if opts.bos:
            ids = with_separators(tok, ids, bos=True, eos=False)
        split = "val" if is_validation_index(i, opts.val_fraction) else "train"
        if opts.output == "webdataset":
            writers[split].add_document(ids, tok.eot_id)
        else:
            writers[split].add(ids)
        summary[split].documents += 1
        summary[split].tokens += len(ids) + 1
        i += 1
        bar.update(1)
        if bar.n % 256 == 0:
            bar.set_postfix_str(f"file {f + 1}/{len(files)}", refresh=False)
        if writers["train"].shard_closed:  # a point to resume from: every shard written so far is closed
            writers["train"].shard_closed = False
            for writer in writers.values():  # (a long document may have started the next shard already)
                writer.flush()
            _write_journal(stage, {"version": JOURNAL_VERSION, "fingerprint": fingerprint, "next": [f, k + 1],
                                   "documents": i, "summary": {s: vars(v) for s, v in summary.items()},
                                   "writers": {s: w.state() for s, w in writers.items()},
                                   "utf8": {"replacements": report.replacements, "places": report.places,
                                            "examples": report.examples}})
    bar.close()
    if summary["train"].documents == 0:
        raise DataError(f"no documents found in {', '.join(opts.inputs)} (all empty?)")
    splits, extra = _close_writers(opts, writers, summary)
    unit = f"samples of {opts.seq_len + 1} tokens" if opts.output == "webdataset" else "tokens"
    for split in ("train", "val"):
        if not splits[split]:
            raise DataError(
                f"the {split} split has no {unit} ({summary[split].documents} document(s), {summary[split].tokens} "
                f"tokens); add data, change --val-fraction, split text into more documents with --text-split "
                f"paragraph|line" + (", or lower --seq-len" if opts.output == "webdataset" else "")
            )
    if utf8_report is None and report.replacements:
        log.warning("prepare_data: %s", report.summary())
    return summary, {"splits": splits, **extra}


def _make_writers(opts: PrepareOptions, out: Path, vocab_size: int, eot_id: int, states: dict) -> dict:
    if opts.output == "mmap":
        return {s: _MmapSplitWriter(out, s, vocab_size, eot_id, opts.shard_tokens, opts.chunk_tokens, states.get(s))
                for s in ("train", "val")}
    return {
        s: TokenSampleWriter(out / s, seq_len=opts.seq_len, vocab_size=vocab_size,
                             samples_per_shard=opts.samples_per_shard, encoding=opts.wds_encoding, state=states.get(s))
        for s in ("train", "val")
    }


def _close_writers(opts: PrepareOptions, writers: dict, summary: dict) -> tuple[dict, dict]:
    splits = {}
    for split, writer in writers.items():
        if opts.output == "mmap":
            splits[split] = writer.close()
        else:
            splits[split], summary[split].dropped_tail_tokens = writer.close()
            summary[split].samples = sum(e["samples"] for e in splits[split])
        summary[split].shards = len(splits[split])
    extra = {"seq_len": opts.seq_len, "encoding": opts.wds_encoding} if opts.output == "webdataset" else {}
    return splits, extra


def _progress(enabled: bool, initial: int = 0, files: int = 0):
    return tqdm(unit="doc", desc="tokenizing", disable=not enabled, mininterval=0.5, initial=initial,
                postfix=f"file 1/{files}" if files else None)
