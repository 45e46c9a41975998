"""DeepSeek-V3's parts against transformers' own DeepseekV3 modules, random and small, on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError
from kernels.registry import REFERENCE_OPS
from model.config import ModelConfig, MoEConfig
from model.gpt import MLP
from model.moe import MoE, route

transformers = pytest.importorskip("transformers", reason="needs transformers (the dev extra)")


def hf_deepseek_config(**changes):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, n_shared_experts=2, n_routed_experts=8, n_group=4, topk_group=2,
                  num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                  max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    fields.update(changes)
    return transformers.DeepseekV3Config(**fields)


def moe_config(hf) -> ModelConfig:
    return ModelConfig(vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_head=4, d_ff=hf.intermediate_size,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                       moe=MoEConfig(experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok, d_ff=hf.moe_intermediate_size,
                                     shared_experts=hf.n_shared_experts, router="sigmoid", renormalize=hf.norm_topk_prob,
                                     routed_scale=hf.routed_scaling_factor, groups=hf.n_group, groups_kept=hf.topk_group,
                                     score_bias=True, first_dense=hf.first_k_dense_replace, aux_loss=0.0))


def copy_moe_from_hf(ours: MoE, theirs) -> None:
    f = ours.w_up.shape[-1]
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.w_gate.copy_(theirs.experts.gate_up_proj[:, :f].transpose(1, 2))
        ours.w_up.copy_(theirs.experts.gate_up_proj[:, f:].transpose(1, 2))
        ours.w_down.copy_(theirs.experts.down_proj.transpose(1, 2))
        shared = theirs.shared_experts
        ours.shared.gate.weight.copy_(shared.gate_proj.weight)
        ours.shared.fc.weight.copy_(shared.up_proj.weight)
        ours.shared.out.weight.copy_(shared.down_proj.weight)


@pytest.mark.parametrize("groups, kept", [(4, 2), (4, 3), (2, 1), (1, 1)])
def test_group_limited_routing_equals_transformers_deepseek_v3_moe(groups, kept):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    hf = hf_deepseek_config(n_group=groups, topk_group=kept)
    theirs = DeepseekV3MoE(hf).eval()
    with torch.no_grad():  # HF starts the router and the correction bias at zero: draw them so routing matters
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
        theirs.gate.e_score_correction_bias.normal_(0.0, 0.3)
    cfg = moe_config(hf)
    cfg.validate()
    width = cfg.moe.shared_experts * cfg.expert_d_ff
    ours = MoE(cfg, REFERENCE_OPS, "loop", shared=MLP(dataclasses.replace(cfg, d_ff=width), REFERENCE_OPS)).eval()
    copy_moe_from_hf(ours, theirs)
    x = torch.randn(2, 24, hf.hidden_size)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    # the routing itself: the experts transformers' router picks (as sets: it leaves them unsorted)
    _, _, their_experts = theirs.gate(x)
    logits = ours.router(x.view(-1, hf.hidden_size))
    mine = route(logits, cfg.moe.top_k, "sigmoid", True, 2.5, ours.expert_bias, groups, kept)
    assert torch.equal(mine.experts.sort(-1).values, their_experts.sort(-1).values)
    if kept < groups:  # the groups changed the choice for some tokens, so the comparison tests them
        free = route(logits, cfg.moe.top_k, "sigmoid", True, 2.5, ours.expert_bias)
        assert not torch.equal(free.experts.sort(-1).values, mine.experts.sort(-1).values)
        per_group = cfg.moe.experts // groups
        assert all(len(set((row // per_group).tolist())) <= kept for row in mine.experts)


@pytest.mark.parametrize("changes, message", [
    ({"groups": 3}, "model.moe.groups=3 must be >= 1 and divide model.moe.experts=8"),
    ({"groups": 4, "groups_kept": 5}, "model.moe.groups_kept=5 must be between 1 and model.moe.groups=4"),
    ({"groups": 4, "groups_kept": 1, "top_k": 3}, "model.moe.top_k=3 is more than the 2 experts"),
])
def test_bad_group_keys_are_one_line_errors(changes, message):
    cfg = ModelConfig(moe=MoEConfig(experts=8, **changes))
    with pytest.raises(ConfigError, match=message) as err:
        cfg.validate()
    assert "\n" not in str(err.value)
