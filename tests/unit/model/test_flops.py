"""Training FLOPs per token (model/flops.py) against torch's own FLOP counter, and the counts of
the attention variants' parameters against the built model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model.config import ModelConfig, MoEConfig
from model.flops import count_parameters, flops_per_token
from model.gpt import GPT, Norm
from training.config import load_config

BATCH, SEQ = 2, 16


def counted_flops(cfg: ModelConfig) -> float:
    """Matmul FLOPs of one forward and backward, counted by torch, per token. The reference
    attention computes every (query, key) score and masks afterwards: the convention's no halving."""
    torch.manual_seed(0)
    model = GPT(cfg, attention_backend="reference")
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(x, torch.roll(x, -1, 1)).backward()
    return counter.get_total_flops() / (BATCH * SEQ)


def norm_gains(cfg: ModelConfig) -> int:
    """Parameters N counts that are not matmul weights (norm gains: the convention's rounding error)."""
    return sum(m.weight.numel() for m in GPT(cfg).modules() if isinstance(m, Norm))


@pytest.mark.parametrize("head_dim", [8, 16])
def test_attention_flops_use_the_query_width_as_torch_counts_them(head_dim):
    """Heads wider than d_model / n_head (Qwen3's 128 with d_model 2048): QK^T and A.V run over
    n_head x head_dim, not d_model."""
    cfg = ModelConfig(vocab_size=64, max_seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                      attention_head_dim=head_dim, norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                      tie_embeddings=False)
    assert flops_per_token(cfg, SEQ) - 6 * norm_gains(cfg) == pytest.approx(counted_flops(cfg), rel=1e-12)


def test_qwen3_moe_attention_flops_at_4096_tokens():
    """qwen3-30b-a3b: 32 heads of 128 = 4096 wide with d_model 2048, so the attention term is twice
    what d_model gives: 12 * 48 * 4096 * 4096 = 9.66 GFLOP per token of 27.91."""
    cfg = load_config("configs/qwen3-30b-a3b.yaml", []).model
    attention = 12 * cfg.n_layer * cfg.q_dim * 4096
    assert attention == pytest.approx(9.664e9, rel=1e-3)
    assert flops_per_token(cfg, 4096) / 1e9 == pytest.approx(27.91, abs=0.01)


def test_sliding_window_layers_count_the_span_their_mask_reaches():
    """Each query is counted against the widest span its layer's mask lets a query reach: the whole
    sequence in a full layer, the window in a windowed one (gpt-oss: every other layer)."""
    from model.attention import causal_mask

    seq, window = 64, 12
    full = ModelConfig(vocab_size=64, max_seq_len=seq, n_layer=4, n_head=4, d_model=32)
    windowed = ModelConfig(vocab_size=64, max_seq_len=seq, n_layer=4, n_head=4, d_model=32, sliding_window=window,
                           sliding_window_every=2)
    spans = [int(causal_mask(seq, seq, "cpu", windowed.window_of(i)).sum(1).max()) for i in range(4)]
    assert spans == [window, seq, window, seq]
    saved = 12 * windowed.q_dim * sum(seq - span for span in spans)
    assert flops_per_token(full, seq) - flops_per_token(windowed, seq) == saved


@pytest.mark.parametrize("changes", [
    {"bias": False, "qkv_bias": True},  # Qwen2
    {"bias": True, "qkv_bias": False, "proj_bias": False},  # MLP biases only
    {"bias": False, "attention_sinks": True, "qkv_bias": True, "proj_bias": True, "swiglu_limit": 7.0,
     "moe": MoEConfig(experts=4, top_k=2, bias=True, d_ff=24)},  # gpt-oss
])
def test_parameter_counts_of_the_attention_variants_match_the_built_model(changes):
    cfg = ModelConfig(vocab_size=64, max_seq_len=SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=32, norm="rmsnorm",
                      mlp="swiglu", position="rope", tie_embeddings=False, **changes)
    model = GPT(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    if cfg.moe.experts:  # one token runs through top_k of the experts: the others' weights and biases idle
        idle = sum(p[cfg.moe.top_k:].numel() for name, p in model.named_parameters()
                   if name.split(".")[-1] in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"))
        assert count_parameters(cfg, active=True) == count_parameters(cfg) - idle
