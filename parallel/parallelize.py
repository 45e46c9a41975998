"""Turn a built GPT into what trains, in one fixed order (torchtitan's order, for the same reasons):

1. activation checkpointing  -- wrappers must exist before compile traces the blocks
2. torch.compile per block   -- compiled regions stay inside FSDP units, so sharding still sees blocks
3. data parallelism          -- DDP, FSDP2 or (in parallel/zero.py) a DeepSpeed engine

Each ``apply_*`` is a no-op when its feature is off and can be tested alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from training.fields import ConfigError


def apply_activation_checkpointing(model: nn.Module, policy: str, every_k: int) -> None:
    if policy == "none":
        return
    from model.checkpointing import apply_activation_checkpointing as apply_policy

    apply_policy(model, policy, every_k)


def apply_compile(model: nn.Module, enabled: bool, mode: str, compile_loss: bool) -> None:
    """Compile each transformer block separately: small graphs compile once and are reused."""
    if not enabled:
        return
    for block in model.blocks:
        block.compile(mode=mode)  # in place: state_dict keys stay free of "_orig_mod."
    if compile_loss:
        model.ops = _compiled_loss_ops(model.ops, mode)


def _compiled_loss_ops(ops, mode: str):
    from dataclasses import replace

    return replace(ops, cross_entropy=torch.compile(ops.cross_entropy, mode=mode))


def apply_data_parallel(model: nn.Module, parallel_cfg, ctx, precision_mode: str = "fp32") -> nn.Module:
    """Wrap for the chosen data-parallel strategy (ZeRO is handled by parallel/zero.py instead).

    Every rank must call this with a model built from the same seed: DDP broadcasts rank 0's
    weights anyway, FSDP2 keeps each rank's own slice of its (identical) full weights.
    ``precision_mode`` (precision.mode) picks FSDP2's mixed-precision policy.
    """
    strategy = parallel_cfg.strategy
    if strategy == "none" or ctx.world_size == 1 and strategy == "ddp":
        return model
    if ctx.world_size == 1:
        raise ConfigError(
            f"parallel.strategy={strategy} needs several processes; launch with torchrun "
            "(e.g. torchrun --nproc_per_node=2 train.py ...) or use parallel.strategy=none"
        )
    dims = layout_of(ctx, parallel_cfg.local_world_size)
    if strategy == "ddp":
        from parallel.ddp import apply_ddp

        return apply_ddp(model, ctx.device, parallel_cfg, dims)
    if strategy == "fsdp":
        from parallel.fsdp import apply_fsdp, build_fsdp_mesh

        mesh = build_fsdp_mesh(dims, ctx.device.type, parallel_cfg.fsdp_hybrid)
        return apply_fsdp(model, mesh, parallel_cfg, precision_mode, ctx.device)
    raise ValueError(f"parallel.strategy={strategy} is not handled by apply_data_parallel")


def layout_of(ctx, local_world_size: int | None):
    """World/node layout of this process; ``local_world_size`` overrides the launcher's ranks per node."""
    from parallel.dims import ParallelDims

    local = local_world_size or ctx.local_world_size
    return ParallelDims(ctx.world_size, local, ctx.rank, ctx.rank % local)
