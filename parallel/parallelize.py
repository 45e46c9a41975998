"""The one build path: config sections in, a ready ``Engine`` out, in one fixed order.

    1. precision x strategy   decided once (``PrecisionPolicy``); the device is checked for it
    2. kernels and attention  the fused ops and the attention backend this device can run
    3. the GPT                built from the seed (on the meta device with ``init_on_meta``)
    4. pipeline split         each rank keeps its stages (parallel/pp.py)
    5. FP8 linears            torchao's Float8Linear swapped in (fp8_backend=torchao, parallel/float8.py)
       tensor parallelism     DTensor shards over the tp mesh dimension (parallel/tp.py)
       context parallelism    each rank its chunks of every sequence, K/V gathered per layer (parallel/cp.py)
       expert parallelism     each rank its experts of every MoE layer, tokens exchanged by all-to-all (parallel/ep.py)
    6. activation recompute   wrappers must exist before compile traces the blocks
    7. torch.compile          per block, so compiled regions stay inside FSDP units
    8. data parallelism       none / DDP / FSDP2 (over the dp mesh dimensions) / DeepSpeed ZeRO
    9. the engine             the one the layout needs (parallel/engine.py, parallel/pp.py)

This is torchtitan's order, for the same reasons. Each ``apply_*`` is a no-op when its feature is
off and can be tested alone. ``train.py`` and every tool that trains call ``build_training``;
nothing else assembles a model for training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping

import torch
import torch.nn as nn

from common.errors import ConfigError, LayoutError
from kernels.config import KernelsConfig
from kernels.registry import resolve_kernel_ops, with_loss_chunks
from model.attention import document_mask_note, select_attention
from model.config import ModelConfig
from model.flops import count_parameters, mlp_parameters
from model.gpt import GPT, indexed_blocks
from model.interop import check_state_dict
from model.moe import select_expert_backend
from model.mup import describe as describe_mup
from model.recompute import apply_recompute, describe_recompute, no_gain_note
from parallel.config import ParallelConfig
from parallel.cp import apply_context_parallel, chunk_ids
from parallel.ddp import apply_ddp
from parallel.dims import ParallelDims
from parallel.distributed import DistContext
from parallel.engine import DDPEngine, Engine, ShardedEngine, TorchEngine
from parallel.ep import apply_expert_parallel
from parallel.float8 import apply_float8, precompute_scales_after_step
from parallel.fsdp import apply_fsdp
from parallel.optim import OptimConfig, describe_split
from parallel.precision import PrecisionConfig, PrecisionPolicy, check_precision_supported, precision_policy
from parallel.rng import seed_activation_rng
from parallel.zero import ZERO_STAGES, apply_zero

if TYPE_CHECKING:
    from parallel.pp import PipelineEngine


@dataclass(frozen=True)
class Built:
    engine: Engine
    model: GPT  # the user's module, under every wrapper
    policy: PrecisionPolicy
    notes: list[str]  # what was chosen and why, one log line each
    warnings: list[str] = field(default_factory=list)  # combinations that cost without gaining, one line each


def build_training(*, model_cfg: ModelConfig, kernels_cfg: KernelsConfig, precision_cfg: PrecisionConfig,
                   parallel_cfg: ParallelConfig, optim_cfg: OptimConfig, ctx: DistContext, seed: int,
                   micro_batch_size: int, grad_accum_steps: int, compile: bool = False,
                   compile_mode: str = "default", compile_loss: bool = False,
                   initial_state: Mapping[str, torch.Tensor] | None = None) -> Built:
    """Build the GPT and everything that trains it; every rank calls this with the same sections.

    ``initial_state``: whole weights to start from (model.init_from), loaded into the whole model
    before anything splits or shards it.
    """
    dims, layout = ctx.dims, ctx.layout
    # The layout resolved the strategy (Layout.of); the section must be the one it was built from.
    if parallel_cfg.strategy not in ("none", layout.strategy):
        raise LayoutError(f"parallel.strategy={parallel_cfg.strategy}, but the run's layout is {layout.describe()}: "
                          "build the context from the same parallel section (Layout.of)")
    parallel_cfg = replace(parallel_cfg, strategy=layout.strategy)
    check_parameters_fit(model_cfg, ctx.device, ctx.world_size, parallel_cfg.init_on_meta)
    # 1. Precision: who holds the fp32 masters depends on the strategy, so both decide together.
    policy = precision_policy(precision_cfg, layout.strategy)
    check_precision_supported(policy.mode, ctx.device, precision_cfg.fp8_backend, precision_cfg.fp8_recipe)
    # 2. Kernels and attention for this device.
    ops, kernel_note = resolve_kernel_ops(kernels_cfg.backend, ctx.device)
    if kernels_cfg.loss_chunk_tokens:
        ops = with_loss_chunks(ops, kernels_cfg.loss_chunk_tokens)
        kernel_note += (f"; LM head and loss {kernels_cfg.loss_chunk_tokens} tokens at a time "
                        "(kernels.loss_chunk_tokens)")
    backend, attention_note = choose_attention(model_cfg, ctx.device, policy)
    expert_backend, expert_note = choose_expert_backend(model_cfg, ctx.device, policy, compile)
    if model_cfg.attention_mask == "document":
        attention_note += "; " + document_mask_note(backend, micro_batch_size, model_cfg.max_seq_len, layout.cp)
    # 3. The model. Every rank builds the same weights from the same seed (DDP broadcasts rank 0's
    # anyway; FSDP2 and TP keep each rank's slice); on meta nothing is allocated until FSDP2 shards it.
    torch.manual_seed(seed)
    with torch.device("meta" if parallel_cfg.init_on_meta else ctx.device):
        model = GPT(model_cfg, ops=ops, attention_backend=backend, expert_backend=expert_backend)
    if initial_state is not None:
        if parallel_cfg.init_on_meta or model_cfg.layers != "torch":
            raise ConfigError("model.init_from loads whole torch-layer weights before sharding: set "
                              "parallel.init_on_meta=false and model.layers=torch")
        check_state_dict(model_cfg, initial_state)  # a mismatch names the key and both shapes
        model.load_state_dict(initial_state)
    model.to(dtype=policy.module_dtype)
    # 4. Pipeline stages: split first, so every later step sees only this rank's layers.
    stages, parts = [0], [model]
    if layout.pp > 1:
        from parallel.pp import split_stages, stage_ids  # torch's pipelining: imported by pp runs only

        stages = stage_ids(dims.coordinate("pp"), layout.pp, layout.pp_virtual_stages)
        parts = split_stages(model, stages, layout.stages)
    loss_parallel = layout.tp > 1 and parallel_cfg.loss_parallel
    fp8_notes = []
    for part in parts:
        # 5. FP8 linears swap module classes, so they go in before tensor parallelism lays out their
        # weights and inputs (a swap after it would drop the layout hooks) and before the recompute
        # and compile wrappers.
        fp8_notes.append(apply_float8(part, mode=policy.mode, backend=precision_cfg.fp8_backend,
                                      recipe=precision_cfg.fp8_recipe, device=ctx.device,
                                      fsdp=layout.fsdp))
        # Tensor parallelism, on the plain modules (before wrappers change their classes).
        if layout.tp > 1:
            from parallel.tp import apply_tensor_parallel  # DTensor's parallel styles: tp runs only

            apply_tensor_parallel(part, ctx.submesh("tp"), sequence_parallel=layout.sequence_parallel,
                                  loss_parallel=loss_parallel, expert_tp=layout.etp > 1)
        # Context parallelism: each rank runs its chunks of every sequence, with K/V gathered per layer;
        # before recompute, so selective recompute re-gathers K/V in backward instead of keeping them.
        apply_context_parallel(part, ctx.submesh("cp").get_group() if layout.cp > 1 else None)
        # Expert parallelism: each rank keeps its experts of every MoE layer, tokens exchanged by all-to-all.
        apply_expert_parallel(part, ctx.submesh("ep") if layout.ep > 1 else None,
                              ctx.submesh("ep", "tp") if layout.ep > 1 and layout.etp > 1 else None)
        # 6-7. Recompute, then compile.
        apply_recompute(part, model_cfg.recompute, model_cfg.recompute_every_k)
        apply_compile(part, compile, compile_mode, compile_loss)
    # 8-9. Data parallelism and the engine that drives the layout.
    if layout.pp > 1:
        engine = apply_pipeline(parts, stages, layout.stages, parallel_cfg, ctx, policy, optim_cfg,
                                grad_accum_steps=grad_accum_steps, loss_parallel=loss_parallel, fsdp=layout.fsdp)
    elif layout.tp > 1:
        engine = apply_sharded_data_parallel(parts[0], parallel_cfg, ctx, policy, optim_cfg, loss_parallel,
                                             fsdp=layout.fsdp)
    else:
        engine = apply_data_parallel(model, parallel_cfg, ctx, policy, optim_cfg, micro_batch_size=micro_batch_size,
                                     grad_accum_steps=grad_accum_steps)
    # Dropout: the ranks of a tensor-parallel group draw alike, every other rank its own masks
    # (parallel/rng.py); the weights above were drawn before, from the same seed everywhere.
    seed_activation_rng(seed, ctx.dims.rank // layout.tp)
    if policy.fp8_torchao:
        for part in engine.optimized_parts():  # a pipeline steps each stage part on its own
            precompute_scales_after_step(part.optimizer, part.model)
    notes = [kernel_note, attention_note] + ([expert_note] if expert_note else []) + [policy.describe(layout.strategy), describe_recompute(parts[0]),
             describe_placement(dims, stages)] + [note for note in fp8_notes[:1] if note]
    if optim_cfg.name == "muon":  # the whole model's split, from the model as built (before any pipeline cut)
        notes.append(describe_split(list(model.named_parameters())))
    if model_cfg.mup:
        notes.append(describe_mup(model_cfg))
    return Built(engine=engine, model=model if layout.pp == 1 else parts[0], policy=policy, notes=notes,
                 warnings=no_gain_warnings(model_cfg, backend))


def no_gain_warnings(model_cfg: ModelConfig, attention_backend: str) -> list[str]:
    """Known combinations that cost time and save nothing here, in one line each with the switch."""
    note = no_gain_note(model_cfg.recompute, attention_backend)
    return [note] if note else []


def describe_placement(dims: ParallelDims, stages: list[int]) -> str:
    """One log line: the run's layout (``Layout.describe``) and where this rank sits in it."""
    lay = dims.layout
    if dims.world_size == 1:
        return "layout: one process"
    line = f"layout: {lay.describe()} ({dims.world_size} ranks); data-parallel rank {dims.dp_rank} of {lay.dp}"
    if lay.ep > 1:
        line += f"; ep rank {dims.ep_rank} of {lay.ep} holds 1/{lay.ep} of each MoE layer's experts"
    if lay.etp > 1:
        line += f"; each expert split over the {lay.etp} tp ranks"
    if lay.cp > 1:
        line += f"; cp rank {dims.coordinate('cp')} of {lay.cp} holds sequence chunks {chunk_ids(lay.cp, dims.coordinate('cp'))}"
    if lay.pp > 1:
        line += f"; pipeline stages {stages} of {lay.stages}"
    return line


def check_parameters_fit(model_cfg: ModelConfig, device: torch.device, world_size: int, init_on_meta: bool) -> None:
    """Refuse, in one line naming the keys, a model whose parameters alone exceed this device's
    memory as this rank would build them, before anything is allocated: the whole model in fp32
    (step 3 builds every weight on the device), or with ``init_on_meta`` at least a 1/world_size
    share in 2-byte floats once sharded. A lower bound (no gradients, optimizer states or
    activations), so what it refuses could only have died in the allocator."""
    memory = device_memory_bytes(device)
    n = count_parameters(model_cfg)
    need = 2 * n / world_size if init_on_meta else 4 * n
    if memory is None or need <= memory:
        return
    how = (f"a 1/{world_size} share of them in 16-bit floats, sharded from meta" if init_on_meta
           else "each rank builds them whole in fp32")
    what, fix = "", "lower model.n_layer, model.d_model, model.d_ff or model.vocab_size"
    if model_cfg.moe.experts is not None:
        routed = model_cfg.n_moe_layers * model_cfg.moe.experts * mlp_parameters(model_cfg, model_cfg.expert_d_ff,
                                                                                 bias=False)
        what = (f" ({routed / 1e9:.3g}B of them in {model_cfg.n_moe_layers} layers x model.moe.experts="
                f"{model_cfg.moe.experts} experts of width {model_cfg.expert_d_ff})")
        fix = "lower model.moe.experts or model.moe.d_ff"
    if not init_on_meta:
        fix += ", or build on meta and shard over more ranks (parallel.init_on_meta=true with parallel.strategy=fsdp)"
    raise ConfigError(f"the model's {n / 1e9:.3g}B parameters{what} need {need / 2**30:,.1f} GiB ({how}), more than "
                      f"the {memory / 2**30:,.1f} GiB of {device.type} memory here; {fix}")


def device_memory_bytes(device: torch.device) -> int | None:
    """All the memory of ``device``: a GPU's, or the host's physical memory for the CPU (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def choose_attention(model_cfg: ModelConfig, device: torch.device, policy: PrecisionPolicy) -> tuple[str, str]:
    """The attention backend for this device and compute dtype, and one line saying why."""
    if model_cfg.layers == "te":
        return "sdpa", "attention: Transformer Engine's own (model.layers=te)"
    return select_attention(model_cfg.attention, device, policy.compute_dtype, model_cfg.head_dim,
                            window=model_cfg.sliding_window, sinks=model_cfg.attention_sinks,
                            latent=model_cfg.is_mla)


def choose_expert_backend(model_cfg: ModelConfig, device: torch.device, policy: PrecisionPolicy,
                          compiled: bool = False) -> tuple[str, str | None]:
    """How MoE layers run their expert GEMMs here (``compiled``: in torch.compile'd blocks), and one
    line saying why (None for a dense model)."""
    if model_cfg.moe.experts is None:
        return "loop", None
    return select_expert_backend(model_cfg.moe.backend, device, policy.compute_dtype, model_cfg, compiled)


def apply_compile(model: nn.Module, enabled: bool, mode: str, compile_loss: bool) -> None:
    """Compile each transformer block separately: small graphs compile once and are reused."""
    if not enabled:
        return
    for _, block in indexed_blocks(model):
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
        return apply_sharded_data_parallel(model, parallel_cfg, ctx, policy, optim_cfg, loss_parallel=False, fsdp=True)
    raise ConfigError(f"parallel.strategy={strategy} has no engine")  # a choice added to the config but not here


def apply_sharded_data_parallel(model: nn.Module, parallel_cfg: ParallelConfig, ctx: DistContext,
                                policy: PrecisionPolicy, optim_cfg: OptimConfig, loss_parallel: bool, *,
                                fsdp: bool) -> ShardedEngine:
    """FSDP2 over the data-parallel dimensions of the mesh (2-D for HSDP) when ``fsdp``, and the
    engine of a model with DTensor parameters. The layout has checked there is something to shard."""
    if fsdp:
        apply_fsdp(model, ctx.fsdp_mesh(), parallel_cfg, policy, ctx.device, ctx.expert_fsdp_mesh())
    return ShardedEngine(model, policy, optim_cfg, ctx.device, fsdp=fsdp, loss_parallel=loss_parallel)


def apply_pipeline(parts: list[GPT], stages: list[int], n_stages: int, parallel_cfg: ParallelConfig,
                   ctx: DistContext, policy: PrecisionPolicy, optim_cfg: OptimConfig, *, grad_accum_steps: int,
                   loss_parallel: bool, fsdp: bool) -> PipelineEngine:
    """Each stage sharded over the data-parallel dimensions (FSDP2), then the schedule over the pp
    dimension; a tied embedding's two copies joined across the first and last stage."""
    from parallel.pp import PipelineEngine, build_pipeline, tie_embedding_copies

    if fsdp:
        for part in parts:
            apply_fsdp(part, ctx.fsdp_mesh(), parallel_cfg, policy, ctx.device, ctx.expert_fsdp_mesh())
    pp_group = ctx.submesh("pp").get_group()
    pipeline, eval_pipeline = build_pipeline(parts, stages, n_stages, parallel_cfg.pp_schedule, grad_accum_steps,
                                             pp_group, ctx.device)
    tied = tie_embedding_copies(parts, ctx.mesh, pp_group)
    return PipelineEngine(pipeline, eval_pipeline, policy, optim_cfg, ctx.device, loss_parallel=loss_parallel,
                          tied=tied)
