"""How every benchmark in the project measures: the one home for timing, comparisons and tolerances.

- where and when: ``resolve_device`` (a tool's ``--device``), ``hardware_name``, ``provenance``;
- timing: ``synchronize`` (CUDA work is asynchronous, so a host clock read without it times the
  launch, not the work), ``time_call``, ``repeat`` (one function, warm-up then timed calls;
  CUDA events on request) and ``interleaved`` (A B A B rounds, so that drift on a shared machine
  hits every variant alike instead of whichever ran last); ``peak_bytes`` for the allocator's peak
  (``host_peak_bytes`` on the CPU);
- summaries: ``summarize`` (median, min, max) and ``ratio_summary`` / ``speedup``, ratios taken
  per round and summarized, whose min-max interval decides whether a difference was measured at
  all;
- the kernel tolerance rule: a kernel's error against an fp32 reference may be at most about
  twice eager PyTorch's error in the same low precision (``check_against_fp32``).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from common.errors import CapabilityError, ConfigError
from common.progress import Progress

NO_DIFFERENCE = "no difference measured"

# --------------------------------------------------------------------------- where and when


def resolve_device(name: str, option: str = "--device") -> torch.device:
    """The device a measurement tool runs on: ``auto`` (CUDA when visible), ``cpu``, ``cuda``, ``cuda:N``.

    ``option`` is the flag the name came from, so the one-line error names it.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{option} {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{option} {name!r}: only cpu and cuda devices are measured; use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CapabilityError(f"{option} {name}: no CUDA device is visible here; use {option} cpu")
    return device


def hardware_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture and the threads torch uses (what CPU timings depend on)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU {platform.machine()} ({threads} thread{'s' if threads > 1 else ''})"


def provenance(device: torch.device) -> dict:
    """Where and when a measurement was taken, written next to every result."""
    return {
        "hardware": hardware_name(device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
    }


def machine_load() -> str:
    """How busy the machine's cores were (1-minute load average): on a shared machine the other
    processes are what widen a timing's spread, so it is said next to the numbers."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device | None) -> None:
    """Wait for the device's queued work (a no-op on CPU, where work runs when it is called)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device | None) -> float:
    """Wall seconds of one ``fn()``, including the device work it queued."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _event_seconds(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def repeat(fn: Callable[[], object], device: torch.device | None, reps: int, warmup: int = 0,
           events: bool = False) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    ``events`` times CUDA work with CUDA events (the stream's own clock: no host overhead in the
    figure, which matters for kernels of a few microseconds); elsewhere the host clock is used.
    """
    if reps < 1:
        raise ConfigError(f"reps must be >= 1 (got {reps})")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if events and device is not None and device.type == "cuda":
        return [_event_seconds(fn) for _ in range(reps)]
    return [time_call(fn, device) for _ in range(reps)]


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                device: torch.device | None = None, before: Callable[[str], None] | None = None,
                progress: str | None = None) -> dict[str, list[float]]:
    """Seconds per call of each function, run in rounds A B C, A B C, ...: {name: [one per round]}.

    Every function first runs ``warmup`` untimed rounds (allocations, lazy state, compilation).
    ``before(name)`` runs untimed before each timed call (e.g. clearing gradients). ``progress``
    names the measurement in the calls' progress on stderr (common/progress.py), for the callers
    that can run for minutes.
    """
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1 (got {rounds})")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    with Progress((warmup + rounds) * len(fns), progress or "", "call", enabled=progress is not None) as calls:
        for _ in range(warmup):
            for fn in fns.values():
                fn()
                calls.update()
        for _ in range(rounds):
            for name, fn in fns.items():
                if before is not None:
                    before(name)
                samples[name].append(time_call(fn, device))
                calls.update()
    return samples


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """The CUDA allocator's peak during ``fn()`` above what was allocated when it started (what
    the call itself needs at its worst); None off CUDA, where torch keeps no such count."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def host_peak_bytes(fn: Callable[[], object]) -> int:
    """The CPU allocator's peak during ``fn()`` above what was allocated when it started, from the
    profiler's memory records: each op's own allocations at its start, every free where it happens
    (torch keeps no running peak for host memory; peak RSS never goes down, so it cannot say this)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = []
    for event in prof.events():
        if event.name == "[memory]":  # an allocation or free outside any recorded op (frees, mostly)
            changes.append((event.time_range.start, event.cpu_memory_usage))
        elif event.self_cpu_memory_usage:
            changes.append((event.time_range.start, event.self_cpu_memory_usage))
    live = peak = 0
    for _, change in sorted(changes, key=lambda c: c[0]):
        live += change
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class Summary:
    median: float
    min: float
    max: float
    n: int


def summarize(samples: Sequence[float]) -> Summary:
    if not samples:
        raise ValueError("no samples to summarize")
    return Summary(statistics.median(samples), min(samples), max(samples), len(samples))


@dataclass(frozen=True)
class RatioSummary:
    """Ratios of two variants taken round by round, so a slow spell of the machine cancels out."""

    median: float
    min: float
    max: float
    n: int

    @property
    def measured_difference(self) -> bool:
        """False when the rounds disagree on the direction: their min-max interval contains 1.0."""
        return not (self.min <= 1.0 <= self.max)

    def text(self, digits: int = 2) -> str:
        """'1.25x (1.20-1.31)', or with NO_DIFFERENCE appended when the interval crosses 1.0."""
        spread = f"{self.median:.{digits}f}x ({self.min:.{digits}f}-{self.max:.{digits}f})"
        return spread if self.measured_difference else f"{spread}: {NO_DIFFERENCE}"


def ratio_summary(numerator: Sequence[float], denominator: Sequence[float]) -> RatioSummary:
    """numerator[i] / denominator[i] for each round i, summarized (both sampled in the same rounds)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"need the same non-zero number of rounds, got {len(numerator)} and {len(denominator)}")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    s = summarize(ratios)
    return RatioSummary(s.median, s.min, s.max, s.n)


def speedup(variant_seconds: Sequence[float], baseline_seconds: Sequence[float]) -> RatioSummary:
    """How many times faster the variant ran than the baseline, per round (above 1: faster)."""
    return ratio_summary(baseline_seconds, variant_seconds)


# --------------------------------------------------------------------------- kernel tolerance

# Explicit mantissa bits: one unit in the last place at a value's magnitude is 2^(exponent - bits).
ULP_BITS = {torch.bfloat16: 7, torch.float16: 10}


def error_floor(dtype: torch.dtype, oracle: torch.Tensor, interpreted: bool) -> float:
    """The error allowed even where eager PyTorch happens to be exact: rounding of the result itself.

    fp32 gets a small relative floor (summation order differs). For 16-bit outputs it is half an
    ulp at the output's scale, a whole one when ``interpreted``: Triton's interpreter truncates
    fp32 -> bf16 casts where the compiled kernel rounds to nearest.
    """
    scale = oracle.abs().max().item() if oracle.numel() else 0.0
    if dtype == torch.float32:
        return 1e-5 * (1.0 + scale)
    ulp = 2.0 ** (math.floor(math.log2(max(scale, 1e-30))) - ULP_BITS[dtype])
    return ulp if interpreted else ulp / 2


def kernel_tolerance(eager_error: float, floor: float) -> float:
    """The rule: a kernel may be off the fp32 answer by twice what eager PyTorch is in the same
    precision, plus the rounding floor (flash-attention's test uses the same criterion)."""
    return 2 * eager_error + floor


def outputs_and_grads(fn: Callable, args: list, grad_positions: list[int],
                      dy: torch.Tensor) -> list[torch.Tensor]:
    """fn(*args) and the gradients of <out, dy> with respect to args[grad_positions], on fresh copies."""
    args = [
        a.detach().clone().requires_grad_(i in grad_positions) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]
    out = fn(*args)
    grads = torch.autograd.grad(out, [args[i] for i in grad_positions], dy)
    return [out.detach(), *grads]


@dataclass
class ToleranceCheck:
    """Per output (forward, then each gradient): the kernel's and eager's max error vs fp32, and the bound."""

    names: list[str]
    errors: list[float]
    eager_errors: list[float]
    tolerances: list[float]
    mismatches: list[str] = field(default_factory=list)  # outputs whose shape or dtype differs from eager's

    @property
    def ok(self) -> bool:
        return not self.mismatches and all(e <= t for e, t in zip(self.errors, self.tolerances))

    @property
    def worst_ratio(self) -> float:
        return max(e / t for e, t in zip(self.errors, self.tolerances))

    def failures(self) -> list[str]:
        """One line per output that broke the rule, saying by how much."""
        lines = list(self.mismatches)
        for name, err, eager, tol in zip(self.names, self.errors, self.eager_errors, self.tolerances):
            if not err <= tol:
                lines.append(f"{name}: kernel error {err:.3g} > {tol:.3g} (eager error {eager:.3g})")
        return lines


def check_against_fp32(kernel: Callable, reference: Callable, args: list, grad_positions: list[int],
                       interpreted: bool, seed: int = 0) -> ToleranceCheck:
    """The kernel's forward and gradients in the args' own dtypes, and eager ``reference``'s, both
    measured against ``reference`` run in fp32, with the same upstream gradient."""
    with torch.no_grad():
        probe = reference(*args)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    dy = torch.randn(probe.shape, generator=generator).to(device=probe.device, dtype=probe.dtype)
    oracle_args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ours = outputs_and_grads(kernel, args, grad_positions, dy)
    eager = outputs_and_grads(reference, args, grad_positions, dy)
    oracle = outputs_and_grads(reference, oracle_args, grad_positions, dy.float())
    check = ToleranceCheck(["output"] + [f"grad of arg {i}" for i in grad_positions], [], [], [])
    for name, o, e, r in zip(check.names, ours, eager, oracle):
        if o.shape != e.shape or o.dtype != e.dtype:
            check.mismatches.append(f"{name}: {tuple(o.shape)} {o.dtype} vs eager's {tuple(e.shape)} {e.dtype}")
        err = (o.float() - r.float()).abs().max().item() if o.shape == r.shape else math.inf
        eager_err = (e.float() - r.float()).abs().max().item()
        check.errors.append(err)
        check.eager_errors.append(eager_err)
        check.tolerances.append(kernel_tolerance(eager_err, error_floor(o.dtype, r, interpreted)))
    return check


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by at least one interval (operators on several threads or streams overlap)."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return covered
