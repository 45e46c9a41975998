"""DataConfig: where tokens come from and how the loader feeds them.

One dataset is ``data.format`` + ``data.path``. A mixture is ``data.sources``, a list of typed
entries (``SourceConfig``), with an optional ``data.schedule`` (``ScheduleEntry``) that changes the
weights from a step on, at once or blended linearly over a window. Everything here is checked
when the config loads; what needs a look at the data (an unreachable URL, an empty source) is
checked by ``data.loader.build_data`` before the first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from common.errors import ConfigError
from common.fields import doc

SOURCE_FORMATS = ("mmap", "webdataset", "hf", "default")


@dataclass
class SourceConfig:
    """One source of a mixture: where its samples come from and how often it is drawn."""

    path: str = doc("", "local directory or file, or a URL (http(s)://, or any fsspec protocol whose package is "
                        "installed); mmap / webdataset: a directory written by tools/prepare_data.py; hf: a "
                        "Hugging Face dataset directory, data files or hub name; unused for format=default")
    format: Literal["mmap", "webdataset", "hf", "default"] = doc(
        "mmap", "mmap: token shards; webdataset: tar shards; hf: Hugging Face datasets, streamed, tokenized and "
        "packed on the fly; default: the built-in byte-level corpus")
    weight: float = doc(1.0, "relative share of samples drawn from this source (> 0; normalised over sources)")
    name: str = doc("", "name in logs, metrics and data.schedule; default: the last part of the path (or the format)")
    tokenizer: str = doc("byte", "hf: byte | tiktoken:<encoding> | hf:<tokenizer.json or its directory>")
    text_field: str = doc("text", "hf: the column holding each document's text")
    split: str = doc("train", "hf: the split trained on")
    val_split: str = doc("validation", "hf: the split validated on")
    val_documents: int = doc(0, "hf: hold out the first N documents of split for validation instead of val_split "
                                "(for data with one split, such as a single file)")
    bos: bool = doc(False, "hf: put the tokenizer's beginning-of-sequence token before each document")
    eos: bool = doc(True, "hf: put the end-of-text token after each document (the document separator)")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.format == "default" or not self.path:
            return self.format
        return PurePosixPath(self.path.rstrip("/")).name.split(".")[0] or self.format


@dataclass
class ScheduleEntry:
    """New mixture weights from a step on (annealing): at once, or blended linearly over a window."""

    from_step: int = doc(0, "the step at which the change starts")
    weights: dict[str, float] = doc({}, "source name -> weight (>= 0); sources not named keep their weight")
    blend_steps: int = doc(0, "0: switch at from_step; N: move linearly from the previous weights, reaching these at "
                              "from_step + N")


@dataclass
class DataConfig:
    format: Literal["default", "mmap", "webdataset"] = doc(
        "default",
        "default: byte-level corpus built (once, cached) from the Python standard library; "
        "mmap: token shards from tools/prepare_data.py; webdataset: tar shards",
    )
    path: str = doc("", "dataset directory (written by tools/prepare_data.py); unused for format=default")
    seq_len: int = doc(0, "tokens per training sequence; 0 means model.max_seq_len")
    cache_dir: str = doc("", "where the default corpus is cached; default: ~/.cache/perfgpt")
    val_fraction: float = doc(0.05, "share of the default corpus held out for validation")
    default_corpus_max_mb: float = doc(30.0, "cap on the default corpus size (MB of Python source)")
    sampling: Literal["random", "sequential"] = doc(
        "random", "mmap/default: windows in a seeded random order reshuffled each epoch, or in file order"
    )
    verify: Literal["header", "lazy", "full"] = doc(
        "lazy",
        "mmap shard checks: header: header and file size only; lazy: also each chunk's CRC on its first read "
        "in each process, before its tokens are used; full: every CRC and the maximum token id at start-up "
        "(reads all)",
    )
    on_bad_shard: Literal["error", "skip"] = doc(
        "error", "a corrupt or unreadable shard stops the run, or is skipped and counted in the log"
    )
    shuffle_shards: bool = doc(True, "webdataset: shuffle the shard order each epoch")
    shuffle_buffer: int = doc(1000, "webdataset: samples in the shuffle buffer (0 disables)")
    resampled: bool = doc(
        False, "webdataset: draw shards with replacement forever instead of one-pass epochs"
    )
    num_workers: int = doc(0, "DataLoader worker processes per rank")
    pin_memory: bool = doc(True, "pin host batches (only used on CUDA)")
    persistent_workers: bool = doc(True, "keep workers alive between epochs (needs num_workers > 0)")
    prefetch_factor: int = doc(2, "batches each worker loads ahead (needs num_workers > 0)")
    drop_last: bool = doc(True, "drop a final incomplete batch")
    timeout: float = doc(0.0, "seconds to wait for a batch from a worker before failing; 0 waits forever")
    sources: list[SourceConfig] = doc(
        [], "a weighted mixture instead of data.format/data.path: a list of {path, format, weight, name, ...}; "
        "see docs/data.md")
    schedule: list[ScheduleEntry] = doc(
        [], "mixture weight changes: a list of {from_step, weights: {name: weight}, blend_steps}")
    retries: int = doc(3, "remote sources: attempts after the first for a failed or dropped read")
    request_timeout: float = doc(30.0, "remote sources: seconds a connection or read may stall before a retry")

    def validate(self) -> None:
        if self.format != "default" and not self.path:
            raise ConfigError(f"data.format={self.format} needs data.path (run tools/prepare_data.py first)")
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.num_workers < 0 or self.prefetch_factor < 1:
            raise ConfigError("data.num_workers must be >= 0 and data.prefetch_factor >= 1")
        if self.seq_len < 0:
            raise ConfigError(f"data.seq_len must be >= 0 (0 means model.max_seq_len), got {self.seq_len}")
        if self.default_corpus_max_mb <= 0:
            raise ConfigError(f"data.default_corpus_max_mb must be > 0, got {self.default_corpus_max_mb}")
        if self.shuffle_buffer < 0:
            raise ConfigError(f"data.shuffle_buffer must be >= 0 (0 disables), got {self.shuffle_buffer}")
        if self.timeout < 0:
            raise ConfigError(f"data.timeout must be >= 0 (0 waits forever), got {self.timeout}")
        if self.retries < 0 or not self.request_timeout > 0:
            raise ConfigError(f"data.retries must be >= 0 and data.request_timeout > 0, got {self.retries} and "
                              f"{self.request_timeout}")
        if self.sources:
            self._validate_mixture()
        elif self.schedule:
            raise ConfigError("data.schedule changes the weights of data.sources, and there are none; list the "
                              "sources in data.sources")

    def _validate_mixture(self) -> None:
        if self.path or self.format != "default":
            raise ConfigError("data.sources replaces data.format and data.path: set one or the other (a single "
                              "dataset can be a one-entry data.sources)")
        names: dict[str, int] = {}
        for i, source in enumerate(self.sources):
            key = f"data.sources[{i}]"
            if not (math.isfinite(source.weight) and source.weight > 0):
                raise ConfigError(f"{key}.weight must be a positive number, got {source.weight}")
            if source.format != "default" and not source.path:
                raise ConfigError(f"{key} ({source.format}) needs a path")
            if source.val_documents < 0:
                raise ConfigError(f"{key}.val_documents must be >= 0, got {source.val_documents}")
            if source.label in names:
                raise ConfigError(f"{key} and data.sources[{names[source.label]}] are both named {source.label!r}; "
                                  f"give each a distinct name")
            names[source.label] = i
        previous_end = -1
        for i, entry in enumerate(self.schedule):
            key = f"data.schedule[{i}]"
            if entry.from_step < 0 or entry.blend_steps < 0:
                raise ConfigError(f"{key}: from_step and blend_steps must be >= 0, got {entry.from_step} and "
                                  f"{entry.blend_steps}")
            if entry.from_step < previous_end:
                raise ConfigError(f"{key}.from_step={entry.from_step} starts before the previous change ends (step "
                                  f"{previous_end}); list changes in step order without overlapping blends")
            previous_end = entry.from_step + entry.blend_steps
            unknown = sorted(set(entry.weights) - set(names))
            if unknown:
                raise ConfigError(f"{key}.weights names {unknown[0]!r}, not a source; sources: {', '.join(names)}")
            bad = {k: v for k, v in entry.weights.items() if not (math.isfinite(v) and v >= 0)}
            if bad:
                name, value = next(iter(bad.items()))
                raise ConfigError(f"{key}.weights.{name}={value} must be a number >= 0")
        for i, weights in enumerate(self.phase_weights()):
            if not sum(weights) > 0:
                raise ConfigError(f"data.schedule[{i}]: the weights after this change sum to 0; at least one source "
                                  f"needs a positive weight")

    def phase_weights(self) -> list[list[float]]:
        """The raw weights each schedule entry reaches (sources it does not name keep theirs)."""
        current = [s.weight for s in self.sources]
        phases = []
        for entry in self.schedule:
            current = [entry.weights.get(s.label, w) for s, w in zip(self.sources, current)]
            phases.append(current)
        return phases
