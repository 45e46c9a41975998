"""Analytic model of one data-parallel training step: memory per GPU, communication, time, MFU.

Everything here is arithmetic on a ``ModelConfig`` and a ``DeviceSpec``; nothing touches a GPU.
Parameter counts and FLOPs come from ``model/flops.py`` (the same functions the trainer logs),
so they equal ``GPT(cfg).num_parameters()`` exactly.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1). Per transformer layer, with s = sequence length, b = micro-batch, h =
hidden size, a = heads, 16-bit activations, 1-byte dropout masks and a 4h GELU MLP:

    none       s*b*h*(34 + 5*a*s/h) bytes
               34*s*b*h = norms 4 + QKV input 2 + Q,K 4 + V 2 + projection input 2 + attention
                          dropout mask 1 + MLP input 2 + GELU input 8 + GELU output 8 + MLP
                          dropout mask 1;
               5*a*s^2*b = softmax output 2 + its dropout mask 1 + dropout output 2
    selective  34*s*b*h            (the attention core, QK^T..softmax..dropout..@V, is recomputed)
    full       2*s*b*h             (only the layer input is kept; the layer is recomputed)

``activation_bytes_per_layer`` generalizes the same accounting to any activation width p
(``dtype_bytes``), mask width m, MLP width f and kind (SwiGLU keeps gate and up, silu(gate) and
the product: 4f), with or without dropout, and with flash-style attention (the s^2 terms become
a fp32 log-sum-exp of a*s*b values). At p=2, m=1, f=4h with dropout it is the formula above
exactly. The policies the paper does not cover are derived the same way:
    op_selective  the block input, plus the outputs of the matmuls and of the attention kernel
                  (what ``model.checkpointing``'s op-level policy keeps)
    every_k       floor(L/k) layers at ``full``, the rest at ``none`` (averaged per layer)
    offload       nothing stays on the GPU; the ``none`` bytes go to host memory over PCIe

``saved_bytes_per_layer`` is the second variant: the tensors *our* ``model.gpt.Block`` saves
with the reference kernels (fp32 norm statistics and fp32 copies of norm inputs, SDPA's CPU
kernel, the reference attention's copies), counted by storage. It is what
``tools/bench_memory.py`` measures on CPU, and it is checked against that in the tests.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3/5): with mixed-precision Adam a
parameter costs 2 (16-bit weight) + 2 (16-bit gradient) + 12 (fp32 master, momentum, variance)
= 16 bytes. Per GPU over N data-parallel ranks: DDP 16*Psi; ZeRO-1 (2+2)*Psi + 12*Psi/N;
ZeRO-2 2*Psi + 14*Psi/N; ZeRO-3 and FSDP 16*Psi/N. Which bytes are 16-bit depends on the
precision mode (``STATE_BYTES``): fp32 and autocast keep fp32 weights and gradients (4+4+8).

Communication per GPU per optimizer step (ZeRO paper, section 7): DDP all-reduces the
gradients, 2*Psi*(N-1)/N elements sent per GPU; ZeRO-1/2 reduce-scatter gradients and
all-gather parameters, the same 2*Psi*(N-1)/N; ZeRO-3/FSDP all-gather parameters twice
(forward and backward) and reduce-scatter gradients, 3*Psi*(N-1)/N.

Time (stated assumptions, all in ``Assumptions``):
- compute = FLOPs / (dense peak of the mode * achievable fraction); FLOPs are the model FLOPs of
  ``model.flops.flops_per_token`` plus recomputation. The fraction defaults to 0.5 of peak (PaLM
  reports 46% MFU, Chowdhery et al. 2022 table 3; Megatron-LM 52% at 1T parameters, Narayanan et
  al. 2021) and 0.35 of the FP8 peak for FP8 GEMMs, which makes FP8 ~1.4x BF16 end to end, in line
  with measured large-model FP8 gains (~1.3-1.4x); fp32 uses the TF32 peak.
- communication = a bandwidth-optimal two-level collective (what NCCL reaches with one NIC per
  GPU): (L-1)/L*M over NVLink one way per reduce-scatter or all-gather inside a node of L GPUs,
  plus (n-1)/n*M/L over each GPU's NIC across n nodes; links run at 0.8 of their peak; latency
  is ignored (large buckets).
- overlap: gradient reduction overlaps the backward pass (2/3 of compute) for DDP/ZeRO-1/2;
  ZeRO-3/FSDP prefetching can hide communication behind the whole step. Only the excess shows.
- offload copies saved activations to the host in forward and back in backward on the compute
  stream (``torch.autograd.graph.save_on_cpu`` does not overlap), at 0.8 of PCIe one-way peak.
- memory-bound work runs at 0.8 of HBM bandwidth: the optimizer step reads and writes every
  model-state byte once per step (what makes larger micro-batches cheaper per token), and
  ``op_selective`` re-writes the element-wise outputs it dropped (read + write).
- memory also holds the logits (fp32 log-probabilities saved by the loss, their gradient and the
  16-bit logits gradient), for ZeRO-3/FSDP two unsharded layers (current and prefetched) and
  their gradients, and a fixed 2 GiB for the CUDA context, communicator buffers and allocator
  fragmentation.
Data parallelism only: no tensor or pipeline parallelism is modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from analysis.hardware import DEVICES, DeviceSpec, lookup_device
from analysis.report import gib
from model.config import CHECKPOINT_POLICIES, ModelConfig
from model.flops import block_parameters, count_parameters, flops_per_token, matmul_parameters

GIB = 2**30

POLICIES = CHECKPOINT_POLICIES
STRATEGIES = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
PRECISION_MODES = ("fp32", "bf16", "fp16", "bf16_master", "fp8")
ATTENTION_KINDS = ("materialized", "flash")
# Attention backends (model.attention) by what they store: only the reference keeps the scores.
ATTENTION_BACKEND_KIND = {"reference": "materialized", "sdpa": "flash", "flash_attn": "flash", "auto": "flash"}

# zero3 is modelled exactly like fsdp (both shard parameters, gradients and optimizer state), so
# the planner lists fsdp for both.
PLANNER_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


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
    # model.checkpointing wraps blocks whose 1-based index is a multiple of k.
    return n_layer // every_k


def _mlp_activation_elements(cfg: ModelConfig) -> int:
    """Elements per token saved inside the MLP between its two matmuls."""
    f = cfg.d_ff
    if cfg.mlp == "swiglu":
        return 4 * f  # gate and up (2f), silu(gate) (f), silu(gate)*up (f)
    return 2 * f  # GELU input and GELU output


def _mlp_matmul_output_elements(cfg: ModelConfig) -> int:
    return (2 if cfg.mlp == "swiglu" else 1) * cfg.d_ff


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
) -> float:
    """Bytes one transformer layer keeps on the GPU for backward (Korthikanti et al. 2022, generalized).

    ``dropout`` defaults to ``model_cfg.dropout > 0``; ``attention`` is ``materialized`` (the
    s x s scores are stored, the paper's case) or ``flash`` (only a fp32 log-sum-exp per row), or
    a backend name (``reference`` stores the scores; ``sdpa``, ``flash_attn`` do not);
    ``every_k`` defaults to ``model_cfg.checkpoint_every_k``. See the module docstring.
    """
    _check_choice("policy", policy, POLICIES)
    attention = ATTENTION_BACKEND_KIND.get(attention, attention)
    _check_choice("attention", attention, ATTENTION_KINDS + tuple(ATTENTION_BACKEND_KIND))
    s, b, h, a = seq_len, micro_batch, model_cfg.d_model, model_cfg.n_head
    p, m = dtype_bytes, dropout_mask_bytes
    with_dropout = model_cfg.dropout > 0 if dropout is None else dropout
    tokens = s * b

    if policy == "full":
        return float(p * tokens * h)
    if policy == "offload":
        return 0.0
    if policy == "every_k":
        k = every_k or model_cfg.checkpoint_every_k
        kept = _checkpointed_layers(model_cfg.n_layer, k)
        full = activation_bytes_per_layer(model_cfg, s, b, "full", p, with_dropout, attention=attention)
        none = activation_bytes_per_layer(
            model_cfg, s, b, "none", p, with_dropout, attention=attention, dropout_mask_bytes=m
        )
        return (kept * full + (model_cfg.n_layer - kept) * none) / model_cfg.n_layer

    if attention == "flash":
        scores = 4.0 * a * s * b  # fp32 log-sum-exp; the mask is regenerated from the RNG state
    else:
        scores = (2 * p + m if with_dropout else p) * a * s * s * b
    if policy == "op_selective":
        matmul_outputs = 3 * h + h + h + _mlp_matmul_output_elements(model_cfg) + h  # qkv, core, proj, fc, out
        core_extra = 4.0 * a * s * b if attention == "flash" else p * a * s * s * b  # lse, or the QK^T bmm output
        return p * tokens * (h + matmul_outputs) + core_extra

    per_token = (
        2 * h  # inputs of the two norms
        + h  # QKV matmul input
        + 3 * h  # Q and K (for QK^T) and V (for @V)
        + h  # output projection input
        + h  # MLP first matmul input
        + _mlp_activation_elements(model_cfg)
    )
    masks = 2 * m * tokens * h if with_dropout else 0  # after attention and after the MLP
    core = 0.0 if policy == "selective" else scores
    return p * tokens * per_token + masks + core


def korthikanti_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, policy: str) -> float:
    """The paper's closed forms (16-bit activations, dropout, 4h MLP), for checking the general one."""
    sbh = seq_len * micro_batch * hidden
    forms = {
        "none": sbh * (34 + 5 * heads * seq_len / hidden),
        "selective": 34.0 * sbh,
        "full": 2.0 * sbh,
    }
    if policy not in forms:
        raise EstimatorError(f"policy={policy!r}: the paper gives none, selective and full only")
    return forms[policy]


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
    rotated_qk = 2 * p * n * h if cfg.position == "rope" else 0
    qkv_out = 3 * p * n * h

    if policy == "full":
        return float(p * n * h + rope_tables)
    if policy == "every_k":
        k = every_k or cfg.checkpoint_every_k
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
    mlp = p * n * h + p * n * _mlp_activation_elements(cfg)  # first matmul input + activations
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


def model_state_bytes(n_params: int, strategy: str, world_size: int, precision: str) -> StateBytes:
    """Bytes per GPU of weights, gradients and optimizer state (ZeRO paper, section 5)."""
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
    world_size: int

    @property
    def sent_per_gpu(self) -> float:
        if self.world_size <= 1:
            return 0.0
        frac = (self.world_size - 1) / self.world_size
        return frac * (2 * self.all_reduce + self.reduce_scatter + self.all_gather)


def comm_volume(n_params: int, strategy: str, world_size: int, precision: str) -> CommVolume:
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


# --------------------------------------------------------------------------- the job and its estimate


@dataclass(frozen=True)
class Assumptions:
    """The knobs of the time and memory model; the module docstring says where each comes from."""

    compute_fraction: float = 0.5  # of the dense peak, for BF16/FP16/TF32 math
    fp8_compute_fraction: float = 0.35  # of the FP8 peak, for FP8 GEMMs
    link_fraction: float = 0.8  # of NVLink / NIC / PCIe one-way peak
    overhead_gib: float = 2.0  # CUDA context, NCCL buffers, allocator fragmentation
    unsharded_layers: int = 2  # ZeRO-3/FSDP: the layer in use and the prefetched one


@dataclass(frozen=True)
class JobSpec:
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

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("precision", self.precision, PRECISION_MODES)
        for key in ("seq_len", "micro_batch", "world_size", "grad_accum"):
            if getattr(self, key) < 1:
                raise EstimatorError(f"{key} must be >= 1 (got {getattr(self, key)})")
        if self.strategy == "none" and self.world_size > 1:
            raise EstimatorError(f"strategy=none runs one process; world_size={self.world_size} needs ddp, zero1-3 or fsdp")
        if self.precision == "fp8" and self.device.fp8_tflops is None:
            raise EstimatorError(f"precision=fp8 needs FP8 tensor cores; {self.device.name} has none (use bf16_master)")

    @property
    def attention(self) -> str:
        # sdpa and flash_attn never store the scores on a GPU; only the reference backend does.
        return ATTENTION_BACKEND_KIND[self.model.attention]

    @property
    def activation_dtype_bytes(self) -> int:
        return ACTIVATION_BYTES[self.precision]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU at the peak of a step (forward end / backward start)."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward by all layers, plus one layer's recompute working set
    logits: float
    unsharded_params: float  # ZeRO-3/FSDP gathered layers and their unreduced gradients
    overhead: float
    host: float  # offloaded activations, in host memory (not part of total)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.logits + self.unsharded_params + self.overhead


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    memory_bound_s: float  # optimizer step and element-wise recompute
    tokens_per_step: int  # over all GPUs
    model_flops_per_step: float  # over all GPUs, recomputation excluded (MFU convention)
    peak_tflops: float | None  # per GPU; None for fp8, where no single peak applies
    world_size: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s + self.memory_bound_s

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


def activation_bytes_total(job: JobSpec) -> tuple[float, float]:
    """(device bytes, host bytes) of saved activations over all layers, with the recompute working set.

    Recomputing (or reloading) a layer during backward rebuilds what that layer dropped, on the
    device, so every policy but ``none`` adds that much for one layer at the peak. The output of
    the embedding (the first layer's input) is counted too.
    """
    cfg, L = job.model, job.model.n_layer
    args = (cfg, job.seq_len, job.micro_batch)
    kw = dict(dtype_bytes=job.activation_dtype_bytes, attention=job.attention)
    none = activation_bytes_per_layer(*args, "none", **kw)
    embeddings = job.activation_dtype_bytes * job.seq_len * job.micro_batch * cfg.d_model
    if job.policy == "offload":
        return none + embeddings, L * none
    per_layer = activation_bytes_per_layer(*args, job.policy, **kw)
    if job.policy == "every_k":
        full = activation_bytes_per_layer(*args, "full", **kw)
        rebuilt = none - full if _checkpointed_layers(L, cfg.checkpoint_every_k) else 0.0
    else:
        rebuilt = max(none - per_layer, 0.0)
    return L * per_layer + rebuilt + embeddings, 0.0


def _logits_bytes(job: JobSpec) -> float:
    # fp32 log-probabilities saved by the loss, their fp32 gradient, and the logits' gradient.
    return job.seq_len * job.micro_batch * job.model.vocab_size * (4 + 4 + job.activation_dtype_bytes)


def _unsharded_bytes(job: JobSpec) -> float:
    if job.strategy not in ("zero3", "fsdp") or job.world_size == 1:
        return 0.0
    per = STATE_BYTES[job.precision]
    return job.assumptions.unsharded_layers * block_parameters(job.model) * (per.param + per.grad)


def estimate_memory(job: JobSpec) -> MemoryEstimate:
    n_params = count_parameters(job.model)
    states = model_state_bytes(n_params, job.strategy, job.world_size, job.precision)
    device_acts, host_acts = activation_bytes_total(job)
    return MemoryEstimate(
        params=states.param,
        grads=states.grad,
        optimizer=states.optimizer,
        activations=device_acts,
        logits=_logits_bytes(job),
        unsharded_params=_unsharded_bytes(job),
        overhead=job.assumptions.overhead_gib * GIB,
        host=host_acts,
    )


def recompute_flops_per_token(model_cfg: ModelConfig, seq_len: int, policy: str, every_k: int | None = None) -> float:
    """Extra forward FLOPs per token that a policy spends in backward (not part of MFU)."""
    return sum(_recompute_flops_split(model_cfg, seq_len, policy, every_k))


def _recompute_flops_split(model_cfg: ModelConfig, seq_len: int, policy: str, every_k: int | None = None) -> tuple[float, float]:
    """(GEMM FLOPs, attention-core FLOPs) recomputed per token."""
    _check_choice("policy", policy, POLICIES)
    L, d = model_cfg.n_layer, model_cfg.d_model
    core = 4.0 * d * seq_len  # QK^T and @V forward, per layer per token (no causal halving)
    gemms = 2.0 * block_parameters(model_cfg)
    if policy == "selective":
        return 0.0, L * core
    if policy == "full":
        return L * gemms, L * core
    if policy == "every_k":
        kept = _checkpointed_layers(L, every_k or model_cfg.checkpoint_every_k)
        return kept * gemms, kept * core
    return 0.0, 0.0  # none, offload; op_selective recomputes element-wise ops only (memory-bound, ~no FLOPs)


def _peak_tflops(device: DeviceSpec, precision: str) -> float:
    return device.tf32_tflops if precision == "fp32" else device.bf16_tflops


def _compute_seconds(job: JobSpec, tokens_per_gpu: int) -> float:
    cfg, a = job.model, job.assumptions
    extra_gemm, extra_core = _recompute_flops_split(cfg, job.seq_len, job.policy)
    gemm_flops = 6.0 * matmul_parameters(cfg) + extra_gemm
    core_flops = flops_per_token(cfg, job.seq_len) - 6.0 * matmul_parameters(cfg) + extra_core
    core_rate = _peak_tflops(job.device, job.precision) * 1e12 * a.compute_fraction
    if job.precision == "fp8":  # FP8 GEMMs; attention and the rest stay at the BF16 rate
        gemm_rate = job.device.fp8_tflops * 1e12 * a.fp8_compute_fraction
    else:
        gemm_rate = core_rate
    return tokens_per_gpu * (gemm_flops / gemm_rate + core_flops / core_rate)


def collective_seconds(nbytes: float, world_size: int, device: DeviceSpec, link_fraction: float = 0.8) -> float:
    """One reduce-scatter or all-gather of a ``nbytes`` tensor over ``world_size`` GPUs (two-level)."""
    if world_size <= 1 or nbytes == 0:
        return 0.0
    local = min(world_size, device.gpus_per_node)
    nodes = math.ceil(world_size / local)
    intra = (local - 1) / local * nbytes / (device.nvlink_one_way_gb_s * 1e9 * link_fraction)
    inter = (nodes - 1) / nodes * nbytes / local / (device.network_gb_s * 1e9 * link_fraction)
    return intra + inter


def _memory_bound_seconds(job: JobSpec, state_bytes: float) -> float:
    hbm = job.device.hbm_tb_s * 1e12 * job.assumptions.link_fraction
    optimizer = 2 * state_bytes / hbm
    if job.policy != "op_selective":
        return optimizer
    args = (job.model, job.seq_len, job.micro_batch)
    kw = dict(dtype_bytes=job.activation_dtype_bytes, attention=job.attention)
    dropped = activation_bytes_per_layer(*args, "none", **kw) - activation_bytes_per_layer(*args, "op_selective", **kw)
    return optimizer + job.grad_accum * job.model.n_layer * 2 * max(dropped, 0.0) / hbm


def estimate_time(job: JobSpec, comm: CommVolume, host_bytes: float, state_bytes: float) -> TimeEstimate:
    a = job.assumptions
    tokens_per_gpu = job.seq_len * job.micro_batch * job.grad_accum
    compute = _compute_seconds(job, tokens_per_gpu)
    link = (job.world_size, job.device, a.link_fraction)
    comm_s = (
        2 * collective_seconds(comm.all_reduce, *link)
        + collective_seconds(comm.reduce_scatter, *link)
        + collective_seconds(comm.all_gather, *link)
    )
    if job.strategy in ("zero3", "fsdp"):
        comm_s *= job.grad_accum  # parameters are gathered again for every micro-batch
        hideable = compute
    else:
        hideable = compute / 3 * 2 / job.grad_accum  # only the last micro-batch's backward overlaps
    offload = job.grad_accum * 2 * host_bytes / (job.device.pcie_gb_s * 1e9 * a.link_fraction)
    peak = None if job.precision == "fp8" else _peak_tflops(job.device, job.precision)
    return TimeEstimate(
        compute_s=compute,
        comm_s=comm_s,
        exposed_comm_s=max(0.0, comm_s - hideable),
        offload_s=offload,
        memory_bound_s=_memory_bound_seconds(job, state_bytes),
        tokens_per_step=tokens_per_gpu * job.world_size,
        model_flops_per_step=flops_per_token(job.model, job.seq_len) * tokens_per_gpu * job.world_size,
        peak_tflops=peak,
        world_size=job.world_size,
    )


def estimate(job: JobSpec) -> Estimate:
    """Memory, communication and time of one optimizer step of ``job``, and why it does not fit."""
    n_params = count_parameters(job.model)
    memory = estimate_memory(job)
    comm = comm_volume(n_params, job.strategy, job.world_size, job.precision)
    time = estimate_time(job, comm, memory.host, memory.states)
    problems = []
    capacity = job.device.hbm_gib * GIB
    if memory.total > capacity:
        problems.append(f"needs {gib(memory.total)} per GPU, {job.device.name} has {job.device.hbm_gib:g} GiB")
    if memory.host > job.device.host_mem_gib * GIB:
        problems.append(
            f"offload needs {gib(memory.host)} of host memory per GPU, a node has ~{job.device.host_mem_gib:g} GiB per GPU"
        )
    return Estimate(job, n_params, flops_per_token(job.model, job.seq_len), memory, time, comm, tuple(problems))


# --------------------------------------------------------------------------- planning


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
) -> list[Estimate]:
    """Combinations of strategy x checkpointing policy x micro-batch that fit, cheapest first.

    Cheapest = least predicted time per token (the cost of the run); ties go to less memory.
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
                result = estimate(job)
                if result.fits:
                    fitting.append(result)
    fitting.sort(key=lambda e: (e.time.seconds_per_token, e.memory.total))
    return fitting if top is None else fitting[:top]


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
) -> str:
    """One or two lines for the trainer's start-up log: does this job fit, and if not, what would."""
    device = resolve_device(device_name)
    try:
        if device is None:
            job = JobSpec(model_cfg, seq_len, micro_batch_size, world_size, strategy, policy, precision_mode)
            mem = estimate_memory(job)
            return (
                f"fit check: no memory figures for device {device_name!r}; on a GPU this job would need "
                f"~{gib(mem.total)} per GPU (model states {gib(mem.states)}, activations "
                f"{gib(mem.activations + mem.logits)})"
            )
        job = JobSpec(model_cfg, seq_len, micro_batch_size, world_size, strategy, policy, precision_mode, device)
    except EstimatorError as exc:
        return f"fit check skipped: {exc}"
    result = estimate(job)
    head = f"{world_size}x {device.name}, {strategy}, checkpointing={policy}, micro-batch {micro_batch_size}, {precision_mode}"
    if result.fits:
        return f"fit: yes, {describe_estimate(result)} ({head})"
    first = f"fit: NO, {result.problems[0]} ({head})"
    plans = plan_fits(model_cfg, seq_len, world_size, device, precision_mode, top=1)
    if plans:
        best = plans[0]
        return first + (
            f"\n  cheapest that fits: strategy={best.job.strategy}, checkpointing={best.job.policy}, "
            f"micro-batch {best.job.micro_batch}: {describe_estimate(best)}"
        )
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
    # Brown et al. 2020 table 2.1: 96 layers, d=12288, 96 heads, context 2048; GPT-2's BPE vocab.
    cfg = ModelConfig(
        vocab_size=50257, max_seq_len=2048, n_layer=96, n_head=96, d_model=12288, mlp="gelu",
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
