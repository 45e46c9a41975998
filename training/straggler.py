"""The straggler report: which rank is slow, from one small all-gather per log interval.

In synchronous data parallelism a slow rank slows every rank: the others wait for it inside the
step's collectives, so wall-clock step times are the same everywhere and name no one. What
differs is the time each rank spends on its own work. The loop marks phases
(training/watchdog.py ``Phases``); a rank's *own time* is the time per step in the phases where,
under DDP, no rank waits for another: loading data, the forward, the optimizer step. (FSDP2's
forward all-gathers, tensor parallelism and pipeline hand-offs wait inside the forward, and
ZeRO's optimizer step all-gathers the updated partitions, so there a slow rank raises the
others' times too and shows less; so does DDP's second forward, which rebuilds the gradient
buckets with a collective.) Every log interval
the ranks all-gather these times, one float each; the slowest is compared with the median.
"""

from __future__ import annotations

import socket
import statistics

import torch
import torch.distributed as dist

from parallel.distributed import DistContext

OWN_PHASES = ("data", "forward", "optimizer")


def own_time_per_step(phase_seconds: dict[str, float], steps: int) -> float:
    return sum(phase_seconds.get(p, 0.0) for p in OWN_PHASES) / max(steps, 1)


def gather_floats(ctx: DistContext, value: float) -> list[float]:
    """Every rank's ``value``, in rank order (a collective; one float per rank)."""
    if ctx.backend is None:
        return [value]
    mine = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    out = torch.empty(ctx.world_size, dtype=torch.float64, device=ctx.device)
    dist.all_gather_into_tensor(out, mine)
    return out.tolist()


def gather_hosts(ctx: DistContext) -> list[str]:
    """Every rank's host name, in rank order (a collective; once per run)."""
    host = socket.gethostname()
    if ctx.backend is None:
        return [host]
    hosts: list[str] = [""] * ctx.world_size
    dist.all_gather_object(hosts, host)
    return hosts


def find_straggler(times: list[float], threshold: float) -> tuple[int, float] | None:
    """(rank, fraction slower than the median) of the slowest rank, if that fraction exceeds
    ``threshold``; None otherwise (or with fewer than two ranks, or no measurable time)."""
    if len(times) < 2:
        return None
    median = statistics.median(times)
    slowest = max(range(len(times)), key=times.__getitem__)
    if median <= 0:
        return None
    slower = times[slowest] / median - 1
    return (slowest, slower) if slower > threshold else None


def describe_straggler(step: int, rank: int, slower: float, times: list[float], hosts: list[str],
                       threshold: float) -> str:
    return (f"step {step}: straggler rank {rank} on {hosts[rank]}: {slower:.0%} slower than the median rank "
            f"({times[rank] * 1e3:.1f} vs {statistics.median(times) * 1e3:.1f} ms per step of data, forward and "
            f"optimizer work; train.straggler_threshold={threshold:g})")
