"""The GPT itself: causality, attention backends, parameter count, and that it can learn."""

from __future__ import annotations

import math

import pytest
import torch

from common.errors import CapabilityError
from model.attention import AttentionCore, reference_attention, select_attention
from model.config import ModelConfig
from model.flops import count_parameters, flops_per_token
from model.gpt import GPT

VARIANTS = [
    dict(position="learned", mlp="gelu", norm="layernorm"),
    dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False),
]


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, max_seq_len=32, n_layer=2, n_head=4, d_model=32)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_changing_a_future_token_never_changes_earlier_logits(variant, backend):
    torch.manual_seed(0)
    model = GPT(tiny(**variant), attention_backend=backend).eval()
    idx = torch.randint(0, 64, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-4  # and the change does reach later positions


@pytest.mark.parametrize("shape", [(2, 5, 3, 8), (1, 17, 2, 16), (3, 1, 4, 4)])
def test_sdpa_backend_equals_explicit_softmax_reference(shape):
    torch.manual_seed(1)
    b, t, h, d = shape
    q, k, v = (torch.randn(b, t, h, d, requires_grad=True) for _ in range(3))
    out = AttentionCore("sdpa", 0.0)(q, k, v)
    # Independent oracle: per-position loop over the visible prefix, no masking tricks.
    expected = torch.empty(b, t, h, d)
    for i in range(t):
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, : i + 1]) / math.sqrt(d)
        expected[:, i] = torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), v[:, : i + 1])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    ref = AttentionCore("reference", 0.0)(q, k, v)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    g_sdpa = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for gs, gr in zip(g_sdpa, g_ref):
        torch.testing.assert_close(gs, gr, rtol=1e-5, atol=1e-5)


def test_reference_attention_scales_by_inverse_sqrt_head_dim():
    q = torch.zeros(1, 1, 2, 4)
    q[..., 0] = 2.0
    k = torch.zeros(1, 1, 2, 4)
    k[..., 0, 0], k[..., 1, 0] = 1.0, 0.0
    v = torch.tensor([[[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]]])
    # Causal: position 1 sees scores [2/sqrt(4), 0] = [1, 0] -> weights softmax([1, 0]).
    out = reference_attention(q, k, v)
    w = torch.tensor([1.0, 0.0]).softmax(0)
    torch.testing.assert_close(out[0, 0, 1, :2], w)


def test_auto_attention_picks_sdpa_on_cpu_and_says_why():
    backend, reason = select_attention("auto", torch.device("cpu"), torch.float32, 64)
    assert backend == "sdpa" and "flash-attn needs CUDA" in reason
    with pytest.raises(CapabilityError, match="flash_attn cannot run"):
        select_attention("flash_attn", torch.device("cpu"), torch.float32, 64)


def test_parameter_count_matches_a_hand_count():
    cfg = tiny()  # V=64, T=32, L=2, d=32, d_ff=128, LayerNorm with bias, tied head
    d, f, v, t, layers = 32, 128, 64, 32, 2
    per_block = (2 * d) * 2 + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    hand = v * d + t * d + layers * per_block + 2 * d
    assert GPT(cfg).num_parameters() == hand == count_parameters(cfg)
    untied = tiny(tie_embeddings=False, bias=False, norm="rmsnorm", mlp="swiglu", d_ff=64, position="rope")
    per_block = d * 2 + 3 * d * d + d * d + 2 * d * 64 + 64 * d
    hand = v * d + layers * per_block + d + v * d
    assert GPT(untied).num_parameters() == hand == count_parameters(untied)


def test_flops_per_token_follows_the_stated_convention():
    cfg = tiny()
    n_matmul = count_parameters(cfg) - 32 * 32  # minus the learned position table
    assert flops_per_token(cfg, 32) == 6 * n_matmul + 12 * 2 * 32 * 32


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=8, d_model=256, n_head=4)
    model = GPT(cfg)
    std = model.blocks["0"].attn.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks["0"].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(model.blocks["0"].attn.qkv.bias == 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_few_hundred_steps_overfit_one_small_batch(variant):
    torch.manual_seed(0)
    model = GPT(tiny(**variant))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 32))
    y = torch.roll(x, -1, dims=1)
    first = None
    for _ in range(200):
        loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.5  # about ln(64) = 4.16 at init
    assert loss.item() < 0.05


def test_sequence_longer_than_max_seq_len_is_rejected():
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=32"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_norms_compute_in_fp32_for_bf16_inputs():
    from kernels.reference import layer_norm

    torch.manual_seed(0)
    x = (torch.randn(4, 256) * 3 + 100).bfloat16()  # large mean: bf16 statistics would lose it
    w, b = torch.ones(256), torch.zeros(256)
    out = layer_norm(x, w, b, 1e-5)
    expected = torch.nn.functional.layer_norm(x.float(), (256,), w, b, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=2e-2)
