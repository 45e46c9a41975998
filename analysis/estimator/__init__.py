"""Analytic model of one training step on a data x tensor x pipeline layout: memory per GPU,
communication, time, MFU, and a planner that searches layouts.

Everything here is arithmetic on a ``ModelConfig`` and a ``DeviceSpec``; nothing touches a GPU.
Parameter counts and FLOPs come from ``model/flops.py`` (the same functions the trainer logs).
docs/estimator.md is the one home of the derivation: every formula, assumption and fitted
parameter, where each comes from, and how far the predictions are from published measurements
(analysis/published.py, docs/results/published_vs_estimator.md).

The package, by concern, each module importing only those above it:

    job.py            the job (JobSpec), the model's parameters (Assumptions), choices, errors
    activations.py    bytes one layer saves for backward under each recompute policy
    memory.py         model states, pipeline stages, the peak per GPU
    communication.py  collectives of every parallel dimension, their bytes and seconds
    time.py           GEMMs, attention, element-wise work, exposed communication, the bubble
    step.py           one step's estimate (memory + communication + time) and whether it fits
    planning.py       the planner, the trainer's fit verdict, layouts in the config's words
    presets.py        the chapter's models

This file is the public API: everything callers use is importable from ``analysis.estimator``.
"""

from __future__ import annotations

from analysis.estimator.activations import (
    activation_bytes_per_layer,
    korthikanti_bytes_per_layer,
    saved_bytes_per_layer,
)
from analysis.estimator.communication import (
    CommVolume,
    collective_seconds,
    comm_volume,
    cp_comm_seconds,
    dp_volume,
    expert_all_to_all,
    expert_exchanges,
    expert_tp_collectives,
    fsdp_collectives,
    gradient_reductions,
    kv_gather_bytes,
    parameter_tensors,
    pp_comm_seconds,
    reshards_after_forward,
    ring_latency_seconds,
    tp_comm_seconds,
    zero3_collective_count,
)
from analysis.estimator.job import (
    ACTIVATION_BYTES,
    ATTENTION_BACKEND_KIND,
    ATTENTION_KERNELS,
    ATTENTION_KINDS,
    CUDNN_HOPPER_ATTENTION_SPEEDUP,
    FITTED_PARAMETERS,
    FP8_CAST_KERNELS,
    FP8_SCALINGS,
    FP8_WEIGHT_CASTS,
    GIB,
    MUON_NS_STEPS,
    MUON_PIECE_BYTES,
    OP_SELECTIVE_SAVES,
    OPTIMIZERS,
    PP_SCHEDULES,
    PRECISION_MODES,
    RECOMPUTE_POLICIES,
    SINK_ATTENTION,
    STATE_BYTES,
    STRATEGIES,
    ZERO3_COLLECTIVES,
    ZERO_REDUCTIONS,
    Assumptions,
    EstimatorError,
    JobSpec,
    StateBytes,
    layout_of,
)
from analysis.estimator.memory import (
    MemoryEstimate,
    MuonMatrices,
    activation_bytes_total,
    block_parameters_per_gpu,
    cp_attention_bytes_per_layer,
    cp_chunk_keys,
    estimate_memory,
    gathered_bytes,
    kv_cache_bytes,
    loss_backward_bytes,
    model_state_bytes,
    mtp_parameters_per_gpu,
    muon_buffer_saving,
    muon_groups,
    muon_matrices,
    muon_numel,
    pipeline_in_flight,
    root_parameters_per_gpu,
    routed_parameters_per_block,
    stage_memory,
    stage_parameters,
    stage_routed_parameters,
    stage_state_bytes,
)
from analysis.estimator.planning import (
    CP_SEARCH_FROM,
    PLANNER_STRATEGIES,
    context_parallel_sizes,
    describe_plan,
    expert_parallel_sizes,
    fit_verdict,
    fp8_scaling_of,
    job_of,
    job_overrides,
    job_verdict,
    job_words,
    min_gpus_to_fit,
    model_parallel_sizes,
    plan_fits,
    plan_layouts,
    resolve_device,
    smallest_power_of_two,
    trainer_config,
    trainer_refusal,
)
from analysis.estimator.presets import PRESET_NAMES, Preset, preset
from analysis.estimator.step import Estimate, describe_estimate, estimate, memory_problems
from analysis.estimator.time import (
    TimeEstimate,
    attention_seconds,
    bubble_fraction,
    bubble_overhead,
    causal_pairs,
    estimate_time,
    fused_core_share,
    gemm_seconds,
    layer_gemms,
    moe_permutation_bytes,
    muon_step,
    recompute_flops_per_token,
)
from model.flops import count_parameters, flops_per_token, matmul_parameters  # callers read them from here too
from parallel.layout import Layout  # what a JobSpec's layout is

__all__ = [
    "ACTIVATION_BYTES", "ATTENTION_BACKEND_KIND", "ATTENTION_KINDS", "FITTED_PARAMETERS", "FP8_CAST_KERNELS", "FP8_SCALINGS", "FP8_WEIGHT_CASTS", "GIB", "OP_SELECTIVE_SAVES",
    "RECOMPUTE_POLICIES", "SINK_ATTENTION", "ATTENTION_KERNELS", "CUDNN_HOPPER_ATTENTION_SPEEDUP", "PP_SCHEDULES", "PRECISION_MODES", "STATE_BYTES", "STRATEGIES", "ZERO3_COLLECTIVES",
    "ZERO_REDUCTIONS",
    "Assumptions", "EstimatorError", "JobSpec", "StateBytes", "layout_of", "activation_bytes_per_layer",
    "korthikanti_bytes_per_layer", "saved_bytes_per_layer", "MemoryEstimate", "activation_bytes_total",
    "block_parameters_per_gpu", "cp_attention_bytes_per_layer", "cp_chunk_keys", "estimate_memory", "gathered_bytes",
    "loss_backward_bytes", "model_state_bytes", "root_parameters_per_gpu",
    "pipeline_in_flight", "kv_cache_bytes", "mtp_parameters_per_gpu", "routed_parameters_per_block", "stage_memory", "stage_parameters",
    "stage_routed_parameters", "stage_state_bytes", "CommVolume", "collective_seconds", "comm_volume",
    "cp_comm_seconds", "dp_volume", "expert_all_to_all", "expert_exchanges", "expert_tp_collectives", "fsdp_collectives", "gradient_reductions", "kv_gather_bytes",
    "parameter_tensors", "pp_comm_seconds", "reshards_after_forward", "ring_latency_seconds", "tp_comm_seconds",
    "zero3_collective_count", "TimeEstimate", "attention_seconds", "bubble_fraction",
    "bubble_overhead", "causal_pairs", "estimate_time", "fused_core_share", "gemm_seconds", "layer_gemms", "moe_permutation_bytes", "recompute_flops_per_token", "Estimate",
    "describe_estimate", "estimate", "memory_problems", "CP_SEARCH_FROM", "PLANNER_STRATEGIES",
    "context_parallel_sizes", "describe_plan", "expert_parallel_sizes", "fit_verdict", "fp8_scaling_of", "job_of", "job_verdict", "job_overrides",
    "job_words", "min_gpus_to_fit", "model_parallel_sizes", "plan_fits", "plan_layouts", "resolve_device",
    "smallest_power_of_two", "trainer_config", "trainer_refusal", "PRESET_NAMES", "Preset", "preset",
    "count_parameters", "flops_per_token", "matmul_parameters", "Layout", "MUON_NS_STEPS", "MUON_PIECE_BYTES",
    "OPTIMIZERS", "MuonMatrices", "muon_buffer_saving", "muon_groups", "muon_matrices", "muon_numel", "muon_step",
]
