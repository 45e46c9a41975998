"""A Hugging Face ``datasets`` source, streamed, tokenized and packed on the fly; the one place that
imports ``datasets``.

``path`` is what ``datasets`` opens: a directory written by ``save_to_disk``, a data file
(``.jsonl``/``.json``, ``.parquet``, ``.csv``, ``.txt``: its one split is ``train``), a directory
of data files (splits from their names: ``train.jsonl``, ``validation.jsonl``, ...) or, on a
machine with network, a hub name. Everything is read in streaming mode, so nothing is prepared
or converted first.

Packing: each document's ids (with the beginning-of-sequence id before it when ``bos`` and the
end-of-text id after it when ``eos``) are concatenated, and window ``k`` of an epoch spans
tokens ``[k·T, k·T + T + 1)`` of that stream, the same windows ``tools/prepare_data.py`` cuts;
the tail of an epoch shorter than a window is dropped. Epoch ``e`` reads the training split
through a shuffle buffer of ``data.shuffle_buffer`` documents seeded by ``(seed, source, e)``
(0: file order). Validation is the first windows of ``val_split`` in file order.

The source is read forward only (``sequential``): the mixture asks for its samples in increasing
order, and after each global micro-batch moves every rank's reader past the samples other ranks
took, so all ranks hold the same position. A position is ``(epoch, document, token offset)`` of
the next window's first token: a resumed reader skips that many documents of the epoch's
(deterministic) order without tokenizing them and starts inside the document at the offset.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
from collections import deque
from pathlib import PurePosixPath

import numpy as np

from common.errors import DataError
from data.config import SourceConfig
from data.remote import is_url, local_path
from data.sources import SOURCE_TAG
from data.tokenizer import build_tokenizer, check_separators, encode_documents, identity, with_separators

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
                 ".md": "text", ".arrow": "arrow"}
ENCODE_BATCH = 64  # documents tokenized per call


def import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("format: hf needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


@contextlib.contextmanager
def offline(datasets):
    """No hub look-ups while opening local files: datasets otherwise asks the network first, and where
    it is unreachable each open waits for time-outs (seconds)."""
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _builder(location: str, source: str) -> str:
    suffix = PurePosixPath(location.split("?", 1)[0]).suffix.lower()
    builder = FILE_BUILDERS.get(suffix)
    if builder is None:
        raise DataError(f"source {source}: {location} is not a data file datasets reads by suffix "
                        f"({', '.join(FILE_BUILDERS)}); give a directory of such files or a dataset name")
    return builder


def open_split(location: str, split: str, source: str):
    """The records of ``split`` as a streaming ``datasets.IterableDataset``; a bad path or split is one line.

    Data files (one file, or a glob such as ``docs/*.md``) are the split ``train``; plain text
    (``.txt``, ``.md``) is read a paragraph per document."""
    datasets = import_datasets()
    path = None if is_url(location) else local_path(location)
    files = path is not None and (path.is_file() or glob.has_magic(str(path))) or (
        is_url(location) and PurePosixPath(location).suffix.lower() in FILE_BUILDERS)
    try:
        if path is not None and path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(path))
            splits = loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        elif files:
            if path is not None and not path.is_file() and not glob.glob(str(path)):
                raise DataError(f"source {source}: no file matches {location}")
            builder = _builder(location, source)
            extra = {"sample_by": "paragraph"} if builder == "text" else {}
            with offline(datasets) if path is not None else contextlib.nullcontext():
                splits = {"train": datasets.load_dataset(builder, data_files={"train": str(location)}, split="train",
                                                         streaming=True, **extra)}
        elif path is not None and path.is_dir():
            with offline(datasets):
                splits = datasets.load_dataset(str(path), streaming=True)
        elif path is not None and (path.is_absolute() or location.startswith(".") or location.count("/") != 1):
            raise DataError(f"source {source}: {location} does not exist (a local path, or a hub name such as "
                            f"org/name)")
        else:  # a hub name: needs the network
            splits = datasets.load_dataset(location, streaming=True)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 -- datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"source {source}: datasets cannot open {location} ({type(e).__name__}: {first})") from None
    if split not in splits:
        raise DataError(f"source {source}: {location} has no split {split!r}; its splits: {', '.join(splits)} "
                        f"(set the source's split / val_split, or val_documents to hold out training documents)")
    part = splits[split]
    return part.to_iterable_dataset() if hasattr(part, "to_iterable_dataset") else part


def pack(documents, start: tuple[int, int], seq_len: int):
    """Windows of ``seq_len + 1`` tokens over ``(index, ids)`` documents, each with the position
    ``(document, offset)`` of the next window's first token; ``start`` is where the first window
    begins (document ``start[0]`` starts at ``start[1]``)."""
    T = seq_len
    held: deque = deque()  # [document index, ids, position of the first unused token]
    available = 0
    for index, ids in documents:
        at = start[1] if index == start[0] else 0
        if at >= len(ids):
            continue
        held.append([index, ids, at])
        available += len(ids) - at
        while available >= T + 1:
            window = np.empty(T + 1, dtype=np.int64)
            filled = 0
            for _, chunk, pos in held:
                take = min(len(chunk) - pos, T + 1 - filled)
                window[filled : filled + take] = chunk[pos : pos + take]
                filled += take
                if filled == T + 1:
                    break
            used = T  # the window's last token starts the next window
            while used:
                entry = held[0]
                take = min(len(entry[1]) - entry[2], used)
                entry[2] += take
                used -= take
                if entry[2] == len(entry[1]):
                    held.popleft()
            available -= T
            yield window, (held[0][0], held[0][2])


class HFSource:
    """A streaming Hugging Face dataset as a forward-only source of packed windows."""

    sequential = True
    samples_per_epoch = None  # unknown until an epoch has been read

    def __init__(self, cfg: SourceConfig, index: int, *, seq_len: int, seed: int, vocab_size: int,
                 shuffle_buffer: int, val_limit: int):
        self.cfg, self.name, self.index = cfg, cfg.label, index
        self.seq_len, self.seed, self.shuffle_buffer = seq_len, seed, shuffle_buffer
        self.location = cfg.path
        tok = build_tokenizer(cfg.tokenizer)
        if tok.vocab_size > vocab_size:
            raise DataError(f"source {self.name}: tokenizer {tok.name} has {tok.vocab_size} ids but "
                            f"model.vocab_size={vocab_size}; set model.vocab_size >= {tok.vocab_size}")
        check_separators(tok, bos=cfg.bos, where=f"source {self.name}")
        self.tokenizer = identity(tok)
        self._tok = tok
        self._splits: dict = {}
        # Before any training: both splits open and each holds at least one window.
        next(self._windows({"epoch": 0, "doc": 0, "offset": 0}))  # an empty split raises here
        self.val = list(itertools.islice(pack(self._documents(self.val_split_name, None, 0), (0, 0), seq_len),
                                         max(1, val_limit)))
        if not self.val:
            raise DataError(f"source {self.name}: the {self.val_split_name} split of {cfg.path} holds fewer than "
                            f"{seq_len + 1} tokens; it is empty for this seq_len")
        self.val = [window for window, _ in self.val]
        self.val_available = len(self.val)
        self.restore(0, {"epoch": 0, "doc": 0, "offset": 0})

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None, "_splits": {}, "_stream": None}

    @property
    def val_split_name(self) -> str:
        """What validation reads: val_split, or with val_documents the first documents of split (held out)."""
        return f"{self.cfg.split}[:{self.cfg.val_documents}]" if self.cfg.val_documents else self.cfg.val_split

    # ------------------------------------------------------------------ reading

    def _split(self, split: str):
        if split not in self._splits:
            self._splits[split] = open_split(self.location, split, self.name)
        return self._splits[split]

    def _documents(self, split: str, epoch: int | None, skip: int):
        """``(index, ids)`` of the split's documents from document ``skip`` on; ``epoch`` None: file order."""
        if self._tok is None:
            self._tok = build_tokenizer(self.cfg.tokenizer)
        held_out = self.cfg.val_documents
        if split == self.val_split_name and held_out:
            data = self._split(self.cfg.split).take(held_out)
        else:
            data = self._split(split)
            if split == self.cfg.split and held_out:
                data = data.skip(held_out)
        if epoch is not None and self.shuffle_buffer > 1:
            seed = int(np.random.default_rng([self.seed, SOURCE_TAG, self.index, epoch]).integers(2**32))
            data = data.shuffle(seed=seed, buffer_size=self.shuffle_buffer)
        if skip:
            data = data.skip(skip)
        field = self.cfg.text_field
        batch: list[tuple[int, str]] = []
        for index, record in enumerate(data, start=skip):
            if field not in record:
                raise DataError(f"source {self.name}: record {index} of {self.location} ({split}) has no field "
                                f"{field!r} (fields: {sorted(record)}); set the source's text_field")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"source {self.name}: field {field!r} of record {index} is {type(text).__name__}, "
                                f"expected a string")
            if text:
                batch.append((index, text))
            if len(batch) == ENCODE_BATCH:
                yield from self._encode(batch)
                batch = []
        yield from self._encode(batch)

    def _encode(self, batch: list[tuple[int, str]]):
        if not batch:
            return
        ids = encode_documents(self._tok, [text for _, text in batch])
        for (index, _), doc in zip(batch, ids):
            yield index, with_separators(self._tok, doc, bos=self.cfg.bos, eos=self.cfg.eos)

    def _windows(self, record: dict):
        """Training windows from ``record`` on, across epochs, each with the position after it."""
        epoch, doc, offset = int(record["epoch"]), int(record["doc"]), int(record["offset"])
        while True:
            produced = 0
            for window, (d, o) in pack(self._documents(self.cfg.split, epoch, doc), (doc, offset), self.seq_len):
                produced += 1
                yield window, {"epoch": epoch, "doc": d, "offset": o}
            if produced == 0 and doc == 0 and offset == 0:
                raise DataError(f"source {self.name}: the {self.cfg.split} split of {self.location} holds fewer "
                                f"than {self.seq_len + 1} tokens; it is empty for this seq_len")
            epoch, doc, offset = epoch + 1, 0, 0

    # ------------------------------------------------------------------ the source protocol

    def restore(self, n: int, record: dict) -> None:
        """Continue at sample ``n``, which starts at ``record`` (a ``position()``)."""
        self._n, self._position, self._stream = n, dict(record), None

    def position(self) -> dict:
        return dict(self._position)

    def skip_to(self, n: int) -> None:
        if n < self._n:
            raise DataError(f"source {self.name}: sample {n} was asked for after sample {self._n} (a streaming "
                            f"source reads forward only)")
        while self._n < n:
            self._next()

    def _next(self) -> np.ndarray:
        if self._stream is None:
            self._stream = self._windows(self._position)
        window, self._position = next(self._stream)
        self._n += 1
        return window

    def sample(self, n: int) -> np.ndarray:
        self.skip_to(n)
        return self._next()

    def val_windows(self):
        return iter(self.val)

    def describe(self) -> str:
        shuffle = f"shuffle buffer {self.shuffle_buffer}" if self.shuffle_buffer > 1 else "file order"
        seps = "+".join(k for k in ("bos", "eos") if getattr(self.cfg, k)) or "no separators"
        held = f" after {self.cfg.val_documents} held out" if self.cfg.val_documents else ""
        return (f"hf {self.location} (streamed, split {self.cfg.split}{held}, field {self.cfg.text_field!r}, "
                f"tokenizer {self.tokenizer['name']}, {seps}, {shuffle})")
