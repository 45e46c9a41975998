"""Tensor parallelism with sequence parallelism (Megatron-LM; Korthikanti et al. 2022), on DTensor.

Applied in place to a built GPT (or a pipeline stage of one) over the ``tp`` mesh dimension,
with PyTorch's own parallel styles (``torch.distributed.tensor.parallel``); the model code has
no TP in it. Per block, with t ranks:

    norm1, norm2     SequenceParallel: each rank normalizes T/t positions (params replicated)
    attn             all-gather the sequence, then qkv column-parallel (each rank computes its
                     key/value groups and their query heads), the attention core on local
                     heads (attention sinks split with them), proj row-parallel with a
                     reduce-scatter back to T/t positions
    latent attn      (model.attention_kind=mla) the same, with the heads' up-projections q_up and
                     kv_up column-parallel and the down-projections, their norms and the shared
                     rotary key replicated (``_latent_attention_plan`` says why)
    mlp              all-gather, fc column-parallel, activation on local columns, out
                     row-parallel with a reduce-scatter
    MoE layer        not split (parallel.etp=1): router, experts and shared experts replicated over
                     the tp ranks, each rank routing the positions it holds (``replicate_moe``);
                     with etp = tp, all-gather, every rank routes the whole sequence, each expert's
                     gate/up column-parallel and down row-parallel, the experts' partial outputs
                     all-reduced, the shared experts split as a dense MLP (``split_moe``)

so between blocks the residual stream stays a plain (B, T/t, C) tensor on every rank, and the
only collectives are one all-gather and one reduce-scatter per sub-layer, forward and backward
(without sequence parallelism: one all-reduce each, and the norms and dropout run on the whole
sequence on every rank). The token embedding is vocab-parallel (row-wise: each rank looks up its
slice of the vocabulary, the partial sums are reduce-scattered into T/t positions); learned
positions are replicated and each rank adds its own T/t rows; the LM head is column-parallel over
the vocabulary and, with ``parallel.loss_parallel``, the cross-entropy runs on the vocab-sharded
logits (``loss_parallel``) so full logits never exist on one rank. A tied head shares the
embedding's vocab-sharded weight. Every parameter ends up a DTensor on the tp mesh (sharded or
replicated), which FSDP2 can then shard over the data-parallel mesh.

The fused QKV projection is laid out for this: ``attn.qkv`` keeps each key/value group's query
heads, key and value together, so a contiguous row shard is a whole set of heads for any t that
divides the KV heads; SwiGLU's gate and up are separate column-parallel projections. The Triton kernels take plain tensors; where a DTensor reaches one (the
norms under sequence parallelism) it falls back to the PyTorch reference (``kernels/registry.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from model.attention import AttentionCore
from model.gpt import GPT, LatentAttention
from model.moe import MoE, expert_mlp
from parallel.ep import EXPERT_WEIGHTS, copy_to_group, sum_over_group
from parallel.rng import split_rng


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool,
                          expert_tp: bool = False) -> None:
    """Shard ``model`` (a whole GPT or one pipeline stage of it) over ``tp_mesh``, in place; with
    ``expert_tp`` (parallel.etp = tp) its routed experts too, else they are replicated."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between sub-layers
    top: dict[str, object] = {}
    if model.tok_emb is not None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    if model.norm_f is not None:
        top["norm_f"] = _norm_style(sequence_parallel)
    parallelize_module(model, tp_mesh, top)
    if model.pos_emb is not None:
        _shard_positions(model.pos_emb, tp_mesh, sequence_parallel)
    if model.cfg.tie_embeddings and model.tok_emb is not None and model.lm_head is not None:
        # Both styles shard the shared (vocab, d_model) weight on dim 0; parallelizing each module
        # registered its own Parameter, so share one again (one gradient, one optimizer state).
        model.lm_head.weight = model.tok_emb.weight
    for module in model.mtp or []:
        # [h; e] -> d_model, replicated: under sequence parallelism each rank projects its own T/t
        # positions (no collective on the activations; the weight's gradient is summed over the tp
        # ranks); each module's block is split below as every block is.
        parallelize_module(module, tp_mesh, {"norm_h": _norm_style(sequence_parallel),
                                             "norm_e": _norm_style(sequence_parallel),
                                             "proj": ReplicatedModule(dim=1 if sequence_parallel else None),
                                             "norm_out": _norm_style(sequence_parallel)})
    for block in [*model.blocks.values(), *(module.block for module in model.mtp or [])]:
        plan = {
            "norm1": _norm_style(sequence_parallel),
            # attn(x, rope, cache, documents): only the hidden states are laid out; the rest stay as they are
            "attn": PrepareModuleInput(input_layouts=(seq, None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "norm2": _norm_style(sequence_parallel),
        } | (_latent_attention_plan(block.attn) if isinstance(block.attn, LatentAttention) else
             {"attn.qkv": ColwiseParallel()})
        if getattr(block.attn, "sinks", None) is not None:  # latent attention has none
            plan["attn.sinks"] = ShardedByHeads()
        if isinstance(block.mlp, MoE) and expert_tp:
            # The MoE layer takes the whole sequence (all-gathered under sequence parallelism) and
            # returns it whole; each rank keeps its own positions of the (summed) output.
            plan["mlp"] = PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                   use_local_input=True, output_layouts=(Replicate(),),
                                                   desired_output_layouts=(seq,))
            parallelize_module(block, tp_mesh, plan)
            split_moe(block.mlp, tp_mesh)
            continue
        if isinstance(block.mlp, MoE):
            # The MoE layer takes the positions this rank holds as a plain tensor (its own T/t slice
            # under sequence parallelism, the whole sequence otherwise) and returns them.
            plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=True)
            parallelize_module(block, tp_mesh, plan)
            replicate_moe(block.mlp, tp_mesh, sequence_parallel)
            continue
        if block.mlp.gate is not None:  # SwiGLU: gate and up are both column-parallel
            parallelize_module(block, tp_mesh, {"mlp.gate": ColwiseParallel()})
        parallelize_module(block, tp_mesh, plan | {
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(),
            "mlp.out": RowwiseParallel(output_layouts=seq),
        })
    if model.cfg.dropout > 0:
        split_dropout(model, tp_mesh.get_local_rank(), sequence_parallel)


# --------------------------------------------------------------------------- latent attention


def _latent_attention_plan(attn: LatentAttention) -> dict[str, ParallelStyle]:
    """Latent attention (model.attention_kind=mla) split by heads, as Megatron splits it.

    The up-projections (``q_up``; ``kv_up``, to each head's key part and value) are column-parallel
    over the heads and ``proj`` row-parallel, as ``attn.qkv`` and ``attn.proj`` are; the core runs on
    the local heads. The down-projections (``q_down``, ``kv_down``: the two latents and the one
    rotary key every head shares) and the latents' norms are replicated: their outputs are a few
    hundred numbers per token that every head reads, so splitting them would need a gather before
    the up-projections, and they are a small part of the layer's weights (DeepSeek-V3: 15M of its
    attention's 187M). Every rank computes them alike on the whole input; each then back-propagates
    through them only its own heads' share of the gradient, so the gradients of the latents, the
    rotary key and these weights are partial sums over the tp ranks (``Partial``): the weights'
    are summed where they meet their replicated parameters (the optimizer step, or FSDP2's
    reduction), and the input's reduce-scattered to the sequence shards, as ``attn.qkv``'s is."""
    plan: dict[str, ParallelStyle] = {"attn.q_up": ColwiseFromReplicated(), "attn.kv_up": ColwiseFromReplicated(),
                                      "attn.kv_down": ReplicatedPartialGrad(), "attn.kv_norm": ReplicatedPartialGrad()}
    if attn.q_down is not None:
        plan |= {"attn.q_down": ReplicatedPartialGrad(), "attn.q_norm": ReplicatedPartialGrad()}
    return plan


class _ReplicatedLocal(torch.autograd.Function):
    """A plain tensor that holds the same value on every rank of ``mesh`` as a ``Replicate`` DTensor,
    whose gradient goes back as this rank's share of a sum over the ranks (what ``Partial`` holds)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        ctx.mesh = mesh
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[torch.Tensor, None]:
        # The modules here (linears, norms) hand back Partial; a whole (Replicate) one is split in equal shares.
        return grad.redistribute(ctx.mesh, [Partial()]).to_local(), None


def _replicated(x, mesh: DeviceMesh):
    """``x`` as a Replicate DTensor: a DTensor as it is (DTensor's autograd labels its gradient), a
    plain tensor with its gradient returned as a partial sum (``_ReplicatedLocal``)."""
    if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
        return x
    return _ReplicatedLocal.apply(x, mesh)


class ReplicatedPartialGrad(ParallelStyle):
    """A module whose parameters are replicated on the tp mesh and whose output every rank computes
    alike, but whose output's gradient each rank holds only its share of (a sum over the tp ranks):
    the output leaves as a plain tensor whose gradient is labelled ``Partial``, so the parameters'
    gradients are partial sums too, and so is the gradient the input gets back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensors(mod, inputs, mesh):
            return tuple(_replicated(t, mesh) for t in inputs)

        def to_local(mod, output, mesh):
            return output.to_local(grad_placements=[Partial()])

        return distribute_module(module, device_mesh, _replicate_parameters, to_dtensors, to_local)


class ColwiseFromReplicated(ParallelStyle):
    """Column-parallel over the heads, on an input that is replicated but whose gradient is a partial
    sum (an output of ``ReplicatedPartialGrad``): each rank's input gradient, from its own columns,
    goes back as its share instead of being all-reduced (what ``ColwiseParallel`` does with a plain
    input). The input becomes a DTensor first, which ``ColwiseParallel`` then takes as it is."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ColwiseParallel()._apply(module, device_mesh)
        module.register_forward_pre_hook(lambda mod, args: (_replicated(args[0], device_mesh), *args[1:]),
                                         prepend=True)
        return module


# --------------------------------------------------------------------------- dropout


class SplitRNG:
    """Mixin placed in front of a dropout's own class: its forward draws from ``split_rng``."""

    split_rank: int

    @torch.compiler.disable  # seeding a generator has no graph; the dropout runs eagerly
    def forward(self, *args, **kwargs):
        with split_rng(self.split_rank):
            return super().forward(*args, **kwargs)


@functools.cache
def _split_class(cls: type) -> type:
    return type(f"Split{cls.__name__}", (SplitRNG, cls), {})


def split_dropout(model: nn.Module, rank: int, sequence_parallel: bool) -> None:
    """Give the dropouts that act on this rank's own part of an activation their own masks: the
    attention core's (its heads' probabilities) always; the residual stream's (``nn.Dropout``:
    after the embedding, after each sub-layer's reduction, inside MoE layers) under sequence
    parallelism, where each rank holds its own positions. The rest see replicated activations and
    keep the default generator, which the ranks of a tp group keep in step."""
    # Split MoE layers (``split_moe``) hold the whole sequence on every rank: their dropouts see
    # replicated activations.
    whole = {id(m) for moe in model.modules() if isinstance(moe, TensorSplitMoE) for m in moe.modules()}
    for module in model.modules():
        if id(module) in whole and not isinstance(module, AttentionCore):
            continue
        if isinstance(module, AttentionCore) or (sequence_parallel and isinstance(module, nn.Dropout)):
            module.__class__ = _split_class(type(module))
            module.split_rank = rank


def _norm_style(sequence_parallel: bool):
    """Norms work on the T/t positions each rank holds; without sequence parallelism every rank
    normalizes the whole (replicated) sequence, with the gains still replicated DTensors so that
    all parameters live on the same mesh (FSDP2 and gradient clipping need that)."""
    return SequenceParallel() if sequence_parallel else ReplicatedModule()


class ReplicatedModule(ParallelStyle):
    """Parameters replicated on the tp mesh; plain tensors in and out. The input is the whole one
    (``Replicate``) or, with ``tokens_split``, this rank's rows of it (``Shard(0)``; ``dim``: its
    slice along that dimension, such as a sequence-parallel slice of positions): then each
    weight's gradient comes out ``Partial`` (this rank's tokens' share) and is summed over the tp
    ranks where it meets the replicated parameter (the optimizer step, or FSDP2's reduction)."""

    def __init__(self, tokens_split: bool = False, dim: int | None = None):
        super().__init__()
        self.layout = Shard(0) if tokens_split else Shard(dim) if dim is not None else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensors(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [self.layout], run_check=False) if isinstance(t, torch.Tensor)
                         and not isinstance(t, DTensor) else t for t in inputs)

        def to_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, _replicate_parameters, to_dtensors, to_local)


class ShardedByHeads(ParallelStyle):
    """A parameter with one entry per query head (attention sinks), split as ``attn.qkv`` splits the
    heads: rank r holds heads [r H/t, (r + 1) H/t), contiguous because the fused projection keeps
    each key/value group's query heads together. The module returns its local entries."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                            requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, shard, output_fn=lambda mod, out, mesh: out.to_local())


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for p_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()],
                                                                          run_check=False)))


# --------------------------------------------------------------------------- MoE layers


def mean_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """The mean of ``x`` over the ranks of ``group``. Every rank's loss then holds the same mean, and
    each hands its own ``x`` 1/n of the gradient (the sum passes it through): summed over the ranks (as
    the router's gradient is), that is the gradient of one process's mean."""
    return sum_over_group(x, group) / dist.get_world_size(group)


class ReplicatedMoE(MoE):
    """An MoE layer whose weights are replicated DTensors on the tp mesh; its experts run on their
    local copies (``expert_grad_placements`` says how their gradients are labelled)."""

    expert_grad_placements: tuple = (Replicate(),)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_up, w_down, w_gate, *biases = (None if w is None else w.to_local(grad_placements=self.expert_grad_placements)
                                         for w in (self.w_up, self.w_down, self.w_gate, self.b_gate, self.b_up,
                                                   self.b_down))
        return expert_mlp(rows, counts, w_up, w_down, w_gate, self.ops, self.gelu_approximate, self.backend,
                          tuple(biases), self.clamp)


def replicate_moe(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """An MoE layer under tensor parallelism: nothing split, every weight replicated over the tp ranks.

    Each rank routes the tokens it holds. Without sequence parallelism those are the same on every
    tp rank, which then compute the same thing and the same gradients (nothing to reduce). With it,
    each rank routes its own T/t positions, so the layer costs 1/t of the work and no collective on
    the activations, and the gradients of its weights are this rank's share: they are summed over
    the tp ranks (``Partial``, reduced by DTensor), and the balancing losses take their means over
    the tp ranks (``MoE.token_mean``). Expert parallelism, applied after this, keeps ``sequence_group``
    to sum its expert gradients the same way (parallel/ep.py).
    """
    dense = ("router", "shared") if moe.shared is not None else ("router",)
    parallelize_module(moe, tp_mesh, {name: ReplicatedModule(tokens_split=sequence_parallel) for name in dense})
    for name in EXPERT_WEIGHTS:
        w = getattr(moe, name)
        if w is not None:
            setattr(moe, name, nn.Parameter(DTensor.from_local(w.detach(), tp_mesh, [Replicate()], run_check=False),
                                            requires_grad=w.requires_grad))
    moe.__class__ = ReplicatedMoE
    if sequence_parallel:
        group = tp_mesh.get_group()
        moe.expert_grad_placements = (Partial(),)
        moe.sequence_group = group
        moe.token_mean = functools.partial(mean_over_ranks, group=group)


class TensorSplitMoE(MoE):
    """An MoE layer whose routed experts are split over the tp ranks (``split_moe``): each runs its
    slice of every expert on the same rows, and the partial outputs are summed over ``tensor_group``."""

    tensor_group: dist.ProcessGroup

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_up, w_down, w_gate = (None if w is None else w.to_local() for w in (self.w_up, self.w_down, self.w_gate))
        out = expert_mlp(copy_to_group(rows, self.tensor_group), counts, w_up, w_down, w_gate, self.ops,
                         self.gelu_approximate, self.backend, None, self.clamp)
        return sum_over_group(out, self.tensor_group)


# Where each expert weight is split over the tp ranks: the (E, d_model, width) gate and up by their
# width's columns, the (E, width, d_model) down by its rows, as ColwiseParallel and RowwiseParallel
# split a dense MLP's. (Expert biases are refused with etp: parallel/layout.py.)
EXPERT_SPLIT = {"w_gate": 2, "w_up": 2, "w_down": 1}


def split_moe(moe: MoE, tp_mesh: DeviceMesh) -> None:
    """An MoE layer under expert tensor parallelism (parallel.etp = tp; Megatron-core's expert tensor
    parallelism with its tensor group equal to the dense one).

    Every tp rank routes the same tokens (the whole sequence: its layer input is all-gathered), with
    the router replicated, so the routing, capacity and balancing losses are one process's. Each rank
    holds 1/tp of every expert's columns (``EXPERT_SPLIT``): it computes its part of the experts'
    output for every row, and those parts are summed over the tp ranks (one all-reduce of the routed
    rows, forward; one of their gradients, backward). The shared experts are a dense MLP on the same
    tokens, split column- then row-parallel with their own all-reduce. Expert parallelism, applied
    after this, keeps each weight's split on the (ep, tp) mesh (parallel/ep.py).
    """
    parallelize_module(moe, tp_mesh, {"router": ReplicatedModule()})
    if moe.shared is not None:
        plan = {"shared.fc": ColwiseParallel(), "shared.out": RowwiseParallel(output_layouts=Replicate())}
        if moe.shared.gate is not None:
            plan["shared.gate"] = ColwiseParallel()
        parallelize_module(moe, tp_mesh, plan)
    for name, dim in EXPERT_SPLIT.items():
        w = getattr(moe, name)
        if w is not None:
            setattr(moe, name, nn.Parameter(distribute_tensor(w.detach(), tp_mesh, [Shard(dim)], src_data_rank=None),
                                            requires_grad=w.requires_grad))
    moe.__class__ = TensorSplitMoE
    moe.tensor_group = tp_mesh.get_group()


def _shard_positions(pos_emb: nn.Embedding, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Learned positions: the table replicated; with sequence parallelism each rank keeps the rows
    of its T/t positions, to add to its part of the residual stream (the backward all-gathers the
    gradient of those rows, so every rank updates the whole table alike)."""

    def to_replicated(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

    def to_local_rows(module, output, mesh):
        if sequence_parallel:
            output = output.redistribute(mesh, [Shard(0)])
        return output.to_local()

    distribute_module(pos_emb, tp_mesh, input_fn=to_replicated, output_fn=to_local_rows)
