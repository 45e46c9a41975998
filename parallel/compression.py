"""Gradient compression as DDP comm hooks: top-k and 1-bit with error feedback, PowerSGD, bf16.

Every hook keeps DDP's overlap: one backward pass, the hook called per bucket as it fills.
Each hook averages exactly once (DDP leaves the division to the hook) and counts the bytes it
sends in a ``CommStats`` that the training loop reads with ``pop_step()``.

Error feedback: what a biased compressor leaves out of a step (the residual) is added to the
same parameters' gradient next step, so over many steps every coordinate is eventually sent:
sum(sent) + residual == sum(gradients). Residuals are kept per parameter, not per bucket,
because DDP rebuilds its buckets after the first step.

Where compression stops paying (n ranks, ring all-reduce as the dense reference, which sends
2(n-1)/n * 4 bytes per fp32 entry per rank):
- top-k exchanges (int64 index, fp32 value) pairs with an all-gather: (n-1) * 12 bytes per kept
  entry, so it only saves bytes below a density of 2/(3n) — 8x at n=8 for 1%, nothing at n=64.
  Summing a densified zero-filled tensor with all-reduce would send every byte.
- 1-bit all-gathers bit-packed signs plus one fp32 scale per tensor: (n-1) * numel/8 bytes, a
  saving of about 64/n — none from n=64 on.
``analysis/comm_model.py`` computes these break-evens; ``tools/comm_model.py`` prints them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from common.errors import ConfigError
from common.log import get_logger
from parallel.comm import (
    CommStats,
    HierarchicalHookState,
    HookStream,
    all_gather_flat,
    completed_future,
    hierarchical_allreduce_hook,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
)
from parallel.dims import NodeGroups

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from parallel.config import ParallelConfig

__all__ = ["CommStats", "ErrorFeedback", "OneBitCompressor", "TopKCompressor", "register_comm_hook"]

log = get_logger("parallel")

Segments = list[tuple[int, int]]  # (key of a parameter, its number of entries), in buffer order


# --------------------------------------------------------------------------- error feedback


@dataclass
class ErrorFeedback:
    """Residuals per parameter key; a bucket's residual is the concatenation of its parameters'."""

    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def corrected(self, flat: torch.Tensor, segments: Segments) -> torch.Tensor:
        """A new tensor: this step's gradient plus what earlier steps did not send."""
        acc = flat.clone()
        for (key, _), part in zip(segments, acc.split([n for _, n in segments])):
            residual = self.residuals.get(key)
            if residual is not None:
                part.add_(residual)
        return acc

    def keep(self, residual: torch.Tensor, segments: Segments) -> None:
        for (key, _), part in zip(segments, residual.split([n for _, n in segments])):
            self.residuals[key] = part

    def residual_of(self, segments: Segments) -> torch.Tensor | None:
        parts = [self.residuals.get(key) for key, _ in segments]
        return None if any(p is None for p in parts) else torch.cat(parts)


def bucket_segments(bucket: dist.GradBucket) -> Segments:
    segments = [(id(p), g.numel()) for p, g in zip(bucket.parameters(), bucket.gradients())]
    if sum(n for _, n in segments) != bucket.buffer().numel():  # DDP packs gradients without gaps
        raise RuntimeError("DDP bucket layout changed: gradients do not tile the bucket buffer")
    return segments


# --------------------------------------------------------------------------- top-k


@dataclass
class TopKCompressor:
    """Keep the k largest-magnitude entries of (gradient + residual); all-gather (index, value)."""

    ratio: float
    group: ProcessGroup | None = None
    stats: CommStats | None = None
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def all_reduce_mean(self, flat: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Replace the 1-D `flat` in place by the mean over ranks of what each rank sent."""
        world = dist.get_world_size(self.group)
        acc = self.feedback.corrected(flat, segments)
        k = self.k_for(acc.numel())
        indices = acc.abs().topk(k, sorted=False).indices  # int64, same k on every rank
        values = acc[indices]
        acc[indices] = 0  # acc is now the residual: everything not sent
        self.feedback.keep(acc, segments)

        all_indices = indices.new_empty(world * k)
        all_values = values.new_empty(world * k)
        all_gather_flat(all_indices, indices, self.group)
        all_gather_flat(all_values, values, self.group)
        flat.zero_().index_add_(0, all_indices, all_values).div_(world)  # overlaps add up
        if self.stats is not None:
            self.stats.add_sent(
                ring_all_gather_bytes(_nbytes(indices), world) + ring_all_gather_bytes(_nbytes(values), world), 2
            )
            self.stats.add_uncompressed(_nbytes(flat), world)
        return flat


# --------------------------------------------------------------------------- 1-bit


_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor (any shape) -> uint8 tensor of ceil(numel / 8) bytes, first entry in the MSB."""
    flat = bits.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (flat.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` bits as a bool tensor."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].bool()


@dataclass
class OneBitCompressor:
    """Send sign(gradient + residual) as bits and one fp32 scale (mean |.|) per parameter.

    Each rank decodes every rank's signs with that rank's own scales and averages, which is the
    mean of the compressed gradients. (All-reducing signs and multiplying by a local scale is
    not: it weights every rank's sign by this rank's magnitude.)
    """

    group: ProcessGroup | None = None
    stats: CommStats | None = None
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)

    def all_reduce_mean(self, flat: torch.Tensor, segments: Segments) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        sizes = [n for _, n in segments]
        acc = self.feedback.corrected(flat, segments)
        scales = torch.stack([part.abs().mean() if part.numel() else acc.new_zeros(()) for part in acc.split(sizes)])
        scales = scales.float()
        positive = acc >= 0  # a zero is sent as +scale; error feedback carries the difference
        packed = pack_bits(positive)
        self.feedback.keep(acc - self._decode(positive, scales, sizes, acc.dtype), segments)

        all_packed = packed.new_empty(world * packed.numel())
        all_scales = scales.new_empty(world * scales.numel())
        all_gather_flat(all_packed, packed, self.group)
        all_gather_flat(all_scales, scales, self.group)
        flat.zero_()
        for r_packed, r_scales in zip(all_packed.chunk(world), all_scales.chunk(world)):
            flat.add_(self._decode(unpack_bits(r_packed, flat.numel()), r_scales, sizes, flat.dtype))
        flat.div_(world)
        if self.stats is not None:
            self.stats.add_sent(
                ring_all_gather_bytes(_nbytes(packed), world) + ring_all_gather_bytes(_nbytes(scales), world), 2
            )
            self.stats.add_uncompressed(_nbytes(flat), world)
        return flat

    @staticmethod
    def _decode(positive: torch.Tensor, scales: torch.Tensor, sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
        per_entry = scales.repeat_interleave(torch.tensor(sizes, device=scales.device))
        return torch.where(positive, per_entry, -per_entry).to(dtype)


# --------------------------------------------------------------------------- DDP hooks


@dataclass
class CompressorHookState:
    compressor: TopKCompressor | OneBitCompressor
    stream: HookStream = field(default_factory=HookStream)


# Hooks leave `bucket` and the return type unannotated: DDP compares hook annotations with the
# real types, and with postponed evaluation ours would be strings.
def compressed_allreduce_hook(state: CompressorHookState, bucket):
    buffer = bucket.buffer()
    with state.stream.around(buffer):
        state.compressor.all_reduce_mean(buffer, bucket_segments(bucket))
        return completed_future(buffer)


@dataclass
class PowerSGDHookState:
    inner: object  # torch's PowerSGDState
    group: ProcessGroup | None
    stats: CommStats
    serialize_buckets: bool  # gloo: finish bucket i before starting bucket i+1 (see powersgd_hook)
    previous: torch.futures.Future | None = None


def powersgd_hook(state: PowerSGDHookState, bucket):
    """PyTorch's PowerSGD hook plus byte counting.

    PowerSGD issues its later all-reduces from future callbacks. On gloo those run on gloo's
    threads and race with the next bucket's first all-reduce, in a different order on each rank,
    which deadlocks; waiting for the previous bucket first keeps one order everywhere. With NCCL
    the callbacks run inline on this thread, so no wait is needed (and none is done).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook as torch_powersgd

    if state.serialize_buckets and state.previous is not None:
        state.previous.wait()
    inner = state.inner
    buffer = bucket.buffer()
    dense = inner.iter < inner.start_powerSGD_iter
    before = inner.total_numel_after_compression
    fut = torch_powersgd(inner, bucket)
    # PowerSGD all-reduces P and Q for the matrices it compresses and the rest uncompressed;
    # its own counter holds exactly that number of entries.
    sent = buffer.numel() if dense else inner.total_numel_after_compression - before
    world = dist.get_world_size(state.group)
    state.stats.add_sent(ring_all_reduce_bytes(sent * buffer.element_size(), world), 1 if dense else 3)
    state.stats.add_uncompressed(_nbytes(buffer), world)
    state.previous = fut
    return fut


@dataclass
class Bf16HookState:
    group: ProcessGroup | None
    stats: CommStats


def bf16_hook(state: Bf16HookState, bucket):
    """PyTorch's bf16 compression hook (cast, average, cast back) plus byte counting."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    state.stats.add_sent(ring_all_reduce_bytes(buffer.numel() * 2, world))
    state.stats.add_uncompressed(_nbytes(buffer), world)
    return bf16_compress_hook(state.group, bucket)


def register_comm_hook(
    ddp_model: torch.nn.Module, cfg: ParallelConfig, groups: NodeGroups | None = None
) -> CommStats | None:
    """Register the hook named by cfg.ddp_comm_hook on a DDP model; returns its byte counter.

    "none" keeps DDP's own all-reduce and returns None. "hierarchical" needs `groups` (from
    parallel.dims.build_node_groups). Call once, before the first backward.
    """
    kind = cfg.ddp_comm_hook
    if kind == "none":
        return None
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(f"parallel.ddp_comm_hook={kind} needs a DDP-wrapped model (parallel.strategy=ddp)")
    group = ddp_model.process_group
    stats = CommStats()
    if kind == "hierarchical":
        if groups is None:
            raise ConfigError("parallel.ddp_comm_hook=hierarchical needs the node groups (build_node_groups)")
        if groups.dims.world_size != dist.get_world_size(group):
            raise ConfigError(
                f"parallel.ddp_comm_hook=hierarchical: layout has {groups.dims.world_size} ranks but DDP's group "
                f"has {dist.get_world_size(group)}"
            )
        ddp_model.register_comm_hook(HierarchicalHookState(groups, stats), hierarchical_allreduce_hook)
    elif kind == "topk":
        ddp_model.register_comm_hook(
            CompressorHookState(TopKCompressor(cfg.topk_ratio, group, stats)), compressed_allreduce_hook
        )
    elif kind == "onebit":
        ddp_model.register_comm_hook(CompressorHookState(OneBitCompressor(group, stats)), compressed_allreduce_hook)
    elif kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        inner = PowerSGDState(
            process_group=group,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_iter,
        )
        serialize = dist.get_backend(group) != "nccl"
        ddp_model.register_comm_hook(PowerSGDHookState(inner, group, stats, serialize), powersgd_hook)
    elif kind == "bf16":
        ddp_model.register_comm_hook(Bf16HookState(group, stats), bf16_hook)
    else:  # the config's Literal keeps this unreachable from YAML
        raise ConfigError(f"parallel.ddp_comm_hook={kind!r} is not valid")
    log.info("DDP comm hook: %s", kind)
    return stats


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
