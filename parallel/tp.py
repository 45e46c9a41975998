"""Tensor parallelism with sequence parallelism (Megatron-LM; Korthikanti et al. 2022), on DTensor.

Applied in place to a built GPT (or a pipeline stage of one) over the ``tp`` mesh dimension,
with PyTorch's own parallel styles (``torch.distributed.tensor.parallel``); the model code has
no TP in it. Per block, with t ranks:

    norm1, norm2     SequenceParallel: each rank normalizes T/t positions (params replicated)
    attn             all-gather the sequence, then qkv column-parallel (each rank computes its
                     key/value groups and their query heads), the attention core on local
                     heads, proj row-parallel with a reduce-scatter back to T/t positions
    mlp              all-gather, fc column-parallel, activation on local columns, out
                     row-parallel with a reduce-scatter

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

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from model.gpt import GPT


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard ``model`` (a whole GPT or one pipeline stage of it) over ``tp_mesh``, in place."""
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
    for block in model.blocks.values():
        if block.mlp.gate is not None:  # SwiGLU: gate and up are both column-parallel
            parallelize_module(block, tp_mesh, {"mlp.gate": ColwiseParallel()})
        parallelize_module(block, tp_mesh, {
            "norm1": _norm_style(sequence_parallel),
            # attn(x, rope, cache, documents): only the hidden states are laid out; the rest stay as they are
            "attn": PrepareModuleInput(input_layouts=(seq, None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "norm2": _norm_style(sequence_parallel),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(),
            "mlp.out": RowwiseParallel(output_layouts=seq),
        })


def _norm_style(sequence_parallel: bool):
    """Norms work on the T/t positions each rank holds; without sequence parallelism every rank
    normalizes the whole (replicated) sequence, with the gains still replicated DTensors so that
    all parameters live on the same mesh (FSDP2 and gradient clipping need that)."""
    return SequenceParallel() if sequence_parallel else ReplicatedModule()


class ReplicatedModule(ParallelStyle):
    """Parameters replicated on the tp mesh; the whole input in, the whole output out, as plain tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()],
                                                                               run_check=False)))

        def to_replicated(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor)
                         and not isinstance(t, DTensor) else t for t in inputs)

        def to_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, replicate, to_replicated, to_local)


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
