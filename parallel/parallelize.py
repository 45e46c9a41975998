"""Turn a built GPT into what trains, in one fixed order (torchtitan's order, for the same reasons):

1. activation checkpointing  -- wrappers must exist before compile traces the blocks
2. torch.compile per block   -- compiled regions stay inside FSDP units, so sharding still sees blocks
3. data parallelism          -- DDP, FSDP2 or (in parallel/zero.py) a DeepSpeed engine

Each ``apply_*`` is a no-op when its feature is off and can be tested alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn


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


def apply_data_parallel(model: nn.Module, parallel_cfg, ctx) -> nn.Module:
    """Wrap for the chosen data-parallel strategy (ZeRO is handled by parallel/zero.py instead)."""
    strategy = parallel_cfg.strategy
    if strategy == "none" or ctx.world_size == 1 and strategy == "ddp":
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids)
    raise ValueError(f"parallel.strategy={strategy} is not handled by apply_data_parallel")
