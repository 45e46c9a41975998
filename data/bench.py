"""What ``tools/bench_data.py`` measures: loader throughput per format, and model consumption.

The naive baseline is the loader people write first: DataLoader workers read raw text files and
tokenize them on the fly, packing the ids into windows. The other formats read tokens that were
prepared once (``data/prepare.py``). All are timed the same way: batches pulled from a
``TrainStream`` after a warm-up batch (worker start-up is reported separately).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data.config import DataConfig
from data.loader import TrainStream
from data.tokenizer import build_tokenizer
from model.gpt import GPT


class NaiveTextBatches(IterableDataset):
    """Read text files and tokenize them while training (worker w takes every N-th file)."""

    def __init__(self, files: list[str], tokenizer: str, seq_len: int, batch_size: int):
        self.files, self.tokenizer, self.seq_len, self.batch_size = list(files), tokenizer, seq_len, batch_size
        self.batches_per_epoch = 0  # unknown without tokenizing everything
        self.position = 0

    # The resumable-stream protocol TrainStream expects; the baseline does not resume.
    def identity(self) -> dict:
        return {"kind": "naive"}

    def initial_state(self) -> dict:
        return {}

    def set_start(self, state: dict) -> None:
        pass

    def advance(self, state: dict, cursor) -> dict:
        return state

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        tok = build_tokenizer(self.tokenizer)
        mine = self.files[worker::workers]
        T, rows, carry = self.seq_len, [], np.zeros(0, dtype=np.int64)
        while True:
            for path in mine:
                text = Path(path).read_text(encoding="utf-8", errors="replace")
                ids = np.concatenate([carry, tok.encode(text).astype(np.int64), [tok.eot_id]])
                count = (ids.size - 1) // T
                for k in range(count):
                    rows.append(ids[k * T : k * T + T + 1])
                    if len(rows) == self.batch_size:
                        yield torch.from_numpy(np.stack(rows)), None
                        rows = []
                carry = ids[count * T :]


def naive_stream(files: list[str], tokenizer: str, seq_len: int, batch_size: int, cfg: DataConfig) -> TrainStream:
    return TrainStream(NaiveTextBatches(files, tokenizer, seq_len, batch_size), cfg, seed=0, rank=0)


@dataclass
class Throughput:
    samples_per_s: float
    tokens_per_s: float
    first_batch_s: float  # includes starting the workers


def measure_stream(stream, batches: int) -> Throughput:
    """Time ``batches`` batches after the first one; the stream is closed afterwards."""
    start = time.perf_counter()
    x, _ = next(stream)
    first = time.perf_counter() - start
    samples = tokens = 0
    start = time.perf_counter()
    for _ in range(batches):
        x, _ = next(stream)
        samples += x.shape[0]
        tokens += x.numel()
    seconds = time.perf_counter() - start
    close = getattr(stream, "close", None)
    if close is not None:
        close()
    return Throughput(samples / seconds, tokens / seconds, first)


def matmul_flops_per_s(size: int = 1024, repeats: int = 5) -> float:
    """Achieved fp32 matmul FLOP/s on this CPU: an upper bound on what training can use."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def measured_training_tokens_per_s(model_cfg, batch_size: int, seq_len: int, budget_s: float = 10.0) -> float:
    """Tokens/s of real forward + backward + AdamW steps of the GPT on this CPU (median step).

    Warm-up steps (allocations, AdamW state) are not timed; then at least 3 steps, more while
    they fit in ``budget_s`` (at most 20), so a small model gets a stable median.
    """
    torch.manual_seed(0)
    model = GPT(model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model_cfg.vocab_size, (batch_size, seq_len))

    def step() -> float:
        start = time.perf_counter()
        model(x, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    if step() < 1.0:
        step()
    times = [step() for _ in range(3)]
    while len(times) < 20 and sum(times) < budget_s:
        times.append(step())
    return batch_size * seq_len / statistics.median(times)
