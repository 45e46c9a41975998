"""DeepSeek-V3's parts against transformers' own DeepseekV3 modules, random and small, on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError
from kernels.registry import REFERENCE_OPS
from model import interop
from model.attention import KVCache
from model.config import ModelConfig, MoEConfig
from model.flops import count_parameters, flops_per_token
from model.generate import generate
from model.gpt import GPT, MLP
from model.moe import MoE, route
from tests.unit.model.test_interop import VOCAB, assert_greedy_like_transformers, round_trip, tokens

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
    ({"attention_kind": "mla", "position": "learned"}, "model.attention_kind=mla needs model.position=rope"),
    ({"attention_kind": "mla", "position": "rope", "n_kv_head": 2}, "model.n_kv_head=2 with model.attention_kind=mla"),
    ({"attention_kind": "mla", "position": "rope", "attention": "flash_attn"}, "flash-attn 2 wants values as wide"),
])
def test_bad_group_mla_and_mtp_keys_are_one_line_errors(changes, message):
    moe = {k: changes.pop(k) for k in ("groups", "groups_kept", "top_k") if k in changes}
    cfg = ModelConfig(moe=MoEConfig(experts=8, **moe), **changes)
    with pytest.raises(ConfigError, match=message) as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def hf_deepseek(seed: int = 0, **changes):
    """A random DeepseekV3ForCausalLM whose every part counts: router, correction bias and norms drawn."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_deepseek_config(**({"vocab_size": VOCAB} | changes)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.eval()


DEEPSEEK_SHAPES = {
    "compressed query, interleaved rope": {},
    "full query projection, attention bias": {"q_lora_rank": None, "attention_bias": True},
    "yarn with mscale_all_dim": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 16, "beta_fast": 32,
                                                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
}


@pytest.mark.parametrize("shape", list(DEEPSEEK_SHAPES))
def test_deepseek_v3_round_trip_keeps_the_logits(tmp_path, shape):
    round_trip(hf_deepseek(**DEEPSEEK_SHAPES[shape]), tmp_path)
    cfg = interop.read_hf_dir(tmp_path / "out")[0]
    assert (cfg.attention_kind, cfg.moe.groups, cfg.moe.groups_kept, cfg.moe.score_bias) == ("mla", 4, 2, True)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_deepseek_v3_greedy_generation_equals_transformers(attention, tmp_path):
    assert_greedy_like_transformers(hf_deepseek(seed=3), attention, new_tokens=16, tmp_path=tmp_path)


def test_latent_cache_holds_the_latent_and_the_rotary_key(monkeypatch):
    from model import generate as generate_module

    cfg = mla_model()
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    made = []

    class Recording(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generate_module, "KVCache", Recording)
    assert len(generate_module.generate(ours, [[1, 2, 3]], 5)[0]) == 5
    (cache,) = made
    assert [tuple(k.shape) for k in cache.keys] == [(1, 8, 1, cfg.kv_lora_rank)] * cfg.n_layer
    assert [tuple(v.shape) for v in cache.values] == [(1, 8, 1, cfg.qk_rope_head_dim)] * cfg.n_layer


def mla_model(**changes) -> ModelConfig:
    fields = dict(vocab_size=VOCAB, max_seq_len=64, n_layer=2, n_head=4, d_model=32, norm="rmsnorm", mlp="swiglu",
                  position="rope", bias=False, attention_kind="mla", q_lora_rank=24, kv_lora_rank=16,
                  qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, eot_id=0)
    fields.update(changes)
    cfg = ModelConfig(**fields)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_latent_attention_under_the_document_mask_computes_each_document_alone(attention):
    torch.manual_seed(0)
    cfg = mla_model(attention_mask="document", document_positions=True)
    model = GPT(cfg, attention_backend=attention).eval()
    docs = [torch.randint(1, VOCAB, (n,)) for n in (5, 9, 6)]
    for d in docs:
        d[-1] = 0  # each ends with the end-of-text id
    packed = torch.cat(docs).unsqueeze(0)
    with torch.no_grad():
        together = model(packed)
        alone = torch.cat([model(d.unsqueeze(0)) for d in docs], dim=1)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["selective", "op_selective", "full"])
def test_latent_attention_recomputed_gives_the_same_gradients(policy):
    from model.recompute import apply_recompute

    torch.manual_seed(0)
    cfg = mla_model()
    idx = tokens(batch=2, length=16)
    state = GPT(cfg).state_dict()
    grads = []
    for recompute in ("none", policy):
        model = GPT(cfg, attention_backend="sdpa")
        model.load_state_dict(state)
        if recompute != "none":
            apply_recompute(model, recompute)
        model(idx, idx).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


def test_deepseek_v3_config_has_the_published_parameter_counts():
    from tests.unit.model.test_moe_configs import built_counts

    total, active = built_counts("configs/deepseek-v3.yaml")
    assert total == pytest.approx(671e9, rel=5e-3)
    assert active == pytest.approx(37e9, rel=2e-2)  # "37B activated", given to two figures


@pytest.mark.parametrize("changes, message", [
    ({"attention_kind": "mla"}, "model.mup=true with model.attention_kind=mla is not supported yet"),
    ({"mtp_depth": 1}, "model.mup=true with model.mtp_depth=1 is not supported yet")])
def test_mup_with_latent_attention_or_mtp_is_refused_in_one_line(changes, message):
    cfg = ModelConfig(position="rope", mup=True, mup_base_width=64, **changes)
    with pytest.raises(ConfigError, match=message) as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def test_qk_clip_with_latent_attention_is_refused_in_one_line():
    from training.config import load_config

    with pytest.raises(ConfigError, match="with model.attention_kind=mla is not supported yet: QK-clip") as err:
        load_config("configs/tiny-mla.yaml", ["--optim.name=muon", "--optim.muon.qk_clip_tau=100"])
    assert "\n" not in str(err.value)


def mtp_reference(model: GPT, seq: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The next-token loss and each depth's loss, written out: depth k at position i sees the token
    at i + k and predicts the one at i + k + 1 of the whole sequence ``seq`` (B, T + 1)."""
    ce = torch.nn.functional.cross_entropy
    idx, t = seq[:, :-1], seq.shape[1] - 1
    rope = (model.rope_cos, model.rope_sin)
    h = model.tok_emb(idx)
    for block in model.blocks.values():
        h = block(h, rope)
    main = ce(model.lm_head(model.norm_f(h)).flatten(0, 1), seq[:, 1:].flatten())
    losses = []
    for k, m in enumerate(model.mtp, start=1):
        joined = torch.cat([m.norm_h(h[:, : t - k]), m.norm_e(model.tok_emb(seq[:, k:t]))], dim=-1)
        h = m.block(m.proj(joined), rope)
        losses.append(ce(model.lm_head(m.norm_out(h)).flatten(0, 1), seq[:, k + 1:].flatten()))
    return main, losses


@pytest.mark.parametrize("changes", [{}, {"attention_kind": "gqa", "init": "llama"}])
def test_multi_token_prediction_equals_a_written_out_reference(changes):
    torch.manual_seed(0)
    cfg = mla_model(mtp_depth=2, mtp_loss_weight=0.25, **changes)
    model = GPT(cfg, attention_backend="reference").train()
    seq = tokens(batch=2, length=17)
    loss = model(seq[:, :-1], seq[:, 1:])
    ours = {n: g for n, g in zip(dict(model.named_parameters()), torch.autograd.grad(loss, list(model.parameters())))}
    main, losses = mtp_reference(model, seq)
    expected = main + 0.25 * torch.stack(losses).mean()
    theirs = dict(zip(dict(model.named_parameters()), torch.autograd.grad(expected, list(model.parameters()))))
    torch.testing.assert_close(loss, main)  # the value logged stays the next-token loss
    torch.testing.assert_close(model.take_mtp_loss(), torch.stack(losses).mean().detach())
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5)
    assert ours["mtp.1.proj.weight"].abs().sum() > 0 and model.take_mtp_loss() is None


def test_multi_token_prediction_is_off_at_inference():
    torch.manual_seed(0)
    with_mtp = GPT(mla_model(mtp_depth=1)).eval()
    plain = GPT(mla_model())
    plain.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    plain.eval()
    seq = tokens(batch=1, length=12)
    with torch.no_grad():
        torch.testing.assert_close(with_mtp(seq), plain(seq))
        torch.testing.assert_close(with_mtp(seq[:, :-1], seq[:, 1:]), plain(seq[:, :-1], seq[:, 1:]))
    assert with_mtp.take_mtp_loss() is None
    assert generate(with_mtp, [[1, 2, 3]], 6) == generate(plain, [[1, 2, 3]], 6)


@pytest.mark.parametrize("path, changes", [
    ("configs/tiny-mla.yaml", {"mtp_depth": 2}), ("configs/deepseek-v3.yaml", {"mtp_depth": 1})])
def test_counts_and_flops_follow_the_built_model(path, changes):
    from training.config import load_config

    cfg = load_config(path, ["--data.path=unused"]).model.with_values(changes)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    idle = sum((m.n_experts - m.top_k) * sum(w[0].numel() for w in (m.w_gate, m.w_up, m.w_down)) for m in moe)
    assert model.num_parameters() - idle == count_parameters(cfg, active=True)
    # FLOPs: 6 N (N: active matmul weights, the head once more per depth) + attention over q and v widths
    n = count_parameters(cfg, include_embeddings=False, active=True) + cfg.mtp_depth * cfg.vocab_size * cfg.d_model
    s = 64
    attention = 6 * s * (cfg.n_layer + cfg.mtp_depth) * cfg.n_head * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert flops_per_token(cfg, s) == 6 * n + attention


def test_init_from_a_deepseek_v3_directory_builds_that_model(tmp_path):
    """configs/tiny.yaml (learned positions, LayerNorm, GELU, multi-head attention, dense) started from a
    DeepSeek-V3 directory: the run's model is the source's (latent attention, groups, score bias,
    shared experts, dense first layer), and the trainer's build computes its logits."""
    from tests.unit.model.test_moe_interop import init_from
    from training.model_io import ARCHITECTURE_KEYS

    hf = hf_deepseek(seed=4, vocab_size=256, hidden_size=128, num_hidden_layers=4, max_position_embeddings=128)
    cfg, ours, note = init_from("configs/tiny.yaml", hf, tmp_path)
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)
    m, source = cfg.model, interop.read_hf_dir(tmp_path / "hf")[0]
    assert {k: m.value_of(k) for k in ARCHITECTURE_KEYS} == {k: source.value_of(k) for k in ARCHITECTURE_KEYS}
    assert (m.attention_kind, m.moe.groups_kept, m.moe.shared_experts) == ("mla", 2, 2)
    assert "attention_kind gqa -> mla" in note
