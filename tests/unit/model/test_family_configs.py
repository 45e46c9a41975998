"""The shipped Mistral, Qwen2.5, Llama 3.1 and gpt-oss configs, built on the meta device and counted
against the published totals (each config's comment names where its figure comes from)."""

from __future__ import annotations

import pytest
import torch

from model.flops import count_parameters, matmul_parameters
from model.gpt import GPT
from model.moe import moe_layers
from training.config import load_config


def built(path: str) -> tuple[GPT, int]:
    """The config's GPT on the meta device, and its parameters counted from the module."""
    cfg = load_config(path, ["--data.path=unused"]).model
    with torch.device("meta"):
        model = GPT(cfg)
    total = model.num_parameters()
    assert total == count_parameters(cfg)
    return model, total


@pytest.mark.parametrize("path, published", [
    ("configs/mistral-7b.yaml", 7.24e9),
    ("configs/llama3.1-8b.yaml", 8.03e9),
])
def test_dense_family_configs_have_the_published_totals(path, published):
    assert built(path)[1] == pytest.approx(published, rel=5e-3)


def test_qwen2_5_7b_has_the_published_totals():
    model, total = built("configs/qwen2.5-7b.yaml")
    assert total == pytest.approx(7.61e9, rel=5e-3)
    assert total - 2 * 152064 * 3584 == pytest.approx(6.53e9, rel=5e-3)  # the model card's non-embedding count
    assert model.blocks["0"].attn.qkv.bias is not None and model.blocks["0"].attn.proj.bias is None


def test_gpt_oss_20b_has_the_published_totals():
    """The model card's active count holds the LM head but not the token table, N of the FLOP
    convention: every block's parameters less the experts a token does not run, plus the head."""
    model, total = built("configs/gpt-oss-20b.yaml")
    assert total == pytest.approx(20.91e9, rel=5e-3)
    stacked = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")  # (experts, ...) each
    idle = sum((layer.n_experts - layer.top_k) * getattr(layer, name)[0].numel()
               for layer in moe_layers([model]) for name in stacked)
    active = total - idle - model.tok_emb.weight.numel()
    assert active == matmul_parameters(model.cfg) == pytest.approx(3.61e9, rel=5e-3)
    assert [model.cfg.window_of(i) for i in range(4)] == [128, None, 128, None]
