"""DataConfig: where tokens come from and how the loader feeds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.errors import ConfigError
from common.fields import doc


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
