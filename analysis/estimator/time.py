"""Step time: GEMMs, the attention core, element-wise work, recomputation, what communication leaves
exposed and the pipeline bubble, on the slowest stage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from analysis.estimator.activations import alternate_matmuls_recomputed, checkpointed_layers, mlp_hidden_width
from analysis.estimator.communication import (
    _dp_and_expert_comm,
    _per_node,
    collective_seconds,
    cp_comm_seconds,
    expert_all_to_all,
    gradient_reductions,
    pp_comm_seconds,
    reshards_after_forward,
    tp_comm_seconds,
)
from analysis.estimator.job import (
    CUDNN_HOPPER_ATTENTION_SPEEDUP,
    MUON_NS_STEPS,
    MUON_PIECE_BYTES,
    PP_SCHEDULES,
    RECOMPUTE_POLICIES,
    Assumptions,
    JobSpec,
    check_choice,
)
from analysis.estimator.memory import (
    edge_stages,
    job_stage_parameters,
    layer_bytes,
    muon_groups,
    muon_matrices,
    muon_numel,
)
from common.hardware import DeviceSpec
from model.config import ModelConfig
from model.flops import blocks_parameters, flops_per_token


def bubble_overhead(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Pipeline idle time relative to the ideal compute time (Narayanan et al. 2021, section 2.2)."""
    check_choice("pp_schedule", schedule, PP_SCHEDULES)
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
    pp_comm_s: float = 0.0  # pipeline sends between stages on the critical path (all of them unless pp_overlap)
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


def recompute_flops_per_token(model_cfg: ModelConfig, seq_len: int, recompute: str, every_k: int | None = None) -> float:
    """Extra forward FLOPs per token that a recompute policy spends in backward (not part of MFU)."""
    return sum(_recompute_flops_split(model_cfg, seq_len, recompute, every_k))


def _recompute_flops_split(model_cfg: ModelConfig, seq_len: int, recompute: str, every_k: int | None = None) -> tuple[float, float]:
    """(GEMM FLOPs, attention-core FLOPs) recomputed per token."""
    check_choice("recompute", recompute, RECOMPUTE_POLICIES)
    L = model_cfg.n_layer
    # QK^T over the query width and @V over the values', forward, per layer per token, against the keys
    # each layer's window lets a query see (no causal halving: the FLOP convention of model/flops.py)
    keys = sum(seq_len if w is None else min(w, seq_len) for w in (model_cfg.window_of(i) for i in range(L))) / L
    core = 2.0 * (model_cfg.q_dim + model_cfg.value_dim) * keys
    gemms = 2.0 * blocks_parameters(model_cfg, active=True) / L  # a token's experts only
    if recompute == "selective":
        return 0.0, L * core
    if recompute == "full":
        return L * gemms, L * core
    if recompute == "every_k":
        kept = checkpointed_layers(L, every_k or model_cfg.recompute_every_k)
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


def gemm_seconds(job: JobSpec, m: float, k: float, n: float, fp8: bool = True) -> float:
    """One (m x k) @ (k x n) GEMM on one GPU, a roofline: 2*m*k*n FLOPs at the device's fitted large-GEMM
    rate scaled by the output shape factor (FP8 GEMMs at the FP8 peak under precision=fp8, unless
    ``fp8`` is False: a GEMM left in 16 bits), or the operands and the result through HBM, whichever is
    longer (a short reduction dimension k makes a GEMM memory-bound)."""
    a = job.assumptions
    if job.precision == "fp8" and fp8:
        rate = job.device.fp8_tflops * 1e12 * a.fp8_gemm_fraction
    else:
        rate = _peak_tflops(job.device, job.precision) * 1e12 * a.gemm_fraction(job.device)
    compute = 2.0 * m * k * n / (rate * _shape_factor((m, n), a.gemm_knee))
    traffic = job.activation_dtype_bytes * (m * k + k * n + m * n) / (job.device.hbm_tb_s * 1e12 * a.hbm_fraction)
    return max(compute, traffic)


def layer_gemms(cfg: ModelConfig, tokens: int, tp: int = 1, moe_split: int = 1, etp: int = 1, ep: int = 1
                ) -> list[tuple[int, float, float]]:
    """The forward GEMMs of one transformer layer on one of ``tp`` GPUs, as (m, k, n): the fused QKV
    and the MLP's first matmul are column-parallel (n / tp), the output projection and the MLP's
    second matmul row-parallel (k / tp). Their 2*m*k*n sum to 2*tokens*(the block's matmul weights)/tp.

    A MoE model's mean layer: its MoE layers' share of the tokens goes to the router and, k copies
    each, spread evenly over the experts (one GEMM pair per expert, as the grouped GEMM runs them),
    plus the shared experts; the rest to the dense MLP. A MoE layer runs on tokens / ``moe_split``
    rows per GPU: tp under sequence parallelism with experts replicated over tp (each tp GPU routes
    its own positions), else 1 (every tp GPU runs all of them); with expert tensor parallelism
    (``etp`` = tp) each expert's and the shared experts' widths are split ``etp`` ways. Under expert
    parallelism a GPU runs its experts / ``ep`` local experts on the copies every rank of its ep group
    routed to them, ``ep`` times one rank's share each (even routing): the same FLOPs as all experts on
    its own tokens, in fewer, taller GEMMs (what the shape factor and the weights' FP8 casts see)."""
    d, f = cfg.d_model, cfg.d_ff
    gated = 2 if cfg.mlp == "swiglu" else 1
    gemms = attention_gemms(cfg, tokens, tp)
    moe_share = cfg.n_moe_layers / cfg.n_layer if cfg.moe.experts is not None else 0.0
    if moe_share < 1:
        dense = tokens * (1 - moe_share)
        gemms += [(dense, d, gated * f / tp), (dense, f / tp, d)]
    if moe_share > 0:
        routed, fe = tokens * moe_share / moe_split, cfg.expert_d_ff / etp
        shared = cfg.moe.shared_experts * fe
        per_expert = routed * cfg.moe.top_k / cfg.moe.experts * ep
        local = cfg.moe.experts // ep
        gemms += [(routed, d, cfg.moe.experts)] + [(per_expert, d, gated * fe), (per_expert, fe, d)] * local
        if shared:
            gemms += [(routed, d, gated * shared), (routed, shared, d)]
    return gemms


def attention_gemms(cfg: ModelConfig, tokens: int, tp: int = 1) -> list[tuple[int, float, float]]:
    """One layer's attention projections on one of ``tp`` GPUs, (m, k, n): the fused QKV (column-
    parallel) and the output projection (row-parallel). Latent attention: the down projections of the
    query and of the key/value latent with its rotary key, whole on every tp GPU (Megatron-LM's
    latent attention does not split them), the up projections column-parallel by heads, the output
    projection row-parallel over the values' width."""
    d = cfg.d_model
    if not cfg.is_mla:
        return [(tokens, d, (cfg.q_dim + 2 * cfg.kv_dim) / tp), (tokens, cfg.q_dim / tp, d)]
    kv_up = cfg.n_head * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    if cfg.q_lora_rank is None:
        query = [(tokens, d, cfg.q_dim / tp)]
    else:
        query = [(tokens, d, cfg.q_lora_rank), (tokens, cfg.q_lora_rank, cfg.q_dim / tp)]
    return query + [(tokens, d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), (tokens, cfg.kv_lora_rank, kv_up / tp),
                    (tokens, cfg.value_dim / tp, d)]


def _recompute_shares(job: JobSpec) -> tuple[float, float, float]:
    """Per layer, how much of its forward is run again in backward: (GEMMs and element-wise work of
    the whole layer, the attention core alone, element-wise work alone)."""
    cfg = job.model
    if job.recompute == "full":
        return 1.0, 0.0, 0.0
    if job.recompute == "every_k":
        return checkpointed_layers(cfg.n_layer, cfg.recompute_every_k) / cfg.n_layer, 0.0, 0.0
    if job.recompute == "selective":
        return 0.0, 1.0, 0.0
    if job.recompute == "op_selective":
        return 0.0, 0.0, 1.0
    return 0.0, 0.0, 0.0


def causal_pairs(seq_len: int, window: int | None = None) -> int:
    """Query-key pairs a causal mask lets through on seq_len positions: query i sees i + 1 keys, or
    with a window of W tokens min(i + 1, W) (model/attention.py's causal_mask)."""
    w = seq_len if window is None else min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def fused_core_share(cfg: ModelConfig, seq_len: int) -> float:
    """A fused core's work per layer, averaged over the layers, as a share of a plain causal one:
    flash-attn skips the blocks outside a sliding window's band; SDPA takes the window as an explicit
    (T, S) mask, so it leaves its causal kernel and runs every block of the square."""
    whole = causal_pairs(seq_len)
    shares = []
    for i in range(cfg.n_layer):
        window = cfg.window_of(i)
        if window is None:
            shares.append(1.0)
        elif cfg.attention == "sdpa":
            shares.append(seq_len * seq_len / whole)
        else:
            shares.append(causal_pairs(seq_len, window) / whole)
    return sum(shares) / len(shares)


def attention_seconds(job: JobSpec, forwards: float) -> tuple[float, float]:
    """(compute, memory-bound) seconds of one layer's attention core for one micro-batch on one GPU,
    with its forward run ``forwards`` times (1, or 2 when recomputed) and its backward once.

    The core's model FLOPs are 2*b*s^2*(q + v) forward (QK^T over the query width q = n_head * head_dim
    and @V over the values' v, equal but in latent attention; every query against every key), split
    over tp by heads. A fused (flash) kernel skips the masked half of a causal
    square (and with flash-attn the blocks outside a sliding window: ``fused_core_share``) and its backward
    recomputes the scores, 2.5x its forward; it runs at ``attention_fraction`` of the large-GEMM rate
    (FlashAttention-2's kernels), or ``CUDNN_HOPPER_ATTENTION_SPEEDUP`` times that where Transformer
    Engine runs it on Hopper (``attention_kernel=te``: cuDNN's fused attention).
    A materialized core (model.attention=reference; Megatron's fused softmax) runs both matmuls on the
    whole square as batched GEMMs (the head dim is their reduction dimension) and moves the s x s
    scores through memory: ``_score_traffic_bytes``.
    """
    cfg, a, t = job.model, job.assumptions, job.layout.tp
    b, s = job.micro_batch, job.seq_len
    q = job.local_seq_len  # a cp GPU's queries, against every key: 1/cp of the square, balanced (parallel/cp.py)
    fwd_flops = 2.0 * b * q * s * (cfg.q_dim + cfg.value_dim) / t
    if job.attention == "flash":
        executed = 0.5 * fwd_flops * fused_core_share(cfg, s) * (forwards + 2.5)
        rate = _gemm_rate(job) * a.attention_fraction
        if job.attention_kernel == "te" and job.device.family == "hopper":
            rate *= CUDNN_HOPPER_ATTENTION_SPEEDUP  # cuDNN's fused attention, what TE picks on Hopper
        return executed / rate, 0.0
    heads = cfg.n_head / t
    sixteen = dataclasses.replace(job, precision="bf16_master") if job.precision == "fp8" else job
    qk_dim, v_dim = cfg.q_dim // cfg.n_head, cfg.value_dim // cfg.n_head
    # QK^T and @V, 2*q*s*qk_dim and 2*q*s*v_dim per head
    one = (gemm_seconds(sixteen, q, qk_dim, s) + gemm_seconds(sixteen, q, v_dim, s)) * b * heads
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
    read and write q and k both ways, 2*(d + kv_dim) each way (latent attention: the queries' rotary
    parts and the shared rotary key; its two latent norms as the block's, read and write forward,
    three passes backward, outside). FP8 adds the casts of the GEMMs' operands (``fp8_cast_bytes``).
    In a MoE layer the activation runs on each token's top-k experts and the shared ones
    (``mlp_hidden_width``), and the router and the token permutation add ``moe_permutation_bytes``
    (for the mean layer, times the MoE layers' share).
    """
    cfg, p, t = job.model, job.activation_dtype_bytes, job.layout.tp
    tokens = job.local_seq_len * job.micro_batch
    d = cfg.d_model
    outside_fwd, outside_bwd = 10 * d * p, 12 * d * p
    if cfg.dropout > 0:
        outside_fwd += 2 * (2 * d * p + d)
        outside_bwd += 2 * (2 * d * p + d)
    act_fwd, act_bwd = (3, 5) if cfg.mlp == "swiglu" else (2, 3)
    width = mlp_hidden_width(cfg)
    inside_fwd, inside_bwd = act_fwd * width * p, act_bwd * width * p
    if cfg.is_mla:  # the rotary parts of the queries and the one shared rotary key; the latents' two norms
        rotated = cfg.n_head * cfg.qk_rope_head_dim + cfg.qk_rope_head_dim
        inside_fwd += 2 * rotated * p
        inside_bwd += 2 * rotated * p
        latents = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank  # outside the TP region, as the block's norms
        outside_fwd += 2 * latents * p
        outside_bwd += 3 * latents * p
    elif cfg.position == "rope":
        inside_fwd += 2 * (d + cfg.kv_dim) * p
        inside_bwd += 2 * (d + cfg.kv_dim) * p
    split = t if job.layout.sp else 1
    fwd = tokens * (outside_fwd / split + inside_fwd / t)
    bwd = tokens * (outside_bwd / split + inside_bwd / t)
    if cfg.moe.experts is not None:
        share = cfg.n_moe_layers / cfg.n_layer
        moe_fwd, moe_bwd = moe_permutation_bytes(job)
        fwd += share * moe_fwd
        bwd += share * moe_bwd
    if job.precision == "fp8":
        cast_fwd, cast_bwd = fp8_cast_bytes(job, tokens)
        fwd += cast_fwd
        bwd += cast_bwd
    return fwd, bwd


def moe_routed_tokens(job: JobSpec) -> float:
    """Tokens one GPU routes in a MoE layer per micro-batch: its positions, or under sequence parallelism
    with experts replicated over tp its 1/tp of them (each tp GPU routes its own)."""
    split = job.layout.tp if job.layout.sp and job.layout.etp == 1 else 1
    return job.local_seq_len * job.micro_batch / split


# The router's scores are fp32 (model/moe.py ``route`` upcasts the logits; Megatron-Core's router too).
ROUTER_SCORE_BYTES = 4


def moe_permutation_bytes(job: JobSpec) -> tuple[float, float]:
    """Bytes one MoE layer's router and token permutation move for one micro-batch on one GPU,
    (forward, backward), memory-bound passes over d-wide rows of p bytes.

    With T routed tokens (``moe_routed_tokens``) and A = T * top_k copies, as model/moe.py and
    parallel/ep.py run them (Megatron-Core's all-to-all dispatcher moves the same rows): forward,
    ``permute`` gathers the copies in expert order (read A, write A); under ep the copies that arrive
    are sorted by local expert and the experts' outputs sorted back (read and write A, twice);
    ``unpermute`` reads the A outputs and writes the T weighted sums. Backward: the un-permutation's
    gradient reads the T output gradients, writes A copies' and reads the A saved outputs for the
    routing weights' gradient; the two sorts again; the permutation's gradient reads A and writes the
    T sums. The router: the softmax (or sigmoid) over T x experts fp32 logits reads them and writes
    the scores, top-k reads the scores (3 passes); backward reads the scores and their gradient and
    writes the logits' (3). The router's GEMM is in ``layer_gemms``; the all-to-alls are in
    communication.py ``expert_all_to_all``."""
    cfg, p = job.model, job.activation_dtype_bytes
    tokens = moe_routed_tokens(job)
    copies = tokens * cfg.moe.top_k
    sorts = 4 * copies if job.layout.ep > 1 else 0.0
    row = cfg.d_model * p
    router = 3 * tokens * cfg.moe.experts * ROUTER_SCORE_BYTES
    fwd = (2 * copies + sorts + copies + tokens) * row + router
    bwd = (2 * copies + tokens + sorts + copies + tokens) * row + router
    return fwd, bwd


# Bytes per element of one cast to FP8: read the 16-bit tensor (2), write the FP8 copy (1) and its
# transpose (1); dynamic scaling reads the tensor once more first, for the amax its scale comes from (2).
FP8_CAST_ELEMENT_BYTES = {"delayed": 4, "dynamic": 6}


def fp8_cast_bytes(job: JobSpec, tokens: float) -> tuple[float, float]:
    """Bytes the casts to FP8 of one layer's GEMM operands move for one micro-batch, (forward, backward).

    Hopper's FP8 tensor cores multiply a row-major by a column-major operand only, so every operand
    cast also writes its transpose, for the backward GEMM that contracts over its other dimension
    (Transformer Engine's cast-transpose kernels, torchao's Float8 casts). Forward casts each GEMM's
    input (m x k) and weight (k x n), backward its output gradient (m x n); the input and weight
    gradients come out in 16 bits. Delayed scaling (Transformer Engine) takes the scale from the
    amax history and records the amax as the cast runs; dynamic scaling (torchao) reduces the
    tensor's amax in a pass of its own before casting (``FP8_CAST_ELEMENT_BYTES``). Eager torchao
    casts the saved 16-bit input and weight again in backward, once per layout; counted here is one
    cast per operand writing both layouts, what a fused (compiled) cast reaches. With
    ``fp8_weight_casts=per_step`` (Megatron-Core's is_first_microbatch) a weight is cast on the step's
    first micro-batch only: its share per micro-batch is 1/grad_accum. With
    ``fp8_cast_kernels=megatron_te`` some operands move fewer bytes (``_megatron_te_cast_bytes``)."""
    per_element = FP8_CAST_ELEMENT_BYTES[job.fp8_scaling]
    gemms = layer_gemms(job.model, tokens, job.layout.tp, ep=job.layout.ep)
    weight_share = 1 / job.grad_accum if job.fp8_weight_casts == "per_step" else 1.0
    fwd = per_element * sum(m * k + weight_share * k * n for m, k, n in gemms)
    bwd = per_element * sum(m * n for m, _, n in gemms)
    if job.fp8_cast_kernels == "megatron_te":
        fwd_change, bwd_change = _megatron_te_cast_bytes(job, tokens)
        fwd += fwd_change
        bwd += bwd_change
    return fwd, bwd


def _megatron_te_cast_bytes(job: JobSpec, tokens: float) -> tuple[float, float]:
    """What Transformer Engine's layers, as Megatron-Core builds a dense block, change in the separate
    casts ``fp8_cast_bytes`` counts, (forward, backward) bytes for one layer and micro-batch.

    The input of the fused QKV and of a dense MLP's first matmul is the output of the norm fused into
    the layer (TELayerNormColumnParallelLinear, TE's LayerNormLinear). Under delayed scaling the norm
    kernel writes it in FP8 itself, 1 byte for the 16-bit 2 the block's norm is counted with, and the
    FP8 copy is transposed for the weight gradient (read 1, write 1; TE 1.x ``fp8_transpose`` in
    backward). Under current scaling (fp8_scaling=dynamic) the norm writes 16 bits and reduces the amax
    as it writes (TE >= 2.7), so the cast has no amax pass: read 2, write 1 + 1.

    Under sequence parallelism (split s = tp) the GEMM runs on all-gathered rows: that input, and the
    output gradient of the output projection and of the MLP's second matmul (row-parallel), are cast
    on the GPU's own 1/s of the rows, row-major only (read 2, write 1; 2 more for the amax under
    current scaling, unless the norm reduced it), gathered in FP8, and the gathered copy is transposed
    (read 1, write 1), where the separate count casts all the gathered rows. Latent attention's and
    the MoE layers' GEMMs keep the separate count (their norms are not fused into a GEMM)."""
    cfg, per_element = job.model, FP8_CAST_ELEMENT_BYTES[job.fp8_scaling]
    split = job.layout.tp if job.layout.sp else 1
    dense = tokens * (1 - cfg.n_moe_layers / cfg.n_layer) if cfg.moe.experts is not None else tokens
    attention = 0.0 if cfg.is_mla else tokens
    normed = (attention + dense) * cfg.d_model  # elements of the norm-fed inputs, all rows
    gathered_grads = (attention + dense) * cfg.d_model if split > 1 else 0.0  # row-parallel output gradients
    transpose = 2.0
    if job.fp8_scaling == "delayed":
        normed_fwd, normed_bwd = -1.0 / split, transpose
    elif split > 1:
        normed_fwd, normed_bwd = 3.0 / split, transpose
    else:
        normed_fwd, normed_bwd = 4.0, 0.0
    grad_bytes = (per_element - 1.0) / split + transpose  # a cast without its transpose, then the gathered transpose
    return (normed * (normed_fwd - per_element),
            normed * normed_bwd + gathered_grads * (grad_bytes - per_element))


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
    plus the forward again for the recomputed share, the attention core (``attention_seconds``) and
    element-wise work at ``hbm_fraction`` of HBM bandwidth (``_elementwise_bytes``, times
    ``elementwise_scale``). The last stage adds the LM head's GEMM (vocab-parallel) and the loss's
    memory-bound pass over the logits (16-bit logits written and read, fp32 log-probabilities written
    and read, 16-bit gradient written), and the multi-token-prediction modules: per depth one more
    layer, its projection, the head and the loss again. With ``loss_chunk_tokens`` the head's GEMM
    runs per chunk and its forward once more in backward (the chunk's logits are recomputed, not kept).
    """
    cfg, a, t = job.model, job.assumptions, job.layout.tp
    tokens = job.local_seq_len * job.micro_batch
    layers = cfg.n_layer // job.layout.pp
    hbm = job.device.hbm_tb_s * 1e12 * a.hbm_fraction
    redo_layer, redo_core, redo_elementwise = _recompute_shares(job)
    moe_split = t if job.layout.sp and job.layout.etp == 1 else 1
    gemm = sum(gemm_seconds(job, *shape) for shape in layer_gemms(cfg, tokens, t, moe_split, job.layout.etp, job.layout.ep))
    core, scores = attention_seconds(job, 1 + redo_core + redo_layer)
    fwd_bytes, bwd_bytes = _elementwise_bytes(job)
    elementwise = (fwd_bytes * (1 + redo_layer + redo_elementwise) + bwd_bytes) * a.elementwise_scale / hbm
    if job.recompute == "op_selective" and job.op_selective_saves == "alternate_matmuls":
        # torchtitan's per-op policy runs the matmuls whose outputs it dropped again in backward
        gemm_redo = sum(gemm_seconds(job, tokens, k, n) for k, n in alternate_matmuls_recomputed(cfg, t))
    else:
        gemm_redo = 0.0
    compute = layers * (gemm * (3 + redo_layer) + gemm_redo + core)
    memory_bound = layers * (elementwise + scores)
    if stage == job.layout.pp - 1:
        # The head and the loss, once and again per multi-token-prediction depth; each depth also runs
        # its 2d -> d projection and one block (never recomputed: model/recompute.py wraps the
        # model's blocks only), counted as the mean layer. The head's GEMM stays in 16 bits under FP8:
        # parallel/float8.py and model/te.py leave it out, as Megatron-Core's output layer is no TE layer.
        heads = 1 + cfg.mtp_depth
        chunk = min(job.loss_chunk_tokens or tokens, tokens)
        if chunk == tokens:
            compute += 3 * heads * gemm_seconds(job, tokens, cfg.d_model, cfg.vocab_size / t, fp8=False)
        else:  # kernels.loss_chunk_tokens: each chunk's head GEMM runs again in its backward
            whole, rest = divmod(tokens, chunk)
            compute += 4 * heads * sum(gemm_seconds(job, rows, cfg.d_model, cfg.vocab_size / t, fp8=False)
                                       for rows in [chunk] * whole + ([rest] if rest else []))
        p = job.activation_dtype_bytes
        memory_bound += heads * tokens * cfg.vocab_size / t * (3 * p + 8) * a.elementwise_scale / hbm
        if cfg.mtp_depth:
            mtp_core, mtp_scores = attention_seconds(job, 1)
            projection = gemm_seconds(job, tokens, 2 * cfg.d_model, cfg.d_model / t)
            compute += cfg.mtp_depth * (3 * (gemm + projection) + mtp_core)
            memory_bound += cfg.mtp_depth * ((fwd_bytes + bwd_bytes) * a.elementwise_scale / hbm + mtp_scores)
    tp_s, _ = tp_comm_seconds(job, stage)
    # Overlapped collectives (Megatron's userbuffers, async TP) hide behind the GEMMs they feed.
    tp_exposed = _exposed(tp_s, compute, a) if job.tp_overlap else tp_s
    pp_s = pp_comm_seconds(job)[0]
    if job.pp_overlap:
        # Megatron-Core's interleaved schedule with overlap_p2p_comm posts the next chunk's receive and this
        # one's send before it computes and waits on them after (no batched send-receive barrier)
        pp_s = _exposed(pp_s, compute, a)
    return _MicroBatch(compute, memory_bound, tp_s, tp_exposed, pp_s, cp_comm_seconds(job)[0])


def _exposed(comm: float, hideable: float, a: Assumptions) -> float:
    """Seconds of a collective of ``comm`` seconds left on the critical path when ``hideable`` seconds of
    compute can run beside it: only ``overlap_efficiency`` of the overlap is real (the collective's
    kernels take multiprocessors and memory bandwidth from the compute they run beside)."""
    return comm - a.overlap_efficiency * min(comm, hideable)


def _optimizer_seconds(job: JobSpec, state_bytes: float) -> float:
    """The optimizer step reads and writes every model-state byte of this GPU once (memory-bound)."""
    return 2 * state_bytes / (job.device.hbm_tb_s * 1e12 * job.assumptions.hbm_fraction)


def largest_stage_parameters(job: JobSpec) -> float:
    return max(job_stage_parameters(job, i) for i in edge_stages(job))


def estimate_time(job: JobSpec, state_bytes: float) -> TimeEstimate:
    """Step time: m micro-batches through the slowest stage, the bubble, and what communication shows.

    ``state_bytes``: model-state bytes per GPU, which the optimizer step reads and writes.
    Data-parallel collectives hide behind compute as the strategy allows (docs/estimator.md):
    FSDP without pp gathers and reduce-scatters every micro-batch, behind that micro-batch's work;
    FSDP under pp gathers once per step behind the first forward and reduce-scatters after the last
    backward; DDP and ZeRO-1/2 reduce behind the backward of each micro-batch they reduce
    (``gradient_reductions``: the last one, or every one for DeepSpeed's ZeRO-2); ``dp_overlap=False``
    hides nothing.
    """
    a, m = job.assumptions, job.grad_accum
    slowest = max((_stage_microbatch(job, stage) for stage in edge_stages(job)), key=lambda mb: mb.total)
    work = m * (slowest.compute + slowest.memory_bound)
    _, dp_s = _dp_and_expert_comm(job, largest_stage_parameters(job))
    if job.layout.strategy in ("zero3", "fsdp") and job.layout.pp == 1:
        hideable = work  # every micro-batch's collectives run beside its own work
    elif job.layout.strategy in ("zero3", "fsdp"):
        # gathers prefetch behind forwards (every micro-batch's with reshard_after_forward); the
        # reduce-scatter after the last backward shows
        hideable = (m if reshards_after_forward(job) else 1) * slowest.compute / 3
    else:
        # each reduction behind the backward of the micro-batch it reduces (the last one's when once per step)
        hideable = gradient_reductions(job) * 2 / 3 * slowest.compute
    if not job.dp_overlap or job.zero3_collectives == "per_parameter_sync":
        # DeepSpeed's 2021 ZeRO-3: a module waits for its own gather, and each prefetched gather first
        # synchronizes the device (compute and the reduce-scatters issued so far)
        hideable = 0.0
    exposed_dp = _exposed(dp_s, hideable, a)
    layers = job.model.n_layer // job.layout.pp
    offloaded = layers * layer_bytes(job, "none") if job.recompute == "offload" else 0.0
    offload = m * 2 * offloaded / (job.device.pcie_gb_s * 1e9 * a.link_fraction)
    peak = None if job.precision == "fp8" else _peak_tflops(job.device, job.precision)
    tokens = job.seq_len * job.micro_batch * m * job.layout.dp
    return TimeEstimate(
        compute_s=m * slowest.compute,
        comm_s=dp_s,
        exposed_comm_s=exposed_dp,
        offload_s=offload,
        memory_bound_s=m * slowest.memory_bound + _optimizer_seconds(job, state_bytes),
        tokens_per_step=tokens,
        model_flops_per_step=flops_per_token(job.model, job.seq_len) * tokens,
        peak_tflops=peak,
        world_size=job.layout.world_size,
        tp_comm_s=m * slowest.tp,
        pp_comm_s=m * slowest.pp,
        bubble_s=bubble_overhead(job.layout.pp_schedule, job.layout.pp, m, job.layout.pp_virtual_stages) * m * slowest.total,
        tp_exposed_s=m * slowest.tp_exposed,
        microbatch_s=slowest.total,
        cp_comm_s=m * slowest.cp,
        ep_comm_s=m * expert_all_to_all(job)[0],
        muon_s=sum(muon_step(job)[1:]),
    )


def _newton_schulz_flops(kind: tuple[tuple[int, int, int], ...], steps: int) -> float:
    """Per iteration on an a x b matrix (a <= b): the Gram matrix (2a^2 b), its square (2a^3), and
    the polynomial times X (2a^2 b)."""
    return steps * sum(count * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for count, r, c in kind)


def muon_step(job: JobSpec) -> tuple[float, float, float]:
    """Muon's extra work per step on one GPU (the mean stage): (bytes sent, all-to-all seconds,
    Newton-Schulz seconds). A matrix sharded over n GPUs goes to one owner and back: each sends
    2 (n - 1) / n^2 of its bytes on average (parallel/muon.py), and the owners, spread evenly,
    share its Newton-Schulz work n ways. Whole matrices (replicas, experts held whole under ep) are
    orthogonalised where they are, with nothing sent; replicas repeat the work."""
    if job.optimizer != "muon":
        return 0.0, 0.0, 0.0
    m, layout = muon_matrices(job.model), job.layout
    n_split, n_whole = muon_groups(job)
    sent = sum(2 * (n - 1) / n**2 * muon_numel(kind) * MUON_PIECE_BYTES
               for kind, n in ((m.split, n_split), (m.whole, n_whole)) if n > 1) / layout.pp
    expert_shard = layout.dp_shard_cp // layout.ep if layout.strategy in ("fsdp", "zero3") else 1
    flops = (_newton_schulz_flops(m.split, MUON_NS_STEPS) / n_split + _newton_schulz_flops(m.whole, MUON_NS_STEPS) / n_whole
             + _newton_schulz_flops(m.routed, MUON_NS_STEPS) / (layout.ep * expert_shard)) / layout.pp
    n = max(n_split, n_whole)
    link = dict(ranks_per_node=_per_node(job, 1, n))
    # an all-to-all sending S bytes per GPU moves what a reduce-scatter of S n / (n - 1) bytes does
    a2a = collective_seconds(sent * n / (n - 1), n, job.device, job.assumptions.link_fraction, **link) if n > 1 else 0.0
    return sent, a2a, flops / _gemm_rate(job)
