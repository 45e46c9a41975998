"""Interop (model/interop.py), model.gelu, and generation with a KV cache (model/generate.py).

Hugging Face models are built from configs with random weights, never downloaded; transformers
is the independent implementation every conversion is checked against.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.errors import ConfigError, InteropError
from kernels.registry import REFERENCE_OPS, resolve_kernel_ops
from model import interop
from model.config import ModelConfig
from model.generate import Sampling, generate, next_token
from model.gpt import GPT

transformers = pytest.importorskip("transformers", reason="needs transformers (the dev extra)")
pytest.importorskip("safetensors", reason="needs safetensors (the dev extra)")

VOCAB = 97


def hf_gpt2(activation: str = "gelu_new", tie: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function=activation,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def hf_llama(kv_heads: int = 2, tie: bool = False, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias, bos_token_id=None, eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initializes biases and norm gains to constants; make every path count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(seed: int = 1, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def perfgpt_from(cfg: ModelConfig, state: dict, attention: str = "reference") -> GPT:
    model = GPT(cfg, attention_backend=attention)
    model.load_state_dict(state)
    return model.eval()


def assert_close_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert (ours - theirs).abs().max().item() <= 1e-5


def round_trip(hf_model, tmp_path, bin_file: bool = False) -> None:
    """HF -> files -> perfgpt (logits equal) -> our export -> HF (no key warnings, logits equal)."""
    idx = tokens()
    hf_model.save_pretrained(tmp_path / "hf")
    if bin_file:  # the older pickle format; recent transformers write safetensors only
        (tmp_path / "hf" / "model.safetensors").unlink()
        torch.save(hf_model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    cfg, state = interop.read_hf_dir(tmp_path / "hf")
    ours = perfgpt_from(cfg, state)
    with torch.no_grad():
        hf_logits, our_logits = hf_model(idx).logits, ours(idx)
    assert_close_logits(our_logits, hf_logits)

    interop.write_hf_dir(cfg, ours.state_dict(), tmp_path / "out")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, dtype=torch.float32
    )
    assert type(back) is type(hf_model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert_close_logits(back.eval()(idx).logits, our_logits)
    assert interop.read_hf_dir(tmp_path / "out")[0] == cfg


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("activation,gelu", [("gelu_new", "tanh"), ("gelu", "exact")])
@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_round_trip(tmp_path, activation, gelu, tie):
    model = hf_gpt2(activation, tie)
    round_trip(model, tmp_path)
    cfg = interop.read_hf_dir(tmp_path / "out")[0]
    assert (cfg.gelu, cfg.tie_embeddings, cfg.position, cfg.d_ff) == (gelu, tie, "learned", 128)


@pytest.mark.parametrize("kv_heads,tie,bias", [(2, False, False), (1, True, True), (4, False, True)])
def test_llama_round_trip(tmp_path, kv_heads, tie, bias):
    round_trip(hf_llama(kv_heads, tie, bias), tmp_path)
    cfg = interop.read_hf_dir(tmp_path / "out")[0]
    assert (cfg.kv_heads, cfg.tie_embeddings, cfg.bias, cfg.rope_theta) == (kv_heads, tie, bias, 500000.0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_key_value_heads"] == kv_heads and config["model_type"] == "llama"


def test_pytorch_model_bin_is_read(tmp_path):
    round_trip(hf_gpt2(), tmp_path, bin_file=True)


def test_sharded_safetensors_are_read_through_their_index(tmp_path):
    model = hf_llama()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    cfg, state = interop.read_hf_dir(tmp_path / "sharded")
    idx = tokens()
    with torch.no_grad():
        assert_close_logits(perfgpt_from(cfg, state)(idx), model(idx).logits)


class Payload:
    """Unpickling this runs code; weights-only loading must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickled_code_in_weight_files_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    hf_gpt2().save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": torch.zeros(1), "x": Payload(marker)}, tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(InteropError) as info:
        interop.read_hf_dir(tmp_path / "hf")
    assert "cannot be read as weights" in one_line(info)
    torch.save({"model_args": {}, "model": {}, "x": Payload(marker)}, tmp_path / "ckpt.pt")
    with pytest.raises(InteropError):
        interop.read_nanogpt_ckpt(tmp_path / "ckpt.pt")
    assert not marker.exists()


def test_bias_free_gpt_exports_to_gpt2_with_zero_biases(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=2, n_head=4, d_model=32, bias=False, gelu="exact")
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    interop.write_hf_dir(cfg, ours.state_dict(), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    idx = tokens()
    with torch.no_grad():
        assert_close_logits(back(idx).logits, ours(idx))


# --------------------------------------------------------------------------- nanoGPT


def nanogpt_layout(model: GPT) -> dict:
    """A perfgpt GPT's weights as nanoGPT's train.py saves them, written out by hand: GPT-2 names,
    nn.Linear (out, in) weights, the compiled model's ``_orig_mod.`` prefix, its causal-mask
    buffers and the tied lm_head."""
    cfg, sd = model.cfg, model.state_dict()
    out = {"transformer.wte.weight": sd["tok_emb.weight"], "transformer.wpe.weight": sd["pos_emb.weight"],
           "lm_head.weight": sd["tok_emb.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        pairs = {"norm1.weight": "ln_1.weight", "norm2.weight": "ln_2.weight", "attn.qkv.weight": "attn.c_attn.weight",
                 "attn.proj.weight": "attn.c_proj.weight", "mlp.fc.weight": "mlp.c_fc.weight",
                 "mlp.out.weight": "mlp.c_proj.weight"}
        if cfg.bias:
            pairs.update({"norm1.bias": "ln_1.bias", "norm2.bias": "ln_2.bias", "attn.qkv.bias": "attn.c_attn.bias",
                          "attn.proj.bias": "attn.c_proj.bias", "mlp.fc.bias": "mlp.c_fc.bias",
                          "mlp.out.bias": "mlp.c_proj.bias"})
        out.update({theirs + b: sd[ours + a] for a, b in pairs.items()})
        t = cfg.max_seq_len
        out[theirs + "attn.bias"] = torch.ones(t, t).tril().view(1, 1, t, t)
    out["transformer.ln_f.weight"] = sd["norm_f.weight"]
    if cfg.bias:
        out["transformer.ln_f.bias"] = sd["norm_f.bias"]
    return {f"_orig_mod.{k}": v.clone() for k, v in out.items()}


def hf_gpt2_from_nanogpt(checkpoint: dict):
    """The same weights in transformers' GPT-2 with exact GELU (nanoGPT's architecture), mapped by hand."""
    args = checkpoint["model_args"]
    config = transformers.GPT2Config(
        vocab_size=args["vocab_size"], n_positions=args["block_size"], n_embd=args["n_embd"], n_layer=args["n_layer"],
        n_head=args["n_head"], activation_function="gelu", layer_norm_epsilon=1e-5, bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items() if not k.endswith(".attn.bias")}
    linear = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {k: v.t() if k.endswith(linear) else v for k, v in state.items()}
    hf_state = hf.state_dict()
    for key in hf_state:  # nanoGPT without biases = GPT-2 with zero biases
        state.setdefault(key, torch.zeros_like(hf_state[key]))
    hf.load_state_dict(state)
    return hf


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_checkpoint_import(tmp_path, bias):
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=32, n_layer=2, n_head=4, d_model=32, bias=bias, gelu="exact")
    torch.manual_seed(0)
    source = GPT(cfg)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    args = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32, "bias": bias, "vocab_size": VOCAB,
            "dropout": 0.0}
    checkpoint = {"model": nanogpt_layout(source), "model_args": args, "optimizer": {}, "iter_num": 5,
                  "best_val_loss": torch.tensor(2.5), "config": {"dataset": "shakespeare_char"}}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    cfg2, state = interop.read_nanogpt_ckpt(tmp_path / "ckpt.pt")
    assert cfg2 == cfg
    ours = perfgpt_from(cfg2, state)
    idx = tokens(length=32)
    with torch.no_grad():
        our_logits = ours(idx)
        assert_close_logits(our_logits, hf_gpt2_from_nanogpt(checkpoint)(idx).logits)
        tanh_model = perfgpt_from(ModelConfig(**{**cfg2.__dict__, "gelu": "tanh"}), state)
        assert (tanh_model(idx) - our_logits).abs().max().item() > 1e-5  # the GELU form is visible
    exported = interop.to_nanogpt(cfg2, ours.state_dict())
    assert exported["model_args"] == args
    cfg3, state3 = interop.from_nanogpt(exported)
    assert cfg3 == cfg and all(torch.equal(state3[k], v) for k, v in ours.state_dict().items())


# --------------------------------------------------------------------------- refusals, one line each


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("changes,needle", [
    (dict(position="learned", mlp="swiglu"), "model.mlp=swiglu"),
    (dict(position="rope", norm="layernorm", mlp="gelu"), "model.position=rope"),
    (dict(n_kv_head=2), "model.n_kv_head=2"),
    (dict(layers="te"), "model.layers=te"),
])
def test_export_refuses_what_no_hf_layout_expresses(changes, needle):
    cfg = ModelConfig(n_head=4, **changes)
    with pytest.raises(InteropError) as info:
        interop.to_hf_config(cfg)
    assert needle in one_line(info)


@pytest.mark.parametrize("changes,needle", [
    (dict(model_type="bert"), "model_type='bert'"),
    (dict(activation_function="relu"), "activation_function='relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
])
def test_import_refuses_gpt2_variants_perfgpt_lacks(changes, needle):
    config = {**hf_gpt2().config.to_dict(), **changes}
    with pytest.raises(InteropError) as info:
        interop.from_hf_config(config)
    assert needle in one_line(info)


@pytest.mark.parametrize("changes,needle", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 8.0}), "'linear'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_import_refuses_llama_variants_perfgpt_lacks(changes, needle):
    config = {**hf_llama().config.to_dict(), **changes}
    with pytest.raises(InteropError) as info:
        interop.from_hf_config(config)
    assert needle in one_line(info)


def test_mismatched_and_missing_weights_are_named(tmp_path):
    hf_llama(kv_heads=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(InteropError) as info:
        interop.read_hf_dir(tmp_path)
    message = one_line(info)
    assert "'model.layers.0.self_attn.k_proj.weight' has shape (32, 64)" in message and "(64, 64)" in message

    config = hf_gpt2().config.to_dict()
    hf_state = hf_gpt2().state_dict()
    del hf_state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(InteropError) as info:
        interop.from_hf_state_dict(config, hf_state)
    assert "missing weight 'transformer.h.1.mlp.c_fc.bias'" in one_line(info)
    hf_state = {**hf_gpt2().state_dict(), "transformer.h.0.attn.extra": torch.zeros(1)}
    with pytest.raises(InteropError) as info:
        interop.from_hf_state_dict(config, hf_state)
    assert "unexpected weight 'transformer.h.0.attn.extra'" in one_line(info)
    cfg = ModelConfig(n_layer=1)
    state = GPT(cfg).state_dict()
    state["blocks.0.mlp.fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(InteropError) as info:
        interop.check_state_dict(cfg, state)
    assert "'blocks.0.mlp.fc.weight' has shape (3, 3), the model config implies (512, 128)" in one_line(info)


def test_unreadable_files_are_one_line_errors(tmp_path):
    with pytest.raises(InteropError) as info:
        interop.read_hf_dir(tmp_path)
    assert "no config.json" in one_line(info)
    hf_gpt2().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(InteropError) as info:
        interop.read_hf_dir(tmp_path)
    assert "model.safetensors cannot be read" in one_line(info)
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(InteropError) as info:
        interop.read_nanogpt_ckpt(tmp_path / "ckpt.pt")
    assert "cannot be read weights-only" in one_line(info)


def test_a_failed_export_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    import errno

    import safetensors.torch

    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=32, n_layer=1, n_head=4, d_model=32)
    model = GPT(cfg)
    interop.write_hf_dir(cfg, model.state_dict(), tmp_path / "out")
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(InteropError) as info:
        interop.write_hf_dir(cfg, GPT(cfg).state_dict(), tmp_path / "out")
    assert "No space left on device" in one_line(info) and str(tmp_path / "out") in one_line(info)
    for name, data in before.items():
        assert (tmp_path / "out" / name).read_bytes() == data


# --------------------------------------------------------------------------- model.gelu


def test_gelu_exact_matches_torch_erf_gelu_and_differs_from_tanh():
    cfg = ModelConfig(n_layer=1, gelu="exact")
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    mlp = model.blocks["0"].mlp
    x = torch.randn(2, 5, cfg.d_model)
    with torch.no_grad():
        expected = mlp.out(F.gelu(mlp.fc(x)))  # torch's default: the exact erf form
        assert torch.allclose(mlp(x), expected, atol=1e-6)
        mlp.gelu_approximate = "tanh"
        assert not torch.allclose(mlp(x), expected, atol=1e-6)


def test_gelu_exact_on_triton_kernels_matches_the_reference_ops():
    pytest.importorskip("triton", reason="needs the triton package")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops, reason = resolve_kernel_ops("triton", device)
    assert ops.backend == "triton", reason
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=1, n_head=2, d_model=32, gelu="exact")
    torch.manual_seed(0)
    reference_model = GPT(cfg, REFERENCE_OPS).to(device)
    kernel_model = GPT(cfg, ops).to(device)
    kernel_model.load_state_dict(reference_model.state_dict())
    idx = torch.randint(0, 64, (2, 16)).to(device)
    ref_loss, loss = reference_model(idx, idx), kernel_model(idx, idx)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel_model.blocks["0"].mlp.fc.bias.grad, reference_model.blocks["0"].mlp.fc.bias.grad,
                               rtol=1e-4, atol=1e-6)
    assert not ops.bias_gelu.logged_reasons, ops.bias_gelu.logged_reasons


def test_gelu_exact_with_te_layers_is_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        ModelConfig(layers="te", gelu="exact").validate()
    assert "model.gelu=exact" in one_line(info)
    ModelConfig(layers="te", gelu="exact", mlp="swiglu").validate()  # the key does not apply to SwiGLU


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_generation_equals_transformers(family, attention):
    assert_greedy_like_transformers(hf_gpt2(seed=3) if family == "gpt2" else hf_llama(kv_heads=2, seed=3), attention)


def assert_greedy_like_transformers(hf_model, attention: str, new_tokens: int = 32, tmp_path=None) -> None:
    """Our greedy continuations of two prompts of different lengths, with and without the KV cache,
    are transformers' ``generate``'s. With ``tmp_path`` the model is read from the files it saves
    there (the Hub's layout, where its in-memory one stacks the experts)."""
    if tmp_path is None:
        cfg, state = interop.from_hf_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    else:
        hf_model.save_pretrained(tmp_path / "hf")
        cfg, state = interop.read_hf_dir(tmp_path / "hf")
    ours = perfgpt_from(cfg, state, attention)
    prompts = [tokens(seed=5, batch=1, length=9)[0].tolist(), tokens(seed=6, batch=1, length=4)[0].tolist()]
    expected = []
    for prompt in prompts:
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected.append(out[0, len(prompt):].tolist())
    assert all(len(row) == new_tokens for row in expected)
    assert generate(ours, prompts, new_tokens, use_cache=True) == expected
    assert generate(ours, prompts, new_tokens, use_cache=False) == expected


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_prompts_of_unequal_length_are_encoded_in_one_pass_and_decode_as_alone(position, monkeypatch):
    """Padded on the left, a batch of unequal prompts costs one forward for all the prompts, then
    one per new token (not one per prompt token beyond the shortest prompt), and each row decodes
    what it decodes alone."""
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=2, n_head=4, position=position)
    torch.manual_seed(2)
    model = GPT(cfg)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [8], [1, 2, 3, 4]]
    alone = [generate(model, [p], 6)[0] for p in prompts]
    calls = []
    monkeypatch.setattr(GPT, "forward", lambda self, *a, _f=GPT.forward, **k: calls.append(a[0].shape) or _f(self, *a, **k))
    assert generate(model, prompts, 6) == alone
    assert calls == [(3, 9)] + [(3, 1)] * 5
    calls.clear()
    assert generate(model, prompts, 6, use_cache=False) == alone


def test_cache_holds_only_the_kv_heads_and_stops_at_end_of_text(monkeypatch):
    from model import generate as generate_module

    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=1, position="rope",
                      norm="rmsnorm", mlp="swiglu", bias=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    caches = []
    real = generate_module.KVCache
    monkeypatch.setattr(generate_module, "KVCache", lambda *a, **k: caches.append(real(*a, **k)) or caches[-1])
    free = generate(model, [[1, 2, 3]], 20)[0]
    assert [k.shape for k in caches[0].keys] == [(1, 23, 1, cfg.head_dim)] * 2  # per layer (batch, positions, kv heads, head dim)
    eos = free[5]
    stopped = generate(model, [[1, 2, 3]], 20, eos_id=eos)[0]
    assert stopped == free[: free.index(eos) + 1]


def test_stop_when_ends_only_the_rows_it_says_and_keeps_their_prefix():
    """A row stops right after the token that makes ``stop_when`` true; the others run on, unchanged."""
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=2, n_head=4)
    torch.manual_seed(1)
    model = GPT(cfg)
    prompts = [[1, 2, 3], [4, 5], [6]]
    free = generate(model, prompts, 16)
    seen = []

    def stop_at_sixth_token_of_row_1(tokens: list[int]) -> bool:
        seen.append(tokens)
        return tokens == free[1][:6]

    stopped = generate(model, prompts, 16, stop_when=stop_at_sixth_token_of_row_1)
    assert stopped == [free[0], free[1][:6], free[2]]
    assert free[1][:1] in seen and free[1][:7] not in seen  # asked after each new token, never after the stop


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=1, n_head=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    prompts = [[5, 6, 7], [8]]
    a = generate(model, prompts, 12, Sampling(temperature=1.3, top_p=0.9, seed=7))
    assert a == generate(model, prompts, 12, Sampling(temperature=1.3, top_p=0.9, seed=7), use_cache=False)
    assert a != generate(model, prompts, 12, Sampling(temperature=1.3, top_p=0.9, seed=8))
    greedy = generate(model, prompts, 12)
    assert generate(model, prompts, 12, Sampling(temperature=2.0, top_k=1, seed=1)) == greedy
    assert generate(model, prompts, 12, Sampling(temperature=2.0, top_p=1e-6, seed=1)) == greedy


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k = {next_token(logits, Sampling(top_k=2), torch.Generator().manual_seed(s)).item() for s in range(200)}
    assert seen_k == {0, 1}
    # top_p=0.8: 0.5 + 0.3 reaches it, so tokens 0 and 1 stay and 2, 3 go
    seen_p = {next_token(logits, Sampling(top_p=0.8), torch.Generator().manual_seed(s)).item() for s in range(200)}
    assert seen_p == {0, 1}


def test_generation_refuses_bad_arguments_in_one_line():
    model = GPT(ModelConfig(vocab_size=VOCAB, max_seq_len=16, n_layer=1))
    for kwargs, needle in ((dict(max_new_tokens=20), "model.max_seq_len=16"),
                           (dict(sampling=Sampling(top_p=0.0)), "top_p"),
                           (dict(sampling=Sampling(temperature=-1.0)), "temperature")):
        with pytest.raises(ConfigError) as info:
            generate(model, [[1, 2]], **{"max_new_tokens": 4, **kwargs})
        assert needle in one_line(info)
