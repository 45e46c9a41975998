"""Activation memory of one transformer layer: bytes saved for backward under each recompute policy
(Korthikanti et al. 2022, generalized; ``saved_bytes_per_layer`` counts our own ``Block`` tensor by tensor)."""

from __future__ import annotations

from fractions import Fraction

from analysis.estimator.job import (
    ATTENTION_BACKEND_KIND,
    ATTENTION_KINDS,
    OP_SELECTIVE_SAVES,
    RECOMPUTE_POLICIES,
    EstimatorError,
    check_choice,
)
from model.config import ModelConfig


def checkpointed_layers(n_layer: int, every_k: int) -> int:
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


def _split_moe_activation_elements(cfg: ModelConfig, dtype_bytes: int) -> tuple[float, float]:
    """Per token in a MoE layer under expert tensor parallelism (parallel.etp = tp, parallel/tp.py
    ``split_moe``), as (elements split over the tp GPUs, elements whole on each). Every tp GPU routes the
    whole sequence, so it keeps the layer's all-gathered input, the router's and the dispatch's tensors
    and each top-k copy's input and (summed) output rows, as one process does; it holds 1/tp of every
    expert's columns, so the experts' hidden activations, and the shared experts', are split."""
    k, f, e = cfg.moe.top_k, cfg.expert_d_ff, cfg.moe.experts
    shared = cfg.moe.shared_experts * f
    split = k * _dense_mlp_activation_elements(cfg, f) + (_dense_mlp_activation_elements(cfg, shared) if shared else 0)
    whole = cfg.d_model + k * 2 * cfg.d_model + (2 * e * 4 + 2 * k * 8) / dtype_bytes
    return split, whole


def _mlp_activation_elements(cfg: ModelConfig, dtype_bytes: int) -> float:
    """Elements per token saved inside the MLP between its two matmuls (a MoE model: the mean over
    layers), in activations of ``dtype_bytes``."""
    dense = _dense_mlp_activation_elements(cfg, cfg.d_ff)
    if cfg.moe.experts is None:
        return dense
    moe = cfg.n_moe_layers
    return (moe * _moe_activation_elements(cfg, dtype_bytes) + (cfg.n_layer - moe) * dense) / cfg.n_layer


def mlp_hidden_width(cfg: ModelConfig) -> float:
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


def attention_saved_elements(cfg: ModelConfig, matmul_outputs: bool = False) -> tuple[float, float]:
    """(outside, inside the TP region) elements per token one layer's attention keeps for backward,
    its input included, the core's scores or log-sum-exp aside.

    Grouped-query attention keeps the QKV input (outside), Q, K and V and the output projection's input
    (inside). Latent attention (model.gpt.LatentAttention) also keeps its latents, outside the tensor-
    parallel region as Megatron-LM's latent attention computes them (the down projections are not
    split): the compressed query (``q_lora_rank``, its norm's input and the up projection's input) and
    the key/value latent (``kv_lora_rank``, the same two); inside, the query and the key (each
    ``n_head * (qk_nope + qk_rope)``: the shared rotary key is copied into every head), the key/value up
    projection's output (``n_head * (qk_nope + v_head_dim)``: the values are a view of it) and the
    core's output (``n_head * v_head_dim``). ``matmul_outputs``: what op_selective keeps instead, the
    outputs of the matmuls and of the core (the block input is counted by the caller)."""
    h = cfg.d_model
    if not cfg.is_mla:
        # none: the QKV input, op_selective: the projection's output (both d wide); Q, K, V and the core's output
        return h, cfg.q_dim + 2 * cfg.kv_dim + cfg.q_dim
    q_rank = cfg.q_lora_rank or 0
    kv_up = cfg.n_head * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    if matmul_outputs:  # the down projections' outputs, the projection's; q_up, kv_up and the core's
        return h + q_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.q_dim + kv_up + cfg.value_dim
    return h + 2 * q_rank + 2 * cfg.kv_lora_rank, 2 * cfg.q_dim + kv_up + cfg.value_dim


def alternate_matmuls_elements(cfg: ModelConfig) -> tuple[int, int]:
    """(outside, inside the TP region) matmul-output elements per token that torchtitan's per-op
    selective recompute keeps: per block, the matmuls in forward order (q, k, v, the output
    projection, then SwiGLU's gate, up and down, or GELU's fc and out: separate projections, as
    torchtitan's Llama runs them) and every odd-numbered one kept, the others recomputed in backward
    (its policy counts aten.mm calls from 1 per checkpointed block and recomputes the even ones;
    torchtitan's activation-checkpoint code, December 2024). Kept: q, v, the MLP's first matmul and,
    with SwiGLU, its last (d wide, outside the region)."""
    if cfg.mlp == "swiglu":
        order = [("in", cfg.q_dim), ("in", cfg.kv_dim), ("in", cfg.kv_dim), ("out", cfg.d_model),
                 ("in", cfg.d_ff), ("in", cfg.d_ff), ("out", cfg.d_model)]
    else:
        order = [("in", cfg.q_dim), ("in", cfg.kv_dim), ("in", cfg.kv_dim), ("out", cfg.d_model),
                 ("in", cfg.d_ff), ("out", cfg.d_model)]
    kept = order[0::2]
    return sum(w for where, w in kept if where == "out"), sum(w for where, w in kept if where == "in")


def alternate_matmuls_recomputed(cfg: ModelConfig, tp: int = 1) -> list[tuple[float, float]]:
    """The matmuls torchtitan's per-op policy runs again in backward, as (k, n) on one of ``tp`` GPUs:
    k (column-parallel), the output projection (row-parallel), and SwiGLU's up projection
    (column-parallel; GELU: its out, row-parallel)."""
    d = cfg.d_model
    last = (d, cfg.d_ff / tp) if cfg.mlp == "swiglu" else (cfg.d_ff / tp, d)
    return [(d, cfg.kv_dim / tp), (cfg.q_dim / tp, d), last]


def activation_bytes_per_layer(
    model_cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    recompute: str,
    dtype_bytes: int = 2,
    dropout: bool | None = None,
    *,
    attention: str = "materialized",
    dropout_mask_bytes: int = 1,
    every_k: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    op_selective_saves: str = "every_matmul",
    expert_tp: bool = False,
) -> float:
    """Bytes one transformer layer keeps on one GPU for backward (Korthikanti et al. 2022, generalized).

    ``dropout`` defaults to ``model_cfg.dropout > 0``; ``attention`` is ``materialized`` (the
    s x s scores are stored, the paper's case) or ``flash`` (only a fp32 log-sum-exp per row), or
    a backend name (``reference`` stores the scores; ``sdpa``, ``flash_attn`` do not);
    ``every_k`` defaults to ``model_cfg.recompute_every_k``. With ``tp`` > 1 the tensors inside
    the tensor-parallel region are split over ``tp`` GPUs, and the rest too when
    ``sequence_parallel``. ``op_selective_saves``: which matmul outputs op_selective keeps
    (``alternate_matmuls_elements``). ``expert_tp`` (parallel.etp = tp): the MoE layers' experts are
    split over the tp GPUs, which each route the whole sequence (``_split_moe_activation_elements``).
    See the module docstring.
    """
    check_choice("recompute", recompute, RECOMPUTE_POLICIES)
    check_choice("op_selective_saves", op_selective_saves, OP_SELECTIVE_SAVES)
    attention = ATTENTION_BACKEND_KIND.get(attention, attention)
    check_choice("attention", attention, ATTENTION_KINDS + tuple(ATTENTION_BACKEND_KIND))
    if tp < 1:
        raise EstimatorError(f"tp must be >= 1 (got {tp})")
    s, b, h, a = seq_len, micro_batch, model_cfg.d_model, model_cfg.n_head
    p, m = dtype_bytes, dropout_mask_bytes
    with_dropout = model_cfg.dropout > 0 if dropout is None else dropout
    tokens = s * b
    split = dict(tp=tp, sequence_parallel=sequence_parallel)

    if recompute == "full":
        return tp_split(p * tokens * h, 0, **split)  # the layer input lies outside the TP region
    if recompute == "offload":
        return 0.0
    if recompute == "every_k":
        k = every_k or model_cfg.recompute_every_k
        kept = checkpointed_layers(model_cfg.n_layer, k)
        full = activation_bytes_per_layer(model_cfg, s, b, "full", p, with_dropout, attention=attention, **split)
        none = activation_bytes_per_layer(model_cfg, s, b, "none", p, with_dropout, attention=attention,
                                          dropout_mask_bytes=m, expert_tp=expert_tp, **split)
        return (kept * full + (model_cfg.n_layer - kept) * none) / model_cfg.n_layer

    # Attention scores and their log-sum-exp are per head: inside the TP region.
    if attention == "flash":
        scores = 4.0 * a * s * b  # fp32 log-sum-exp; the mask is regenerated from the RNG state
    else:
        scores = (2 * p + m if with_dropout else p) * a * s * s * b
    # A MoE layer is not tensor-split (replicated over the tp GPUs, parallel/tp.py): its activations
    # lie outside the TP region, on s/t positions per GPU only with sequence parallelism. Under expert
    # tensor parallelism its experts' activations are inside and its routed rows whole (``whole``).
    split_experts = expert_tp and tp > 1 and model_cfg.moe.experts is not None
    if recompute == "op_selective" and op_selective_saves == "alternate_matmuls":
        outside, inside = alternate_matmuls_elements(model_cfg)
        lse = 4.0 * a * s * b if attention == "flash" else p * a * s * s * b
        return tp_split(p * tokens * (h + outside), p * tokens * (inside + model_cfg.q_dim) + lse, **split)
    if recompute == "op_selective":
        moe = _moe_activation_share(model_cfg, _moe_matmul_output_elements(model_cfg)) if model_cfg.moe.experts else 0.0
        if split_experts:  # the experts' matmul outputs are split by width, as a dense MLP's
            moe = 0.0
        attn_out, attn_in = attention_saved_elements(model_cfg, matmul_outputs=True)
        outside = h + attn_out + h + moe  # block input, projection output, MLP output (+ MoE layers' matmul outputs)
        inside = attn_in + _mlp_matmul_output_elements(model_cfg) - moe  # qkv, core output, fc
        core_extra = 4.0 * a * s * b if attention == "flash" else p * a * s * s * b  # lse, or the QK^T bmm output
        return tp_split(p * tokens * outside, p * tokens * inside + core_extra, **split)

    attn_out, attn_in = attention_saved_elements(model_cfg)  # QKV input; Q, K, V and the projection's input
    moe = _moe_activation_share(model_cfg, _moe_activation_elements(model_cfg, p)) if model_cfg.moe.experts else 0.0
    outside = (
        2 * h  # inputs of the two norms
        + attn_out
        + h  # MLP first matmul input
        + moe
    )
    inside = attn_in + _mlp_activation_elements(model_cfg, p) - moe
    whole = 0.0
    if split_experts:  # the MoE layers' input is gathered whole instead of held on s/t positions
        in_split, in_whole = _split_moe_activation_elements(model_cfg, p)
        outside -= moe + _moe_activation_share(model_cfg, h)
        inside += _moe_activation_share(model_cfg, in_split)
        whole = _moe_activation_share(model_cfg, in_whole)
    masks = 2 * m * tokens * h if with_dropout else 0  # after attention and after the MLP: outside
    core = 0.0 if recompute == "selective" else scores
    return tp_split(p * tokens * outside + masks, p * tokens * inside + core, **split) + p * tokens * whole


def tp_split(outside: float, inside: float, *, tp: int, sequence_parallel: bool) -> float:
    """Bytes on one GPU: the TP region is split over ``tp``; the rest only with sequence parallelism."""
    if tp == 1:
        return float(outside + inside)
    return outside / (tp if sequence_parallel else 1) + inside / tp


def korthikanti_bytes_per_layer(
    seq_len: int, micro_batch: int, hidden: int, heads: int, recompute: str, tp: int = 1, sequence_parallel: bool = False
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
    if recompute not in forms:
        raise EstimatorError(f"recompute={recompute!r}: the paper gives none, selective and full only")
    return float(forms[recompute])


def saved_bytes_per_layer(
    model_cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    recompute: str,
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
    check_choice("recompute", recompute, RECOMPUTE_POLICIES)
    check_choice("attention", attention, ("sdpa", "reference"))
    check_choice("device", device, ("cpu", "cuda"))
    cfg = model_cfg
    s, b, h, a = seq_len, micro_batch, cfg.d_model, cfg.n_head
    p, n = dtype_bytes, seq_len * micro_batch
    dropout = cfg.dropout > 0
    mask = p if device == "cpu" else 1
    fused = attention == "sdpa" and not (dropout and device == "cpu")
    if cfg.is_mla:
        attn = _latent_attention_bytes(cfg, p, n)
        rope_tables, out_width, copies = 0, cfg.value_dim, (cfg.q_dim, cfg.q_dim, cfg.value_dim)
    else:
        kv = cfg.kv_dim  # narrower than h with grouped-query attention
        rope_tables = 2 * s * (cfg.head_dim // 2) * p if cfg.position == "rope" else 0
        rotated_qk = p * n * (h + kv) if cfg.position == "rope" else 0
        qkv_out = p * n * (h + 2 * kv)
        attn = {"matmuls": qkv_out, "core_inputs": qkv_out + rotated_qk + rope_tables, "latents": 0}
        out_width, copies = h, (h, h, h)

    if recompute == "full":
        return float(p * n * h + rope_tables)
    if recompute == "every_k":
        k = every_k or cfg.recompute_every_k
        kept = checkpointed_layers(cfg.n_layer, k)
        args = (cfg, s, b)
        full = saved_bytes_per_layer(*args, "full", p, attention=attention, device=device)
        none = saved_bytes_per_layer(*args, "none", p, attention=attention, device=device)
        return (kept * full + (cfg.n_layer - kept) * none) / cfg.n_layer
    if recompute == "op_selective":
        if fused:
            core = p * n * out_width + 4 * n * a  # SDPA output and log-sum-exp
        else:
            width = 4 if attention == "sdpa" else p  # the math path upcasts to fp32
            core = width * a * s * s * b + width * n * out_width  # QK^T and @V bmm outputs
        matmuls = attn["matmuls"] + p * n * (h + _mlp_matmul_output_elements(cfg) + h)  # qkv, proj, fc, out
        return float(p * n * h + matmuls + core + rope_tables)

    norm_input = 4 * n * h  # the reference norms compute in fp32 and save the fp32 input
    if cfg.norm == "layernorm":
        norm = norm_input + 2 * 4 * n  # fp32 mean and rstd
    else:
        norm = norm_input + 4 * n * h + 4 * n  # x * rsqrt(mean(x^2)) in fp32, and the rsqrt
    mlp = p * n * h + p * n * _mlp_activation_elements(cfg, p)  # first matmul input + activations
    resid_masks = 2 * mask * n * h if dropout else 0

    core_inputs = attn["core_inputs"]  # q, k, v: views of the qkv output (latent attention: q, k, kv_up's output)
    if fused:
        core = core_inputs + p * n * out_width + 4 * n * a  # output (= projection input) and log-sum-exp
        proj_input = 0
    else:
        core = _unfused_core_bytes(p, n, copies, a, s, b, attention, dropout, mask) + rope_tables
        proj_input = p * n * out_width  # the reshape after the core copies its output
    if recompute == "selective":
        # The checkpointed core keeps its inputs (views of the qkv output) and, for SDPA, its
        # output, which the projection saves anyway.
        core, proj_input = core_inputs, p * n * out_width
    # ``offload`` saves exactly what ``none`` saves, in host memory instead.
    return float(2 * norm + p * n * h + attn["latents"] + core + proj_input + mlp + resid_masks)


def _latent_attention_bytes(cfg: ModelConfig, p: int, n: int) -> dict[str, int]:
    """Saved bytes of model.gpt.LatentAttention beside its input, for n tokens in a model of p-byte
    tensors: ``latents``, the two compressed paths (each latent norm, in fp32 as the reference norms
    run, keeps its fp32 input, x * rsqrt and the rsqrt, and the up projection keeps the normalised
    latent; in an fp32 model the key/value norm's input is a view of the down projection's whole
    output, rotary key included); ``core_inputs``, the query and key (built by concatenation) and the
    key/value up projection's output (the values are a view of it); ``matmuls``, the five projections'
    outputs but the last, which op_selective keeps. The rotary embedding, a product with the fixed
    tables, keeps nothing."""
    q_rank, kv_rank, rope = cfg.q_lora_rank or 0, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    kv_up = cfg.n_head * (cfg.qk_nope_head_dim + cfg.v_head_dim)

    def latent_norm(width: int, stored_input: int) -> int:
        return 4 * n * stored_input + 4 * n * width + 4 * n + p * n * width

    query = latent_norm(q_rank, q_rank) if q_rank else 0
    keys_values = latent_norm(kv_rank, kv_rank + rope if p == 4 else kv_rank)
    return {"latents": query + keys_values, "core_inputs": p * n * (2 * cfg.q_dim + kv_up),
            "matmuls": p * n * (q_rank + cfg.q_dim + kv_rank + rope + kv_up)}


def _unfused_core_bytes(p: int, n: int, copies: tuple[int, int, int], a: int, s: int, b: int, attention: str,
                        dropout: bool, mask: int) -> int:
    """Saved bytes of an attention core that builds the (b, a, s, s) scores.

    QK^T and @V save contiguous copies of q (scaled, on the math path), k^T and v (``copies``: their
    widths per token). The reference
    softmax runs in fp32 and is cast back (a second copy in 16-bit models) and its causal mask is
    a bool s x s; its dropout keeps a mask and the dropped probabilities. SDPA's math path (CPU
    with dropout) upcasts 16-bit inputs to fp32, so everything there is 4 bytes wide.
    """
    scores = a * s * s * b
    if attention == "sdpa":
        return 4 * n * sum(copies) + 4 * scores * (3 if dropout else 1)
    total = p * n * sum(copies) + 4 * scores + s * s
    if dropout:
        total += (mask + p) * scores  # the 16-bit cast of the probabilities is dropout's input only
    elif p != 4:
        total += p * scores  # the 16-bit cast of the fp32 probabilities, saved by @V
    return total
