"""The one build path: config sections in, a ready ``Engine`` out, in one fixed order.

    1. precision x strategy   decided once (``PrecisionPolicy``); the device is checked for it
    2. kernels and attention  the fused ops and the attention backend this device can run
    3. the GPT                built from the seed (on the meta device with ``init_on_meta``)
    4. activation recompute   wrappers must exist before compile traces the blocks
    5. torch.compile          per block, so compiled regions stay inside FSDP units
    6. data parallelism       none / DDP / FSDP2 / DeepSpeed ZeRO, each with its engine

This is torchtitan's order, for the same reasons. Each ``apply_*`` is a no-op when its feature is
off and can be tested alone. ``train.py`` and every tool that trains call ``build_training``;
nothing else assembles a model for training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from common.errors import ConfigError
from kernels.config import KernelsConfig
from kernels.registry import resolve_kernel_ops
from model.attention import select_attention
from model.config import ModelConfig
from model.gpt import GPT
from model.recompute import apply_recompute, describe_recompute
from parallel.config import ParallelConfig
from parallel.ddp import apply_ddp
from parallel.distributed import DistContext
from parallel.engine import DDPEngine, Engine, ShardedEngine, TorchEngine
from parallel.fsdp import apply_fsdp, build_fsdp_mesh
from parallel.optim import OptimConfig
from parallel.precision import PrecisionConfig, PrecisionPolicy, check_precision_supported, precision_policy
from parallel.zero import ZERO_STAGES, apply_zero


@dataclass(frozen=True)
class Built:
    engine: Engine
    model: GPT  # the user's module, under every wrapper
    policy: PrecisionPolicy
    notes: list[str]  # what was chosen and why, one log line each


def build_training(*, model_cfg: ModelConfig, kernels_cfg: KernelsConfig, precision_cfg: PrecisionConfig,
                   parallel_cfg: ParallelConfig, optim_cfg: OptimConfig, ctx: DistContext, seed: int,
                   micro_batch_size: int, grad_accum_steps: int, compile: bool = False,
                   compile_mode: str = "default", compile_loss: bool = False) -> Built:
    """Build the GPT and everything that trains it; every rank calls this with the same sections."""
    # 1. Precision: who holds the fp32 masters depends on the strategy, so both decide together.
    policy = precision_policy(precision_cfg, parallel_cfg.strategy)
    check_precision_supported(policy.mode, ctx.device)
    # 2. Kernels and attention for this device.
    ops, kernel_note = resolve_kernel_ops(kernels_cfg.backend, ctx.device)
    backend, attention_note = choose_attention(model_cfg, ctx.device, policy)
    # 3. The model. Every rank builds the same weights from the same seed (DDP broadcasts rank 0's
    # anyway; FSDP2 keeps each rank's slice); on meta nothing is allocated until FSDP2 shards it.
    torch.manual_seed(seed)
    with torch.device("meta" if parallel_cfg.init_on_meta else ctx.device):
        model = GPT(model_cfg, ops=ops, attention_backend=backend)
    model.to(dtype=policy.module_dtype)
    # 4-5. Recompute, then compile.
    apply_recompute(model, model_cfg.checkpointing, model_cfg.checkpoint_every_k)
    apply_compile(model, compile, compile_mode, compile_loss)
    # 6. Data parallelism and the engine that drives it.
    engine = apply_data_parallel(model, parallel_cfg, ctx, policy, optim_cfg, micro_batch_size=micro_batch_size,
                                 grad_accum_steps=grad_accum_steps)
    notes = [kernel_note, attention_note, policy.describe(parallel_cfg.strategy), describe_recompute(model)]
    return Built(engine=engine, model=model, policy=policy, notes=notes)


def choose_attention(model_cfg: ModelConfig, device: torch.device, policy: PrecisionPolicy) -> tuple[str, str]:
    """The attention backend for this device and compute dtype, and one line saying why."""
    if model_cfg.layers == "te":
        return "sdpa", "attention: Transformer Engine's own (model.layers=te)"
    return select_attention(model_cfg.attention, device, policy.compute_dtype, model_cfg.head_dim)


def apply_compile(model: nn.Module, enabled: bool, mode: str, compile_loss: bool) -> None:
    """Compile each transformer block separately: small graphs compile once and are reused."""
    if not enabled:
        return
    for block in model.blocks:
        block.compile(mode=mode)  # in place: state_dict keys stay free of "_orig_mod."
    if compile_loss:
        model.ops = replace(model.ops, cross_entropy=torch.compile(model.ops.cross_entropy, mode=mode))


def apply_data_parallel(model: nn.Module, parallel_cfg: ParallelConfig, ctx: DistContext, policy: PrecisionPolicy,
                        optim_cfg: OptimConfig, *, micro_batch_size: int = 1, grad_accum_steps: int = 1) -> Engine:
    """Wrap ``model`` for ``parallel.strategy`` and return the engine that trains it (every rank calls this).

    ``micro_batch_size`` and ``grad_accum_steps`` are only read by DeepSpeed, which wants the
    batch shape in its own config.
    """
    strategy = parallel_cfg.strategy
    if strategy == "none" or (ctx.world_size == 1 and strategy == "ddp"):
        return TorchEngine(model, policy, optim_cfg, ctx.device)
    if ctx.backend is None:
        raise ConfigError(
            f"parallel.strategy={strategy} needs several processes; launch with torchrun "
            "(e.g. torchrun --nproc_per_node=2 train.py ...) or use parallel.strategy=none"
        )
    if strategy in ZERO_STAGES:
        return apply_zero(model, parallel_cfg, policy, optim_cfg, micro_batch_size=micro_batch_size,
                          grad_accum_steps=grad_accum_steps, world_size=ctx.world_size, device=ctx.device)
    if strategy == "ddp":
        ddp, comm_counter = apply_ddp(model, ctx.device, parallel_cfg, ctx.dims)
        return DDPEngine(ddp, policy, optim_cfg, ctx.device, comm_counter)
    if strategy == "fsdp":
        mesh = build_fsdp_mesh(ctx.dims, ctx.device.type, parallel_cfg.fsdp_hybrid)
        return ShardedEngine(apply_fsdp(model, mesh, parallel_cfg, policy, ctx.device), policy, optim_cfg, ctx.device)
    raise ConfigError(f"parallel.strategy={strategy} has no engine")  # a choice added to the config but not here
