"""The estimator on latent attention (MLA), multi-token prediction (MTP) and sliding windows: saved
activations against the tensors our own blocks save (saved-tensor hooks), the KV cache against what
model/generate.py allocates, and GEMMs, FLOPs, memory and time against hand counts on small shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from analysis import estimator as est
from analysis.recompute_bench import measure_saved_bytes
from common.hardware import DEVICES
from model.attention import KVCache
from model.config import ModelConfig, MoEConfig
from model.flops import latent_attention_parameters, mtp_parameters

H800 = DEVICES["H800"]


def mla(**changes) -> ModelConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=4, d_model=64, d_ff=96, max_seq_len=64, attention_kind="mla",
                q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_latent_attention_saved_bytes_are_what_the_block_saves(q_lora_rank, backend):
    """Every recompute policy, counted by the project's saved-tensor bench (analysis/recompute_bench.py)
    on a 2-layer MLA model in fp32: byte for byte."""
    cfg = mla(q_lora_rank=q_lora_rank)
    for policy in est.RECOMPUTE_POLICIES:
        row = measure_saved_bytes(cfg, policy, 16, 2, backend, torch.float32, "cpu")
        measured = row["offloaded_bytes"] / cfg.n_layer if policy == "offload" else row["per_layer_bytes"]
        assert est.saved_bytes_per_layer(cfg, 16, 2, policy, 4, attention=backend) == measured, policy


def test_latent_attention_saved_bytes_in_bf16_leave_out_only_the_norm_weights_fp32_casts():
    cfg = mla()
    row = measure_saved_bytes(cfg, "none", 16, 2, "sdpa", torch.bfloat16, "cpu")
    # the reference norms cast their bf16 gains to fp32 and save the cast: the block's two norms (d
    # each) and the two latent norms (q_lora_rank, kv_lora_rank), parameters the count leaves out
    casts = 4 * (2 * 64 + 24 + 16)
    assert row["per_layer_bytes"] - est.saved_bytes_per_layer(cfg, 16, 2, "none", 2, attention="sdpa") == casts


def test_latent_attention_activations_by_hand():
    """Korthikanti's general form for MLA, 16-bit, flash core, s=32, b=2: per token, elements."""
    cfg, s, b, p = mla(), 32, 2, 2
    n, h, lse = s * b, 64, 4 * 4 * s * b  # fp32 log-sum-exp per head and token
    q_dim, kv_up, v = 4 * (8 + 4), 4 * (8 + 12), 4 * 12
    swiglu = 4 * 96
    # outside: two norm inputs, the attention input, its two latents twice (norm input, up-projection
    # input), the MLP input; inside: q, k (rotary key copied into every head), kv_up's output (v is a
    # view of it), the core output, the SwiGLU activations
    none_outside, none_inside = 2 * h + h + 2 * 24 + 2 * 16 + h, 2 * q_dim + kv_up + v + swiglu
    expected = {
        "none": p * n * (none_outside + none_inside) + lse,
        "selective": p * n * (none_outside + none_inside),
        # block input, the down projections' outputs (rotary key included), the projection and MLP
        # outputs; q_up, kv_up, the core's output and the MLP's two first matmuls
        "op_selective": p * n * ((h + 24 + 16 + 4 + h + h) + (q_dim + kv_up + v + 2 * 96)) + lse,
        "full": p * n * h,
    }
    for policy, bytes_ in expected.items():
        assert est.activation_bytes_per_layer(cfg, s, b, policy, p, attention="flash") == bytes_, policy
    # tp=2 with sequence parallelism: the latents outside, split by sequence; the heads' tensors by head
    split = est.activation_bytes_per_layer(cfg, s, b, "none", p, attention="flash", tp=2, sequence_parallel=True)
    assert split == p * n * none_outside / 2 + (p * n * none_inside + lse) / 2


def test_latent_attention_gemms_are_its_projections():
    cfg, tokens = mla(), 128
    gemms = est.layer_gemms(cfg, tokens)
    attention = gemms[:5]
    # down projections of the query and the latent (+ rotary key), their up projections, the output
    assert [(k, n) for _, k, n in attention] == [(64, 24), (24, 48), (64, 20), (16, 80), (48, 64)]
    norms = 24 + 16  # the latent norms' gains: no matmul
    assert sum(k * n for _, k, n in attention) == latent_attention_parameters(cfg) - norms
    # tp=2: the heads' projections split, the down projections whole on each GPU
    assert [(k, n) for _, k, n in est.layer_gemms(cfg, tokens, tp=2)[:5]] == [(64, 24), (24, 24), (64, 20), (16, 40),
                                                                                (24, 64)]
    assert [(k, n) for _, k, n in est.layer_gemms(mla(q_lora_rank=None), tokens)[:4]] == [(64, 48), (64, 20), (16, 80),
                                                                                            (48, 64)]


def test_latent_attention_core_runs_the_query_width_then_the_values():
    """QK^T over the query width (4 heads x (8 + 4) = 48) and @V over the values' (4 x 20 = 80): the
    fused core's time is that of a multi-head core whose heads are as wide as their mean (4 x 16)."""
    s = 2048
    latent = est.JobSpec(mla(max_seq_len=s, v_head_dim=20), s, 1, device=H800)  # q 48, v 80
    plain = ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=64, d_ff=96, attention_head_dim=16,
                        max_seq_len=s, position="rope", norm="rmsnorm", mlp="swiglu", bias=False)  # q = v = 64
    mha = est.JobSpec(plain, s, 1, device=H800)
    assert est.attention_seconds(latent, 1)[0] == pytest.approx(est.attention_seconds(mha, 1)[0] * (48 + 80) / (2 * 64))


def test_kv_cache_bytes_are_what_generate_allocates():
    """model/generate.py's cache, built as it builds it, against the estimator, for MLA and for GQA
    with windows on every other layer (a context longer and one shorter than the window)."""
    def allocated(cache: KVCache) -> int:
        return sum(t.nbytes for t in cache.keys + cache.values)

    latent = mla(n_layer=3)
    cache = KVCache(latent.n_layer, 2, 40, 1, latent.kv_lora_rank, "cpu", torch.bfloat16, value_dim=latent.qk_rope_head_dim)
    assert est.kv_cache_bytes(latent, 40, 2, 2) == allocated(cache) == 2 * 2 * 40 * 3 * (16 + 4)
    windowed = ModelConfig(n_layer=4, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64, position="rope",
                           sliding_window=9, sliding_window_every=2)
    for context in (40, 5):
        cache = KVCache(4, 2, context, windowed.kv_heads, windowed.head_dim, "cpu", torch.float32,
                        windows=[windowed.window_of(i) for i in range(4)])
        assert est.kv_cache_bytes(windowed, context, 2, 4) == allocated(cache)
    # by hand at 40 positions: two layers hold 40, two their last 8; each position 2 x 2 heads x 16
    assert est.kv_cache_bytes(windowed, 40, 1, 2) == 2 * (40 + 40 + 8 + 8) * 2 * 32
    # DeepSeek-V3: (512 + 64) numbers per token and layer, 61 layers, 2 bytes
    v3 = mla(n_layer=61, n_head=128, d_model=7168, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
             qk_rope_head_dim=64, v_head_dim=128, max_seq_len=4096)
    assert est.kv_cache_bytes(v3, 1, 1, 2) == 70_272


MOE_MTP = mla(n_layer=3, mtp_depth=2, moe=MoEConfig(experts=8, top_k=2, d_ff=32, shared_experts=1, first_dense=1))


@pytest.mark.parametrize("cfg", [mla(mtp_depth=1), MOE_MTP], ids=["dense", "moe"])
def test_the_last_stage_holds_the_mtp_modules(cfg):
    assert est.stage_parameters(cfg) == est.count_parameters(cfg)
    plain = dataclasses.replace(cfg, mtp_depth=0)
    assert est.stage_parameters(cfg) - est.stage_parameters(plain) == mtp_parameters(cfg)
    # tp=2 on a dense model: each module's projection and its block's up projections, output projection
    # and MLP split; its norms (three, the block's two, the two latent ones) and down projections whole
    if cfg.moe.experts is None:
        whole = 3 * 64 + 2 * 64 + (24 + 16) + 64 * 24 + 64 * (16 + 4)
        per_gpu = whole + (mtp_parameters(cfg) - whole) / 2
        assert est.mtp_parameters_per_gpu(cfg, tp=2) == per_gpu
        assert est.stage_parameters(cfg, tp=2, pp=2, stage=1) - est.stage_parameters(plain, tp=2, pp=2, stage=1) == per_gpu
        assert est.stage_parameters(cfg, tp=2, pp=2, stage=0) == est.stage_parameters(plain, tp=2, pp=2, stage=0)


def test_mtp_memory_by_hand():
    """Each depth keeps one block (never recomputed), six d-wide tensors and one more set of fp32
    log-probabilities; its parameters add their model states. ddp, one GPU, 16-bit activations."""
    s, b = 32, 2
    plain_cfg = dataclasses.replace(MOE_MTP, mtp_depth=0)
    job = est.JobSpec(MOE_MTP, s, b, recompute="full", precision="bf16_master", device=H800)
    plain = dataclasses.replace(job, model=plain_cfg)
    with_mtp, without = est.estimate_memory(job), est.estimate_memory(plain)
    block = est.activation_bytes_per_layer(MOE_MTP, s, b, "none", 2, attention="flash")
    assert with_mtp.activations - without.activations == pytest.approx(2 * (block + 6 * 2 * s * b * 64))
    assert with_mtp.logits - without.logits == 2 * 4 * s * b * 64  # two depths' log-probabilities, vocab 64
    assert with_mtp.states - without.states == 16 * mtp_parameters(MOE_MTP)  # 2 + 2 + 12 bytes each


def test_mtp_time_is_a_layer_a_projection_and_the_head_again_per_depth():
    s, b = 512, 2
    cfg = mla(mtp_depth=1, max_seq_len=s, vocab_size=4096)
    job = est.JobSpec(cfg, s, b, recompute="selective", device=H800)
    plain = dataclasses.replace(job, model=dataclasses.replace(cfg, mtp_depth=0))
    tokens = s * b
    gemms = sum(est.gemm_seconds(job, *shape) for shape in est.layer_gemms(cfg, tokens))
    projection = est.gemm_seconds(job, tokens, 128, 64)
    head = est.gemm_seconds(job, tokens, 64, 4096)
    core = est.attention_seconds(job, 1)[0]  # the module's block is not recomputed: its core runs forward once
    assert est.estimate_time(job, 0).compute_s - est.estimate_time(plain, 0).compute_s == pytest.approx(
        3 * (gemms + projection + head) + core)


def test_recompute_flops_count_each_layers_window_and_the_value_width():
    s, w = 1024, 128
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=64, max_seq_len=s, position="rope", sliding_window=w,
                      sliding_window_every=2)
    # layers 0 and 2 see 128 keys, 1 and 3 all 1024: QK^T and @V forward, 2 x (64 + 64) per key
    assert est.recompute_flops_per_token(cfg, s, "selective") == 2 * 128 * (128 + 1024 + 128 + 1024)
    latent = mla(max_seq_len=s)  # q 48, v 48, 2 layers
    assert est.recompute_flops_per_token(latent, s, "selective") == 2 * 2 * (48 + 48) * s


# --------------------------------------------------------------------------- torchtitan's per-op recompute


def llama(**changes) -> ModelConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, max_seq_len=64,
                position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    return ModelConfig(**{**base, **changes})


def test_alternate_matmuls_keep_q_v_gate_and_down_by_hand():
    """torchtitan's policy over wq wk wv wo w1 w3 w2 keeps the 1st, 3rd, 5th and 7th outputs; s=32, b=2, bf16, flash."""
    cfg, s, b, p = llama(), 32, 2, 2
    n, lse = s * b, 4 * 4 * s * b
    kept = p * n * ((64 + 64) + (64 + 32 + 96 + 64)) + lse  # block input, w2 out; q, v, w1 out, the core's output
    assert est.activation_bytes_per_layer(cfg, s, b, "op_selective", p, attention="flash",
                                          op_selective_saves="alternate_matmuls") == kept
    every = p * n * ((64 + 64 + 64) + (64 + 2 * 32 + 64 + 2 * 96)) + lse
    assert est.activation_bytes_per_layer(cfg, s, b, "op_selective", p, attention="flash") == every
    gelu = llama(mlp="gelu")  # wq wk wv wo fc out: q, v, fc kept
    assert est.activation_bytes_per_layer(gelu, s, b, "op_selective", p, attention="flash",
                                          op_selective_saves="alternate_matmuls") == p * n * (64 + 64 + 32 + 96 + 64) + lse


def test_alternate_matmuls_run_k_the_output_projection_and_up_again():
    s, b = 512, 2
    job = est.JobSpec(llama(max_seq_len=s), s, b, recompute="op_selective", device=H800)
    alternate = dataclasses.replace(job, op_selective_saves="alternate_matmuls")
    tokens = s * b
    redo = sum(est.gemm_seconds(job, tokens, k, n) for k, n in ((64, 32), (64, 64), (64, 96)))
    assert est.estimate_time(alternate, 0).compute_s - est.estimate_time(job, 0).compute_s == pytest.approx(2 * redo)
    with pytest.raises(est.EstimatorError, match="op_selective_saves=alternate_matmuls counts a dense"):
        est.JobSpec(mla(), 64, 1, recompute="op_selective", device=H800, op_selective_saves="alternate_matmuls")
