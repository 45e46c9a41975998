"""The straggler report: which rank is slow, from one small all-gather per log interval.

In synchronous data parallelism a slow rank slows every rank: the others wait for it inside the
step's collectives, so wall-clock step times are the same everywhere and name no one. What
differs is the time each rank spends on its own work. The loop marks phases
(training/watchdog.py ``Phases``); a rank's *own time* is the time per step in the phases where,
under DDP, no rank waits for another: loading data, the forward, the optimizer step. (FSDP2's
forward all-gathers, tensor parallelism and pipeline hand-offs wait inside the forward, and
ZeRO's optimizer step all-gathers the updated partitions, so there a slow rank raises the
others' times too and shows less; so does DDP's second forward, which rebuilds the gradient
buckets with a collective.) Every log interval the ranks all-gather these times, one float each.

Attribution. A rank is named only when its own time exceeds the median of the *other* ranks' by
more than ``train.straggler_threshold`` (a fraction) and by more than ``train.straggler_min_gap_s``
(seconds per step). Against the median of all ranks, two ranks would be compared with their own
midpoint, which halves the gap. The ratio alone named a rank for 2 ms of noise on a 5 ms step (9
of 29 healthy 2-rank runs warned); the gap alone would name noise on long steps. The gap also
keeps the waiting rank from being named: a rank that waits inside one of its own phases (the
bucket rebuild above) has its own time raised by the same wait as the slow rank's, so the two
differ by noise, which the gap does not let through; and a rank paused inside a phase where all
wait (the backward's all-reduce) raises no one's own time, so no one is named rather than the
wrong one.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import all_gather_flat
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
    all_gather_flat(out, mine, None)
    return out.tolist()


def gather_hosts(ctx: DistContext) -> list[str]:
    """Every rank's host name, in rank order (a collective; once per run)."""
    host = socket.gethostname()
    if ctx.backend is None:
        return [host]
    hosts: list[str] = [""] * ctx.world_size
    dist.all_gather_object(hosts, host)
    return hosts


@dataclass(frozen=True)
class Straggler:
    rank: int
    others_s: float  # the median of the other ranks' own time per step
    slower: float  # the fraction by which this rank's own time exceeds it
    gap_s: float  # and by how many seconds per step


def find_straggler(times: list[float], threshold: float, min_gap_s: float) -> Straggler | None:
    """The slowest rank, when its own time per step (``times``, one per rank) exceeds the median
    of the other ranks' by more than the fraction ``threshold`` and by more than ``min_gap_s``
    seconds; None otherwise, with fewer than two ranks, or with no measurable time."""
    if len(times) < 2:
        return None
    slowest = max(range(len(times)), key=times.__getitem__)
    others = statistics.median(t for rank, t in enumerate(times) if rank != slowest)
    if others <= 0:
        return None
    straggler = Straggler(slowest, others, times[slowest] / others - 1, times[slowest] - others)
    return straggler if straggler.slower > threshold and straggler.gap_s > min_gap_s else None


def describe_straggler(step: int, straggler: Straggler, times: list[float], hosts: list[str]) -> str:
    r = straggler.rank
    return (f"step {step}: straggler rank {r} on {hosts[r]}: {straggler.slower:.0%} slower than the median of the "
            f"other ranks ({times[r] * 1e3:.1f} vs {straggler.others_s * 1e3:.1f} ms per step of data, forward and "
            f"optimizer work; they waited for it)")
