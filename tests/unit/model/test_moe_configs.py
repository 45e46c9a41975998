"""The shipped MoE configs, built on the meta device and counted against the published figures."""

from __future__ import annotations

import pytest
import torch

from model.flops import count_parameters
from model.gpt import GPT
from model.moe import moe_layers
from training.config import load_config


def built_counts(path: str) -> tuple[int, int]:
    """(total, active per token) parameters of the config's GPT, counted from the built module:
    every parameter, less the experts one token does not run in each MoE layer."""
    cfg = load_config(path, ["--data.path=unused"]).model
    with torch.device("meta"):
        model = GPT(cfg)
    total = model.num_parameters()
    idle = 0
    for layer in moe_layers([model]):
        per_expert = sum(w[0].numel() for w in (layer.w_gate, layer.w_up, layer.w_down) if w is not None)
        idle += (layer.n_experts - layer.top_k) * per_expert
    assert total == count_parameters(cfg) and total - idle == count_parameters(cfg, active=True)
    return total, total - idle


@pytest.mark.parametrize("path, total, active", [
    ("configs/mixtral-8x7b.yaml", 46.7e9, 12.9e9),
])
def test_moe_configs_have_the_published_parameter_counts(path, total, active):
    got_total, got_active = built_counts(path)
    assert got_total == pytest.approx(total, rel=5e-3)
    assert got_active == pytest.approx(active, rel=5e-3)
