"""Expert parallelism: an MoE layer's routed experts split over the ep ranks, tokens sent to them.

Applied in place to a built GPT over the ``ep`` mesh dimension (``apply_expert_parallel``); the model
code has one seam for it (``MoE.run_experts``). The ep group is carved out of the data-parallel shard
ranks, as in torchtitan and Megatron-core: ep ranks read different batches, and each holds
E / ep of the E experts (a contiguous block: rank r holds experts r*E/ep .. (r+1)*E/ep - 1).

With context parallelism the ep group is carved out of dp_shard x cp, as torchtitan does: routing is
per token, so the cp ranks, which hold different chunks of the same sequences, are just more sources
of tokens for the all-to-all, and ep can grow to dp_shard x cp (a long-context run with few
data-parallel ranks still spreads its experts). An ep group spans whole cp groups, so ep must be a
multiple of cp: ep = ep_shard x cp, ep_shard of the dp_shard ranks (``Layout.ep_shard``, parallel/layout.py). The
other choice, ep out of dp_shard alone, would cap ep at dp_shard, which long-context runs keep small.
Per layer:

    route, permute  on this rank's tokens, as in one process (model/moe.py): rows sorted by expert
    counts          all_to_all of the per-expert row counts (E,): each rank learns how many rows every
                    rank sends to each of its local experts
    dispatch        all_to_all of the rows with variable splits (rows for rank r's experts go to r);
                    what arrives is grouped by source rank, then expert: re-sorted by expert
    experts         this rank's E / ep experts over every rank's rows for them (one grouped GEMM)
    combine         the reverse all_to_all: each row returns to the rank that routed it, to be
                    un-permuted and weighted there

Both all_to_alls are autograd-aware (backward runs the reverse exchange), so the gradients of the
tokens are those of one process. Gradients of the weights need one correction. A dense weight's
gradient on each rank comes from its own tokens, and FSDP2 averages it over the R data-parallel
ranks: the mean over every token of the global batch. An expert weight's gradient on its rank comes
from the tokens of all ep ranks (they were sent to it), so it is already a sum over ep ranks' losses;
FSDP2 then averages it over the R / ep ranks holding the same expert (``ParallelDims.expert_fsdp_dims``).
Scaling it by 1 / ep in backward makes that (1 / ep) * (ep / R) * sum over all R ranks = the same mean.
With cp, R counts the cp ranks too (dp_shard x cp: FSDP2 averages the dense gradients over them) and
each rank's loss is already rescaled by parallel/cp.py so that the mean over its cp group is the
whole sequences' loss; the ep group holds cp ranks, the expert FSDP2 group none, so the same 1 / ep
gives the one-process gradient.

Expert weights become DTensors sharded on dim 0 over the ep mesh, with their global shape, so DCP
checkpoints of any ep size load into any other (and into one process). FSDP2 shards them further
over the expert-data-parallel ranks; with none left they stay whole on their ep rank. With
``parallel.init_on_meta`` the same steps run on meta tensors (slicing one allocates nothing), and
parallel/fsdp.py's ``materialize`` then allocates and draws each rank's expert shard, with the
global-shape init's std, as it does the dense weights' shards.

Composition: pipeline stages apply it to their own layers (each stage's MoE layers exchange tokens
within the stage's ep group); context parallelism as above. Under tensor parallelism the MoE layer is
replicated over the tp ranks (parallel/tp.py, applied before this), or with ``parallel.etp`` = tp its
experts are split over them; either way the ep group of each tp rank is the ep ranks at its tp
coordinate, so every tp rank runs its own all_to_alls. Split experts become DTensors on the (ep, tp)
mesh; the tp ranks then route and send the same (whole micro-batch's) rows, each gets back its slice's
partial outputs, and those are summed over tp after the combine (``tensor_group``). With sequence parallelism each tp rank routes its own slice of the sequence, so
the expert gradients here are one slice's share: ``sequence_group`` sums them over the tp ranks
before the 1 / ep scale. Without it the tp ranks exchange the same tokens and compute the same
gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from common.values import local_shard
from model.moe import MoE, expert_mlp, moe_layers

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")  # stacked on the expert dimension


class _ScaleGradient(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``scale`` in backward, and sums it over
    ``group`` first when there is one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.scale, ctx.group = scale, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.group is not None:
            grad = grad.contiguous()  # all_reduce works in place on a dense tensor
            dist.all_reduce(grad, group=ctx.group)
        return grad * ctx.scale, None, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x``, held alike by the ranks of ``group``, entering a computation each of them does in part
    (expert tensor parallelism): identity in forward; in backward each rank's gradient is its part's,
    so they are summed over ``group`` (Megatron's "f")."""
    return _ScaleGradient.apply(x, 1.0, group)


class _SumOverGroup(torch.autograd.Function):
    """The sum of ``x`` over ``group`` (each rank's partial result); backward passes the gradient, which
    every rank holds alike, through (Megatron's "g")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _SumOverGroup.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of ``x`` in blocks of ``send[r]`` go to rank r; ``recv[r]`` rows arrive from rank r, in rank order."""
    return _AllToAll.apply(x, recv, send, group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(E,) rows this rank sends to each expert -> (ep, E / ep): rows each rank sends to each local expert."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)  # rank r gets every rank's block r
    return received.view(ep, -1)


def by_expert_order(received: torch.Tensor) -> torch.Tensor:
    """The order that sorts rows grouped (source rank, local expert) into (local expert, source rank).

    ``received`` (ep, E_local): rows from each rank for each local expert, in the order they arrive.
    """
    flat = received.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(received)  # where each (rank, expert) block begins
    lengths = received.t().flatten()  # blocks in (expert, rank) order
    block_starts = starts.t().flatten()
    new_starts = torch.cumsum(lengths, 0) - lengths
    offsets = torch.repeat_interleave(block_starts - new_starts, lengths)
    return torch.arange(int(lengths.sum()), device=received.device) + offsets


def dispatch_and_combine(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, experts) -> torch.Tensor:
    """Rows sorted by global expert (A, C), ``counts`` (E,) -> the experts' outputs for them (A, C),
    computed on the ranks holding those experts. ``experts(rows, local_counts)`` runs the local ones."""
    ep = dist.get_world_size(group)
    received = exchange_counts(counts, group)  # (ep, E_local)
    send = counts.view(ep, -1).sum(1).tolist()  # rows to each rank; host values all_to_all needs
    recv = received.sum(1).tolist()
    arrived = all_to_all(rows, recv, send, group)
    order = by_expert_order(received)
    out = experts(arrived[order], received.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    out = out[back]  # grouped by source rank again
    return all_to_all(out, send, recv, group)


class ExpertParallelMoE(MoE):
    """An MoE layer holding E / ep experts and exchanging token rows with the other ep ranks.

    Installed by swapping the class of a built layer (as parallel/cp.py does for the GPT), so
    parameter names stay those of one process.
    """

    ep_group: dist.ProcessGroup
    ep: int
    # The tp ranks that route other slices of the same sequences (sequence parallelism, set by
    # parallel/tp.py): the expert gradients are summed over them. None: they route the same tokens.
    sequence_group: dist.ProcessGroup | None = None
    # Expert tensor parallelism (parallel.etp = tp, set by parallel/tp.py): the tp ranks, which route
    # the same tokens and each hold a column/row slice of every local expert; their partial outputs
    # are summed over it. None: experts whole on each tp rank.
    tensor_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A copy, not the view MoE returns: FSDP2 hooks a unit's output for backward, and warns
        # (once per process) that an in-place op on a view would bypass that hook.
        return super().forward(x).clone()

    # Eager inside a torch.compile'd block, as torchtitan keeps its token dispatch outside the
    # compiled regions: the all_to_alls take their row counts from the host, and a graph traced
    # through them broke at each and was recompiled whenever the counts changed (every step).
    @torch.compiler.disable
    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_up, w_down, w_gate, *biases = (self._local(w, rows.dtype) for w in
                                         (self.w_up, self.w_down, self.w_gate, self.b_gate, self.b_up, self.b_down))

        def local_experts(x: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            return expert_mlp(x, local_counts, w_up, w_down, w_gate, self.ops, self.gelu_approximate, self.backend,
                              tuple(biases), self.clamp)

        if self.tensor_group is None:
            return dispatch_and_combine(rows, counts, self.ep_group, local_experts)
        # Each tp rank sends the same rows to the same ep rank (its peer at its tp coordinate), whose
        # experts give back this tp rank's part of their outputs: summed over the tp ranks after the combine.
        out = dispatch_and_combine(copy_to_group(rows, self.tensor_group), counts, self.ep_group, local_experts)
        return sum_over_group(out, self.tensor_group)

    def _local(self, w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's experts of ``w`` (E / ep, ...) in the compute dtype, with the 1 / ep gradient
        scale (module docstring) and the sum over ``sequence_group``. The cast matters where no FSDP2
        unit holds the experts (no ranks left after ep): nothing else turns their fp32 weights into a
        bf16 run's compute dtype."""
        if w is None:
            return None
        return _ScaleGradient.apply(local_shard(w).to(dtype), 1.0 / self.ep, self.sequence_group)

    def extra_repr(self) -> str:
        return f"ep={self.ep}, local experts={self.n_experts // self.ep} of {self.n_experts}"


def apply_expert_parallel(model: nn.Module, ep_mesh, ep_tp_mesh=None) -> None:
    """Shard every MoE layer's experts of ``model`` over ``ep_mesh`` (a no-op without one), in place.
    ``ep_tp_mesh``: the 2-D (ep, tp) mesh, where expert tensor parallelism has split the experts over tp."""
    if ep_mesh is None:
        return
    from torch.distributed.tensor import DTensor, Shard

    group, ep, rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moe_layers([model]):
        per_rank = moe.n_experts // ep
        for name in EXPERT_WEIGHTS:
            w = getattr(moe, name)
            if w is None:
                continue
            # Under tensor parallelism w is replicated over the tp ranks (each takes the same block of
            # experts), or split over them (etp = tp: each takes its slice of the same block, and the
            # weight lives on the (ep, tp) mesh, so checkpoints hold every expert whole).
            local = local_shard(w.detach())[rank * per_rank:(rank + 1) * per_rank].clone()
            split = getattr(w, "placements", (None,))[0]
            mesh, placements = (ep_tp_mesh, [Shard(0), split]) if isinstance(split, Shard) else (ep_mesh, [Shard(0)])
            sharded = DTensor.from_local(local, mesh, placements, run_check=False)
            setattr(moe, name, nn.Parameter(sharded, requires_grad=w.requires_grad))
        moe.ep_group, moe.ep = group, ep
        moe.__class__ = ExpertParallelMoE


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel weights under ``module``."""
    return [getattr(m, name) for m in module.modules() if isinstance(m, ExpertParallelMoE)
            for name in EXPERT_WEIGHTS if getattr(m, name) is not None]


def shard_experts(block: nn.Module, expert_mesh, *, mesh, **fsdp_kwargs) -> set[nn.Parameter]:
    """FSDP2 for a block's expert-parallel layers, before the block's own ``fully_shard`` (over
    ``mesh``, with ``fsdp_kwargs``).

    With an expert mesh, each such layer becomes its own FSDP2 unit over it, holding only the expert
    weights: its router and shared experts are dense, so they get units over the dense mesh first
    (a unit owns every parameter under it that no inner unit owns). Without one (no data-parallel
    ranks left after ep), the expert weights are returned for the block to leave alone.
    """
    from torch.distributed.fsdp import fully_shard

    layers = [m for m in block.modules() if isinstance(m, ExpertParallelMoE)]
    if expert_mesh is None:
        return set(expert_parameters(block))
    for moe in layers:
        for dense in (moe.router, moe.shared):
            if dense is not None:
                fully_shard(dense, mesh=mesh, **fsdp_kwargs)
        fully_shard(moe, mesh=expert_mesh, **fsdp_kwargs)
    return set()
