"""Grouped-query attention (model.n_kv_head): backends, RoPE kernel, unchanged default, counts, training.

Every attention backend that runs on CPU is checked against an explicit oracle written here:
each key/value head repeated for its group of consecutive query heads (head i reads kv head
i // (n_head / n_kv_head)), then plain causal softmax attention.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from analysis import estimator as est
from common.errors import ConfigError
from kernels import reference
from kernels.registry import REFERENCE_OPS, TRITON_OPS, resolve_kernel_ops
from model import attention
from model.attention import AttentionCore
from model.config import ModelConfig
from model.flops import count_parameters, flops_per_token, matmul_parameters
from model.gpt import GPT, split_qkv
from tests.unit.kernels.test_triton_kernels import DEVICE, assert_matches_reference, randn

DTYPES = [torch.float32, torch.bfloat16]


def repeat_interleave_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The oracle: q (B, T, H, D), k and v (B, T, H_kv, D); k/v heads repeated per query group."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    t = q.shape[2]
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype).transpose(1, 2)


# --------------------------------------------------------------------------- attention backends


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv_head", [1, 2, 6])
@pytest.mark.parametrize("backend,native_gqa", [("reference", None), ("sdpa", True), ("sdpa", False)])
def test_gqa_attention_equals_repeat_interleave(monkeypatch, backend, native_gqa, n_kv_head, dtype):
    """Forward and gradients of q, k, v; sdpa both through enable_gqa and through the explicit repeat
    (the path of CUDA kernels that do not take enable_gqa)."""
    if native_gqa is not None:
        monkeypatch.setattr(attention, "_sdpa_takes_gqa", lambda q: native_gqa)
    core = AttentionCore(backend, dropout=0.0)
    batch, seq, heads, head_dim = 2, 9, 6, 8
    q = randn(batch, seq, heads, head_dim, dtype=dtype, seed=1)
    k = randn(batch, seq, n_kv_head, head_dim, dtype=dtype, seed=2)
    v = randn(batch, seq, n_kv_head, head_dim, dtype=dtype, seed=3)
    assert_matches_reference(core, repeat_interleave_attention, [q, k, v], [0, 1, 2])


NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=NEEDS_CUDA)])
def test_gqa_attention_on_cuda_equals_repeat_interleave(backend, dtype, _):
    """SDPA takes enable_gqa in bf16 (flash kernel) and repeats in fp32 (memory-efficient kernel);
    flash-attn takes the narrow k/v natively (bf16 only)."""
    if backend == "flash_attn":
        from model.attention import _flash_usable

        usable, why = _flash_usable(torch.device("cuda"), dtype, 64)
        if not usable:
            pytest.skip(f"flash_attn: {why}")
    core = AttentionCore(backend, dropout=0.0)
    q = randn(2, 128, 8, 64, dtype=dtype, seed=1)
    k, v = randn(2, 128, 2, 64, dtype=dtype, seed=2), randn(2, 128, 2, 64, dtype=dtype, seed=3)
    assert_matches_reference(core, repeat_interleave_attention, [q, k, v], [0, 1, 2])


@pytest.mark.parametrize("_", [pytest.param(None, marks=NEEDS_CUDA)])
def test_te_layer_gets_the_kv_head_count(_):
    from model.te import te_available

    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    from model.te import TEBlock

    cfg = ModelConfig(n_head=8, n_kv_head=2, d_model=256, max_seq_len=64, layers="te", bias=False,
                      norm="rmsnorm", mlp="swiglu", position="rope")
    block = TEBlock(cfg, 0).cuda()
    qkv = [p for name, p in block.named_parameters() if "qkv" in name and p.dim() == 2]
    assert [tuple(p.shape) for p in qkv] == [(256 + 2 * 64, 256)]
    out = block(torch.randn(2, 64, 256, device="cuda"))
    assert out.shape == (2, 64, 256) and torch.isfinite(out).all()


def test_query_heads_read_their_own_kv_group():
    """Changing kv head 1 changes exactly the query heads 2 and 3 (of 6 heads over 3 kv heads)."""
    core = AttentionCore("sdpa", dropout=0.0)
    q, k, v = randn(1, 5, 6, 4, seed=1), randn(1, 5, 3, 4, seed=2), randn(1, 5, 3, 4, seed=3)
    before = core(q, k, v)
    v2 = v.clone()
    v2[:, :, 1] += 1.0
    changed = (core(q, k, v2) - before).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.tolist() == [False, False, True, True, False, False]


# --------------------------------------------------------------------------- RoPE kernel


@pytest.fixture(scope="module")
def triton_ops():
    pytest.importorskip("triton", reason="needs the triton package (pip install triton)")
    ops, reason = resolve_kernel_ops("triton", DEVICE)
    assert ops.backend == "triton", reason
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rope_on_q_and_k_with_different_head_counts(triton_ops, dtype):
    """q (6 heads) and k (2 heads) sliced out of one fused GQA projection, rotated by the kernel."""
    batch, seq, heads, kv_heads, head_dim = 2, 7, 6, 2, 8
    cos, sin = reference.rope_tables(seq + 2, head_dim, 500000.0, device=DEVICE)

    def rotate(apply_rope):
        def fn(qkv):
            q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
            q = apply_rope(q.view(batch, seq, heads, head_dim), cos, sin)
            k = apply_rope(k.view(batch, seq, kv_heads, head_dim), cos, sin)
            return torch.cat([q.flatten(2), k.flatten(2), v], dim=-1)
        return fn

    qkv = randn(batch, seq, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    assert_matches_reference(rotate(triton_ops.apply_rope), rotate(reference.apply_rope), [qkv], [0])
    assert not triton_ops.apply_rope.logged_reasons, triton_ops.apply_rope.logged_reasons


def test_gqa_gpt_on_triton_kernels_matches_the_reference_ops(triton_ops):
    cfg = ModelConfig(vocab_size=64, max_seq_len=12, n_layer=1, n_head=4, n_kv_head=2, d_model=32,
                      norm="rmsnorm", mlp="swiglu", position="rope", bias=False)
    cfg.validate()
    torch.manual_seed(0)
    reference_model = GPT(cfg, REFERENCE_OPS).to(DEVICE)
    kernel_model = GPT(cfg, triton_ops).to(DEVICE)
    kernel_model.load_state_dict(reference_model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len)).to(DEVICE)
    ref_loss, loss = reference_model(idx, idx), kernel_model(idx, idx)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(reference_model.named_parameters(), kernel_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    for name in TRITON_OPS:
        if name in ("apply_rope", "rms_norm", "swiglu", "cross_entropy"):
            assert not getattr(triton_ops, name).logged_reasons, name


# --------------------------------------------------------------------------- multi-head attention as a special case


def multi_head_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """A plain multi-head GPT forward, op for op: the fused projection viewed as (B, T, 3, H, D),
    i.e. [all query heads | all key heads | all value heads], and the MLP bias added after the GEMM.
    The model stores qkv rows grouped per key/value head (and draws them at init in the plain
    order), so its weights regrouped into the plain layout must give the same logits."""
    cfg, sd = model.cfg, model.state_dict()
    for name in [n for n in sd if ".attn.qkv." in n]:
        sd[name] = torch.cat(split_qkv(sd[name], cfg.n_head, cfg.kv_heads))
    b, t = idx.shape
    x = F.embedding(idx, sd["tok_emb.weight"]) + F.embedding(torch.arange(t), sd["pos_emb.weight"])

    def norm(x, prefix):
        return F.layer_norm(x.float(), (cfg.d_model,), sd[f"{prefix}.weight"].float(),
                            sd[f"{prefix}.bias"].float(), cfg.norm_eps).to(x.dtype)

    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        qkv = F.linear(norm(x, p + "norm1"), sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"])
        q, k, v = qkv.view(b, t, 3, cfg.n_head, cfg.head_dim).unbind(dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True).transpose(1, 2)
        x = x + F.linear(y.reshape(b, t, cfg.d_model), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])
        h = F.linear(norm(x, p + "norm2"), sd[p + "mlp.fc.weight"])
        h = F.gelu(h + sd[p + "mlp.fc.bias"], approximate="tanh")
        x = x + F.linear(h, sd[p + "mlp.out.weight"], sd[p + "mlp.out.bias"])
    return F.linear(norm(x, "norm_f"), sd["lm_head.weight"])


def test_n_kv_head_equal_to_n_head_reproduces_the_multi_head_model_bit_for_bit():
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    models = []
    for n_kv_head in (None, 4):
        torch.manual_seed(0)
        models.append(GPT(ModelConfig(n_head=4, n_kv_head=n_kv_head), attention_backend="sdpa").eval())
    default, explicit = models
    assert default.blocks["0"].attn.qkv.weight.shape == (3 * 128, 128)
    default_sd, explicit_sd = default.state_dict(), explicit.state_dict()
    assert default_sd.keys() == explicit_sd.keys()
    assert all(torch.equal(default_sd[key], explicit_sd[key]) for key in default_sd)
    with torch.no_grad():
        logits = default(idx)
        assert torch.equal(explicit(idx), logits)
        assert torch.equal(multi_head_forward(default, idx), logits)


# --------------------------------------------------------------------------- config, counts


def test_n_kv_head_must_divide_n_head_in_one_line():
    for bad in (3, 0, 8):
        with pytest.raises(ConfigError) as info:
            ModelConfig(n_head=4, n_kv_head=bad).validate()
        message = str(info.value)
        assert "\n" not in message and f"model.n_kv_head={bad}" in message and "[1, 2, 4]" in message
    ModelConfig(n_head=4, n_kv_head=1).validate()


def test_parameter_and_flop_counts_by_hand():
    # d=64, 8 heads of 8, 2 kv heads: q 64 wide, k and v 16 wide each; GELU MLP 256; with biases.
    cfg = ModelConfig(vocab_size=100, max_seq_len=32, n_layer=3, n_head=8, n_kv_head=2, d_model=64)
    cfg.validate()
    qkv = 64 * (64 + 16 + 16) + (64 + 16 + 16)
    proj = 64 * 64 + 64
    mlp = 64 * 256 + 256 + 256 * 64 + 64
    norms = 2 * (64 + 64)
    block = qkv + proj + mlp + norms
    total = 3 * block + (64 + 64) + 100 * 64 + 32 * 64  # final norm, tied table, positions
    assert count_parameters(cfg) == total
    assert GPT(cfg).num_parameters() == total
    matmul = 3 * block + (64 + 64) + 100 * 64  # positions are a lookup; the tied table is the head
    assert matmul_parameters(cfg) == matmul
    # attention scores: every one of the 8 query heads still scores all s keys
    assert flops_per_token(cfg, 32) == 6 * matmul + 12 * 3 * 64 * 32


def test_llama3_8b_config_builds_on_meta_with_the_published_count():
    from training.config import load_config

    cfg = load_config("configs/llama3-8b.yaml", ["--data.path=unused"]).model
    assert (cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.rope_theta) == (32, 8, 128, 500000.0)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.blocks["0"].attn.qkv.weight.shape == ((32 + 2 * 8) * 128, 4096)
    assert model.num_parameters() == count_parameters(cfg) == 8_030_261_248


# --------------------------------------------------------------------------- estimator


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_estimator_saved_bytes_match_the_measured_gqa_block(backend):
    """The KV part of the saved activations shrinks with n_kv_head, to the byte."""
    bench = pytest.importorskip("tools.bench_memory", reason="tools/bench_memory.py (measurement tool) not present")
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=1, d_model=32, max_seq_len=16)
    for policy in ("none", "selective", "op_selective", "full"):
        row = bench.measure_saved_bytes(cfg, policy, 16, 2, backend, torch.float32, "cpu")
        assert est.saved_bytes_per_layer(cfg, 16, 2, policy, 4, attention=backend) == row["per_layer_bytes"], policy


def test_korthikanti_bytes_shrink_by_the_kv_width():
    mha = ModelConfig(n_layer=2, n_head=8, d_model=512)
    gqa = ModelConfig(n_layer=2, n_head=8, n_kv_head=2, d_model=512)
    s, b, p = 128, 2, 2
    narrower = 2 * (512 - 128)  # K and V, each 512 -> 128 wide
    for attention_kind in ("materialized", "flash"):
        for policy, saved_kv in (("none", 1), ("selective", 1), ("op_selective", 1), ("full", 0)):
            full_width = est.activation_bytes_per_layer(mha, s, b, policy, p, attention=attention_kind)
            grouped = est.activation_bytes_per_layer(gqa, s, b, policy, p, attention=attention_kind)
            assert full_width - grouped == saved_kv * p * s * b * narrower, (attention_kind, policy)
