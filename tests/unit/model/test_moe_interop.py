"""Mixtral and Qwen3-MoE interop: transformers' own models, random and small, are the reference."""

from __future__ import annotations

import json

import pytest
import torch

from common.errors import ConfigError, InteropError
from model import interop
from model.config import ModelConfig, MoEConfig
from tests.unit.model.test_interop import VOCAB, round_trip

transformers = pytest.importorskip("transformers", reason="needs transformers (the dev extra)")


def perturb_norms(model):
    with torch.no_grad():  # HF initializes norm gains to ones; make every path count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_mixtral(seed: int = 0, tie: bool = False):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_theta=1e6, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
    )
    return perturb_norms(transformers.MixtralForCausalLM(config))


def hf_qwen3_moe(seed: int = 0, norm_topk_prob: bool = True, mlp_only_layers=(), head_dim: int = 16):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers), max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None,
    )
    return perturb_norms(transformers.Qwen3MoeForCausalLM(config))


def test_mixtral_round_trip(tmp_path):
    round_trip(hf_mixtral(), tmp_path)
    cfg = interop.read_hf_dir(tmp_path / "out")[0]
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.expert_d_ff, cfg.moe.renormalize, cfg.qk_norm) == (4, 2, 24, True, False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4


@pytest.mark.parametrize("norm_topk_prob, mlp_only_layers, head_dim", [(True, (), 16), (False, (0,), 8)])
def test_qwen3_moe_round_trip(tmp_path, norm_topk_prob, mlp_only_layers, head_dim):
    round_trip(hf_qwen3_moe(norm_topk_prob=norm_topk_prob, mlp_only_layers=mlp_only_layers, head_dim=head_dim),
               tmp_path)
    cfg = interop.read_hf_dir(tmp_path / "out")[0]
    assert (cfg.qk_norm, cfg.head_dim, cfg.moe.renormalize) == (True, head_dim, norm_topk_prob)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [i not in mlp_only_layers for i in range(3)]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_export_refuses_moe_models_no_hf_layout_expresses():
    base = dict(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, norm="rmsnorm", mlp="swiglu", position="rope",
                bias=False)
    for changes, needle in [({"router": "sigmoid"}, "model.moe.router=sigmoid"),
                            ({"shared_experts": 1}, "model.moe.shared_experts=1"),
                            ({"bias_update_rate": 0.001}, "model.moe.bias_update_rate=0.001"),
                            ({"every": 2}, "model.moe.every=2 with model.qk_norm=false")]:
        with pytest.raises(InteropError, match=needle) as err:
            interop.hf_layout(ModelConfig(**base, moe=MoEConfig(experts=4, **changes)))
        assert "\n" not in str(err.value)


def test_import_refuses_moe_parts_perfgpt_lacks_naming_the_field(tmp_path):
    model = hf_mixtral()
    model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for changes, needle in [({"sliding_window": 8, "layer_types": ["chunked_attention", "full_attention"]},
                             "config.json layer_types="),
                            ({"attention_bias": True}, "config.json attention_bias=true"),
                            ({"model_type": "jamba"}, "model_type='jamba'"),
                            ({"model_type": "qwen3_moe", "mlp_only_layers": [1]}, "mlp_only_layers=[1]")]:
        with pytest.raises(InteropError, match=needle.replace("[", r"\[").replace("]", r"\]")) as err:
            interop.from_hf_config(config | changes)
        assert "\n" not in str(err.value)
    # an expert with biases (gpt-oss style) or an attention sink: a weight perfgpt has no place for
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for extra in ("model.layers.0.block_sparse_moe.experts.0.w1.bias", "model.layers.0.self_attn.sinks"):
        with pytest.raises(InteropError, match=f"unexpected weight '{extra}'"):
            interop.from_hf_state_dict(config, state | {extra: torch.zeros(4)})


@pytest.mark.parametrize("qwen", [False, True])
def test_sample_cli_on_a_moe_model_equals_transformers_generate(tmp_path, capsys, qwen):
    from data.tokenizer import ByteTokenizer
    from model.gpt import GPT
    from tools import sample as sample_tool
    from training.model_io import ModelSource, write_export

    cfg = ModelConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, norm="rmsnorm",
                      mlp="swiglu", position="rope", tie_embeddings=False, bias=False,
                      moe=MoEConfig(experts=4, top_k=2, d_ff=16), qk_norm=qwen, attention_head_dim=16 if qwen else None)
    torch.manual_seed(3)
    write_export(ModelSource(cfg, GPT(cfg).state_dict(), "byte", None, "test"), tmp_path / "hf", "hf")
    prompt = "def f(x):"
    assert sample_tool.main([str(tmp_path / "hf"), "--prompt", prompt, "--greedy", "--max-new-tokens", "24"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if qwen else "MixtralForCausalLM")
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode(prompt).tolist()])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                      min_new_tokens=24, pad_token_id=0)
    assert f"--- {prompt!r} + 24 new tokens:\n{tok.decode(out[0, ids.shape[1]:].tolist())}\n" in capsys.readouterr().out


# --------------------------------------------------------------------------- model.init_from


def tiny_shaped(kind: str):
    """A Mixtral or a Qwen3-MoE with configs/tiny.yaml's explicit shape (vocabulary 256, 4 layers, 4
    heads, width 128), and MoE settings of its own; the Mixtral's positions reach past tiny's 128."""
    torch.manual_seed(5)
    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  bos_token_id=None, eos_token_id=None)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=256, rope_theta=1e6)
        return perturb_norms(transformers.MixtralForCausalLM(config))
    config = transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                                         num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                         mlp_only_layers=[0], max_position_embeddings=128)
    return perturb_norms(transformers.Qwen3MoeForCausalLM(config))


def init_from(config: str, source, tmp_path, *overrides: str):
    """What train.py does with --model.init_from: the config with the source's architecture, built by
    the trainer's one build path from the source's weights."""
    from parallel.distributed import DistContext
    from training.build import build_from_config
    from training.config import explicit_keys, load_config
    from training.model_io import with_initial_weights

    source.save_pretrained(tmp_path / "hf")
    overrides = [f"--model.init_from={tmp_path / 'hf'}", *overrides]
    cfg, loaded, note = with_initial_weights(load_config(config, overrides), explicit_keys(config, overrides))
    return cfg, build_from_config(cfg, DistContext.single(), loaded.state).model.eval(), note


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_init_from_a_moe_model_builds_that_model(tmp_path, kind):
    """configs/tiny.yaml sets no MoE key: the experts, routing, query/key norms and head width come from
    the source, and the trainer's model computes its logits."""
    hf = tiny_shaped(kind)
    cfg, ours, note = init_from("configs/tiny.yaml", hf, tmp_path)
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)
    m = cfg.model
    if kind == "mixtral":
        assert (m.moe.experts, m.moe.top_k, m.expert_d_ff, m.qk_norm, m.max_seq_len) == (4, 2, 64, False, 128)
        assert "moe.experts None -> 4" in note and "mlp gelu -> swiglu" in note
    else:
        assert (m.moe.experts, m.moe.top_k, m.expert_d_ff, m.moe.first_dense, m.moe.renormalize, m.qk_norm,
                m.head_dim) == (6, 3, 32, 1, False, True, 16)
        assert "attention_head_dim 32 -> 16" in note and "qk_norm False -> True" in note


@pytest.mark.parametrize("kind, conflicts", [
    ("mixtral", "model.moe.experts=16 (the source's: 4), model.moe.top_k=4 (the source's: 2), "
                "model.moe.routed_scale=4.0 (the source's: 1.0); set them to the source's value or leave them out"),
    ("qwen3_moe", "model.moe.experts=16 (the source's: 6), model.moe.top_k=4 (the source's: 3), "
                  "model.moe.d_ff=64 (the source's: 32), model.moe.routed_scale=4.0 (the source's: 1.0); set them"),
])
def test_init_from_refuses_moe_settings_the_config_sets_otherwise(tmp_path, kind, conflicts):
    """configs/tiny-moe.yaml asks for 16 experts, top-4 and a routed scale of 4: another model than
    the source's, so the run is refused, naming each key with both values (and nothing it agrees on)."""
    with pytest.raises(ConfigError) as err:
        init_from("configs/tiny-moe.yaml", tiny_shaped(kind), tmp_path)
    assert "\n" not in str(err.value) and conflicts in str(err.value), str(err.value)
    assert "n_layer" not in str(err.value) and "mlp" not in str(err.value)


def test_init_from_builds_the_source_where_the_config_agrees_with_it(tmp_path):
    """The same config with its MoE keys set to the source's values (and an explicit dense key that
    differs refused as the MoE ones are)."""
    hf = tiny_shaped("mixtral")
    agree = ("--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.routed_scale=1.0")
    _, ours, _ = init_from("configs/tiny-moe.yaml", hf, tmp_path, *agree)
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"sets model\.n_layer=2 \(the source's: 4\); set it to"):
        init_from("configs/tiny-moe.yaml", hf, tmp_path, *agree, "--model.n_layer=2")
