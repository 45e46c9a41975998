"""Hierarchical (two-level) all-reduce, its DDP comm hook, and byte accounting for hooks.

The two-level algorithm for nodes of L ranks (M bytes per rank, N nodes):
  1. reduce-scatter inside the node: each local rank ends with the node's sum of one 1/L shard;
  2. all-reduce of that shard across nodes, among the ranks with the same local index — so all
     L NICs of a node carry traffic at once, each 2(N-1)/N * M/L bytes;
  3. all-gather inside the node to rebuild the full sum on every rank.
A leader-only design (node all-reduce, leaders all-reduce, broadcast) instead pushes all M bytes
through one NIC per node. With one node the algorithm is just the local collective.

Hooks run their collectives on the thread DDP calls them from, in bucket order, so every rank
issues the same sequence. Chaining collectives in future callbacks is the other idiom, but on
gloo those callbacks run on gloo's threads and interleave with the next bucket differently on
each rank (seen as deadlocks with PyTorch's PowerSGD hook). On CUDA the collectives go to a
side stream, so backward kernels queued after the hook do not wait for them; the returned
future carries that stream's event and DDP waits on it before using the result.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from parallel.dims import NodeGroups

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

ReduceKind = Literal["avg", "sum"]


# --------------------------------------------------------------------------- byte accounting


def ring_all_reduce_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce (reduce-scatter + all-gather) of nbytes."""
    return 2 * (group_size - 1) * nbytes // group_size


def ring_reduce_scatter_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of an nbytes input."""
    return (group_size - 1) * nbytes // group_size


def ring_all_gather_bytes(nbytes_per_rank: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-gather where each rank contributes nbytes_per_rank."""
    return (group_size - 1) * nbytes_per_rank


@dataclass
class CommStats:
    """Bytes this rank sent during the current step, next to a flat dense all-reduce of the same
    gradients. Counts come from the sizes of the tensors handed to each collective, converted to
    per-rank wire bytes with the ring formulas above (what NCCL's ring algorithm sends)."""

    bytes_sent_this_step: int = 0
    bytes_uncompressed_this_step: int = 0
    collectives_this_step: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_sent(self, wire_bytes: int, collectives: int = 1) -> None:
        with self._lock:
            self.bytes_sent_this_step += int(wire_bytes)
            self.collectives_this_step += collectives

    def add_uncompressed(self, dense_nbytes: int, group_size: int) -> None:
        """The reference: a flat ring all-reduce of dense_nbytes over group_size ranks."""
        with self._lock:
            self.bytes_uncompressed_this_step += ring_all_reduce_bytes(dense_nbytes, group_size)

    def pop_step(self) -> dict[str, float]:
        """This step's numbers for the metrics log; resets the counters for the next step."""
        with self._lock:
            sent, dense = self.bytes_sent_this_step, self.bytes_uncompressed_this_step
            calls = self.collectives_this_step
            self.bytes_sent_this_step = self.bytes_uncompressed_this_step = self.collectives_this_step = 0
        return {
            "comm_bytes_sent": sent,
            "comm_bytes_uncompressed": dense,
            "comm_saving": dense / sent if sent else 0.0,
            "comm_collectives": calls,
        }


# --------------------------------------------------------------------------- collectives


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_gather_flat(output: torch.Tensor, local: torch.Tensor, group: ProcessGroup | None) -> None:
    """output = concatenation of every rank's `local` (equal sizes), in group-rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # *_single: torch >= 2.13
    fn(output, local, group=group)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None) -> None:
    """output = sum over ranks of this rank's 1/size slice of `full`."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, full, op=dist.ReduceOp.SUM, group=group)


def hierarchical_all_reduce(
    tensor: torch.Tensor, groups: NodeGroups, op: ReduceKind = "avg", stats: CommStats | None = None
) -> torch.Tensor:
    """All-reduce `tensor` in place over all ranks of `groups` in two levels; returns it.

    Any shape and size works (the flat view is zero-padded to a multiple of the local size).
    "avg" divides once by the world size, before summing, so fp16/bf16 sums do not overflow.
    """
    if op not in ("avg", "sum"):
        raise ValueError(f"hierarchical_all_reduce: op={op!r} is not valid; choose avg or sum")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"hierarchical_all_reduce: op=avg needs a floating tensor, got {tensor.dtype}; use op=sum")
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)  # reshape copies here
    if op == "avg":
        flat.div_(groups.dims.world_size)
    _two_level_sum(flat, groups, stats)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _two_level_sum(flat: torch.Tensor, groups: NodeGroups, stats: CommStats | None) -> None:
    if flat.numel() == 0:
        return
    local_size, nodes = group_size(groups.intra), group_size(groups.inter)
    if nodes == 1 or local_size == 1:  # one level only: a plain all-reduce over it
        level = groups.intra if nodes == 1 else groups.inter
        if max(local_size, nodes) > 1:
            dist.all_reduce(flat, group=level)
            _count(stats, ring_all_reduce_bytes(_nbytes(flat), max(local_size, nodes)))
        return
    chunk = math.ceil(flat.numel() / local_size)
    padded = flat
    if chunk * local_size != flat.numel():
        padded = flat.new_zeros(chunk * local_size)
        padded[: flat.numel()].copy_(flat)
    shard = flat.new_empty(chunk)
    reduce_scatter_flat(shard, padded, groups.intra)  # 1. node sum of my shard
    dist.all_reduce(shard, group=groups.inter)  # 2. across nodes, same local index
    all_gather_flat(padded, shard, groups.intra)  # 3. rebuild the full sum in the node
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])
    if stats is not None:
        shard_bytes = _nbytes(shard)
        stats.add_sent(
            ring_reduce_scatter_bytes(_nbytes(padded), local_size)
            + ring_all_reduce_bytes(shard_bytes, nodes)
            + ring_all_gather_bytes(shard_bytes, local_size),
            collectives=3,
        )


def _count(stats: CommStats | None, wire_bytes: int) -> None:
    if stats is not None:
        stats.add_sent(wire_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- DDP hook plumbing


@dataclass
class HookStream:
    """A side CUDA stream for a hook's collectives, created on first use; no-op on CPU."""

    stream: object | None = None

    @contextmanager
    def around(self, tensor: torch.Tensor) -> Iterator[None]:
        if tensor.device.type != "cuda":
            yield
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=tensor.device)
        # The bucket was filled by kernels on the current stream: start after them.
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            yield


def completed_future(tensor: torch.Tensor) -> torch.futures.Future:
    """A finished future holding `tensor`; on CUDA it records the current stream's work so that
    whoever waits on it (DDP) waits for the collectives queued there."""
    fut: torch.futures.Future = (
        torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()
    )
    fut.set_result(tensor)
    return fut


@dataclass
class HierarchicalHookState:
    groups: NodeGroups
    stats: CommStats | None = None
    stream: HookStream = field(default_factory=HookStream)


# `bucket` and the return type are left unannotated: DDP compares hook annotations with the real
# types, and with postponed evaluation ours would be strings.
def hierarchical_allreduce_hook(state: HierarchicalHookState | NodeGroups, bucket):
    """DDP comm hook: average the bucket over all ranks with the two-level algorithm.

    DDP does not divide gradients when a hook is registered; this hook divides exactly once.
    Pass a HierarchicalHookState (register_comm_hook does); a bare NodeGroups also works but
    then gets no byte counting and, on CUDA, a new side stream per call.
    """
    if isinstance(state, NodeGroups):
        state = HierarchicalHookState(state)
    buffer = bucket.buffer()
    with state.stream.around(buffer):
        if state.stats is not None:
            state.stats.add_uncompressed(_nbytes(buffer), state.groups.dims.world_size)
        hierarchical_all_reduce(buffer, state.groups, op="avg", stats=state.stats)
        return completed_future(buffer)
