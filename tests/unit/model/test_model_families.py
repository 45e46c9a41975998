"""Mistral, Qwen2/2.5, Llama 3.1 and gpt-oss: their parts against transformers' own modules.

transformers builds each family small and random (shapes chosen here, never a published config's),
with a context longer than the sliding windows so the windows cut; perfgpt reads the weights, and
logits, greedy generation (with and without the KV cache), the rotary tables of each scaling, and
gpt-oss's MoE layer must match. Then what the variants do under the document mask, in the KV
cache and in the attention backend's choice, and the llama initialization.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from common.errors import CapabilityError, ConfigError
from model import interop
from model.attention import select_attention
from model.config import ModelConfig, MoEConfig, RopeScaling
from model.generate import generate
from model.gpt import GPT
from model.rope import rope_frequencies
from tests.unit.model.test_interop import VOCAB, assert_greedy_like_transformers, perfgpt_from, round_trip, tokens

transformers = pytest.importorskip("transformers", reason="needs transformers (the dev extra)")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def perturbed(model):
    """HF initializes biases, sinks and norm gains to constants; move them so every path counts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def hf_mistral(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=5, rope_theta=1e6,
        bos_token_id=None, eos_token_id=None)
    return perturbed(transformers.MistralForCausalLM(config))


def hf_qwen2(seed: int = 0, tie: bool = True):
    """Q/K/V biases, a window from layer 1 on (max_window_layers), YaRN as Qwen2.5 configures it."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    return perturbed(transformers.Qwen2ForCausalLM(config))


def hf_llama31(seed: int = 0, attention_bias: bool = False):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, rope_scaling=dict(LLAMA3),
        attention_bias=attention_bias, mlp_bias=False, bos_token_id=None, eos_token_id=None)
    return perturbed(transformers.LlamaForCausalLM(config))


def hf_gpt_oss(seed: int = 0, layers: int = 3):
    """Windows on the even layers, sinks, attention and expert biases, the clamped SwiGLU (a limit low
    enough to clamp random activations), YaRN without truncation as gpt-oss ships it."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=5, swiglu_limit=0.5, bos_token_id=None, eos_token_id=None, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 16})
    return perturbed(transformers.GptOssForCausalLM(config))


FAMILIES = {"mistral": hf_mistral, "qwen2": hf_qwen2, "llama31": hf_llama31, "gpt_oss": hf_gpt_oss}


# --------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_files_keeps_the_logits(tmp_path, family):
    round_trip(FAMILIES[family](), tmp_path)


def test_what_each_family_reads_as():
    def read(hf):
        return interop.from_hf_config(hf.config.to_dict())

    mistral, qwen2, llama, oss = (read(FAMILIES[f]()) for f in FAMILIES)
    assert [mistral.window_of(i) for i in range(2)] == [5, 5] and not mistral.bias
    assert [qwen2.window_of(i) for i in range(3)] == [None, 6, 6]
    assert (qwen2.has_qkv_bias, qwen2.has_proj_bias, qwen2.bias, qwen2.rope_scaling.type) == (True, False, False, "yarn")
    assert llama.rope_scaling == RopeScaling(type="llama3", factor=8.0, original_max_seq_len=16)
    assert [oss.window_of(i) for i in range(3)] == [5, None, 5]
    assert (oss.attention_sinks, oss.moe.bias, oss.swiglu_limit, oss.rope_scaling.truncate) == (True, True, 0.5, False)


def test_llama_with_attention_bias_but_no_mlp_bias(tmp_path):
    round_trip(hf_llama31(attention_bias=True), tmp_path)
    cfg = interop.read_hf_dir(tmp_path / "out")[0]
    assert (cfg.has_qkv_bias, cfg.has_proj_bias, cfg.bias) == (True, True, False)


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(family, attention):
    """Prompts and continuations longer than the windows: the bounded cache of a windowed layer must
    still hand each new token the keys it sees."""
    assert_greedy_like_transformers(FAMILIES[family](seed=3), attention, new_tokens=24)


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_a_windowed_layer_caches_only_its_window(monkeypatch, attention):
    """The bounded cache holds the last window - 1 positions, and the logits of a prompt fed in pieces
    through it equal those of one forward over the whole sequence."""
    from model import generate as generate_module
    from model.attention import KVCache

    hf_model = hf_qwen2(seed=1)
    cfg, state = interop.from_hf_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    model = perfgpt_from(cfg, state, attention)
    caches = []
    real = generate_module.KVCache
    monkeypatch.setattr(generate_module, "KVCache", lambda *a, **k: caches.append(real(*a, **k)) or caches[-1])
    generate(model, [[1, 2, 3]], 30)
    # (batch, positions, kv heads, head dim) per layer: window 6 keeps 5 positions, a full layer all 33
    assert [tuple(k.shape) for k in caches[0].keys] == [(1, 33, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)]
    idx = tokens(seed=4, batch=2, length=30)
    cache = KVCache(cfg.n_layer, 2, 30, cfg.kv_heads, cfg.head_dim, "cpu", torch.float32,
                    windows=[cfg.window_of(i) for i in range(cfg.n_layer)])
    with torch.no_grad():
        pieces = [model(idx[:, a:b], cache=cache) for a, b in ((0, 3), (3, 4), (4, 13), (13, 14), (14, 30))]
        torch.testing.assert_close(torch.cat(pieces, 1), model(idx), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- parts


@pytest.mark.parametrize("params", [
    dict(LLAMA3),
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5, "original_max_position_embeddings": 128},
])
@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 1e6), (16, 10000.0)])
def test_rotary_frequencies_equal_transformers(params, head_dim, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                         max_position_embeddings=131072, rope_theta=theta, rope_scaling=dict(params))
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu")
    cfg = interop.from_hf_config(hf_config.to_dict())
    got, factor = rope_frequencies(head_dim, theta, cfg.rope_scaling)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_gpt_oss_moe_layer_equals_transformers():
    """Router bias, top-k then softmax over the k, expert biases, gate and up interleaved in one tensor,
    the clamped SwiGLU: one layer on the same weights, tokens whose activations reach the clamp."""
    hf_model = hf_gpt_oss(seed=2, layers=1)
    cfg, state = interop.from_hf_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ours = perfgpt_from(cfg, state).blocks["0"].mlp
    theirs = hf_model.model.layers[0].mlp
    x = 3 * torch.randn(2, 7, 32)
    with torch.no_grad():
        want, _ = theirs(x)
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-6)
        gate_up = x.view(-1, 32) @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
    assert (gate_up[..., 0::2] > cfg.swiglu_limit).any() and (gate_up[..., 1::2].abs() > cfg.swiglu_limit).any()


# --------------------------------------------------------------------------- what the variants do


def variant_model(**changes) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, max_seq_len=32, n_layer=3, n_head=4, n_kv_head=2, d_model=32,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
                       attention_mask="document", eot_id=0, document_positions=True, **changes)


@pytest.mark.parametrize("changes", [
    {"sliding_window": 3, "sliding_window_every": 2, "attention_sinks": True, "qkv_bias": True, "proj_bias": True,
     "swiglu_limit": 1.0, "moe": MoEConfig(experts=4, top_k=2, d_ff=16, bias=True)},
    {"sliding_window": 4, "sliding_window_first": 1, "qkv_bias": True},
])
@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_under_the_document_mask_each_document_is_computed_alone(changes, attention):
    """Packed documents with windows, sinks and biases: each document's logits are those of the
    document run by itself, its positions restarting (the window and the sinks stay inside it)."""
    cfg = variant_model(**changes)
    torch.manual_seed(0)
    model = GPT(cfg, attention_backend=attention).eval()
    with torch.no_grad():
        for module in model.modules():  # sinks and biases start at zero: make them count
            for name, p in module.named_parameters(recurse=False):
                if name in ("bias", "b_gate", "b_up", "b_down") or module.__class__.__name__ == "Sinks":
                    p.normal_(0, 0.5)
    docs = [torch.randint(1, VOCAB, (n,)) for n in (7, 12, 5)]
    for d in docs:
        d[-1] = 0  # each document ends with the end-of-text id
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        whole = model(packed)
        start = 0
        for d in docs:
            torch.testing.assert_close(whole[0, start:start + len(d)], model(d[None])[0], rtol=1e-5, atol=1e-5)
            start += len(d)


def test_the_backend_choice_says_what_windows_and_sinks_force():
    cpu = torch.device("cpu")
    backend, line = select_attention("auto", cpu, torch.float32, 64, sinks=True)
    assert backend == "reference" and "SDPA and flash-attn 2 have no sink term" in line
    backend, line = select_attention("auto", cpu, torch.float32, 64, window=128)
    assert backend == "sdpa" and "sliding window 128 as an explicit (T, S) mask" in line
    with pytest.raises(CapabilityError, match="model.attention=sdpa cannot run model.attention_sinks") as err:
        select_attention("sdpa", cpu, torch.float32, 64, sinks=True)
    assert "\n" not in str(err.value)
    # A core built with sinks runs the reference path whatever backend the model was given.
    model = GPT(variant_model(attention_sinks=True), attention_backend="sdpa")
    assert {b.attn.core.backend for b in model.blocks.values()} == {"reference"}


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window": 0}, "model.sliding_window must be >= 1"),
    ({"sliding_window": 4, "sliding_window_first": 3}, "model.sliding_window_first=3 leaves none of the 3 layers"),
    ({"swiglu_limit": 7.0, "mlp": "gelu"}, "model.swiglu_limit clamps a SwiGLU: it needs model.mlp=swiglu"),
    ({"rope_scaling": RopeScaling(type="yarn"), "position": "learned"}, "model.rope_scaling.type=yarn scales rotary"),
    ({"rope_scaling": RopeScaling(type="llama3", factor=0.5)}, "model.rope_scaling.factor=0.5 must be >= 1"),
    ({"rope_scaling": RopeScaling(type="llama3", low_freq_factor=4.0, high_freq_factor=1.0)},
     "model.rope_scaling.high_freq_factor=1.0 must be above low_freq_factor=4.0"),
    ({"attention_sinks": True, "layers": "te"}, "model.attention_sinks needs model.layers=torch"),
    ({"init": "llama", "layers": "te"}, "model.init=llama needs model.layers=torch"),
    ({"attention_sinks": True, "attention": "sdpa"}, "model.attention=sdpa cannot run model.attention_sinks"),
    ({"attention_sinks": True, "attention": "flash_attn"}, "model.attention=flash_attn cannot run model.attention_sinks"),
])
def test_bad_variant_keys_are_one_line_errors(changes, message):
    base = dict(vocab_size=VOCAB, n_layer=3, n_head=4, d_model=32, norm="rmsnorm", mlp="swiglu", position="rope")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        ModelConfig(**(base | changes)).validate()
    assert "\n" not in str(err.value)


def test_llama_init_truncates_and_scales_output_projections_by_depth():
    cfg = ModelConfig(vocab_size=512, max_seq_len=16, n_layer=4, n_head=4, d_model=256, norm="rmsnorm", mlp="swiglu",
                      position="rope", bias=False, tie_embeddings=False, init="llama")
    torch.manual_seed(0)
    model = GPT(cfg)
    for i, block in model.blocks.items():
        out_std = 0.02 / math.sqrt(2 * (int(i) + 1))
        for w, std in ((block.attn.qkv.weight, 0.02), (block.mlp.gate.weight, 0.02), (block.attn.proj.weight, out_std),
                       (block.mlp.fc.weight, out_std), (block.mlp.out.weight, out_std)):
            assert w.std().item() == pytest.approx(std * 0.9866, rel=0.05)  # a normal cut at 3 std keeps 98.7% of it
            assert w.abs().max().item() <= 3 * std
    assert model.tok_emb.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(256 ** -0.5 * 0.9866, rel=0.05)
    # Routed experts: the gate at std, up and down at the block's output std; biases zero.
    moe = GPT(dataclasses.replace(cfg, moe=MoEConfig(experts=4, top_k=2, bias=True))).blocks["1"].mlp
    for w, std in ((moe.w_gate, 0.02), (moe.w_up, 0.01), (moe.w_down, 0.01)):
        assert w.std().item() == pytest.approx(std * 0.9866, rel=0.05) and w.abs().max().item() <= 3 * std
    assert not moe.b_up.any() and not moe.router.bias.any()


# --------------------------------------------------------------------------- model.init_from


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gpt_oss", "llama31"])
def test_init_from_builds_the_source_family(tmp_path, family):
    """configs/tiny.yaml (learned positions, LayerNorm, GELU, biases, no window) started from a
    Mistral, a Qwen2, a gpt-oss or a Llama 3.1 model: the run's model is the source's, windows, sinks, biases,
    rotary scaling and experts included, and the trainer's build computes its logits."""
    from tests.unit.model.test_moe_interop import init_from

    torch.manual_seed(7)
    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
    if family == "mistral":
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=16, rope_theta=1e6))
    elif family == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=16, max_window_layers=2,
            rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}))
    elif family == "gpt_oss":
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rope_theta=150000.0,
            rope_scaling={"rope_type": "yarn", "factor": 2.0, "truncate": False, "beta_fast": 32.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": 64}))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_scaling=dict(LLAMA3)))
    hf = perturbed(hf)
    cfg, ours, note = init_from("configs/tiny.yaml", hf, tmp_path)
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)
    from training.model_io import ARCHITECTURE_KEYS

    m, source = cfg.model, interop.read_hf_dir(tmp_path / "hf")[0]
    assert {k: m.value_of(k) for k in ARCHITECTURE_KEYS} == {k: source.value_of(k) for k in ARCHITECTURE_KEYS}
    if family == "mistral":
        assert (m.sliding_window, m.sliding_window_every, m.has_qkv_bias, m.rope_theta) == (16, 1, False, 1e6)
        assert "sliding_window None -> 16" in note and m.rope_scaling.type == "none"
    else:
        scaling = "llama3" if family == "llama31" else "yarn"
        assert m.rope_scaling.type == scaling and "rope_scaling.type none ->" in note
    if family == "gpt_oss":
        assert (m.attention_sinks, m.moe.bias, m.moe.experts, m.sliding_window_every) == (True, True, 4, 2)
    if family == "qwen2":
        assert (m.has_qkv_bias, m.has_proj_bias, m.sliding_window_first) == (True, False, 2)
