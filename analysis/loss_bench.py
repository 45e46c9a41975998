"""The LM loss with and without the whole logits: peak memory and time of the head + cross-entropy.

The plain loss computes the (tokens x vocab) logits at once, keeps them (and cross-entropy's fp32
copy) for backward, then builds their gradient; ``kernels.loss_chunk_tokens`` computes the head and
loss a chunk of tokens at a time and recomputes each chunk's logits in backward
(``kernels.reference.chunked_linear_cross_entropy``). Measured here on the final hidden states
(tokens x d_model) and the head weight alone, forward and backward, so the difference is the
logits' and nothing else: the allocator's peak above what was allocated before (CUDA: its peak
counter; CPU: the profiler's memory records, ``host_peak_bytes``) and the time per call, in
interleaved rounds with ratios per round (median, min, max).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common.measure import RatioSummary, Summary, host_peak_bytes, interleaved, peak_bytes, ratio_summary, summarize
from kernels.reference import chunked_linear_cross_entropy, cross_entropy


@dataclass(frozen=True)
class LossVariant:
    name: str
    peak_bytes: list[int]
    seconds: Summary
    peak_vs_plain: RatioSummary
    time_vs_plain: RatioSummary


def loss_step(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> Callable[[], None]:
    """Forward and backward of the loss on ``h``; 0 chunk tokens: the plain loss on the whole logits."""

    def step() -> None:
        h.grad = weight.grad = None
        if chunk_tokens:
            loss = chunked_linear_cross_entropy(h, weight, targets, chunk_tokens=chunk_tokens,
                                                cross_entropy=cross_entropy)
        else:
            loss = cross_entropy(h @ weight.t(), targets)
        loss.backward()

    return step


def run_loss_benchmark(*, tokens: int, d_model: int, vocab: int, chunks: list[int], rounds: int,
                       device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[LossVariant]:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, d_model, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=g) * 0.02).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    steps = {("plain" if c == 0 else f"chunks of {c}"): loss_step(h, weight, targets, c) for c in [0, *chunks]}

    def measure_peak(step: Callable[[], None]) -> int:
        step()  # the gradients from a previous call are let go inside the step: not counted
        h.grad = weight.grad = None
        return peak_bytes(step, device) if device.type == "cuda" else host_peak_bytes(step)

    peaks: dict[str, list[int]] = {name: [] for name in steps}
    for _ in range(rounds):  # interleaved: each round measures every variant once
        for name, step in steps.items():
            peaks[name].append(measure_peak(step))
    times = interleaved(steps, rounds, warmup=1, device=device, progress="loss variants")
    return [LossVariant(name, peaks[name], summarize(times[name]), ratio_summary(peaks[name], peaks["plain"]),
                        ratio_summary(times[name], times["plain"])) for name in steps]


def table_rows(variants: list[LossVariant]) -> list[list[str]]:
    mib = 2**20
    return [[v.name, f"{sorted(v.peak_bytes)[len(v.peak_bytes) // 2] / mib:.1f} "
             f"({min(v.peak_bytes) / mib:.1f}-{max(v.peak_bytes) / mib:.1f})", v.peak_vs_plain.text(),
             f"{v.seconds.median * 1e3:.1f} ({v.seconds.min * 1e3:.1f}-{v.seconds.max * 1e3:.1f})",
             v.time_vs_plain.text()] for v in variants]


TABLE_HEADERS = ["loss", "peak MiB median (min-max)", "peak vs plain", "ms fwd+bwd median (min-max)", "time vs plain"]
