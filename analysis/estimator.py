"""Analytic model of one training step on a data x tensor x pipeline layout: memory per GPU,
communication, time, MFU, and a planner that searches layouts.

Everything here is arithmetic on a ``ModelConfig`` and a ``DeviceSpec``; nothing touches a GPU.
Parameter counts and FLOPs come from ``model/flops.py`` (the same functions the trainer logs).
docs/estimator.md is the one home of the derivation: every formula, assumption and fitted
parameter, where each comes from, and how far the predictions are from published measurements
(analysis/published.py, docs/results/published_vs_estimator.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction

from common.errors import ConfigError
from common.fields import choices
from common.hardware import DEVICES, DeviceSpec, lookup_device
from common.report import gib
from model.config import RECOMPUTE_POLICIES, ModelConfig
from model.flops import (
    blocks_parameters,
    count_parameters,
    flops_per_token,
    matmul_parameters,  # noqa: F401 (callers read it from here: est.matmul_parameters)
    moe_parameters,
)
from parallel.config import ParallelConfig
from parallel.precision import PrecisionConfig
from training.config import JobConfig

GIB = 2**30

# The choices the trainer's config sections accept, read from them (never a second copy).
POLICIES = RECOMPUTE_POLICIES
STRATEGIES = choices(ParallelConfig, "strategy")
PRECISION_MODES = choices(PrecisionConfig, "mode")
PP_SCHEDULES = choices(ParallelConfig, "pp_schedule")
ATTENTION_KINDS = ("materialized", "flash")
# Attention backends (model.attention) by what they store: only the reference keeps the scores.
ATTENTION_BACKEND_KIND = {"reference": "materialized", "sdpa": "flash", "flash_attn": "flash", "auto": "flash"}

# The optimizers the trainer offers (optim.name): AdamW everywhere, or Muon on the hidden matrices.
OPTIMIZERS = ("adamw", "muon")
# Muon as the trainer runs it on a GPU: optim.muon.ns_steps' default, and the Newton-Schulz dtype of
# optim.muon.ns_dtype=auto (bf16 on CUDA), in which sharded matrices travel to their owners and back.
MUON_NS_STEPS = 5
MUON_PIECE_BYTES = 2

# zero3 is modelled exactly like fsdp (both shard parameters, gradients and optimizer state), so
# the planner lists fsdp for both.
PLANNER_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
# Sequences from this length on make the planner try context parallelism (context_parallel_sizes).
CP_SEARCH_FROM = 16384
# Schedules that run several model chunks (virtual stages) per GPU.
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


class EstimatorError(ValueError):
    """Bad input to the estimator; the message names the argument and the valid choices."""


# --------------------------------------------------------------------------- bytes per element


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state (AdamW)."""

    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


STATE_BYTES: dict[str, StateBytes] = {
    # fp32 weights and grads, fp32 exp_avg and exp_avg_sq.
    "fp32": StateBytes(4, 4, 8),
    # torch.autocast keeps fp32 parameters and gradients; only activations are 16-bit. This is why
    # "AMP halves memory" is wrong for model states.
    "bf16": StateBytes(4, 4, 8),
    "fp16": StateBytes(4, 4, 8),
    # 16-bit weights and grads, fp32 master + exp_avg + exp_avg_sq: the ZeRO paper's 2 + 2 + 12.
    "bf16_master": StateBytes(2, 2, 12),
    # Transformer Engine FP8 keeps bf16 weights and fp32 master state; its FP8 weight copies are
    # per-layer caches and not counted.
    "fp8": StateBytes(2, 2, 12),
}

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16_master": 2, "fp8": 2}


# --------------------------------------------------------------------------- activations


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise EstimatorError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def _checkpointed_layers(n_layer: int, every_k: int) -> int:
    # model.recompute wraps blocks whose 1-based index is a multiple of k.
    return n_layer // every_k


def _dense_mlp_activation_elements(cfg: ModelConfig, f: int) -> int:
    if cfg.mlp == "swiglu":
        return 4 * f  # gate and up (2f), silu(gate) (f), silu(gate)*up (f)
    return 2 * f  # GELU input and GELU output


def _moe_activation_elements(cfg: ModelConfig, dtype_bytes: int) -> float:
    """Per token in a MoE layer, in activations of ``dtype_bytes``: each of its top-k copies keeps its
    permuted input row, its expert's hidden activations and its output row; the router keeps fp32
    logits and scores (E each), the dispatch int64 slot and expert indices (k each), whatever the
    activation dtype; the shared experts keep a dense MLP's."""
    k, f, e = cfg.moe.top_k, cfg.expert_d_ff, cfg.moe.experts
    copies = k * (2 * cfg.d_model + _dense_mlp_activation_elements(cfg, f))
    router_and_dispatch = (2 * e * 4 + 2 * k * 8) / dtype_bytes  # their bytes, as activation elements
    shared = cfg.moe.shared_experts * f
    return copies + router_and_dispatch + (_dense_mlp_activation_elements(cfg, shared) if shared else 0)


def _mlp_activation_elements(cfg: ModelConfig, dtype_bytes: int) -> float:
    """Elements per token saved inside the MLP between its two matmuls (a MoE model: the mean over
    layers), in activations of ``dtype_bytes``."""
    dense = _dense_mlp_activation_elements(cfg, cfg.d_ff)
    if cfg.moe.experts is None:
        return dense
    moe = cfg.n_moe_layers
    return (moe * _moe_activation_elements(cfg, dtype_bytes) + (cfg.n_layer - moe) * dense) / cfg.n_layer


def _mlp_hidden_width(cfg: ModelConfig) -> float:
    """Hidden units one token runs through in an MLP (a MoE model: the mean over layers; a MoE layer:
    its top-k experts and the shared ones)."""
    if cfg.moe.experts is None:
        return cfg.d_ff
    moe = cfg.n_moe_layers
    active = (cfg.moe.top_k + cfg.moe.shared_experts) * cfg.expert_d_ff
    return (moe * active + (cfg.n_layer - moe) * cfg.d_ff) / cfg.n_layer


def _moe_activation_share(cfg: ModelConfig, elements: float) -> float:
    """A MoE layer's ``elements`` per token, as the mean over layers does (0 for a dense model)."""
    return 0.0 if cfg.moe.experts is None else cfg.n_moe_layers * elements / cfg.n_layer


def _moe_matmul_output_elements(cfg: ModelConfig) -> float:
    """Per token in a MoE layer: its top-k copies' and the shared experts' first matmul outputs."""
    gated = 2 if cfg.mlp == "swiglu" else 1
    return (cfg.moe.top_k + cfg.moe.shared_experts) * gated * cfg.expert_d_ff


def _mlp_matmul_output_elements(cfg: ModelConfig) -> float:
    dense = (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff
    if cfg.moe.experts is None:
        return dense
    moe = cfg.n_moe_layers
    return (moe * _moe_matmul_output_elements(cfg) + (cfg.n_layer - moe) * dense) / cfg.n_layer


def activation_bytes_per_layer(
    model_cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    policy: str,
    dtype_bytes: int = 2,
    dropout: bool | None = None,
    *,
    attention: str = "materialized",
    dropout_mask_bytes: int = 1,
    every_k: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Bytes one transformer layer keeps on one GPU for backward (Korthikanti et al. 2022, generalized).

    ``dropout`` defaults to ``model_cfg.dropout > 0``; ``attention`` is ``materialized`` (the
    s x s scores are stored, the paper's case) or ``flash`` (only a fp32 log-sum-exp per row), or
    a backend name (``reference`` stores the scores; ``sdpa``, ``flash_attn`` do not);
    ``every_k`` defaults to ``model_cfg.recompute_every_k``. With ``tp`` > 1 the tensors inside
    the tensor-parallel region are split over ``tp`` GPUs, and the rest too when
    ``sequence_parallel``. See the module docstring.
    """
    _check_choice("policy", policy, POLICIES)
    attention = ATTENTION_BACKEND_KIND.get(attention, attention)
    _check_choice("attention", attention, ATTENTION_KINDS + tuple(ATTENTION_BACKEND_KIND))
    if tp < 1:
        raise EstimatorError(f"tp must be >= 1 (got {tp})")
    s, b, h, a = seq_len, micro_batch, model_cfg.d_model, model_cfg.n_head
    kv = model_cfg.kv_dim  # K and V are each kv wide; h with multi-head attention, less with GQA
    p, m = dtype_bytes, dropout_mask_bytes
    with_dropout = model_cfg.dropout > 0 if dropout is None else dropout
    tokens = s * b
    split = dict(tp=tp, sequence_parallel=sequence_parallel)

    if policy == "full":
        return _tp_split(p * tokens * h, 0, **split)  # the layer input lies outside the TP region
    if policy == "offload":
        return 0.0
    if policy == "every_k":
        k = every_k or model_cfg.recompute_every_k
        kept = _checkpointed_layers(model_cfg.n_layer, k)
        full = activation_bytes_per_layer(model_cfg, s, b, "full", p, with_dropout, attention=attention, **split)
        none = activation_bytes_per_layer(
            model_cfg, s, b, "none", p, with_dropout, attention=attention, dropout_mask_bytes=m, **split
        )
        return (kept * full + (model_cfg.n_layer - kept) * none) / model_cfg.n_layer

    # Attention scores and their log-sum-exp are per head: inside the TP region.
    if attention == "flash":
        scores = 4.0 * a * s * b  # fp32 log-sum-exp; the mask is regenerated from the RNG state
    else:
        scores = (2 * p + m if with_dropout else p) * a * s * s * b
    # A MoE layer is not tensor-split (replicated over the tp GPUs, parallel/tp.py): its activations
    # lie outside the TP region, on s/t positions per GPU only with sequence parallelism.
    if policy == "op_selective":
        moe = _moe_activation_share(model_cfg, _moe_matmul_output_elements(model_cfg)) if model_cfg.moe.experts else 0.0
        outside = h + h + h + moe  # block input, projection output, MLP output (+ MoE layers' matmul outputs)
        inside = (h + 2 * kv) + h + _mlp_matmul_output_elements(model_cfg) - moe  # qkv, core output, fc
        core_extra = 4.0 * a * s * b if attention == "flash" else p * a * s * s * b  # lse, or the QK^T bmm output
        return _tp_split(p * tokens * outside, p * tokens * inside + core_extra, **split)

    outside = (
        2 * h  # inputs of the two norms
        + h  # QKV matmul input
        + h  # MLP first matmul input
    )
    moe = _moe_activation_share(model_cfg, _moe_activation_elements(model_cfg, p)) if model_cfg.moe.experts else 0.0
    outside += moe
    inside = (
        h + 2 * kv  # Q and K (for QK^T) and V (for @V)
        + h  # output projection input
        + _mlp_activation_elements(model_cfg, p) - moe
    )
    masks = 2 * m * tokens * h if with_dropout else 0  # after attention and after the MLP: outside
    core = 0.0 if policy == "selective" else scores
    return _tp_split(p * tokens * outside + masks, p * tokens * inside + core, **split)


def _tp_split(outside: float, inside: float, *, tp: int, sequence_parallel: bool) -> float:
    """Bytes on one GPU: the TP region is split over ``tp``; the rest only with sequence parallelism."""
    if tp == 1:
        return float(outside + inside)
    return outside / (tp if sequence_parallel else 1) + inside / tp


def korthikanti_bytes_per_layer(
    seq_len: int, micro_batch: int, hidden: int, heads: int, policy: str, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """The paper's closed forms (16-bit activations, dropout, 4h MLP), for checking the general one.

    Section 4.1 (t = 1), 4.2.1 (tensor parallel), 4.2.2 (+ sequence parallel) and its table of
    per-layer activation memory. Evaluated in exact rational arithmetic and rounded once. Full
    recompute with sequence parallelism keeps a sequence-split input, 2*s*b*h/t (the paper's
    table lists full recompute only as 2*s*b*h, without sequence parallelism).
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = Fraction(s * b * h)
    scores = Fraction(5 * a * s, h)
    if sequence_parallel and t > 1:
        forms = {"none": sbh / t * (34 + scores), "selective": 34 * sbh / t, "full": 2 * sbh / t}
    else:
        forms = {
            "none": sbh * (10 + Fraction(24, t) + scores / t),
            "selective": sbh * (10 + Fraction(24, t)),
            "full": 2 * sbh,
        }
    if policy not in forms:
        raise EstimatorError(f"policy={policy!r}: the paper gives none, selective and full only")
    return float(forms[policy])


def saved_bytes_per_layer(
    model_cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    policy: str,
    dtype_bytes: int = 4,
    *,
    attention: str = "sdpa",
    device: str = "cpu",
    every_k: int | None = None,
) -> float:
    """Bytes of tensors our ``Block`` saves for backward, counted by storage, for a model whose
    weights and activations are all ``dtype_bytes`` wide (``model.to(dtype)``), with the
    reference kernels of ``kernels/reference.py``.

    ``attention`` is the backend: ``sdpa`` or ``reference``. On CPU, SDPA with dropout falls
    back to PyTorch's math path, which upcasts 16-bit inputs to fp32 and stores the scores, and
    dropout masks are as wide as their input; on CUDA masks are 1 byte and SDPA stays fused.
    Parameters (and their fp32 casts in 16-bit models, a few KiB) are not counted. Tensors kept
    alive by checkpointing (block or core inputs) and tensors ``op_selective`` caches are
    counted, because they occupy memory just the same; ``offload`` counts what moves to the host.
    """
    _check_choice("policy", policy, POLICIES)
    _check_choice("attention", attention, ("sdpa", "reference"))
    _check_choice("device", device, ("cpu", "cuda"))
    cfg = model_cfg
    s, b, h, a = seq_len, micro_batch, cfg.d_model, cfg.n_head
    p, n = dtype_bytes, seq_len * micro_batch
    dropout = cfg.dropout > 0
    mask = p if device == "cpu" else 1
    fused = attention == "sdpa" and not (dropout and device == "cpu")
    rope_tables = 2 * s * (cfg.head_dim // 2) * p if cfg.position == "rope" else 0
    kv = cfg.kv_dim  # narrower than h with grouped-query attention
    rotated_qk = p * n * (h + kv) if cfg.position == "rope" else 0
    qkv_out = p * n * (h + 2 * kv)

    if policy == "full":
        return float(p * n * h + rope_tables)
    if policy == "every_k":
        k = every_k or cfg.recompute_every_k
        kept = _checkpointed_layers(cfg.n_layer, k)
        args = (cfg, s, b)
        full = saved_bytes_per_layer(*args, "full", p, attention=attention, device=device)
        none = saved_bytes_per_layer(*args, "none", p, attention=attention, device=device)
        return (kept * full + (cfg.n_layer - kept) * none) / cfg.n_layer
    if policy == "op_selective":
        if fused:
            core = p * n * h + 4 * n * a  # SDPA output and log-sum-exp
        else:
            width = 4 if attention == "sdpa" else p  # the math path upcasts to fp32
            core = width * a * s * s * b + width * n * h  # QK^T and @V bmm outputs
        matmuls = qkv_out + p * n * (h + _mlp_matmul_output_elements(cfg) + h)  # qkv, proj, fc, out
        return float(p * n * h + matmuls + core + rope_tables)

    norm_input = 4 * n * h  # the reference norms compute in fp32 and save the fp32 input
    if cfg.norm == "layernorm":
        norm = norm_input + 2 * 4 * n  # fp32 mean and rstd
    else:
        norm = norm_input + 4 * n * h + 4 * n  # x * rsqrt(mean(x^2)) in fp32, and the rsqrt
    mlp = p * n * h + p * n * _mlp_activation_elements(cfg, p)  # first matmul input + activations
    resid_masks = 2 * mask * n * h if dropout else 0

    core_inputs = qkv_out + rotated_qk + rope_tables  # q, k, v are views of the qkv output
    if fused:
        core = core_inputs + p * n * h + 4 * n * a  # output (= projection input) and log-sum-exp
        proj_input = 0
    else:
        core = _unfused_core_bytes(p, n, h, a, s, b, attention, dropout, mask) + rope_tables
        proj_input = p * n * h  # the reshape after the core copies its output
    if policy == "selective":
        # The checkpointed core keeps its inputs (views of the qkv output) and, for SDPA, its
        # output, which the projection saves anyway.
        core, proj_input = core_inputs, p * n * h
    # ``offload`` saves exactly what ``none`` saves, in host memory instead.
    return float(2 * norm + p * n * h + core + proj_input + mlp + resid_masks)


def _unfused_core_bytes(p: int, n: int, h: int, a: int, s: int, b: int, attention: str, dropout: bool, mask: int) -> int:
    """Saved bytes of an attention core that builds the (b, a, s, s) scores.

    QK^T and @V save contiguous copies of q (scaled, on the math path), k^T and v. The reference
    softmax runs in fp32 and is cast back (a second copy in 16-bit models) and its causal mask is
    a bool s x s; its dropout keeps a mask and the dropped probabilities. SDPA's math path (CPU
    with dropout) upcasts 16-bit inputs to fp32, so everything there is 4 bytes wide.
    """
    scores = a * s * s * b
    if attention == "sdpa":
        return 3 * 4 * n * h + 4 * scores * (3 if dropout else 1)
    total = 3 * p * n * h + 4 * scores + s * s
    if dropout:
        total += (mask + p) * scores  # the 16-bit cast of the probabilities is dropout's input only
    elif p != 4:
        total += p * scores  # the 16-bit cast of the fp32 probabilities, saved by @V
    return total


# --------------------------------------------------------------------------- model states, comm


def model_state_bytes(n_params: float, strategy: str, world_size: int, precision: str) -> StateBytes:
    """Bytes per GPU of weights, gradients and optimizer state (ZeRO paper, section 5).

    ``n_params`` is what one GPU holds before data-parallel sharding (all of it without tensor or
    pipeline parallelism, ``stage_parameters`` with them); ``world_size`` the ranks it is sharded over.
    """
    _check_choice("strategy", strategy, STRATEGIES)
    _check_choice("precision", precision, PRECISION_MODES)
    per = STATE_BYTES[precision]
    n = 1 if strategy in ("none", "ddp") else world_size
    shard_opt = strategy in ("zero1", "zero2", "zero3", "fsdp")
    shard_grad = strategy in ("zero2", "zero3", "fsdp")
    shard_param = strategy in ("zero3", "fsdp")
    return StateBytes(
        param=n_params * per.param / (n if shard_param else 1),
        grad=n_params * per.grad / (n if shard_grad else 1),
        optimizer=n_params * per.optimizer / (n if shard_opt else 1),
    )


@dataclass(frozen=True)
class CommVolume:
    """Bytes of whole tensors entering collectives per optimizer step, and bytes each GPU sends."""

    all_reduce: float  # M of the all-reduces
    reduce_scatter: float
    all_gather: float
    world_size: int  # ranks of those collectives (the data-parallel, or HSDP shard, group)
    replica_all_reduce: float = 0.0  # HSDP: M of the all-reduce across replicas
    replicas: int = 1
    tensor_parallel: float = 0.0  # bytes each GPU sends in tensor-parallel collectives per step
    pipeline: float = 0.0  # bytes each GPU sends to its neighbouring stages per step
    expert_all_to_all: float = 0.0  # bytes each GPU sends in expert-parallel dispatch and combine per step
    expert_sharded: float = 0.0  # bytes each GPU sends gathering and reducing its experts (FSDP over dp_shard / ep)
    muon: float = 0.0  # bytes each GPU sends moving sharded Muon matrices to their owners and back

    @property
    def sent_per_gpu(self) -> float:
        extra = self.tensor_parallel + self.pipeline + self.expert_all_to_all + self.expert_sharded + self.muon
        if self.replicas > 1:
            extra += 2 * (self.replicas - 1) / self.replicas * self.replica_all_reduce
        if self.world_size <= 1:
            return extra
        frac = (self.world_size - 1) / self.world_size
        return frac * (2 * self.all_reduce + self.reduce_scatter + self.all_gather) + extra


def comm_volume(n_params: float, strategy: str, world_size: int, precision: str) -> CommVolume:
    """What each strategy puts through collectives per step (ZeRO paper, section 7)."""
    _check_choice("strategy", strategy, STRATEGIES)
    per = STATE_BYTES[precision]
    grads, params = n_params * per.grad, n_params * per.param
    if strategy == "none" or world_size <= 1:
        return CommVolume(0.0, 0.0, 0.0, world_size)
    if strategy == "ddp":
        return CommVolume(grads, 0.0, 0.0, world_size)
    if strategy in ("zero1", "zero2"):
        return CommVolume(0.0, grads, params, world_size)
    return CommVolume(0.0, grads, 2 * params, world_size)  # all-gather in forward and in backward


# --------------------------------------------------------------------------- tensor and pipeline parallelism


def block_parameters_per_gpu(cfg: ModelConfig, tp: int = 1) -> float:
    """One block's parameters on one of ``tp`` GPUs: the matmul weights (and column-parallel
    biases) are split; norm gains and the two row-parallel output biases are whole (Megatron-LM).
    A MoE layer is whole (router and experts replicated over the tp GPUs, parallel/tp.py). A MoE
    model's blocks differ (dense and MoE layers): their mean, every expert included."""
    block = blocks_parameters(cfg) / cfg.n_layer
    if tp == 1:
        return block
    norm = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    out_bias = cfg.d_model if cfg.bias else 0
    moe_share = cfg.n_moe_layers / cfg.n_layer if cfg.moe.experts is not None else 0.0
    mlp_whole = moe_share * (moe_parameters(cfg) if moe_share else 0) + (1 - moe_share) * out_bias
    whole = 2 * norm + out_bias + mlp_whole
    return (block - whole) / tp + whole


def stage_parameters(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds under tensor parallelism ``tp``.

    Each of its L/p blocks counts ``block_parameters_per_gpu``. The first stage holds
    the vocab-parallel token table (1/t) and the learned positions (whole), the last stage the
    final norm and the vocab-parallel LM head. Tied embeddings share one table when one stage
    holds both ends; with p > 1 the last stage keeps its own copy (Megatron-LM keeps the two in
    sync by all-reducing their gradients). At tp = pp = 1 this is ``count_parameters(cfg)``.
    """
    d, v = cfg.d_model, cfg.vocab_size
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    n = cfg.n_layer // pp * block_parameters_per_gpu(cfg, tp)
    table = v * d if tp == 1 else v * d / tp
    if stage == 0:
        n += table + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
    if stage == pp - 1:
        head = 0 if cfg.tie_embeddings and pp == 1 else table
        n += norm + head
    return n


def pipeline_in_flight(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1, stage: int = 0) -> float:
    """Micro-batches' worth of its own layers' activations stage ``stage`` holds at its peak.

    Counts forwards whose backward has not run yet, in units of the whole stage (an interleaved
    GPU runs ``virtual_stages`` chunks, each 1/v of its layers). The warm-up counts are those of
    torch.distributed.pipelining's schedules (see the module docstring); without a pipeline one
    micro-batch is in flight (gradient accumulation frees each before the next).
    """
    _check_choice("pp_schedule", schedule, PP_SCHEDULES)
    p, m, v, i = stages, microbatches, virtual_stages, stage
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - i, m))
    per_round = m // max(1, m // p)
    hops = 2 * (p - 1 - i) if schedule == "interleaved_1f1b" else p - 1 - i
    chunks = min((v - 1) * per_round + hops + 1, m * v)
    return chunks / v


def bubble_overhead(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Pipeline idle time relative to the ideal compute time (Narayanan et al. 2021, section 2.2)."""
    _check_choice("pp_schedule", schedule, PP_SCHEDULES)
    p, m, v = stages, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    # zero_bubble (ZB-H1): weight-gradient work fills the warm-up, leaving (p-1)*(F + B - W) of
    # 1F1B's (p-1)*(F + B + W) idle; a third with equal F, B and W.
    return (p - 1) / (3 * v * m)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of the step the pipeline stands idle: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1)
    interleaved, (p-1)/(3*v*m+p-1) zero-bubble."""
    idle = bubble_overhead(schedule, stages, microbatches, virtual_stages)
    return idle / (1 + idle)


def torch_microbatch_rule(schedule: str, stages: int, microbatches: int) -> str | None:
    """Why torch's schedule refuses ``microbatches`` on ``stages`` stages, or None.

    Every schedule needs at least one micro-batch per stage (Schedule1F1B checks it; the layout
    requires it of all); the interleaved schedules run max(1, m // p) rounds and need m to be a
    multiple of them.
    """
    if stages == 1:
        return None
    if microbatches < stages:
        return f"grad_accum={microbatches} micro-batches must be >= pp={stages} stages"
    rounds = max(1, microbatches // stages)
    if schedule in MULTI_CHUNK_SCHEDULES and microbatches % rounds:
        return (f"pp_schedule={schedule} runs {rounds} rounds of micro-batches; grad_accum={microbatches} "
                f"must be a multiple of {rounds}")
    return None


# --------------------------------------------------------------------------- the job and its estimate


@dataclass(frozen=True)
class Assumptions:
    """The parameters of the time and memory model (docs/estimator.md says where each comes from).

    The first six were fitted on the calibration half of the published measurements
    (analysis/published.py; ``python -m tools.published --fit`` reproduces them); the rest are stated
    in advance and were never fitted.
    """

    # fitted (docs/estimator.md, "Calibration")
    gemm_fraction_ampere: float = 0.92  # A100: a GEMM's share of the dense peak as its output dims grow without bound
    gemm_fraction_hopper: float = 0.61  # H100/H200: the same
    gemm_knee: float = 448.0  # an output dimension x runs at x / (x + knee) of that rate
    attention_fraction: float = 0.31  # a fused (flash) attention kernel's rate, relative to a large GEMM's
    elementwise_scale: float = 1.68  # multiplier on the counted element-wise memory traffic
    fp8_gemm_fraction: float = 0.99  # FP8 GEMMs: share of the dense FP8 peak as the output dims grow
    # stated
    overlap_efficiency: float = 0.5  # share of an overlappable collective that compute really hides
    link_fraction: float = 0.8  # of NVLink / NIC / PCIe one-way peak that a large collective reaches
    hbm_fraction: float = 0.8  # of HBM bandwidth that memory-bound kernels reach
    cuda_context_gib: float = 0.5  # CUDA context and kernel images, outside PyTorch's allocator
    comm_buffers_gib: float = 0.5  # NCCL channel buffers, outside PyTorch's allocator
    fragmentation: float = 0.1  # the caching allocator's reserve above the bytes allocated at the peak
    unsharded_layers: int = 2  # ZeRO-3/FSDP: the layer in use and the prefetched one

    def gemm_fraction(self, device: DeviceSpec) -> float:
        return self.gemm_fraction_ampere if device.family == "ampere" else self.gemm_fraction_hopper


# The parameters the calibration fits, in the order it searches them.
FITTED_PARAMETERS = ("gemm_fraction_ampere", "gemm_fraction_hopper", "gemm_knee", "attention_fraction",
                     "elementwise_scale", "fp8_gemm_fraction")


@dataclass(frozen=True)
class JobSpec:
    """One training job: model, batch, layout, strategy, recompute policy, precision and GPU.

    The layout fields are the config's ``parallel`` words; dp_shard is what remains of
    ``world_size`` after tp, pp and dp_replicate. ``grad_accum`` is the number of micro-batches
    per step (the pipeline's micro-batches under pp). ``tp_overlap`` and ``dp_overlap`` say whether
    the framework overlaps those collectives with compute: the trainer does not overlap tensor-parallel
    collectives and overlaps data-parallel ones (other frameworks' published runs set them as they ran).
    """

    model: ModelConfig
    seq_len: int
    micro_batch: int
    world_size: int = 1
    strategy: str = "fsdp"
    policy: str = "none"
    precision: str = "bf16_master"
    device: DeviceSpec = field(default_factory=lambda: DEVICES["H100"])
    grad_accum: int = 1
    assumptions: Assumptions = field(default_factory=Assumptions)
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    sequence_parallel: bool | None = None  # None: on whenever tp > 1 (the config's default)
    cp: int = 1  # context parallelism: each sequence split over cp GPUs (parallel/cp.py)
    tp_overlap: bool = False
    dp_overlap: bool = True
    fsdp_reshard_after_forward: bool = True  # parallel.fsdp_reshard_after_forward
    ep: int = 1  # parallel.ep: an MoE model's routed experts split over ep of the dp_shard x cp GPUs
    optimizer: str = "adamw"  # optim.name: muon keeps one state buffer per hidden matrix instead of two

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("precision", self.precision, PRECISION_MODES)
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        counts = ("seq_len", "micro_batch", "world_size", "grad_accum", "tp", "pp", "dp_replicate", "pp_virtual_stages",
                  "cp")
        for key in counts:
            if getattr(self, key) < 1:
                raise EstimatorError(f"{key} must be >= 1 (got {getattr(self, key)})")
        self._check_layout()
        if self.strategy == "none" and self.dp > 1:
            raise EstimatorError(
                f"strategy=none has no data parallelism; {self.dp} data-parallel ranks (world_size="
                f"{self.world_size} / (tp*pp)) needs ddp, zero1-3 or fsdp"
            )
        if self.precision == "fp8" and self.device.fp8_tflops is None:
            raise EstimatorError(f"precision=fp8 needs FP8 tensor cores; {self.device.name} has none (use bf16_master)")

    def _check_layout(self) -> None:
        cfg, t, p, v = self.model, self.tp, self.pp, self.pp_virtual_stages
        if self.world_size % (t * p * self.cp * self.dp_replicate):
            names = "tp*pp*cp*dp_replicate" if self.cp > 1 else "tp*pp*dp_replicate"
            raise EstimatorError(f"world_size={self.world_size} is not divisible by {names}="
                                 f"{t * p * self.cp * self.dp_replicate}")
        if self.seq_len % (2 * self.cp):
            raise EstimatorError(f"cp={self.cp} splits each sequence into 2*cp chunks: seq_len={self.seq_len} must "
                                 f"divide by {2 * self.cp}")
        if cfg.n_head % t or cfg.kv_heads % t:
            raise EstimatorError(f"tp={t} must divide model.n_head={cfg.n_head} and the KV heads ({cfg.kv_heads})")
        if cfg.n_layer % (p * v):
            raise EstimatorError(
                f"pp*pp_virtual_stages={p}*{v} must divide model.n_layer={cfg.n_layer} (equal stages)"
            )
        if v > 1 and self.pp_schedule not in MULTI_CHUNK_SCHEDULES:
            raise EstimatorError(
                f"pp_virtual_stages={v} needs pp_schedule in {', '.join(MULTI_CHUNK_SCHEDULES)} "
                f"(pp_schedule={self.pp_schedule} runs one chunk per GPU)"
            )
        if self.pp_schedule == "interleaved_1f1b" and p > 1 and v < 2:
            raise EstimatorError("pp_schedule=interleaved_1f1b needs pp_virtual_stages >= 2")
        problem = torch_microbatch_rule(self.pp_schedule, p, self.grad_accum)
        if problem:
            raise EstimatorError(problem)
        if self.dp_replicate > 1 and self.strategy not in ("zero3", "fsdp"):
            raise EstimatorError(f"dp_replicate={self.dp_replicate} (HSDP) needs strategy=fsdp, not {self.strategy}")
        if self.ep < 1:
            raise EstimatorError(f"ep must be >= 1 (got {self.ep})")
        if self.ep > 1:
            if cfg.moe.experts is None or cfg.moe.experts % self.ep:
                raise EstimatorError(f"ep={self.ep} must divide the model's routed experts ({cfg.moe.experts})")
            if self.cp > 1 and self.ep % self.cp:
                raise EstimatorError(f"ep={self.ep} must be a multiple of cp={self.cp}: an expert-parallel group spans "
                                     "whole context-parallel groups")
            if self.shard_group % self.ep:
                gpus = "dp_shard x cp" if self.cp > 1 else "dp_shard"
                raise EstimatorError(f"ep={self.ep} must divide the {self.shard_group} {gpus} GPUs it is carved out of")

    @property
    def dp(self) -> int:
        """Data-parallel ranks (dp_replicate x dp_shard): how many micro-batches run side by side."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def shard_group(self) -> int:
        """GPUs that shard the model states and average gradients together: dp_shard, with the cp
        ranks folded in (they hold the same weights and see different tokens, parallel/dims.py)."""
        return self.dp_shard * self.cp

    @property
    def config_dp_shard(self) -> int:
        """parallel.dp_shard as the trainer's config counts it: with ep, the GPUs holding the same
        experts (ep is carved out of dp_shard x cp, parallel/dims.py)."""
        return self.shard_group // self.ep if self.ep > 1 else self.dp_shard

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence on one GPU (seq_len / cp): what activations scale with."""
        return self.seq_len // self.cp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it only means something with tp > 1)."""
        return self.tp > 1 and self.sequence_parallel is not False

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all GPUs."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def attention(self) -> str:
        # sdpa and flash_attn never store the scores on a GPU; only the reference backend does.
        return ATTENTION_BACKEND_KIND[self.model.attention]

    @property
    def activation_dtype_bytes(self) -> int:
        return ACTIVATION_BYTES[self.precision]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU at the peak of a step (forward end / backward start), on the fullest stage.

    ``total`` is what the device holds (what nvidia-smi shows, and what must fit); ``reserved`` is
    what PyTorch's caching allocator holds (``torch.cuda.max_memory_reserved``): the total less the
    CUDA context and the communicators' buffers, which live outside it.
    """

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward by all layers, plus one layer's recompute working set
    logits: float
    unsharded_params: float  # ZeRO-3/FSDP gathered layers and their unreduced gradients
    overhead: float  # CUDA context and communicator buffers, outside the allocator
    host: float  # offloaded activations, in host memory (not part of total)
    stage: int = 0  # the pipeline stage these figures belong to (the one with the largest total)
    fragmentation: float = 0.0  # the allocator's reserve above the allocated peak

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def allocated(self) -> float:
        """Bytes of live tensors at the peak (``torch.cuda.max_memory_allocated``)."""
        return self.states + self.activations + self.logits + self.unsharded_params

    @property
    def reserved(self) -> float:
        return self.allocated + self.fragmentation

    @property
    def total(self) -> float:
        return self.reserved + self.overhead


@dataclass(frozen=True)
class TimeEstimate:
    """One optimizer step's time, by what it is spent on (seconds, on the slowest pipeline stage).

    ``step_s`` is the sum of what is on the critical path: compute, memory-bound work, the exposed
    part of each communication dimension, offload copies and the pipeline bubble. ``comm_s`` and
    ``tp_comm_s`` are the data- and tensor-parallel collectives' whole time, overlapped or not.
    """

    compute_s: float  # GEMMs and the attention core, recomputation included
    comm_s: float  # data-parallel collectives (all of them)
    exposed_comm_s: float  # the part of comm_s that compute does not hide
    offload_s: float
    memory_bound_s: float  # element-wise work, attention-score traffic, the loss and the optimizer step
    tokens_per_step: int  # over all GPUs
    model_flops_per_step: float  # over all GPUs, recomputation excluded (MFU convention)
    peak_tflops: float | None  # per GPU; None for fp8, where no single peak applies
    world_size: int
    tp_comm_s: float = 0.0  # tensor-parallel collectives (all of them)
    pp_comm_s: float = 0.0  # pipeline sends between stages, not overlapped
    bubble_s: float = 0.0  # pipeline fill and drain
    tp_exposed_s: float | None = None  # the part of tp_comm_s on the critical path (None: all of it)
    microbatch_s: float = 0.0  # one micro-batch through the slowest stage (what the bubble is made of)
    ep_comm_s: float = 0.0  # expert-parallel all-to-alls, not overlapped
    muon_s: float = 0.0  # Muon: Newton-Schulz and the all-to-alls to and from the owners, after the backward
    cp_comm_s: float = 0.0  # context-parallel K/V collectives (all of them, none overlapped)

    @property
    def tp_exposed(self) -> float:
        return self.tp_comm_s if self.tp_exposed_s is None else self.tp_exposed_s

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.exposed_comm_s + self.offload_s + self.memory_bound_s
                + self.tp_exposed + self.pp_comm_s + self.bubble_s + self.cp_comm_s + self.ep_comm_s + self.muon_s)

    @property
    def seconds_per_token(self) -> float:
        return self.step_s / self.tokens_per_step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float | None:
        if self.peak_tflops is None:
            return None
        return self.model_flops_per_step / (self.step_s * self.world_size * self.peak_tflops * 1e12)

    def exposed(self) -> dict[str, float]:
        """Seconds per step each communication dimension (and the bubble) adds to the critical path."""
        return {"tp": self.tp_exposed, "pp": self.pp_comm_s, "cp": self.cp_comm_s, "dp": self.exposed_comm_s,
                "bubble": self.bubble_s}


@dataclass(frozen=True)
class Estimate:
    job: JobSpec
    n_params: int
    flops_per_token: float
    memory: MemoryEstimate
    time: TimeEstimate
    comm: CommVolume
    problems: tuple[str, ...]  # empty when the job fits

    @property
    def fits(self) -> bool:
        return not self.problems


def _layer_bytes(job: JobSpec, policy: str) -> float:
    return activation_bytes_per_layer(
        job.model, job.local_seq_len, job.micro_batch, policy, job.activation_dtype_bytes,
        attention=job.attention, tp=job.tp, sequence_parallel=job.sp,
    ) + cp_attention_bytes_per_layer(job, policy)


def cp_attention_bytes_per_layer(job: JobSpec, policy: str) -> float:
    """What a cp GPU's attention keeps beyond a layer of seq_len / cp tokens: the keys and values
    gathered from the other cp ranks (saved by the attention kernel), and with a materialized core
    the scores of its queries against those keys. Rank i's chunks i and 2cp-1-i (c = s / 2cp tokens
    each) see (i + 1) c and (2cp - i) c keys: c^2 (2cp + 1) scores per head, where a layer of s / cp
    tokens counts (s / cp)^2. Selective and full recompute rebuild the core, gather included, in
    backward; every_k keeps it in the layers it does not recompute."""
    cp, cfg = job.cp, job.model
    if cp == 1 or policy in ("selective", "full", "offload"):
        return 0.0
    s, b, p = job.seq_len, job.micro_batch, job.activation_dtype_bytes
    kv = p * b * 2 * cfg.kv_dim * (s - s // cp)  # inside the tensor-parallel region: KV heads split over tp
    scores = 0.0
    if job.attention == "materialized":
        c = s // (2 * cp)
        per_score = 2 * p + 1 if cfg.dropout > 0 else p
        scores = per_score * cfg.n_head * b * (c * c * (2 * cp + 1) - (s // cp) ** 2)
    extra = (kv + scores) / job.tp
    if policy == "every_k":
        kept = _checkpointed_layers(cfg.n_layer, cfg.recompute_every_k)
        return extra * (cfg.n_layer - kept) / cfg.n_layer
    return extra


def _in_flight(job: JobSpec, stage: int) -> float:
    return pipeline_in_flight(job.pp_schedule, job.pp, job.grad_accum, job.pp_virtual_stages, stage)


@dataclass(frozen=True)
class _LayerActivations:
    """Per-layer bytes of a job, the same on every stage: computed once per estimate."""

    kept: float  # what the policy keeps per layer and micro-batch (on the host for offload)
    rebuilt: float  # one layer's recompute (or reload) working set at the peak
    embeddings: float  # the embedding output, on the first stage


def _layer_activations(job: JobSpec) -> _LayerActivations:
    cfg = job.model
    none = _layer_bytes(job, "none")
    embeddings = _tp_split(job.activation_dtype_bytes * job.local_seq_len * job.micro_batch * cfg.d_model, 0,
                           tp=job.tp, sequence_parallel=job.sp)
    if job.policy == "offload":
        return _LayerActivations(none, none, embeddings)
    kept = _layer_bytes(job, job.policy)
    if job.policy == "every_k":
        full = _layer_bytes(job, "full")
        rebuilt = none - full if _checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) else 0.0
    else:
        rebuilt = max(none - kept, 0.0)
    return _LayerActivations(kept, rebuilt, embeddings)


def activation_bytes_total(job: JobSpec, stage: int = 0, layer: _LayerActivations | None = None) -> tuple[float, float]:
    """(device bytes, host bytes) of saved activations on one GPU of ``stage``, with the recompute working set.

    Each in-flight micro-batch keeps the stage's L/p layers; recomputing (or reloading) a layer
    during backward rebuilds what that layer dropped, on the device, so every policy but ``none``
    adds that much for one layer at the peak. The first stage also keeps the embedding output.
    """
    layer = layer or _layer_activations(job)
    layers = job.model.n_layer // job.pp
    in_flight = _in_flight(job, stage)
    embeddings = layer.embeddings if stage == 0 else 0.0
    if job.policy == "offload":
        return layer.rebuilt + in_flight * embeddings, in_flight * layers * layer.kept
    return in_flight * layers * layer.kept + layer.rebuilt + in_flight * embeddings, 0.0


def _logits_bytes(job: JobSpec, stage: int | None = None) -> float:
    """fp32 log-probabilities the loss saves (per in-flight micro-batch), their fp32 gradient and the
    logits' gradient (one micro-batch at a time); vocab-parallel over tp; on the last stage only."""
    last = job.pp - 1
    if stage is not None and stage != last:
        return 0.0
    tokens_vocab = job.local_seq_len * job.micro_batch * job.model.vocab_size / job.tp
    return tokens_vocab * (4 * _in_flight(job, last) + 4 + job.activation_dtype_bytes)


def _unsharded_bytes(job: JobSpec, stage: int = 0) -> float:
    if job.strategy not in ("zero3", "fsdp") or job.shard_group == 1:
        return 0.0
    per = STATE_BYTES[job.precision]
    if job.pp > 1:  # pipelining keeps the stage gathered, and its gradients unreduced, until the last backward
        held = stage_parameters(job.model, job.tp, job.pp, stage) - stage_routed_parameters(job) * (1 - 1 / job.ep)
        return held * (per.param + per.grad)
    block = block_parameters_per_gpu(job.model, job.tp) - routed_parameters_per_block(job.model) * (1 - 1 / job.ep)
    return job.assumptions.unsharded_layers * block * (per.param + per.grad)


def stage_memory(job: JobSpec, stage: int, layer: _LayerActivations | None = None) -> MemoryEstimate:
    """Bytes per GPU of pipeline stage ``stage`` at its peak."""
    n_params = stage_parameters(job.model, job.tp, job.pp, stage)
    states = stage_state_bytes(job, n_params)
    device_acts, host_acts = activation_bytes_total(job, stage, layer)
    a = job.assumptions
    logits, unsharded = _logits_bytes(job, stage), _unsharded_bytes(job, stage)
    return MemoryEstimate(
        params=states.param,
        grads=states.grad,
        optimizer=states.optimizer,
        activations=device_acts,
        logits=logits,
        unsharded_params=unsharded,
        overhead=(a.cuda_context_gib + a.comm_buffers_gib) * GIB,
        host=host_acts,
        stage=stage,
        # Model states are allocated once, in a few large blocks; what is freed and allocated again
        # every micro-batch (activations, logits, gathered layers) is what fragments the cache.
        fragmentation=a.fragmentation * (device_acts + logits + unsharded),
    )


def _edge_stages(job: JobSpec) -> tuple[int, ...]:
    # A middle stage holds no more than the first (the same blocks, no embedding, no more micro-batches
    # in flight) and computes no more than the first or the last, so these two decide (tested).
    return (0,) if job.pp == 1 else (0, job.pp - 1)


def estimate_memory(job: JobSpec) -> MemoryEstimate:
    """The fullest stage's memory (every GPU must fit, so the largest decides)."""
    layer = _layer_activations(job)
    return max((stage_memory(job, i, layer) for i in _edge_stages(job)), key=lambda m: (m.total, m.host))


def recompute_flops_per_token(model_cfg: ModelConfig, seq_len: int, policy: str, every_k: int | None = None) -> float:
    """Extra forward FLOPs per token that a policy spends in backward (not part of MFU)."""
    return sum(_recompute_flops_split(model_cfg, seq_len, policy, every_k))


def _recompute_flops_split(model_cfg: ModelConfig, seq_len: int, policy: str, every_k: int | None = None) -> tuple[float, float]:
    """(GEMM FLOPs, attention-core FLOPs) recomputed per token."""
    _check_choice("policy", policy, POLICIES)
    L, d = model_cfg.n_layer, model_cfg.d_model
    core = 4.0 * d * seq_len  # QK^T and @V forward, per layer per token (no causal halving)
    gemms = 2.0 * blocks_parameters(model_cfg, active=True) / L  # a token's experts only
    if policy == "selective":
        return 0.0, L * core
    if policy == "full":
        return L * gemms, L * core
    if policy == "every_k":
        kept = _checkpointed_layers(L, every_k or model_cfg.recompute_every_k)
        return kept * gemms, kept * core
    return 0.0, 0.0  # none, offload; op_selective recomputes element-wise ops only (memory-bound, ~no FLOPs)


def _peak_tflops(device: DeviceSpec, precision: str) -> float:
    return device.tf32_tflops if precision == "fp32" else device.bf16_tflops


def _shape_factor(dims: tuple[float, ...], knee: float) -> float:
    """Share of the large-GEMM rate a GEMM reaches for its output dimensions: each costs x/(x+knee)
    (edge tiles that do not fill, too few tiles to keep every multiprocessor busy)."""
    factor = 1.0
    for x in dims:
        factor *= x / (x + knee)
    return factor


def gemm_seconds(job: JobSpec, m: float, k: float, n: float) -> float:
    """One (m x k) @ (k x n) GEMM on one GPU, a roofline: 2*m*k*n FLOPs at the device's fitted large-GEMM
    rate scaled by the output shape factor (FP8 GEMMs at the FP8 peak under precision=fp8), or the
    operands and the result through HBM, whichever is longer (a short reduction dimension k makes a
    GEMM memory-bound)."""
    a = job.assumptions
    if job.precision == "fp8":
        rate = job.device.fp8_tflops * 1e12 * a.fp8_gemm_fraction
    else:
        rate = _peak_tflops(job.device, job.precision) * 1e12 * a.gemm_fraction(job.device)
    compute = 2.0 * m * k * n / (rate * _shape_factor((m, n), a.gemm_knee))
    traffic = job.activation_dtype_bytes * (m * k + k * n + m * n) / (job.device.hbm_tb_s * 1e12 * a.hbm_fraction)
    return max(compute, traffic)


def layer_gemms(cfg: ModelConfig, tokens: int, tp: int = 1, moe_split: int = 1) -> list[tuple[int, float, float]]:
    """The forward GEMMs of one transformer layer on one of ``tp`` GPUs, as (m, k, n): the fused QKV
    and the MLP's first matmul are column-parallel (n / tp), the output projection and the MLP's
    second matmul row-parallel (k / tp). Their 2*m*k*n sum to 2*tokens*(the block's matmul weights)/tp.

    A MoE model's mean layer: its MoE layers' share of the tokens goes to the router and, k copies
    each, spread evenly over the experts (one GEMM pair per expert, as the grouped GEMM runs them;
    experts are not tensor-split), plus the shared experts; the rest to the dense MLP. A MoE layer
    runs on tokens / ``moe_split`` rows per GPU: tp under sequence parallelism (each tp GPU routes
    its own positions), else 1 (every tp GPU runs all of them)."""
    d, f = cfg.d_model, cfg.d_ff
    gated = 2 if cfg.mlp == "swiglu" else 1
    gemms = [(tokens, d, (cfg.q_dim + 2 * cfg.kv_dim) / tp), (tokens, cfg.q_dim / tp, d)]
    moe_share = cfg.n_moe_layers / cfg.n_layer if cfg.moe.experts is not None else 0.0
    if moe_share < 1:
        dense = tokens * (1 - moe_share)
        gemms += [(dense, d, gated * f / tp), (dense, f / tp, d)]
    if moe_share > 0:
        routed, fe, shared = tokens * moe_share / moe_split, cfg.expert_d_ff, cfg.moe.shared_experts * cfg.expert_d_ff
        per_expert = routed * cfg.moe.top_k / cfg.moe.experts
        gemms += [(routed, d, cfg.moe.experts)] + [(per_expert, d, gated * fe), (per_expert, fe, d)] * cfg.moe.experts
        if shared:
            gemms += [(routed, d, gated * shared), (routed, shared, d)]
    return gemms


def _recompute_shares(job: JobSpec) -> tuple[float, float, float]:
    """Per layer, how much of its forward is run again in backward: (GEMMs and element-wise work of
    the whole layer, the attention core alone, element-wise work alone)."""
    cfg = job.model
    if job.policy == "full":
        return 1.0, 0.0, 0.0
    if job.policy == "every_k":
        return _checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / cfg.n_layer, 0.0, 0.0
    if job.policy == "selective":
        return 0.0, 1.0, 0.0
    if job.policy == "op_selective":
        return 0.0, 0.0, 1.0
    return 0.0, 0.0, 0.0


def _attention_seconds(job: JobSpec, forwards: float) -> tuple[float, float]:
    """(compute, memory-bound) seconds of one layer's attention core for one micro-batch on one GPU,
    with its forward run ``forwards`` times (1, or 2 when recomputed) and its backward once.

    The core's model FLOPs are 4*b*s^2*d forward (QK^T and @V, every query against every key), split
    over tp by heads. A fused (flash) kernel skips the masked half of a causal square and its backward
    recomputes the scores, 2.5x its forward; it runs at ``attention_fraction`` of the large-GEMM rate.
    A materialized core (model.attention=reference; Megatron's fused softmax) runs both matmuls on the
    whole square as batched GEMMs (the head dim is their reduction dimension) and moves the s x s
    scores through memory: ``_score_traffic_bytes``.
    """
    cfg, a, t = job.model, job.assumptions, job.tp
    b, s, d = job.micro_batch, job.seq_len, cfg.d_model
    q = job.local_seq_len  # a cp GPU's queries, against every key: 1/cp of the square, balanced (parallel/cp.py)
    fwd_flops = 4.0 * b * q * s * d / t
    if job.attention == "flash":
        executed = 0.5 * fwd_flops * (forwards + 2.5)
        rate = _gemm_rate(job) * a.attention_fraction
        return executed / rate, 0.0
    heads = cfg.n_head / t
    sixteen = dataclasses.replace(job, precision="bf16_master") if job.precision == "fp8" else job
    one = 2 * gemm_seconds(sixteen, q, cfg.head_dim, s) * b * heads  # QK^T and @V, each 2*q*s*head_dim per head
    fwd_bytes, bwd_bytes = _score_traffic_bytes(job)
    elements = b * heads * q * s
    hbm = job.device.hbm_tb_s * 1e12 * a.hbm_fraction
    traffic = elements * (forwards * fwd_bytes + bwd_bytes) * a.elementwise_scale / hbm
    return one * (forwards + 2), traffic


def _gemm_rate(job: JobSpec) -> float:
    a = job.assumptions
    if job.precision == "fp8":  # attention stays in 16 bits under FP8 training
        return job.device.bf16_tflops * 1e12 * a.gemm_fraction(job.device)
    return _peak_tflops(job.device, job.precision) * 1e12 * a.gemm_fraction(job.device)


def _score_traffic_bytes(job: JobSpec) -> tuple[float, float]:
    """Bytes moved per attention-score element by a materialized core, (forward, backward).

    Forward: QK^T writes the scores, the fused scale-mask-softmax reads and writes them, @V reads the
    probabilities (4 passes of p bytes); dropout reads and writes them and writes a mask. Backward:
    @V's weight gradient reads the probabilities and its input gradient writes dP, the softmax backward
    reads P and dP and writes dS, QK^T's backward reads dS (5 passes); dropout reads the mask and
    passes the gradient through (2 passes)."""
    p, m = job.activation_dtype_bytes, 1
    if job.model.dropout > 0:
        return 6 * p + m, 7 * p + m
    return 4 * p, 5 * p


def _elementwise_bytes(job: JobSpec) -> tuple[float, float]:
    """Bytes one layer's element-wise work moves for one micro-batch on one GPU, (forward, backward).

    Counted per token in d-wide reads and writes. Outside the tensor-parallel region (split over tp
    only with sequence parallelism): forward two norms (read, write) and two residual adds (read two,
    write one), 10 passes; backward 12 (each norm reads input and gradient and writes one, each
    residual gradient is added, read two, write one). Dropout on the two residual branches adds a
    read and a write each way and a 1-byte mask. Inside (split over tp): the MLP activation, GELU
    forward 2*d_ff (read, write) and backward 3*d_ff; SwiGLU 3*d_ff and 5*d_ff; rotary embeddings
    read and write q and k both ways, 2*(d + kv_dim) each way. FP8 adds the casts of the weights.
    In a MoE layer the activation runs on each token's top-k experts and the shared ones
    (``_mlp_hidden_width``); the permutation's gathers are not counted.
    """
    cfg, p, t = job.model, job.activation_dtype_bytes, job.tp
    tokens = job.local_seq_len * job.micro_batch
    d = cfg.d_model
    outside_fwd, outside_bwd = 10 * d * p, 12 * d * p
    if cfg.dropout > 0:
        outside_fwd += 2 * (2 * d * p + d)
        outside_bwd += 2 * (2 * d * p + d)
    act_fwd, act_bwd = (3, 5) if cfg.mlp == "swiglu" else (2, 3)
    width = _mlp_hidden_width(cfg)
    inside_fwd, inside_bwd = act_fwd * width * p, act_bwd * width * p
    if cfg.position == "rope":
        inside_fwd += 2 * (d + cfg.kv_dim) * p
        inside_bwd += 2 * (d + cfg.kv_dim) * p
    split = t if job.sp else 1
    fwd = tokens * (outside_fwd / split + inside_fwd / t)
    bwd = tokens * (outside_bwd / split + inside_bwd / t)
    if job.precision == "fp8":
        # FP8 GEMMs read their weights cast to FP8 (read 2 bytes, write 1, once each way per micro-batch);
        # the activations' casts are fused into the kernels that produce them (norm, activation).
        weights = sum(k * n for _, k, n in layer_gemms(cfg, tokens, t))
        fwd += 3 * weights
        bwd += 3 * weights
    return fwd, bwd


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch through one GPU of a pipeline stage (seconds)."""

    compute: float  # GEMMs and the attention core, recomputation included
    memory_bound: float  # element-wise work, score traffic, the loss
    tp: float  # tensor-parallel collectives
    tp_exposed: float
    pp: float  # sends to the neighbouring stages
    cp: float = 0.0  # context-parallel K/V all-gathers and reduce-scatters (not overlapped)

    @property
    def total(self) -> float:
        return self.compute + self.memory_bound + self.tp_exposed + self.pp + self.cp


def _stage_microbatch(job: JobSpec, stage: int) -> _MicroBatch:
    """One micro-batch through one GPU of ``stage``.

    Its L/p layers each run their GEMMs forward once and backward twice (input and weight gradients),
    plus the forward again for the recomputed share, the attention core (``_attention_seconds``) and
    element-wise work at ``hbm_fraction`` of HBM bandwidth (``_elementwise_bytes``, times
    ``elementwise_scale``). The last stage adds the LM head's GEMM (vocab-parallel) and the loss's
    memory-bound pass over the logits (16-bit logits written and read, fp32 log-probabilities written
    and read, 16-bit gradient written).
    """
    cfg, a, t = job.model, job.assumptions, job.tp
    tokens = job.local_seq_len * job.micro_batch
    layers = cfg.n_layer // job.pp
    hbm = job.device.hbm_tb_s * 1e12 * a.hbm_fraction
    redo_layer, redo_core, redo_elementwise = _recompute_shares(job)
    gemm = sum(gemm_seconds(job, *shape) for shape in layer_gemms(cfg, tokens, t, moe_split=t if job.sp else 1))
    core, scores = _attention_seconds(job, 1 + redo_core + redo_layer)
    fwd_bytes, bwd_bytes = _elementwise_bytes(job)
    elementwise = (fwd_bytes * (1 + redo_layer + redo_elementwise) + bwd_bytes) * a.elementwise_scale / hbm
    compute = layers * (gemm * (3 + redo_layer) + core)
    memory_bound = layers * (elementwise + scores)
    if stage == job.pp - 1:
        compute += 3 * gemm_seconds(job, tokens, cfg.d_model, cfg.vocab_size / t)
        p = job.activation_dtype_bytes
        memory_bound += tokens * cfg.vocab_size / t * (3 * p + 8) * a.elementwise_scale / hbm
    tp_s, _ = tp_comm_seconds(job, stage)
    # Overlapped collectives (Megatron's userbuffers, async TP) hide behind the GEMMs they feed.
    tp_exposed = _exposed(tp_s, compute, a) if job.tp_overlap else tp_s
    return _MicroBatch(compute, memory_bound, tp_s, tp_exposed, pp_comm_seconds(job)[0], cp_comm_seconds(job)[0])


def collective_seconds(
    nbytes: float, world_size: int, device: DeviceSpec, link_fraction: float = 0.8, *, ranks_per_node: int | None = None
) -> float:
    """One reduce-scatter or all-gather of a ``nbytes`` tensor over ``world_size`` GPUs (two-level).

    ``ranks_per_node``: how many of the group share a node (default: as many as fit, i.e. the
    group is packed); a data-parallel group strided by tensor parallelism has fewer per node.
    """
    if world_size <= 1 or nbytes == 0:
        return 0.0
    local = max(1, min(world_size, ranks_per_node or device.gpus_per_node))
    nodes = math.ceil(world_size / local)
    intra = (local - 1) / local * nbytes / (device.nvlink_one_way_gb_s * 1e9 * link_fraction)
    inter = (nodes - 1) / nodes * nbytes / local / (device.network_gb_s * 1e9 * link_fraction)
    return intra + inter


def _per_node(job: JobSpec, stride: int, group: int) -> int:
    """Ranks of a mesh group whose members sit ``stride`` ranks apart that share one node."""
    return max(1, min(group, job.device.gpus_per_node // stride))


def tp_comm_seconds(job: JobSpec, stage: int = 0) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of tensor-parallel collectives for one micro-batch on ``stage``.

    Per layer 8 reduce-scatter/all-gather-equivalents of the s*b*h activation (4 forward, 4
    backward; an all-reduce counts as two), 4 more for a layer recomputed in full; the embedding
    and the LM head one each way on their stages (module docstring).
    """
    t = job.tp
    if t == 1:
        return 0.0, 0.0
    cfg = job.model
    activation = job.activation_dtype_bytes * job.local_seq_len * job.micro_batch * cfg.d_model
    one = collective_seconds(activation, t, job.device, job.assumptions.link_fraction,
                             ranks_per_node=_per_node(job, 1, t))
    layers = cfg.n_layer // job.pp
    recomputed = {"full": layers, "every_k": _checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / job.pp}
    count = 8 * layers + 4 * recomputed.get(job.policy, 0)
    count += 2 * (stage == 0) + 2 * (stage == job.pp - 1)
    return count * one, count * (t - 1) / t * activation


def kv_gather_bytes(model_cfg: ModelConfig, seq_len: int, micro_batch: int, dtype_bytes: int, tp: int = 1) -> float:
    """Bytes of one layer's gathered keys and values on one cp GPU: the whole sequence's K and V of
    the KV heads it holds (kv_dim / tp wide). The all-gather brings in (cp - 1) / cp of them, and
    each GPU sends its own share to the cp - 1 others: (cp - 1) / cp of this, per layer and direction."""
    return dtype_bytes * micro_batch * seq_len * 2 * model_cfg.kv_dim / tp


def cp_comm_seconds(job: JobSpec) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of context-parallel collectives for one micro-batch: per layer
    one all-gather of K and V forward and one reduce-scatter of their gradients backward, and one
    more all-gather for a layer whose core is recomputed (selective, full, every_k's layers). Counted
    as not overlapped with compute (the trainer issues them in line)."""
    cp, cfg = job.cp, job.model
    if cp == 1:
        return 0.0, 0.0
    nbytes = kv_gather_bytes(cfg, job.seq_len, job.micro_batch, job.activation_dtype_bytes, job.tp)
    layers = cfg.n_layer // job.pp
    recomputed = {"selective": layers, "full": layers,
                  "every_k": _checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / job.pp}
    count = 2 * layers + recomputed.get(job.policy, 0)
    # cp groups sit inside tp on the mesh (dims.py): members tp ranks apart
    one = collective_seconds(nbytes, cp, job.device, job.assumptions.link_fraction,
                             ranks_per_node=_per_node(job, job.tp, cp))
    return count * one, count * (cp - 1) / cp * nbytes


def pp_comm_seconds(job: JobSpec) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of one micro-batch's activations and gradients between stages:
    one of each per model chunk (``pp_virtual_stages`` of them on an interleaved GPU). Under context
    parallelism each cp rank sends its seq_len / cp tokens to the same cp rank of the next stage."""
    if job.pp == 1:
        return 0.0, 0.0
    cfg, frac = job.model, job.assumptions.link_fraction
    # Each tensor-parallel rank sends 1/t of the activation: its sequence shard under sequence
    # parallelism, or its slice of the replicated tensor (Megatron's scatter/gather, which re-gathers it
    # over NVLink on the receiving stage).
    nbytes = job.activation_dtype_bytes * job.local_seq_len * job.micro_batch * cfg.d_model / job.tp
    same_node = job.world_size <= job.device.gpus_per_node  # stages are the outermost mesh dimension
    link = job.device.nvlink_one_way_gb_s if same_node else job.device.network_gb_s
    sent = 2 * job.pp_virtual_stages * nbytes
    return sent / (link * 1e9 * frac), sent


def fsdp_collectives(job: JobSpec) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of its parameters that a ZeRO-3/FSDP GPU runs per optimizer step.

    Without pp every micro-batch gathers in forward and again in backward (once, when
    ``fsdp_reshard_after_forward`` keeps the forward's copy) and reduce-scatters its gradients. Under pp,
    torch.distributed.pipelining keeps gradients unreduced and parameters gathered after the first
    backward until the step ends; with reshard_after_forward every micro-batch's forward gathers again
    (m forwards + 1 backward gather), without it the first gather serves the whole step."""
    m = job.grad_accum
    if job.pp == 1:
        return (2 if job.fsdp_reshard_after_forward else 1) * m, m
    return (m + 1 if reshards_after_forward(job) else 1), 1


def reshards_after_forward(job: JobSpec) -> bool:
    """Whether the trainer's FSDP2 blocks free their gathered weights after forward: the setting,
    except in a zero_bubble pipeline, which keeps them for its weight-gradient pass
    (ParallelConfig.reshard_blocks_after_forward)."""
    return job.fsdp_reshard_after_forward and not (job.pp > 1 and job.pp_schedule == "zero_bubble")


def _dp_comm(job: JobSpec, n_params: float) -> tuple[CommVolume, float]:
    """Data-parallel traffic of one GPU holding ``n_params`` per step, and its time (before overlap)."""
    frac = job.assumptions.link_fraction
    # cp ranks average gradients with the data-parallel ones (folded into the shard group)
    if job.dp_replicate == 1:
        volume = comm_volume(n_params, job.strategy, job.dp * job.cp, job.precision)
        group = job.dp * job.cp
    else:  # HSDP: FSDP inside dp_shard, then the reduced shard is all-reduced across replicas
        shard = comm_volume(n_params, job.strategy, job.shard_group, job.precision)
        grads = n_params * STATE_BYTES[job.precision].grad / job.shard_group
        volume = dataclasses.replace(shard, replica_all_reduce=grads, replicas=job.dp_replicate)
        group = job.shard_group
    if job.strategy in ("zero3", "fsdp") and group > 1:
        gathers, scatters = fsdp_collectives(job)
        per = STATE_BYTES[job.precision]
        volume = dataclasses.replace(volume, all_gather=gathers * n_params * per.param,
                                     reduce_scatter=scatters * n_params * per.grad)
    link = dict(ranks_per_node=_per_node(job, job.tp, group))
    seconds = (
        2 * collective_seconds(volume.all_reduce, group, job.device, frac, **link)
        + collective_seconds(volume.reduce_scatter, group, job.device, frac, **link)
        + collective_seconds(volume.all_gather, group, job.device, frac, **link)
    )
    if volume.replicas > 1:
        outer = dict(ranks_per_node=_per_node(job, job.tp * job.shard_group, volume.replicas))
        seconds += 2 * collective_seconds(volume.replica_all_reduce, volume.replicas, job.device, frac, **outer)
    return volume, seconds


def _exposed(comm: float, hideable: float, a: Assumptions) -> float:
    """Seconds of a collective of ``comm`` seconds left on the critical path when ``hideable`` seconds of
    compute can run beside it: only ``overlap_efficiency`` of the overlap is real (the collective's
    kernels take multiprocessors and memory bandwidth from the compute they run beside)."""
    return comm - a.overlap_efficiency * min(comm, hideable)


def _optimizer_seconds(job: JobSpec, state_bytes: float) -> float:
    """The optimizer step reads and writes every model-state byte of this GPU once (memory-bound)."""
    return 2 * state_bytes / (job.device.hbm_tb_s * 1e12 * job.assumptions.hbm_fraction)


def _largest_stage_parameters(job: JobSpec) -> float:
    return max(stage_parameters(job.model, job.tp, job.pp, i) for i in _edge_stages(job))


def estimate_time(job: JobSpec, state_bytes: float) -> TimeEstimate:
    """Step time: m micro-batches through the slowest stage, the bubble, and what communication shows.

    ``state_bytes``: model-state bytes per GPU, which the optimizer step reads and writes.
    Data-parallel collectives hide behind compute as the strategy allows (docs/estimator.md):
    FSDP without pp gathers and reduce-scatters every micro-batch, behind that micro-batch's work;
    FSDP under pp gathers once per step behind the first forward and reduce-scatters after the last
    backward; DDP and ZeRO-1/2 reduce behind the last micro-batch's backward; ``dp_overlap=False``
    hides nothing.
    """
    a, m = job.assumptions, job.grad_accum
    slowest = max((_stage_microbatch(job, stage) for stage in _edge_stages(job)), key=lambda mb: mb.total)
    work = m * (slowest.compute + slowest.memory_bound)
    _, dp_s = _dp_and_expert_comm(job, _largest_stage_parameters(job))
    if job.strategy in ("zero3", "fsdp") and job.pp == 1:
        hideable = work  # every micro-batch's collectives run beside its own work
    elif job.strategy in ("zero3", "fsdp"):
        # gathers prefetch behind forwards (every micro-batch's with reshard_after_forward); the
        # reduce-scatter after the last backward shows
        hideable = (m if reshards_after_forward(job) else 1) * slowest.compute / 3
    else:
        hideable = 2 / 3 * slowest.compute  # the last micro-batch's backward
    if not job.dp_overlap:
        hideable = 0.0
    exposed_dp = _exposed(dp_s, hideable, a)
    layers = job.model.n_layer // job.pp
    offloaded = layers * _layer_bytes(job, "none") if job.policy == "offload" else 0.0
    offload = m * 2 * offloaded / (job.device.pcie_gb_s * 1e9 * a.link_fraction)
    peak = None if job.precision == "fp8" else _peak_tflops(job.device, job.precision)
    tokens = job.seq_len * job.micro_batch * m * job.dp
    return TimeEstimate(
        compute_s=m * slowest.compute,
        comm_s=dp_s,
        exposed_comm_s=exposed_dp,
        offload_s=offload,
        memory_bound_s=m * slowest.memory_bound + _optimizer_seconds(job, state_bytes),
        tokens_per_step=tokens,
        model_flops_per_step=flops_per_token(job.model, job.seq_len) * tokens,
        peak_tflops=peak,
        world_size=job.world_size,
        tp_comm_s=m * slowest.tp,
        pp_comm_s=m * slowest.pp,
        bubble_s=bubble_overhead(job.pp_schedule, job.pp, m, job.pp_virtual_stages) * m * slowest.total,
        tp_exposed_s=m * slowest.tp_exposed,
        microbatch_s=slowest.total,
        cp_comm_s=m * slowest.cp,
        ep_comm_s=m * expert_all_to_all(job)[0],
        muon_s=sum(muon_step(job)[1:]),
    )


def estimate(job: JobSpec) -> Estimate:
    """Memory, communication and time of one optimizer step of ``job``, and why it does not fit."""
    return _estimate_with(job, estimate_memory(job))


def _estimate_with(job: JobSpec, memory: MemoryEstimate) -> Estimate:
    n_params = count_parameters(job.model)
    comm, _ = _dp_and_expert_comm(job, _largest_stage_parameters(job))
    tp_bytes = job.grad_accum * max(tp_comm_seconds(job, i)[1] for i in _edge_stages(job))
    comm = dataclasses.replace(comm, tensor_parallel=tp_bytes, pipeline=job.grad_accum * pp_comm_seconds(job)[1],
                               expert_all_to_all=job.grad_accum * expert_all_to_all(job)[1], muon=muon_step(job)[0])
    time = estimate_time(job, memory.states)
    return Estimate(job, n_params, flops_per_token(job.model, job.seq_len), memory, time, comm,
                    memory_problems(job, memory))


def memory_problems(job: JobSpec, memory: MemoryEstimate) -> tuple[str, ...]:
    """Why ``memory`` does not fit on ``job.device`` (empty when it does)."""
    problems = []
    where = f" (pipeline stage {memory.stage})" if job.pp > 1 else ""
    if memory.total > job.device.hbm_gib * GIB:
        problems.append(f"needs {gib(memory.total)} per GPU{where}, {job.device.name} has {job.device.hbm_gib:g} GiB")
    if memory.host > job.device.host_mem_gib * GIB:
        problems.append(
            f"offload needs {gib(memory.host)} of host memory per GPU, a node has ~{job.device.host_mem_gib:g} GiB per GPU"
        )
    return tuple(problems)


# --------------------------------------------------------------------------- expert parallelism


def routed_parameters_per_block(cfg: ModelConfig) -> float:
    """The routed experts' weights of one block, as ``block_parameters_per_gpu`` averages blocks
    (shared experts and the router are dense: every GPU holds them)."""
    if cfg.moe.experts is None:
        return 0.0
    matrices = 3 if cfg.mlp == "swiglu" else 2
    return cfg.n_moe_layers * cfg.moe.experts * matrices * cfg.d_model * cfg.expert_d_ff / cfg.n_layer


def stage_routed_parameters(job: JobSpec) -> float:
    """Routed expert weights among a pipeline stage's parameters (before ep splits them)."""
    return job.model.n_layer // job.pp * routed_parameters_per_block(job.model)


def stage_state_bytes(job: JobSpec, n_params: float) -> StateBytes:
    """Model-state bytes per GPU of a stage holding ``n_params``: with ep > 1 the routed experts
    are split over ep GPUs and each split sharded over the dp_shard / ep GPUs holding it; the rest
    is sharded over the shard group as without ep (with cp, ep is carved out of the shard group, cp included)."""
    saving = muon_buffer_saving(job)
    if job.ep == 1:
        states = model_state_bytes(n_params, job.strategy, job.shard_group, job.precision)
        return dataclasses.replace(states, optimizer=states.optimizer - saving)
    routed = stage_routed_parameters(job)
    dense = model_state_bytes(n_params - routed, job.strategy, job.shard_group, job.precision)
    experts = model_state_bytes(routed / job.ep, job.strategy, job.shard_group // job.ep, job.precision)
    return StateBytes(dense.param + experts.param, dense.grad + experts.grad,
                      dense.optimizer + experts.optimizer - saving)


# --------------------------------------------------------------------------- Muon


@dataclass(frozen=True)
class MuonMatrices:
    """The matrices Muon orthogonalises in the whole model, each kind as (count, rows, columns):
    those tensor parallelism splits (attention's QKV and output projections, the dense MLPs), those
    a MoE layer keeps whole on every tp GPU (shared experts), and the routed experts, one matrix per
    expert. Routers, embeddings, the head, norms and biases stay on AdamW (parallel/optim.py)."""

    split: tuple[tuple[int, int, int], ...]
    whole: tuple[tuple[int, int, int], ...]
    routed: tuple[tuple[int, int, int], ...]


def muon_matrices(cfg: ModelConfig) -> MuonMatrices:
    d, per_mlp, moe = cfg.d_model, (3 if cfg.mlp == "swiglu" else 2), cfg.n_moe_layers
    split = [(cfg.n_layer, cfg.q_dim + 2 * cfg.kv_dim, d), (cfg.n_layer, d, cfg.q_dim)]
    if cfg.n_layer > moe:  # the down projection is the up one transposed: the same size and cost
        split.append(((cfg.n_layer - moe) * per_mlp, cfg.d_ff, d))
    whole, routed = [], []
    if moe and cfg.moe.shared_experts:
        whole.append((moe * per_mlp, cfg.moe.shared_experts * cfg.expert_d_ff, d))
    if moe:
        routed.append((moe * cfg.moe.experts * per_mlp, cfg.expert_d_ff, d))
    return MuonMatrices(tuple(split), tuple(whole), tuple(routed))


def muon_numel(kind: tuple[tuple[int, int, int], ...]) -> float:
    return sum(count * rows * cols for count, rows, cols in kind)


def _newton_schulz_flops(kind: tuple[tuple[int, int, int], ...], steps: int) -> float:
    """Per iteration on an a x b matrix (a <= b): the Gram matrix (2a^2 b), its square (2a^3), and
    the polynomial times X (2a^2 b)."""
    return steps * sum(count * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for count, r, c in kind)


def muon_groups(job: JobSpec) -> tuple[int, int]:
    """Ranks each split matrix and each whole (shared-expert) matrix is sharded over: tensor
    parallelism times FSDP's shard group (ddp and none keep the data-parallel copies whole)."""
    shard = job.shard_group if job.strategy in ("fsdp", "zero3") else 1
    return job.tp * shard, shard


def muon_buffer_saving(job: JobSpec) -> float:
    """Optimizer-state bytes per GPU Muon saves against AdamW: one fp32 momentum per hidden matrix
    element instead of two moments (4 bytes less; fp32 masters, where kept, stay)."""
    if job.optimizer != "muon":
        return 0.0
    m = muon_matrices(job.model)
    shard = job.shard_group if job.strategy in ("zero1", "zero2", "zero3", "fsdp") else 1
    dense = muon_numel(m.split) / job.tp + muon_numel(m.whole)
    routed = muon_numel(m.routed) / job.ep / (shard // job.ep if shard > 1 else 1)
    return 4 * (dense / shard + routed) / job.pp


def muon_step(job: JobSpec) -> tuple[float, float, float]:
    """Muon's extra work per step on one GPU (the mean stage): (bytes sent, all-to-all seconds,
    Newton-Schulz seconds). A matrix sharded over n ranks goes to one owner and back: each rank
    sends 2 (n - 1) / n^2 of its bytes on average (parallel/muon.py), and the owners, spread
    evenly, share its Newton-Schulz work n ways. Whole matrices (replicas, experts held whole
    under ep) are orthogonalised where they are, with nothing sent; replicas repeat the work."""
    if job.optimizer != "muon":
        return 0.0, 0.0, 0.0
    m = muon_matrices(job.model)
    n_split, n_whole = muon_groups(job)
    sent = sum(2 * (n - 1) / n**2 * muon_numel(kind) * MUON_PIECE_BYTES
               for kind, n in ((m.split, n_split), (m.whole, n_whole)) if n > 1) / job.pp
    expert_shard = job.shard_group // job.ep if job.strategy in ("fsdp", "zero3") else 1
    flops = (_newton_schulz_flops(m.split, MUON_NS_STEPS) / n_split + _newton_schulz_flops(m.whole, MUON_NS_STEPS) / n_whole
             + _newton_schulz_flops(m.routed, MUON_NS_STEPS) / (job.ep * expert_shard)) / job.pp
    n = max(n_split, n_whole)
    link = dict(ranks_per_node=_per_node(job, 1, n))
    # an all-to-all sending S bytes per rank moves what a reduce-scatter of S n / (n - 1) bytes does
    a2a = collective_seconds(sent * n / (n - 1), n, job.device, job.assumptions.link_fraction, **link) if n > 1 else 0.0
    return sent, a2a, flops / _gemm_rate(job)


def expert_exchanges(job: JobSpec) -> float:
    """All-to-alls of token rows per micro-batch on a stage (the mean stage): per MoE layer the
    dispatch and the combine in forward and their gradients in backward (4), and the forward's two
    again in backward for a layer whose forward is recomputed. That is every layer under ``full``, and
    under ``op_selective`` too (its policy caches the GEMM and attention outputs only, so the
    collectives run again); under ``every_k`` the MoE layers whose 1-based index k divides."""
    cfg = job.model
    if job.policy in ("full", "op_selective"):
        recomputed = cfg.n_moe_layers
    elif job.policy == "every_k":
        k = cfg.recompute_every_k
        recomputed = sum(1 for i in range(cfg.n_layer) if cfg.is_moe_layer(i) and (i + 1) % k == 0)
    else:
        recomputed = 0
    return (4 * cfg.n_moe_layers + 2 * recomputed) / job.pp


def expert_all_to_all(job: JobSpec) -> tuple[float, float]:
    """(seconds, bytes sent per GPU) of one micro-batch's expert-parallel all-to-alls on a stage.

    ``expert_exchanges`` of them, each of the micro-batch's top-k token copies (d values each);
    each GPU keeps the 1/ep of its copies routed to its own experts (balanced routing) and sends the
    rest. An all-to-all is modelled as an all-gather of the same bytes (``collective_seconds``);
    across nodes it is slower than that (many small messages), which this does not count.
    """
    cfg = job.model
    if job.ep == 1:
        return 0.0, 0.0
    # Each tp GPU exchanges the copies of the positions it routes: its own s/t under sequence
    # parallelism, all of them without; a cp rank routes its chunks only.
    copies = job.seq_len * job.micro_batch * cfg.moe.top_k / ((job.tp if job.sp else 1) * job.cp)
    nbytes = copies * cfg.d_model * job.activation_dtype_bytes
    count = expert_exchanges(job)
    one = collective_seconds(nbytes, job.ep, job.device, job.assumptions.link_fraction,
                             ranks_per_node=_per_node(job, job.tp, job.ep))
    return count * one, count * (job.ep - 1) / job.ep * nbytes


def _dp_and_expert_comm(job: JobSpec, n_params: float) -> tuple[CommVolume, float]:
    """``_dp_comm`` of a stage holding ``n_params``; with ep > 1 its routed experts travel apart, over
    the dp_shard / ep GPUs holding the same experts (each holding 1/ep of them)."""
    if job.ep == 1:
        return _dp_comm(job, n_params)
    routed = stage_routed_parameters(job)
    dense, dense_s = _dp_comm(job, n_params - routed)
    # The GPUs holding the same experts: the shard group over ep (cp ranks are inside the ep group).
    expert_job = dataclasses.replace(job, world_size=job.world_size // job.ep, ep=1, cp=1)
    experts, experts_s = _dp_comm(expert_job, routed / job.ep)
    return dataclasses.replace(dense, expert_sharded=experts.sent_per_gpu), dense_s + experts_s


def expert_parallel_sizes(model_cfg: ModelConfig, dp_shard: int, strategy: str, cp: int = 1) -> list[int]:
    """The ep degrees a job can use: 1, and with an MoE model under fsdp every divisor of dp_shard x cp
    that divides the routed experts and, with cp, is a multiple of cp (parallel/dims.py)."""
    if model_cfg.moe.experts is None or strategy not in ("fsdp", "zero3"):
        return [1]
    return [e for e in _divisors(dp_shard * cp) if model_cfg.moe.experts % e == 0 and (e == 1 or e % cp == 0)]


# --------------------------------------------------------------------------- planning


def trainer_config(job: JobSpec, base: JobConfig | None = None) -> JobConfig:
    """The trainer's configuration of ``job``: ``base`` (a loaded config; default: every section's
    defaults) with the job's model, recompute policy, batch, precision and layout put in."""
    base = base or JobConfig()
    parallel = dataclasses.replace(
        base.parallel, strategy=job.strategy, tp=job.tp, pp=job.pp, cp=job.cp, dp_replicate=job.dp_replicate,
        pp_schedule=job.pp_schedule, pp_virtual_stages=job.pp_virtual_stages,
        sequence_parallel=job.sp if job.tp > 1 else base.parallel.sequence_parallel,
        fsdp_reshard_after_forward=job.fsdp_reshard_after_forward,
        fsdp_hybrid=False,  # HSDP is written as dp_replicate here
        ep=job.ep, dp_shard=job.config_dp_shard,  # the config's dp_shard excludes the ep ranks
    )
    return dataclasses.replace(
        base,
        optim=dataclasses.replace(base.optim, name=job.optimizer),
        model=dataclasses.replace(job.model, recompute=job.policy),
        data=dataclasses.replace(base.data, seq_len=job.seq_len),
        train=dataclasses.replace(base.train, micro_batch_size=job.micro_batch, grad_accum_steps=job.grad_accum),
        precision=dataclasses.replace(base.precision, mode=job.precision),
        parallel=parallel,
    )


def trainer_refusal(job: JobSpec, base: JobConfig | None = None) -> str | None:
    """Why the trainer refuses ``job`` (its one-line ConfigError), or None: the same checks train.py
    runs (``JobConfig.validate_layout``), on ``trainer_config(job, base)``."""
    try:
        trainer_config(job, base).validate_layout()
    except ConfigError as exc:
        return str(exc)
    return None


def layout_overrides(job: JobSpec) -> list[str]:
    """The job's layout as the trainer's ``--section.key=value`` overrides (what ``layout_words`` says)."""
    words = [f"--parallel.strategy={job.strategy}", f"--parallel.dp_replicate={job.dp_replicate}",
             f"--parallel.dp_shard={job.config_dp_shard}", f"--parallel.tp={job.tp}", f"--parallel.pp={job.pp}",
             f"--parallel.pp_schedule={job.pp_schedule}", f"--parallel.pp_virtual_stages={job.pp_virtual_stages}"]
    if job.tp > 1:
        words.append(f"--parallel.sequence_parallel={'true' if job.sp else 'false'}")
    if job.cp > 1:
        words.append(f"--parallel.cp={job.cp}")
    if job.ep > 1:
        words.append(f"--parallel.ep={job.ep}")
    return words + [f"--model.recompute={job.policy}", f"--train.micro_batch_size={job.micro_batch}",
                    f"--train.grad_accum_steps={job.grad_accum}", f"--precision.mode={job.precision}"]


def plan_fits(
    model_cfg: ModelConfig,
    seq_len: int,
    world_size: int,
    device: DeviceSpec,
    precision: str = "bf16_master",
    *,
    strategies: tuple[str, ...] | None = None,
    policies: tuple[str, ...] = POLICIES,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    top: int | None = 10,
    assumptions: Assumptions | None = None,
    config: JobConfig | None = None,
) -> list[Estimate]:
    """Combinations of strategy x checkpointing policy x micro-batch that fit, cheapest first.

    Cheapest = least predicted time per token (the cost of the run); ties go to less memory. Only
    what the trainer accepts (``trainer_refusal``; ``config`` is the job's own configuration, if any).
    """
    if strategies is None:
        strategies = ("none",) if world_size == 1 else PLANNER_STRATEGIES
    fitting = []
    for strategy in strategies:
        for policy in policies:
            for micro_batch in micro_batches:
                job = JobSpec(
                    model_cfg, seq_len, micro_batch, world_size, strategy, policy, precision, device,
                    assumptions=assumptions or Assumptions(),
                )
                if trainer_refusal(job, config):
                    continue
                result = estimate(job)
                if result.fits:
                    fitting.append(result)
    fitting.sort(key=lambda e: (e.time.seconds_per_token, e.memory.total))
    return fitting if top is None else fitting[:top]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_parallel_sizes(model_cfg: ModelConfig, world_size: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every (tp, pp) a job can use: tp divides the heads and the KV heads and stays inside a node;
    pp divides the layers; both divide the GPU count (any count, not only powers of two)."""
    sizes = []
    for tp in _divisors(world_size):
        if tp > gpus_per_node or model_cfg.n_head % tp or model_cfg.kv_heads % tp:
            continue
        sizes += [(tp, pp) for pp in _divisors(world_size // tp) if model_cfg.n_layer % pp == 0]
    return sizes


def _data_parallel_options(dp: int, strategies: tuple[str, ...] | None, cp: int = 1) -> list[tuple[str, int]]:
    """(strategy, dp_replicate) pairs for ``dp`` data-parallel ranks; HSDP replicas are tried at every
    divisor of dp that leaves at least two shards. Which of them the trainer runs with tensor or
    pipeline parallelism is its own rule (``trainer_refusal``), not repeated here. Under context
    parallelism the cp ranks join the shard group, so FSDP2 runs even with one data-parallel rank
    (the trainer turns strategy none into fsdp there)."""
    if cp > 1:
        return [("fsdp", r) for r in _divisors(dp)]
    if dp == 1:
        return [("none", 1)]
    if strategies is None:
        strategies = PLANNER_STRATEGIES
    options = []
    for strategy in strategies:
        options.append((strategy, 1))
        if strategy in ("zero3", "fsdp"):
            options += [(strategy, r) for r in _divisors(dp)[1:] if dp // r >= 2]
    return options


def _pipeline_options(
    model_cfg: ModelConfig, pp: int, schedules: tuple[str, ...], virtual_stages: tuple[int, ...]
) -> list[tuple[str, int]]:
    """(pp_schedule, pp_virtual_stages) pairs whose chunks split the layers evenly."""
    if pp == 1:
        return [("1f1b", 1)]
    options = []
    for schedule in schedules:
        if schedule in MULTI_CHUNK_SCHEDULES:
            low = 2 if schedule == "interleaved_1f1b" else 1
            options += [(schedule, v) for v in virtual_stages if v >= low and model_cfg.n_layer % (pp * v) == 0]
        else:
            options.append((schedule, 1))
    return options


def plan_layouts(
    model_cfg: ModelConfig,
    seq_len: int,
    world_size: int,
    device: DeviceSpec,
    precision: str = "bf16_master",
    *,
    global_batch: int,
    strategies: tuple[str, ...] | None = None,
    policies: tuple[str, ...] = POLICIES,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    schedules: tuple[str, ...] = PP_SCHEDULES,
    virtual_stages: tuple[int, ...] = (1, 2, 4),
    top: int | None = 10,
    assumptions: Assumptions | None = None,
    config: JobConfig | None = None,
) -> list[Estimate]:
    """Layouts that fit at a fixed global batch, cheapest per token first.

    Searches dp_replicate x dp_shard x cp x tp x pp over ``world_size`` GPUs (``model_parallel_sizes``,
    ``context_parallel_sizes``, ``_data_parallel_options``), ep for an MoE model (``expert_parallel_sizes``),
    the pipeline schedule and virtual stages, the strategy, the
    recompute policy and the micro-batch; grad_accum follows from micro_batch x grad_accum x dp =
    ``global_batch`` (sequences per step). The GPUs per node come from ``device.gpus_per_node``.
    Every layout passes the trainer's own checks first (``trainer_refusal``, on ``config`` when the
    job has one), so the planner proposes only what train.py runs. Ties in time per token go to
    less memory, then to the simpler layout.
    """
    if global_batch < 1:
        raise EstimatorError(f"global_batch must be >= 1 (got {global_batch})")
    _check_choice("precision", precision, PRECISION_MODES)
    fitting = []
    for tp, pp, cp in [(tp, pp, cp) for tp, pp in model_parallel_sizes(model_cfg, world_size, device.gpus_per_node)
                       for cp in context_parallel_sizes(seq_len, world_size // (tp * pp))]:
        dp = world_size // (tp * pp * cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        for strategy, dp_replicate, ep in [(s_, r, e) for s_, r in _data_parallel_options(dp, strategies, cp)
                                           for e in expert_parallel_sizes(model_cfg, dp // r, s_, cp)]:
            for schedule, v in _pipeline_options(model_cfg, pp, schedules, virtual_stages):
                for policy in policies:
                    # Memory never shrinks as the micro-batch grows at a fixed global batch (GPipe
                    # holds b*m = b*per_rank/b sequences either way), so the first miss ends the row.
                    for micro_batch in sorted(b for b in micro_batches if per_rank % b == 0):
                        grad_accum = per_rank // micro_batch
                        if torch_microbatch_rule(schedule, pp, grad_accum):
                            continue
                        job = JobSpec(
                            model_cfg, seq_len, micro_batch, world_size, strategy, policy, precision, device,
                            grad_accum, assumptions or Assumptions(), tp=tp, pp=pp, dp_replicate=dp_replicate,
                            pp_schedule=schedule, pp_virtual_stages=v, cp=cp, ep=ep,
                        )
                        if trainer_refusal(job, config):
                            continue
                        memory = estimate_memory(job)
                        if memory_problems(job, memory):
                            break
                        fitting.append(_estimate_with(job, memory))
    fitting.sort(key=lambda e: (e.time.seconds_per_token, e.memory.total, e.job.dp_replicate, e.job.pp, e.job.tp,
                                e.job.cp, e.job.ep))
    return fitting if top is None else fitting[:top]


def context_parallel_sizes(seq_len: int, gpus: int) -> list[int]:
    """The cp degrees the planner tries on ``gpus`` GPUs (what tp and pp leave): 1, and from
    ``CP_SEARCH_FROM`` tokens on every divisor that splits the sequence into 2*cp equal chunks.
    Below that length a sequence's activations are small next to the model states, and cp's
    per-layer K/V traffic buys nothing that data parallelism does not."""
    if seq_len < CP_SEARCH_FROM:
        return [1]
    return [cp for cp in _divisors(gpus) if seq_len % (2 * cp) == 0]


def layout_words(job: JobSpec) -> str:
    """The job in the config's own words, e.g. ``strategy=fsdp dp_shard=8 tp=8 pp=1 ...``.

    Keys: parallel.{strategy, dp_replicate, dp_shard, tp, pp, ep, pp_schedule, pp_virtual_stages,
    sequence_parallel}, model.recompute, train.micro_batch_size (micro_batch) and
    train.grad_accum_steps (grad_accum). dp_replicate, the schedule and sequence_parallel are
    named only where they apply.
    """
    words = [f"strategy={job.strategy}"]
    if job.dp_replicate > 1:
        words.append(f"dp_replicate={job.dp_replicate}")
    words += [f"dp_shard={job.config_dp_shard}", f"tp={job.tp}", f"pp={job.pp}"]
    if job.ep > 1:
        words.append(f"ep={job.ep}")
    if job.pp > 1:
        words.append(f"pp_schedule={job.pp_schedule}")
        if job.pp_virtual_stages > 1:
            words.append(f"pp_virtual_stages={job.pp_virtual_stages}")
    if job.tp > 1:
        words.append(f"sequence_parallel={'true' if job.sp else 'false'}")
    if job.cp > 1:
        words.append(f"cp={job.cp}")
    words += [f"recompute={job.policy}", f"micro_batch={job.micro_batch}", f"grad_accum={job.grad_accum}"]
    return " ".join(words)


def describe_plan(result: Estimate) -> str:
    """One planner line: the layout in config words, then predicted memory, step time and MFU."""
    mem, t, job = result.memory, result.time, result.job
    where = f" (stage {mem.stage})" if job.pp > 1 else ""
    mfu = f", MFU {t.mfu:.0%}" if t.mfu is not None else ""
    idle = bubble_fraction(job.pp_schedule, job.pp, job.grad_accum, job.pp_virtual_stages)
    bubble = f", bubble {idle:.1%}" if job.pp > 1 else ""
    return f"{layout_words(job)}: {gib(mem.total)}/GPU{where}, {t.step_s:,.3g} s/step{mfu}{bubble}"


def _fits_on(model_cfg: ModelConfig, seq_len: int, device: DeviceSpec, precision: str, n: int) -> bool:
    strategy = "none" if n == 1 else "fsdp"
    return estimate(JobSpec(model_cfg, seq_len, 1, n, strategy, "full", precision, device)).fits


def min_gpus_to_fit(
    model_cfg: ModelConfig, seq_len: int, device: DeviceSpec, precision: str = "bf16_master", limit: int = 1 << 16
) -> int | None:
    """Fewest GPUs, any count, on which fsdp + full recompute at micro-batch 1 fits (None beyond ``limit``).

    Under fsdp only the sharded model states (16 Psi / N) depend on N, so memory per GPU never
    grows with N and the smallest fitting count can be bisected: double until a count fits, then
    bisect between it and the previous power of two. Rounding up to hardware-friendly counts is
    the caller's choice (``smallest_power_of_two``).
    """
    if _fits_on(model_cfg, seq_len, device, precision, 1):
        return 1
    if limit < 2:
        return None
    low, high = 1, 2  # low does not fit; high is the candidate upper bound
    while not _fits_on(model_cfg, seq_len, device, precision, high):
        if high >= limit:
            return None
        low, high = high, min(2 * high, limit)
    while high - low > 1:
        mid = (low + high) // 2
        if _fits_on(model_cfg, seq_len, device, precision, mid):
            high = mid
        else:
            low = mid
    return high


def smallest_power_of_two(n: int) -> int:
    """The smallest power of two >= n (GPU counts are often allocated that way)."""
    return 1 << (n - 1).bit_length()


def resolve_device(device_name: str) -> DeviceSpec | None:
    """A table entry for 'H100' or a torch.cuda.get_device_name() string; None for CPU/unknown."""
    return DEVICES.get(device_name.upper()) or lookup_device(device_name)


def fit_verdict(
    model_cfg: ModelConfig,
    seq_len: int,
    micro_batch_size: int,
    world_size: int,
    strategy: str,
    policy: str,
    precision_mode: str,
    device_name: str,
    config: JobConfig | None = None,
    **layout,
) -> str:
    """One or two lines for the trainer's start-up log: does this job fit, and if not, what would.

    ``layout``: any of JobSpec's grad_accum, tp, pp, dp_replicate, pp_schedule, pp_virtual_stages,
    sequence_parallel. When the job does not fit, the cheapest layout that does at the same global
    batch (``plan_layouts``, among what the trainer accepts with ``config``) is named in the
    config's words.
    """
    device = resolve_device(device_name)
    try:
        if device is None:
            job = JobSpec(model_cfg, seq_len, micro_batch_size, world_size, strategy, policy, precision_mode, **layout)
            mem = estimate_memory(job)
            return (
                f"fit check: no memory figures for device {device_name!r}; on a GPU this job would need "
                f"~{gib(mem.total)} per GPU (model states {gib(mem.states)}, activations "
                f"{gib(mem.activations + mem.logits)})"
            )
        job = JobSpec(model_cfg, seq_len, micro_batch_size, world_size, strategy, policy, precision_mode, device, **layout)
    except EstimatorError as exc:
        return f"fit check skipped: {exc}"
    result = estimate(job)
    shape = f", tp={job.tp}, pp={job.pp}" if job.tp * job.pp > 1 else ""
    head = f"{world_size}x {device.name}, {strategy}{shape}, recompute={policy}, micro-batch {micro_batch_size}, {precision_mode}"
    if result.fits:
        return f"fit: yes, {describe_estimate(result)} ({head})"
    first = f"fit: NO, {result.problems[0]} ({head})"
    plans = plan_layouts(model_cfg, seq_len, world_size, device, precision_mode, global_batch=job.global_batch, top=1,
                         config=config)
    if plans:
        same = f"same global batch: {job.global_batch} sequences"
        return first + f"\n  cheapest that fits: {describe_plan(plans[0])} ({same})"
    need = min_gpus_to_fit(model_cfg, seq_len, device, precision_mode)
    more = (
        f"at least {need} GPUs (smallest power of two: {smallest_power_of_two(need)})"
        if need else "more memory than any GPU count provides"
    )
    return first + f"\n  nothing fits on {world_size} GPUs; fsdp + full checkpointing at micro-batch 1 needs {more}"


def describe_estimate(result: Estimate) -> str:
    mem, t = result.memory, result.time
    mfu = f", MFU {t.mfu:.0%}" if t.mfu is not None else ""
    return (
        f"{gib(mem.total)} of {result.job.device.hbm_gib:g} GiB per GPU "
        f"(model states {gib(mem.states)}, activations {gib(mem.activations + mem.logits)}); "
        f"predicted {t.step_s:,.3g} s/step{mfu}"
    )


# --------------------------------------------------------------------------- the chapter's models


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: ModelConfig
    seq_len: int
    micro_batch: int
    world_size: int
    device: str


def preset(name: str) -> Preset:
    """The configurations the chapter's tables talk about (fresh objects on every call)."""
    builders = {
        "70b": _preset_70b,
        "gpt3-175b": _preset_gpt3,
        "llama2-7b": _preset_llama2_7b,
    }
    if name not in builders:
        raise EstimatorError(f"unknown preset {name!r}; choose one of: {', '.join(builders)}")
    return builders[name]()


PRESET_NAMES = ("70b", "gpt3-175b", "llama2-7b")


def _preset_70b() -> Preset:
    # The chapter's 8.2 table: h=8192, a=64, L=80, s=4096, b=4. A 4h GELU MLP and dropout, as
    # Korthikanti's formula assumes; the reference attention stores the scores as the paper does.
    cfg = ModelConfig(
        vocab_size=32000, max_seq_len=4096, n_layer=80, n_head=64, d_model=8192, mlp="gelu",
        position="rope", bias=False, tie_embeddings=False, dropout=0.1, attention="reference",
    )
    cfg.validate()
    return Preset("70b", "70B-class GPT (h=8192, a=64, L=80, 4h GELU MLP)", cfg, 4096, 4, 64, "H100")


def _preset_gpt3() -> Preset:
    # Brown et al. 2020 table 2.1: 96 layers, d=12288, 96 heads, context 2048; GPT-2's BPE vocabulary of
    # 50257 padded to 50304 (a multiple of 128), as Megatron-LM pads it (--make-vocab-size-divisible-by):
    # tensor parallelism splits the vocabulary, so tp must divide it, and 50257 = 29 x 1733 admits no
    # tp > 1. The 47 padding rows never see a token; they add 0.0003% to the parameters.
    cfg = ModelConfig(
        vocab_size=50304, max_seq_len=2048, n_layer=96, n_head=96, d_model=12288, mlp="gelu",
        position="learned", bias=True, tie_embeddings=True, dropout=0.0,
    )
    cfg.validate()
    return Preset("gpt3-175b", "GPT-3 175B (h=12288, a=96, L=96)", cfg, 2048, 1, 8, "H100")


def _preset_llama2_7b() -> Preset:
    # Touvron et al. 2023: 32 layers, d=4096, 32 heads, SwiGLU 11008, RMSNorm, RoPE, untied, 4k context.
    cfg = ModelConfig(
        vocab_size=32000, max_seq_len=4096, n_layer=32, n_head=32, d_model=4096, d_ff=11008, mlp="swiglu",
        norm="rmsnorm", position="rope", bias=False, tie_embeddings=False, dropout=0.0,
    )
    cfg.validate()
    return Preset("llama2-7b", "Llama-2-7B-like (h=4096, a=32, L=32, SwiGLU 11008)", cfg, 4096, 1, 8, "H100")
