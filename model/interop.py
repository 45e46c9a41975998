"""Weights in and out: perfgpt <-> Hugging Face layouts (GPT-2, Llama, Mistral, Qwen2, Mixtral,
Qwen3-MoE, gpt-oss, DeepSeek-V3), and nanoGPT checkpoints.

Pure functions on a ``ModelConfig`` and a state dict (name -> tensor), plus reading and writing
a Hugging Face model directory (``config.json`` and ``model.safetensors`` or
``pytorch_model.bin``, sharded or not) and a nanoGPT ``ckpt.pt``. Nothing here needs
``transformers``; the layouts below are what its ``*ForCausalLM`` classes read and write.

Which layout a perfgpt model exports to follows from its shape:
- GPT-2: learned positions, LayerNorm, GELU MLP (``model.gelu`` tanh = ``gelu_new``, exact =
  ``gelu``), multi-head attention. GPT-2's linear layers are ``Conv1D``, weights stored (in, out),
  so they are transposed. GPT-2 always has biases: a bias-free model is written with zero biases.
- Llama: rotary positions, RMSNorm, SwiGLU; ``num_key_value_heads`` = ``model.n_kv_head``. Our
  fused qkv projection is split into q/k/v_proj and joined back; ``mlp.gate`` is gate_proj and
  ``mlp.fc`` up_proj. ``attention_bias`` is ``model.qkv_bias`` and ``proj_bias`` together,
  ``mlp_bias`` ``model.bias``; ``rope_scaling`` carries ``model.rope_scaling`` (llama3 or yarn)
  in every rotary layout. Mistral is Llama's names with a sliding window in every layer and no
  biases; Qwen2 adds a bias on the Q/K/V projections only and windows the layers from
  ``max_window_layers`` on (or those its ``layer_types`` name). A windowless bias-free Mistral is
  written back as Llama, the same function.
Our fused qkv stores its rows grouped by key/value head (``model.gpt.group_qkv``); every exchange
goes through the plain [all q | all k | all v] order first (``_canonical`` / ``_stored``).
  Rotary embeddings use the same convention on both sides (the two halves of a head are the
  real and imaginary parts, HF's ``rotate_half``; ``kernels.reference.apply_rope``), so q/k
  weights are copied without a permutation. Llama has no residual dropout; ``attention_dropout``
  carries ``model.dropout``.
- Mixtral and Qwen3-MoE (a model with ``model.moe.experts``): Llama's attention and norms, a
  softmax router (``gate``) and per-expert SwiGLU weights, written per expert as on the Hub
  (Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen3-MoE ``mlp.experts.{e}.gate/up/down_proj``)
  and stacked into ``w_gate``/``w_up`` (E, d, f) and ``w_down`` (E, f, d), transposed. Qwen3-MoE
  adds per-head query/key norms (``model.qk_norm``), a head width of its own, optional weight
  renormalisation (``norm_topk_prob``) and dense layers (``mlp_only_layers`` as a prefix,
  ``decoder_sparse_step``). Both run dropless: a ``model.moe.capacity`` only applies in perfgpt;
  both may window every layer.
- gpt-oss (a model with attention sinks, expert biases or a clamped SwiGLU): attention biases,
  ``self_attn.sinks``, windows on the layers ``layer_types`` names, a router with a bias
  (``mlp.router``; top-k of the logits then a softmax over the k, which is the softmax
  renormalised over its top-k), and experts stacked as ours, (E, in, out), with gate and up in
  one ``gate_up_proj`` whose columns alternate (gate even, up odd), biases beside them.
- DeepSeek-V3 (a model with ``model.attention_kind=mla``): latent attention under ``self_attn.q_a_proj``,
  ``q_a_layernorm``, ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
  ``kv_b_proj``; a sigmoid router ``mlp.gate`` with its ``e_score_correction_bias`` (our
  ``expert_bias``), experts per expert as Qwen3-MoE's, ``mlp.shared_experts``. Its rotary pairs
  are adjacent dims when ``rope_interleave`` (the default): the rotary rows are reordered on
  import and written in halves with ``rope_interleave: false``. Multi-token-prediction modules
  (``model.mtp_depth``, ``num_nextn_predict_layers``) in DeepSeek's published layout: module k is
  the layer ``model.layers.{n_layer + k}``, its block under the usual names, beside it ``enorm``
  (our ``norm_e``), ``hnorm`` (``norm_h``), ``eh_proj`` (``proj``, whose input halves are the
  other way round: DeepSeek projects [embedding; hidden], perfgpt [hidden; embedding]),
  ``shared_head.norm`` (``norm_out``), and copies of the shared tables, ``embed_tokens`` and
  ``shared_head.head``, which must equal the model's on import. A checkpoint without those layers
  (transformers' ``save_pretrained`` writes none, whatever ``num_nextn_predict_layers`` says)
  imports with ``mtp_depth=0``. No other layout has the modules: exporting them there is refused.
Anything else (e.g. learned positions with SwiGLU, GQA in the GPT-2 layout, a window on some
layers of a model without Q/K/V bias, shared experts, a sigmoid router) is refused with one line
naming the key.

nanoGPT (karpathy/nanoGPT ``ckpt.pt``): ``model_args`` (n_layer, n_head, n_embd, block_size,
bias, vocab_size, dropout) and a state dict under GPT-2's names but with ``nn.Linear`` weights
(no transpose), an optional ``_orig_mod.`` prefix (torch.compile), exact GELU, LayerNorm eps 1e-5,
tied head, and all biases on or off together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from common.errors import InteropError
from common.files import kind_problem, name_problem, read_json, short_repr
from model.config import ModelConfig, MoEConfig, RopeScaling
from model.flops import count_parameters
from model.gpt import GPT, group_qkv, split_qkv

State = dict[str, torch.Tensor]

GPT2, LLAMA, MISTRAL, QWEN2 = "gpt2", "llama", "mistral", "qwen2"
MIXTRAL, QWEN3_MOE, GPT_OSS, DEEPSEEK_V3 = "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"
MOE_LAYOUTS = (MIXTRAL, QWEN3_MOE, GPT_OSS, DEEPSEEK_V3)
ROTARY_LAYOUTS = (LLAMA, MISTRAL, QWEN2, *MOE_LAYOUTS)  # Llama's names for attention, norms and embeddings
HF_ARCHITECTURES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM", MISTRAL: "MistralForCausalLM",
                    QWEN2: "Qwen2ForCausalLM", MIXTRAL: "MixtralForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM",
                    GPT_OSS: "GptOssForCausalLM", DEEPSEEK_V3: "DeepseekV3ForCausalLM"}
# What the Mixtral and Qwen3-MoE layouts require of a perfgpt MoE model.
MOE_NEEDS = (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("bias", False),
             ("moe.router", "softmax"), ("moe.routed_scale", 1.0), ("moe.shared_experts", 0),
             ("moe.bias_update_rate", 0.0))
# What gpt-oss requires besides its own parts (sinks, expert and router biases, clamped SwiGLU).
GPT_OSS_NEEDS = (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("bias", False), ("qk_norm", False),
                 ("attention_sinks", True), ("moe.bias", True), ("moe.router", "softmax"), ("moe.renormalize", True),
                 ("moe.routed_scale", 1.0), ("moe.shared_experts", 0), ("moe.bias_update_rate", 0.0),
                 ("moe.every", 1), ("moe.first_dense", 0))
# What DeepSeek-V3 requires besides latent attention (model.attention_kind=mla).
DEEPSEEK_NEEDS = (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("bias", False), ("moe.bias", False),
                  ("moe.router", "sigmoid"), ("moe.score_bias", True), ("moe.every", 1), ("attention_sinks", False),
                  ("swiglu_limit", None))
# What each dense layout family requires of a perfgpt model: (config key, required value).
LAYOUT_NEEDS = {
    GPT2: (("position", "learned"), ("norm", "layernorm"), ("mlp", "gelu")),
    LLAMA: (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu")),
}
HF_GELU = {"tanh": "gelu_new", "exact": "gelu"}
HF_GELU_IMPORT = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
# Buffers that HF GPT-2 (older versions), nanoGPT (without flash attention) and older HF Llama
# save next to the weights: causal masks and rotary frequencies, rebuilt by every model.
DERIVED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# --------------------------------------------------------------------------- choosing the layout


def hf_layout(cfg: ModelConfig) -> str:
    """The Hugging Face layout that expresses this model (``gpt2``, ``llama``, ``mistral``, ``qwen2``,
    ``mixtral``, ``qwen3_moe`` or ``gpt_oss``), or InteropError naming the key none of them has."""
    if cfg.layers != "torch":
        raise InteropError(
            f"model.layers={cfg.layers}: export from a model.layers=torch build (TE names its weights differently)"
        )
    refuse_mup(cfg, "the Hugging Face layouts")
    if cfg.mtp_depth and not cfg.is_mla:
        raise InteropError(f"model.mtp_depth={cfg.mtp_depth}: of the Hugging Face layouts only DeepSeek-V3 (model."
                           "attention_kind=mla) has multi-token-prediction modules; export perfgpt's own format "
                           "(--format safetensors)")
    if cfg.is_mla:
        return _deepseek_layout(cfg)
    if cfg.moe.experts is not None:
        return _moe_layout(cfg)
    for key, on, who in (("qk_norm", cfg.qk_norm, "Qwen3-MoE"), ("attention_sinks", cfg.attention_sinks, "gpt-oss"),
                         ("swiglu_limit", cfg.swiglu_limit is not None, "gpt-oss")):
        if on:
            raise InteropError(f"model.{key}={cfg.value_of(key)}: of the Hugging Face layouts perfgpt writes, only "
                               f"{who} has it, a mixture of experts (it needs model.moe.experts)")
    misses = {layout: [k for k, v in needs if getattr(cfg, k) != v] for layout, needs in LAYOUT_NEEDS.items()}
    layout = min(misses, key=lambda name: len(misses[name]))
    if misses[layout]:
        wanted = ", ".join(f"model.{k}={v}" for k, v in LAYOUT_NEEDS[layout])
        found = ", ".join(f"model.{k}={getattr(cfg, k)}" for k in misses[layout])
        raise InteropError(
            f"{found}: no Hugging Face layout expresses this model (the nearest, {layout}, needs {wanted}; "
            f"the other needs {', '.join(f'model.{k}={v}' for k, v in LAYOUT_NEEDS[_other(layout)])})"
        )
    if layout == GPT2 and cfg.kv_heads != cfg.n_head:
        raise InteropError(
            f"model.n_kv_head={cfg.n_kv_head}: the GPT-2 layout has no grouped-query attention "
            "(export needs n_kv_head unset or equal to model.n_head)"
        )
    if layout == GPT2 and cfg.sliding_window is not None:
        raise InteropError(f"model.sliding_window={cfg.sliding_window}: GPT-2 attends to the whole context")
    return layout if layout == GPT2 else _rotary_dense_layout(cfg)


def refuse_mup(cfg: ModelConfig, target: str) -> None:
    """µP multiplies the logits by base/width and scales attention by 1/d_head (model/mup.py): weights
    written without those factors would compute another function."""
    if cfg.mup:
        raise InteropError(f"model.mup=true: {target} cannot express µP's output multiplier and 1/d_head attention "
                           "scale, so the exported weights would compute another function; export with --format "
                           "safetensors (perfgpt's own, which keeps the model config)")


def _other(layout: str) -> str:
    return LLAMA if layout == GPT2 else GPT2


def _rotary_dense_layout(cfg: ModelConfig) -> str:
    """Llama, Mistral or Qwen2: which biases and windows the model has decides."""
    biases = (cfg.has_qkv_bias, cfg.has_proj_bias, cfg.bias)
    if biases == (True, False, False):
        return QWEN2  # Q/K/V bias only; any layers windowed
    if cfg.sliding_window is not None:
        if any(biases):
            raise InteropError(f"model.sliding_window={cfg.sliding_window} with biases (model.bias={cfg.bias}, "
                               f"qkv_bias={cfg.has_qkv_bias}, proj_bias={cfg.has_proj_bias}): Mistral has none, "
                               "Qwen2 only the query/key/value one (model.bias=false, model.qkv_bias=true)")
        if not _windows_every_layer(cfg):
            raise InteropError(f"model.sliding_window_every={cfg.sliding_window_every}, sliding_window_first="
                               f"{cfg.sliding_window_first}: Mistral windows every layer; a window in some layers is "
                               "Qwen2's (model.qkv_bias=true, model.bias=false) or gpt-oss's (a mixture of experts)")
        return MISTRAL
    if cfg.has_qkv_bias != cfg.has_proj_bias:
        raise InteropError(f"model.qkv_bias={cfg.has_qkv_bias} with proj_bias={cfg.has_proj_bias}: Llama's "
                           "attention_bias is both or neither; Qwen2's Q/K/V bias alone needs model.bias=false")
    return LLAMA


def _windows_every_layer(cfg: ModelConfig) -> bool:
    return cfg.sliding_window is None or (cfg.sliding_window_every == 1 and cfg.sliding_window_first == 0)


def _moe_layout(cfg: ModelConfig) -> str:
    if cfg.attention_sinks or cfg.moe.bias or cfg.swiglu_limit is not None:
        return _gpt_oss_layout(cfg)
    for key, value in MOE_NEEDS:
        if cfg.value_of(key) != value:
            why = {"moe.bias_update_rate": " (the aux-loss-free routing bias has no place in them)",
                   "moe.shared_experts": " (they have no shared experts)"}.get(key, "")
            raise InteropError(f"model.{key}={cfg.value_of(key)}: the Mixtral and Qwen3-MoE layouts need "
                               f"model.{key}={value}{why}")
    if cfg.has_qkv_bias or cfg.has_proj_bias:
        key = "qkv_bias" if cfg.has_qkv_bias else "proj_bias"
        raise InteropError(f"model.{key}=true: the Mixtral and Qwen3-MoE layouts have no attention biases "
                           "(gpt-oss has them, with its sinks and expert biases)")
    if not _windows_every_layer(cfg):
        raise InteropError(f"model.sliding_window_every={cfg.sliding_window_every}, sliding_window_first="
                           f"{cfg.sliding_window_first}: Mixtral and Qwen3-MoE window every layer or none (gpt-oss "
                           "windows some)")
    if cfg.qk_norm:
        return QWEN3_MOE
    for key, value in (("renormalize", True), ("every", 1), ("first_dense", 0)):
        if getattr(cfg.moe, key) != value:
            raise InteropError(f"model.moe.{key}={getattr(cfg.moe, key)} with model.qk_norm=false: Mixtral needs "
                               f"model.moe.{key}={value}, Qwen3-MoE (which has it) needs model.qk_norm=true")
    return MIXTRAL


def _deepseek_layout(cfg: ModelConfig) -> str:
    if cfg.moe.experts is None:
        raise InteropError("model.attention_kind=mla without model.moe.experts: DeepSeek-V3, the layout with latent "
                           "attention, routes experts (its dense layers are model.moe.first_dense)")
    for key, value in DEEPSEEK_NEEDS:
        if cfg.value_of(key) != value:
            raise InteropError(f"model.{key}={cfg.value_of(key)}: DeepSeek-V3 (the layout with latent attention) "
                               f"needs model.{key}={value}")
    if cfg.has_qkv_bias != cfg.has_proj_bias:
        raise InteropError(f"model.qkv_bias={cfg.has_qkv_bias} with proj_bias={cfg.has_proj_bias}: DeepSeek-V3's "
                           "attention_bias is both or neither")
    return DEEPSEEK_V3


def _gpt_oss_layout(cfg: ModelConfig) -> str:
    for key, value in GPT_OSS_NEEDS:
        if cfg.value_of(key) != value:
            raise InteropError(f"model.{key}={cfg.value_of(key)}: gpt-oss (the layout with attention sinks, expert "
                               f"biases and a clamped SwiGLU) needs model.{key}={value}")
    if cfg.swiglu_limit is None:
        raise InteropError("model.swiglu_limit=null: gpt-oss's experts clamp their SwiGLU (its published limit: 7.0)")
    if cfg.has_qkv_bias != cfg.has_proj_bias:
        raise InteropError(f"model.qkv_bias={cfg.has_qkv_bias} with proj_bias={cfg.has_proj_bias}: gpt-oss's "
                           "attention_bias is both or neither")
    return GPT_OSS


# --------------------------------------------------------------------------- name maps


def _gpt2_names(cfg: ModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(perfgpt name, GPT-2/nanoGPT name, is a linear weight) for every tensor."""
    yield "tok_emb.weight", "transformer.wte.weight", False
    yield "pos_emb.weight", "transformer.wpe.weight", False
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            yield f"{ours}{a}.weight", f"{theirs}{b}.weight", False
            yield f"{ours}{a}.bias", f"{theirs}{b}.bias", False
        for a, b in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.out", "mlp.c_proj")):
            yield f"{ours}{a}.weight", f"{theirs}{b}.weight", True
            yield f"{ours}{a}.bias", f"{theirs}{b}.bias", False
        yield f"{ours}mlp.fc.weight", f"{theirs}mlp.c_fc.weight", True
        yield f"{ours}mlp.fc.bias", f"{theirs}mlp.c_fc.bias", False
    yield "norm_f.weight", "transformer.ln_f.weight", False
    yield "norm_f.bias", "transformer.ln_f.bias", False
    if not cfg.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight", False


def _layers(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer index, our prefix, the HF prefix) of every transformer block: the model's, then its
    multi-token-prediction modules' (DeepSeek-V3 publishes them as the layers after the last)."""
    return [(i, f"blocks.{i}.", f"model.layers.{i}.") for i in range(cfg.n_layer)] + [
        (cfg.n_layer + k, f"mtp.{k}.block.", f"model.layers.{cfg.n_layer + k}.") for k in range(cfg.mtp_depth)]


def _mtp_names(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """(perfgpt name, HF name) of each multi-token-prediction module's tensors beside its block: its
    norms and projection, and the copies of the shared embedding and head DeepSeek stores with it."""
    for k in range(cfg.mtp_depth):
        ours, theirs = f"mtp.{k}.", f"model.layers.{cfg.n_layer + k}."
        for a, b in (("norm_e", "enorm"), ("norm_h", "hnorm"), ("proj", "eh_proj"), ("norm_out", "shared_head.norm")):
            yield f"{ours}{a}.weight", f"{theirs}{b}.weight"
        yield "tok_emb.weight", f"{theirs}embed_tokens.weight"
        yield "lm_head.weight", f"{theirs}shared_head.head.weight"


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """An MTP projection's input columns the other way round: [hidden; embedding] <-> [embedding; hidden]."""
    first, second = weight.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def _llama_names(cfg: ModelConfig) -> Iterator[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    """(perfgpt name, HF names, row sizes of the split) for every tensor of the rotary layouts but
    the experts' weights (``_expert_names``, ``_gpt_oss_expert_names``); one name = a copy."""
    d, kv, layout = cfg.q_dim, cfg.kv_dim, hf_layout(cfg)
    yield "tok_emb.weight", ("model.embed_tokens.weight",), ()
    for i, ours, theirs in _layers(cfg):
        yield f"{ours}norm1.weight", (f"{theirs}input_layernorm.weight",), ()
        yield f"{ours}norm2.weight", (f"{theirs}post_attention_layernorm.weight",), ()
        if cfg.is_mla:
            linears = list(_latent_attention_names(cfg))
        else:
            qkv = tuple(f"{theirs}self_attn.{p}_proj" for p in "qkv")
            for kind in ("weight", "bias") if cfg.has_qkv_bias else ("weight",):
                yield f"{ours}attn.qkv.{kind}", tuple(f"{n}.{kind}" for n in qkv), (d, kv, kv)
            linears = [("attn.proj", "self_attn.o_proj", cfg.has_proj_bias)]  # (ours, theirs, with a bias)
        if cfg.qk_norm:
            linears += [("attn.q_norm", "self_attn.q_norm", False), ("attn.k_norm", "self_attn.k_norm", False)]
        if cfg.attention_sinks:
            yield f"{ours}attn.sinks.weight", (f"{theirs}self_attn.sinks",), ()
        if cfg.is_moe_layer(i):
            router = {MIXTRAL: "block_sparse_moe.gate", GPT_OSS: "mlp.router"}.get(layout, "mlp.gate")
            linears += [("mlp.router", router, cfg.moe.bias)]
            if layout == DEEPSEEK_V3:
                yield f"{ours}mlp.expert_bias", (f"{theirs}mlp.gate.e_score_correction_bias",), ()
                if cfg.moe.shared_experts:
                    linears += [(f"mlp.shared.{a}", f"mlp.shared_experts.{b}_proj", False)
                                for a, b in (("gate", "gate"), ("fc", "up"), ("out", "down"))]
        else:
            linears += [(f"mlp.{a}", f"mlp.{b}_proj", cfg.bias) for a, b in (("gate", "gate"), ("fc", "up"),
                                                                               ("out", "down"))]
        for a, b, with_bias in linears:
            for kind in ("weight", "bias") if with_bias else ("weight",):
                yield f"{ours}{a}.{kind}", (f"{theirs}{b}.{kind}",), ()
    yield "norm_f.weight", ("model.norm.weight",), ()
    if not cfg.tie_embeddings:
        yield "lm_head.weight", ("lm_head.weight",), ()
    for ours, theirs in _mtp_names(cfg):
        yield ours, (theirs,), ()


def _latent_attention_names(cfg: ModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(ours, theirs under the layer, with a bias) of DeepSeek-V3's latent attention."""
    bias = cfg.has_qkv_bias
    if cfg.q_lora_rank is None:
        yield "attn.q_up", "self_attn.q_proj", False
    else:
        yield from (("attn.q_down", "self_attn.q_a_proj", bias), ("attn.q_norm", "self_attn.q_a_layernorm", False),
                    ("attn.q_up", "self_attn.q_b_proj", False))
    yield from (("attn.kv_down", "self_attn.kv_a_proj_with_mqa", bias),
                ("attn.kv_norm", "self_attn.kv_a_layernorm", False), ("attn.kv_up", "self_attn.kv_b_proj", False),
                ("attn.proj", "self_attn.o_proj", cfg.has_proj_bias))


def _rope_deinterleaved(cfg: ModelConfig, state: State) -> State:
    """DeepSeek's ``rope_interleave``: its rotary pairs are adjacent dims (0, 1), (2, 3), ..., ours the
    two halves. Reordering the rotary rows of the query and key projections (evens, then odds)
    turns the one into the other exactly (the rotated result is the same numbers in the same order)."""
    r = cfg.qk_rope_head_dim
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            heads = tensor.view(cfg.n_head, cfg.qk_nope_head_dim + r, -1)
            out[name] = torch.cat([heads[:, :cfg.qk_nope_head_dim], heads[:, cfg.qk_nope_head_dim:][:, order]],
                                  dim=1).reshape(tensor.shape)
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            out[name] = torch.cat([tensor[:cfg.kv_lora_rank], tensor[cfg.kv_lora_rank:][order]])
    return out


def _expert_names(cfg: ModelConfig) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(perfgpt stacked weight, the per-expert HF weights it holds, transposed) for every MoE layer
    of Mixtral and Qwen3-MoE."""
    layout = hf_layout(cfg)
    if layout == GPT_OSS:
        return
    mixtral = layout == MIXTRAL
    parts = (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")) if mixtral else (
        ("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    for i, block, layer in _layers(cfg):
        if cfg.is_moe_layer(i):
            theirs = f"{layer}{'block_sparse_moe' if mixtral else 'mlp'}.experts"
            for ours, name in parts:
                yield f"{block}mlp.{ours}", tuple(f"{theirs}.{e}.{name}.weight" for e in range(cfg.moe.experts))


def _gpt_oss_expert_names(cfg: ModelConfig) -> Iterator[tuple[tuple[str, str], str]]:
    """((perfgpt gate, perfgpt up) or (perfgpt down, ""), the gpt-oss tensor) for every MoE layer.
    gpt-oss stacks its experts as perfgpt does, (E, in, out), with gate and up in one tensor whose
    columns alternate: gate at the even ones, up at the odd ones."""
    if hf_layout(cfg) != GPT_OSS:
        return
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp.experts."
        yield (f"{ours}w_gate", f"{ours}w_up"), f"{theirs}gate_up_proj"
        yield (f"{ours}b_gate", f"{ours}b_up"), f"{theirs}gate_up_proj_bias"
        yield (f"{ours}w_down", ""), f"{theirs}down_proj"
        yield (f"{ours}b_down", ""), f"{theirs}down_proj_bias"


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(..., f) twice -> (..., 2f) with gate at the even columns and up at the odd ones."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- perfgpt -> HF


def to_hf_config(cfg: ModelConfig, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of the HF model; ``extra`` adds or overrides keys (e.g. eos_token_id).

    bos/eos token ids are written as null unless given: HF's defaults (50256 for GPT-2, 1 and 2
    for Llama) are ids of tokenizers this model may not use, and ``generate`` would stop on them.
    """
    layout = hf_layout(cfg)
    if layout == GPT2:
        config = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
            "activation_function": HF_GELU[cfg.gelu], "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        }
    else:
        config = {
            "architectures": [HF_ARCHITECTURES[layout]], "model_type": layout,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": _hf_rope_scaling(cfg), "attention_dropout": cfg.dropout,
        }
        if layout == LLAMA:
            config.update(attention_bias=cfg.has_qkv_bias, mlp_bias=cfg.bias, pretraining_tp=1)
        if layout == DEEPSEEK_V3:  # rotary rows in halves, as perfgpt keeps them (not interleaved)
            config.update(num_nextn_predict_layers=cfg.mtp_depth, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.rope_dim,
                          qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.rope_dim,
                          num_key_value_heads=cfg.n_head, rope_interleave=False, attention_bias=cfg.has_qkv_bias)
        config.update(_hf_window(cfg, layout))
        if layout in MOE_LAYOUTS:
            config.update(_moe_hf_config(cfg, layout))
    config.update({"tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
                   "bos_token_id": None, "eos_token_id": None})
    config.update(extra or {})
    return config


def _hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """``rope_scaling`` as transformers 4.x wrote it (5.x reads it into ``rope_parameters``)."""
    r = cfg.rope_scaling
    common = {"rope_type": r.type, "factor": r.factor, "original_max_position_embeddings": r.original_max_seq_len}
    if r.type == "llama3":
        return common | {"low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor}
    if r.type == "yarn":
        extra = {"attention_factor": r.attention_factor} if r.attention_factor is not None else {}
        extra |= {"mscale": r.mscale, "mscale_all_dim": r.mscale_all_dim} if r.mscale and r.mscale_all_dim else {}
        return common | {"beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "truncate": r.truncate} | extra
    return None


def _hf_window(cfg: ModelConfig, layout: str) -> dict[str, Any]:
    """The sliding-window keys of each layout (hf_layout has checked that it expresses the pattern)."""
    window = cfg.sliding_window
    if layout in (MISTRAL, MIXTRAL):
        return {"sliding_window": window}
    if layout == QWEN3_MOE:
        return {"use_sliding_window": window is not None, "sliding_window": window}
    types = ["sliding_attention" if cfg.window_of(i) else "full_attention" for i in range(cfg.n_layer)]
    if layout == QWEN2:
        return {"use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": cfg.sliding_window_first if window is not None else cfg.n_layer,
                "layer_types": types}
    if layout == GPT_OSS:
        return {"sliding_window": window, "layer_types": types}
    return {}


def _moe_hf_config(cfg: ModelConfig, layout: str) -> dict[str, Any]:
    common = {"num_experts_per_tok": cfg.moe.top_k, "router_aux_loss_coef": cfg.moe.aux_loss,
              "output_router_logits": False}
    if layout == MIXTRAL:
        return common | {"intermediate_size": cfg.expert_d_ff, "num_local_experts": cfg.moe.experts,
                         "router_jitter_noise": 0.0}
    if layout == DEEPSEEK_V3:
        return common | {"moe_intermediate_size": cfg.expert_d_ff, "n_routed_experts": cfg.moe.experts,
                         "n_shared_experts": cfg.moe.shared_experts, "n_group": cfg.moe.groups,
                         "topk_group": cfg.moe.groups_kept or cfg.moe.groups, "routed_scaling_factor": cfg.moe.routed_scale,
                         "norm_topk_prob": cfg.moe.renormalize, "first_k_dense_replace": cfg.moe.first_dense,
                         "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    if layout == GPT_OSS:
        return common | {"intermediate_size": cfg.expert_d_ff, "num_local_experts": cfg.moe.experts,
                         "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit,
                         "attention_bias": cfg.has_qkv_bias}
    return common | {"moe_intermediate_size": cfg.expert_d_ff, "num_experts": cfg.moe.experts,
                     "norm_topk_prob": cfg.moe.renormalize, "decoder_sparse_step": cfg.moe.every,
                     "mlp_only_layers": list(range(cfg.moe.first_dense))}


def to_hf_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> State:
    """perfgpt weights under HF names; new tensors throughout (safetensors refuses shared storage)."""
    state = _canonical(cfg, state)
    if hf_layout(cfg) == GPT2:
        return _to_gpt2_names(cfg, state, transpose=True)
    out: State = {}
    for ours, theirs, rows in _llama_names(cfg):
        tensor = _get(state, ours)
        parts = tensor.split(rows) if rows else (tensor,)
        out.update({name: part.detach().clone() for name, part in zip(theirs, parts)})
    for ours, theirs in _expert_names(cfg):
        stacked = _get(state, ours)
        out.update({name: w.detach().t().contiguous() for name, w in zip(theirs, stacked)})
    for (first, second), theirs in _gpt_oss_expert_names(cfg):
        tensor = _get(state, first).detach()
        out[theirs] = _interleave(tensor, _get(state, second).detach()) if second else tensor.clone()
    for ours, theirs in _mtp_names(cfg):
        if ours.endswith(".proj.weight"):
            out[theirs] = _swap_halves(out[theirs])
    return out


def _to_gpt2_names(cfg: ModelConfig, state: Mapping[str, torch.Tensor], transpose: bool) -> State:
    out: State = {}
    for ours, theirs, linear in _gpt2_names(cfg):
        if ours in state:
            tensor = state[ours].detach()
            out[theirs] = tensor.t().contiguous() if linear and transpose else tensor.clone()
        elif ours.endswith("bias"):
            # A bias-free perfgpt model in a layout that always has biases: zero biases are exact.
            out[theirs] = torch.zeros(_bias_size(cfg, ours), dtype=state["tok_emb.weight"].dtype)
        else:
            raise InteropError(f"the state dict has no {ours!r}; is it a perfgpt model of this config?")
    return out


def _bias_size(cfg: ModelConfig, name: str) -> int:
    if name.endswith("attn.qkv.bias"):
        return cfg.q_dim + 2 * cfg.kv_dim
    return cfg.d_ff if name.endswith("fc.bias") else cfg.d_model


def _qkv_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [name for name in state if name.endswith(("attn.qkv.weight", "attn.qkv.bias"))]


def _canonical(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> State:
    """Our fused qkv rows in the plain [all q | all k | all v] order that GPT-2's c_attn uses."""
    out = dict(state)
    for name in _qkv_names(state):
        out[name] = torch.cat(split_qkv(state[name], cfg.n_head, cfg.kv_heads))
    return out


def _stored(cfg: ModelConfig, state: State) -> State:
    """The inverse of ``_canonical``: qkv rows grouped by key/value head, as the model stores them."""
    for name in _qkv_names(state):
        q, k, v = state[name].split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim))
        state[name] = group_qkv(q, k, v, cfg.kv_heads)
    return state


# --------------------------------------------------------------------------- HF -> perfgpt


# The config.json fields the readers take numbers and switches from, with their JSON types: a
# value of another type is named in one line rather than failing somewhere inside the reader.
HF_INT_FIELDS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "n_inner", "max_position_embeddings",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                 "intermediate_size", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "decoder_sparse_step", "sliding_window", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_group", "topk_group", "first_k_dense_replace")
HF_ZERO_MEANS_DEFAULT = ("n_inner", "num_key_value_heads")  # 0 (or null): 4 x n_embd, num_attention_heads
HF_FLOAT_FIELDS = ("layer_norm_epsilon", "rms_norm_eps", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                   "attention_dropout", "initializer_range", "rope_theta", "router_aux_loss_coef", "swiglu_alpha",
                   "swiglu_limit", "routed_scaling_factor")
HF_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window",
                  "rope_interleave")
HF_STR_FIELDS = ("model_type", "activation_function", "hidden_act")
HF_OBJECT_FIELDS = ("rope_scaling", "rope_parameters")
HF_TOKEN_FIELDS = ("eos_token_id", "bos_token_id")  # an id or a list of ids
# Far above any real width, depth, vocabulary or context, and low enough that no product of a few
# of them overflows a tensor's size.
MAX_SIZE = 2**31 - 1
# The most parameters a config may describe (2.8e14): beyond any model, and far below where a
# tensor's byte count overflows int64 (a damaged n_embd of 1e30 would overflow inside torch).
MAX_PARAMETERS = 2**48


def check_hf_config_types(config: Any) -> None:
    """InteropError naming the first field whose JSON type or range the readers cannot use."""
    if not isinstance(config, Mapping):
        raise InteropError(f"config.json holds a JSON {type(config).__name__}, not a JSON object of model settings")
    for key in HF_INT_FIELDS:
        if config.get(key) is not None:
            check_size(f"config.json {key}", config[key], low=0 if key in HF_ZERO_MEANS_DEFAULT else 1)
    for keys, ok, what in ((HF_FLOAT_FIELDS, _is_finite_number, "a finite number"),
                           (HF_BOOL_FIELDS, lambda v: isinstance(v, bool), "true or false"),
                           (HF_STR_FIELDS, lambda v: isinstance(v, str), "a string"),
                           (HF_OBJECT_FIELDS, lambda v: isinstance(v, Mapping), "an object (or null)"),
                           (HF_TOKEN_FIELDS, _is_token_ids, "a token id or a list of them"),
                           (("mlp_only_layers",), lambda v: isinstance(v, list) and all(_is_index(i) for i in v),
                            "a list of layer indices"),
                           (("layer_types",), lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
                            "a list of layer type names"),
                           (("max_window_layers",), _is_index, "a layer index")):
        for key in keys:
            value = config.get(key)
            if value is not None and not ok(value):
                raise InteropError(f"config.json {key}={short_repr(value)} must be {what}")


def check_size(what: str, value: Any, low: int = 1) -> int:
    """``value`` if it is an integer from ``low`` to MAX_SIZE, else InteropError naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InteropError(f"{what}={short_repr(value)} must be an integer")
    if not low <= value <= MAX_SIZE:
        raise InteropError(f"{what}={short_repr(value)} must be between {low} and {MAX_SIZE}")
    return value


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SIZE


def _is_token_ids(value: Any) -> bool:
    return _is_index(value) or isinstance(value, list) and all(_is_index(v) for v in value)


def from_hf_config(config: Mapping[str, Any]) -> ModelConfig:
    """A perfgpt ModelConfig for an HF ``config.json`` of one of HF_ARCHITECTURES' layouts;
    InteropError for what it cannot express."""
    check_hf_config_types(config)
    model_type = config.get("model_type")
    quantized = config.get("quantization_config")
    if quantized is not None:  # e.g. gpt-oss as OpenAI publishes it: MXFP4 expert blocks and scales
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
        raise InteropError(f"config.json quantization_config quant_method={short_repr(method)}: perfgpt reads "
                           "unquantized weights; load the model with transformers, dequantized, and save_pretrained "
                           "it again")
    if model_type == GPT2:
        cfg = _from_gpt2_config(config)
    elif model_type in (LLAMA, MISTRAL, QWEN2):
        cfg = _from_rotary_config(config, model_type)
    elif model_type == DEEPSEEK_V3:
        cfg = _from_deepseek_config(config)
    elif model_type in MOE_LAYOUTS:
        cfg = _from_moe_config(config, model_type)
    else:
        raise InteropError(f"config.json model_type={model_type!r}: perfgpt reads the {', '.join(HF_ARCHITECTURES)} "
                           "layouts only")
    cfg.validate()
    return cfg


def _from_gpt2_config(c: Mapping[str, Any]) -> ModelConfig:
    activation = c.get("activation_function", "gelu_new")
    if activation not in HF_GELU_IMPORT:
        raise InteropError(f"config.json activation_function={activation!r}: perfgpt has {sorted(HF_GELU_IMPORT)}")
    _refuse_if(c, "scale_attn_by_inverse_layer_idx", True, "perfgpt scales attention scores by 1/sqrt(head_dim) only")
    _refuse_if(c, "scale_attn_weights", False, "perfgpt always scales attention scores by 1/sqrt(head_dim)")
    _refuse_if(c, "add_cross_attention", True, "perfgpt is decoder-only")
    d = c.get("n_embd", 768)
    dropout = max(c.get("resid_pdrop", 0.0), c.get("embd_pdrop", 0.0), c.get("attn_pdrop", 0.0))  # perfgpt has one rate
    return ModelConfig(
        vocab_size=c.get("vocab_size", 50257), max_seq_len=c.get("n_positions", 1024), n_layer=c.get("n_layer", 12),
        n_head=c.get("n_head", 12), d_model=d, d_ff=c.get("n_inner") or 4 * d, norm="layernorm",
        norm_eps=c.get("layer_norm_epsilon", 1e-5), mlp="gelu", gelu=HF_GELU_IMPORT[activation], position="learned",
        tie_embeddings=c.get("tie_word_embeddings", True), bias=True, dropout=dropout,
        init_std=c.get("initializer_range", 0.02),
    )


def _from_rotary_config(c: Mapping[str, Any], layout: str) -> ModelConfig:
    """Llama, Mistral and Qwen2, and the attention, norms and embeddings of the MoE layouts."""
    if c.get("hidden_act", "silu") != "silu":
        raise InteropError(f"config.json hidden_act={c.get('hidden_act')!r}: perfgpt's SwiGLU uses silu")
    theta, scaling = _rope_from_hf(c, 150000.0 if layout == GPT_OSS else 10000.0)
    d, heads = c.get("hidden_size", 4096), c.get("num_attention_heads", 32)
    head_dim = c.get("head_dim")
    kv_heads = c.get("num_key_value_heads") or heads
    return ModelConfig(
        attention_head_dim=None if head_dim in (None, d // heads) else head_dim,
        vocab_size=c.get("vocab_size", 32000), max_seq_len=c.get("max_position_embeddings", 2048),
        n_layer=c.get("num_hidden_layers", 32), n_head=heads, n_kv_head=None if kv_heads == heads else kv_heads,
        d_model=d, d_ff=c.get("intermediate_size", 11008), norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-6),
        mlp="swiglu", position="rope", rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=c.get("tie_word_embeddings", False), **_biases_from_hf(c, layout), **_window_from_hf(c, layout),
        dropout=c.get("attention_dropout", 0.0) or 0.0, init_std=c.get("initializer_range", 0.02),
    )


def _biases_from_hf(c: Mapping[str, Any], layout: str) -> dict[str, Any]:
    """model.bias (the MLP's), qkv_bias and proj_bias of each layout."""
    if layout == QWEN2:
        return {"bias": False, "qkv_bias": True}  # Qwen2's Q/K/V projections always have one, nothing else
    if layout in (MISTRAL, MIXTRAL):
        return {"bias": False}
    attention = bool(c.get("attention_bias", layout == GPT_OSS))
    mlp = bool(c.get("mlp_bias", False)) if layout == LLAMA else False
    return {"bias": mlp} | ({} if attention == mlp else {"qkv_bias": attention, "proj_bias": attention})


HF_ROPE_TYPES = ("default", "llama3", "yarn")


def _rope_from_hf(c: Mapping[str, Any], default_theta: float) -> tuple[float, RopeScaling]:
    """(rope_theta, model.rope_scaling) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` and
    ``rope_theta`` (4.x)."""
    for key in HF_OBJECT_FIELDS:  # both, where an older writer left rope_scaling beside rope_parameters
        rope_type = (c.get(key) or {}).get("rope_type", (c.get(key) or {}).get("type", "default"))
        if rope_type not in HF_ROPE_TYPES:
            raise InteropError(f"config.json rope type {short_repr(rope_type)}: perfgpt has the rotary scalings "
                               f"{', '.join(HF_ROPE_TYPES)} (model.rope_scaling.type)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    numbers = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
               "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor")
    for key in numbers:
        if rope.get(key) is not None and not _is_finite_number(rope[key]):
            raise InteropError(f"config.json rope {key}={short_repr(rope[key])} must be a finite number")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise InteropError(f"config.json partial_rotary_factor={rope['partial_rotary_factor']}: perfgpt rotates the "
                           "whole head")
    theta = float(rope.get("rope_theta", c.get("rope_theta", default_theta)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, RopeScaling()
    original = rope.get("original_max_position_embeddings", c.get("max_position_embeddings", 2048))
    check_size("config.json rope original_max_position_embeddings", original)
    factor = rope.get("factor") or c.get("max_position_embeddings", original) / original
    common = {"type": rope_type, "factor": float(factor), "original_max_seq_len": original}
    if rope_type == "llama3":
        return theta, RopeScaling(**common, low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                                  high_freq_factor=float(rope.get("high_freq_factor", 4.0)))
    attention = rope.get("attention_factor")
    return theta, RopeScaling(**common, beta_fast=float(rope.get("beta_fast") or 32.0),
                              beta_slow=float(rope.get("beta_slow") or 1.0), truncate=bool(rope.get("truncate", True)),
                              attention_factor=None if attention is None else float(attention),
                              mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))


def _window_from_hf(c: Mapping[str, Any], layout: str) -> dict[str, Any]:
    """model.sliding_window and the layers that have it, from each layout's keys."""
    window = c.get("sliding_window")
    if layout in (QWEN2, QWEN3_MOE) and not c.get("use_sliding_window", False):
        window = None  # their configs carry a window that only use_sliding_window switches on
    if window is None or layout == LLAMA:
        return {}
    n = c.get("num_hidden_layers", 32)
    types = c.get("layer_types")
    if types is not None:
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise InteropError(f"config.json layer_types={short_repr(types)}: perfgpt has sliding_attention and "
                               f"full_attention layers, one type per layer ({n})")
        windowed = [t == "sliding_attention" for t in types]
    elif layout == QWEN2:
        windowed = [i >= c.get("max_window_layers", n) for i in range(n)]
    elif layout == GPT_OSS:
        windowed = [i % 2 == 0 for i in range(n)]  # GptOssConfig's default: the even layers
    else:
        windowed = [True] * n  # Mistral, Mixtral, Qwen3-MoE: every layer
    at = [i for i, w in enumerate(windowed) if w]
    if not at:
        return {}
    keys = {"sliding_window": window, "sliding_window_first": at[0],
            "sliding_window_every": at[1] - at[0] if len(at) > 1 else n}
    if [i in at for i in range(n)] != [i >= at[0] and (i - at[0]) % keys["sliding_window_every"] == 0
                                       for i in range(n)]:
        raise InteropError(f"config.json layer_types={short_repr(types)}: perfgpt windows every k-th layer from a "
                           "first one (model.sliding_window_every, model.sliding_window_first)")
    return keys


def _from_moe_config(c: Mapping[str, Any], layout: str) -> ModelConfig:
    """Mixtral / Qwen3-MoE / gpt-oss: Llama's attention and norms, plus the router and the experts."""
    if layout != GPT_OSS and c.get("attention_bias", False):
        raise InteropError(f"config.json attention_bias=true: perfgpt reads {layout} without attention biases "
                           "(gpt-oss has them)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "topk_group"):
        if c.get(key):
            raise InteropError(f"config.json {key}={c[key]!r}: perfgpt's MoE layouts have no such part")
    base = _from_rotary_config({k: v for k, v in c.items() if k not in ("intermediate_size",)}
                               | {"intermediate_size": c.get("intermediate_size", 14336)}, layout)
    experts = c.get("num_experts", c.get("num_local_experts"))
    if not isinstance(experts, int) or isinstance(experts, bool):
        raise InteropError(f"config.json num_experts={experts!r} must be an integer")
    moe = MoEConfig(experts=experts, top_k=c.get("num_experts_per_tok", 2), router="softmax",
                    aux_loss=float(c.get("router_aux_loss_coef", 0.01)))
    if layout == MIXTRAL:
        return dataclasses.replace(base, moe=moe)  # the experts are intermediate_size wide (moe.d_ff unset)
    if layout == GPT_OSS:
        # Top-k of the router's logits, then a softmax over those k: Mixtral's softmax renormalised over
        # its top-k, the same weights. Every layer routes; the experts are intermediate_size wide.
        return dataclasses.replace(base, attention_sinks=True, swiglu_limit=float(c.get("swiglu_limit", 7.0)),
                                   swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
                                   moe=dataclasses.replace(moe, renormalize=True, bias=True))
    dense = c.get("mlp_only_layers") or []
    if list(dense) != list(range(len(dense))):
        raise InteropError(f"config.json mlp_only_layers={dense}: perfgpt's dense layers are the first k "
                           "(model.moe.first_dense)")
    moe = dataclasses.replace(moe, d_ff=c.get("moe_intermediate_size", 768),
                              renormalize=bool(c.get("norm_topk_prob", False)), every=c.get("decoder_sparse_step", 1),
                              first_dense=len(dense))
    return dataclasses.replace(base, qk_norm=True, moe=moe)


def _from_deepseek_config(c: Mapping[str, Any]) -> ModelConfig:
    """DeepSeek-V3: latent attention, a sigmoid router choosing within groups by its corrected scores,
    shared experts, the first k layers dense, and ``num_nextn_predict_layers`` multi-token-prediction
    modules (``from_hf_state_dict`` keeps them only where the weights hold them)."""
    for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if c.get(key, value) != value:
            raise InteropError(f"config.json {key}={short_repr(c[key])}: perfgpt reads DeepSeek-V3's {key}={value}")
    q_rank = c.get("q_lora_rank", 1536)
    if q_rank is not None and not _is_index(q_rank):
        raise InteropError(f"config.json q_lora_rank={short_repr(q_rank)} must be an integer or null")
    base = _from_rotary_config(c | {"head_dim": None, "num_key_value_heads": None}, DEEPSEEK_V3)
    experts = check_size("config.json n_routed_experts", c.get("n_routed_experts", 256))
    groups = c.get("n_group") or 1
    moe = MoEConfig(experts=experts, top_k=c.get("num_experts_per_tok", 8), d_ff=c.get("moe_intermediate_size", 2048),
                    shared_experts=c.get("n_shared_experts") or 0, router="sigmoid", score_bias=True,
                    renormalize=bool(c.get("norm_topk_prob", True)),
                    routed_scale=float(c.get("routed_scaling_factor", 2.5)), groups=groups,
                    groups_kept=c.get("topk_group") or groups, first_dense=c.get("first_k_dense_replace", 3) or 0,
                    aux_loss=float(c.get("router_aux_loss_coef", 0.0)))
    attention = bool(c.get("attention_bias", False))
    return dataclasses.replace(
        base, attention_kind="mla", q_lora_rank=q_rank, kv_lora_rank=c.get("kv_lora_rank", 512),
        qk_nope_head_dim=c.get("qk_nope_head_dim", 128), qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
        v_head_dim=c.get("v_head_dim", 128), bias=False, qkv_bias=attention or None, proj_bias=attention or None,
        moe=moe, mtp_depth=c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0)


def _refuse_if(c: Mapping[str, Any], key: str, value: Any, why: str) -> None:
    if c.get(key, not value) == value:
        raise InteropError(f"config.json {key}={value}: {why}")


def from_hf_state_dict(config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> tuple[ModelConfig, State]:
    """(perfgpt config, perfgpt state dict) from an HF ``config.json`` and its weights.

    Missing, unexpected or mis-shaped weights are one InteropError naming the first such key.
    """
    cfg = from_hf_config(config)
    state = _without_derived(state)
    if cfg.is_mla:
        cfg, state = _mtp_from_hf(cfg, state)
        if config.get("rope_interleave", True):
            state = _rope_deinterleaved(cfg, state)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the shared table twice
    check_shapes(state, to_hf_state_dict(cfg, _meta_state(cfg)), "the config.json")
    out: State = {}
    if hf_layout(cfg) == GPT2:
        for ours, theirs, linear in _gpt2_names(cfg):
            out[ours] = state[theirs].t() if linear else state[theirs]
    else:
        for ours, theirs, _rows in _llama_names(cfg):
            out[ours] = torch.cat([state[name] for name in theirs]) if len(theirs) > 1 else state[theirs[0]]
        for ours, theirs in _expert_names(cfg):
            out[ours] = torch.stack([state[name].t() for name in theirs])
        for (first, second), theirs in _gpt_oss_expert_names(cfg):
            if second:
                out[first], out[second] = state[theirs][..., 0::2], state[theirs][..., 1::2]
            else:
                out[first] = state[theirs]
        for ours, theirs in _mtp_names(cfg):
            if ours.endswith(".proj.weight"):
                out[ours] = _swap_halves(out[ours])
            elif ours in ("tok_emb.weight", "lm_head.weight"):  # the copies checked equal: the model's own
                out[ours] = state["model.embed_tokens.weight" if ours == "tok_emb.weight" else _head_name(cfg)]
    return cfg, _tie(cfg, _stored(cfg, out))


def _head_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"


def _mtp_from_hf(cfg: ModelConfig, state: State) -> tuple[ModelConfig, State]:
    """DeepSeek-V3's multi-token-prediction layers, as many as ``num_nextn_predict_layers`` says and
    the weights hold: none held imports the model without them (what transformers' own saves give);
    some, all of them, each layer's copies of the embedding and head equal to the model's (absent
    ones are taken from it), since perfgpt's modules share those. Layers beyond are dropped."""
    held = [k for k in range(cfg.mtp_depth) if f"model.layers.{cfg.n_layer + k}.eh_proj.weight" in state]
    if not held:
        cfg = dataclasses.replace(cfg, mtp_depth=0)
    last = cfg.n_layer + cfg.mtp_depth
    state = {k: v for k, v in state.items()
             if not (k.startswith("model.layers.") and k.split(".")[2].isdigit() and int(k.split(".")[2]) >= last)}
    for ours, theirs in _mtp_names(cfg):
        if ours not in ("tok_emb.weight", "lm_head.weight"):
            continue
        own = state.get("model.embed_tokens.weight" if ours == "tok_emb.weight" else _head_name(cfg))
        if theirs not in state:
            state[theirs] = own
        elif own is not None and not torch.equal(state[theirs], own):
            raise InteropError(f"weight {theirs!r} differs from the model's {ours.split('.')[0]}: perfgpt's "
                               "multi-token-prediction modules share the model's embedding and head")
    return cfg, state


# --------------------------------------------------------------------------- nanoGPT


def from_nanogpt(checkpoint: Mapping[str, Any]) -> tuple[ModelConfig, State]:
    """(perfgpt config, perfgpt state dict) from a nanoGPT checkpoint dict (``torch.load`` of ckpt.pt)."""
    args, state = checkpoint.get("model_args"), checkpoint.get("model")
    if not isinstance(args, Mapping) or not isinstance(state, Mapping):
        raise InteropError(
            "not a nanoGPT checkpoint: it needs the keys 'model_args' and 'model' (as nanoGPT's train.py saves)"
        )
    missing = [k for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size") if k not in args]
    if missing:
        raise InteropError(f"nanoGPT model_args lacks {missing[0]!r}")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        check_size(f"nanoGPT model_args {key}", args[key])
    if not isinstance(args["bias"], bool) or not _is_finite_number(args.get("dropout", 0.0)):
        key = "bias" if not isinstance(args["bias"], bool) else "dropout"
        raise InteropError(f"nanoGPT model_args {key}={short_repr(args[key])} must be "
                           f"{'true or false' if key == 'bias' else 'a number'}")
    d = args["n_embd"]
    cfg = ModelConfig(
        vocab_size=args["vocab_size"], max_seq_len=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
        d_model=d, d_ff=4 * d, norm="layernorm", norm_eps=1e-5, mlp="gelu", gelu="exact", position="learned",
        tie_embeddings=True, bias=bool(args["bias"]), dropout=float(args.get("dropout", 0.0)),
    )
    cfg.validate()
    not_tensors = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise InteropError(f"nanoGPT weight {not_tensors[0]!r} is a {type(state[not_tensors[0]]).__name__}, not a "
                           "tensor: not a model saved by nanoGPT's train.py")
    state = _without_derived({k.removeprefix("_orig_mod."): v for k, v in state.items()})
    state.pop("lm_head.weight", None)  # tied to transformer.wte.weight
    names = [(ours, theirs) for ours, theirs, _ in _gpt2_names(cfg) if cfg.bias or not ours.endswith("bias")]
    expected = _meta_state(cfg)
    check_shapes(state, {theirs: expected[ours] for ours, theirs in names}, "nanoGPT's model_args")
    return cfg, _tie(cfg, _stored(cfg, {ours: state[theirs] for ours, theirs in names}))


def to_nanogpt(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A nanoGPT checkpoint dict (``model_args`` and ``model``) for a model nanoGPT expresses."""
    refuse_mup(cfg, "nanoGPT's GPT")
    needs = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "gelu": "exact", "tie_embeddings": True,
             "layers": "torch", "d_ff": 4 * cfg.d_model, "norm_eps": 1e-5, "kv_heads": cfg.n_head}
    for key, value in needs.items():
        if getattr(cfg, key) != value:
            name = "n_kv_head" if key == "kv_heads" else key
            raise InteropError(f"model.{name}={getattr(cfg, key)}: nanoGPT's GPT needs {value}")
    names = [(ours, theirs) for ours, theirs, _ in _gpt2_names(cfg) if cfg.bias or not ours.endswith("bias")]
    state = _canonical(cfg, state)
    model = {theirs: _get(state, ours).detach().clone() for ours, theirs in names}
    model["lm_head.weight"] = model["transformer.wte.weight"]
    args = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.d_model, "block_size": cfg.max_seq_len,
            "bias": cfg.bias, "vocab_size": cfg.vocab_size, "dropout": cfg.dropout}
    return {"model_args": args, "model": model}


# --------------------------------------------------------------------------- checks


def check_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
    """A perfgpt state dict against the model ``cfg`` builds: one InteropError naming the first bad key."""
    check_shapes(state, _meta_state(cfg), "the model config")


def check_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], source: str) -> None:
    """Same keys and shapes as ``expected``, or one InteropError naming the first difference."""
    missing = [k for k in expected if k not in state]
    if missing:
        raise InteropError(f"missing weight {missing[0]!r}{_more(missing)}, which {source} implies")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise InteropError(f"unexpected weight {unexpected[0]!r}{_more(unexpected)}, which {source} does not describe")
    bad = [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if bad:
        k = bad[0]
        raise InteropError(
            f"weight {k!r} has shape {tuple(state[k].shape)}, {source} implies {tuple(expected[k].shape)}{_more(bad)}"
        )


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def _meta_state(cfg: ModelConfig) -> State:
    """Every tensor the model of ``cfg`` has, with its shape, allocating nothing."""
    n = count_parameters(cfg)
    if n > MAX_PARAMETERS:
        raise InteropError(f"the model config describes {n:.3g} parameters (vocab_size {cfg.vocab_size}, d_model "
                           f"{cfg.d_model}, d_ff {cfg.d_ff}, n_layer {cfg.n_layer}), more than any model can hold "
                           f"(at most {MAX_PARAMETERS:.3g}); its sizes are damaged")
    with torch.device("meta"):
        return GPT(cfg).state_dict()


def _without_derived(state: Mapping[str, torch.Tensor]) -> State:
    return {k: v for k, v in state.items() if not k.endswith(DERIVED_SUFFIXES)}


def _tie(cfg: ModelConfig, state: State) -> State:
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state


def _get(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise InteropError(f"the state dict has no {name!r}; is it a perfgpt model of this config?")
    return state[name]


# --------------------------------------------------------------------------- files


CONFIG_FILE = "config.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_FILE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, State]:
    """(perfgpt config, perfgpt state dict) from a Hugging Face model directory."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise InteropError(f"{path} is not a Hugging Face model directory (no {CONFIG_FILE})")
    return from_hf_state_dict(_read_json(config_path), read_hf_weights(path))


def read_hf_weights(path: Path) -> State:
    """Every tensor of model.safetensors / pytorch_model.bin in ``path``, sharded (with an index) or not.

    The shards an index names must be files of ``path`` (no ``..``, no absolute path): the folder
    holds the model. A name may be a symbolic link (the Hub's cache links each file of a snapshot
    to its blob), and must lead to a regular file.
    """
    for single, index, reader in ((SAFETENSORS_FILE, SAFETENSORS_INDEX, _read_safetensors),
                                  (BIN_FILE, BIN_INDEX, _read_bin)):
        if (path / single).is_file():
            return reader(path / single)
        if (path / index).is_file():
            state: State = {}
            for shard in _shards(path / index):
                state.update(reader(path / shard))
            return state
    raise InteropError(f"{path} has no {SAFETENSORS_FILE}, {BIN_FILE} or their .index.json")


def _shards(index: Path) -> list[str]:
    """The shard files a weight index names, each checked to be a plain name inside its folder."""
    content = _read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, Mapping) else None
    if not isinstance(weight_map, Mapping):
        raise InteropError(f"{index} is not a weight index (no weight_map object)")
    for tensor, shard in weight_map.items():
        problem = name_problem(shard)
        if problem is not None:
            raise InteropError(f"{index} maps {short_repr(tensor)} to {short_repr(shard)}, which {problem}; refusing "
                               "to read weights from outside the model folder")
    return sorted(set(weight_map.values()))


def _read_json(file: Path) -> Any:
    try:
        return read_json(file)
    except ValueError as exc:
        raise InteropError(str(exc)) from None
    except OSError as exc:
        raise InteropError(f"cannot read {file}: {exc.strerror or exc}") from None


def _read_safetensors(file: Path) -> State:
    from safetensors.torch import load_file

    return _read(file, lambda: load_file(str(file)))


def _read_bin(file: Path) -> State:
    return _read(file, lambda: torch.load(file, map_location="cpu", weights_only=True))


def _read(file: Path, load: Callable[[], Any]) -> State:
    if not file.exists():
        raise InteropError(f"{file} is missing (named by the weight index)")
    problem = kind_problem(file)
    if problem is not None:
        raise InteropError(f"{file} {problem}; refusing to read weights from it")
    try:
        state = load()
    except Exception as exc:  # a truncated or foreign file: any reader error means the same to the user
        raise InteropError(f"{file} cannot be read as weights: {_why(exc)}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InteropError(f"{file} does not hold a flat name -> tensor state dict")
    return state


def write_hf_dir(cfg: ModelConfig, state: Mapping[str, torch.Tensor], path: str | Path,
                 extra_config: Mapping[str, Any] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``transformers`` loads as
    GPT2LMHeadModel or LlamaForCausalLM; returns the directory."""
    from safetensors.torch import save_file

    config = to_hf_config(cfg, extra_config)
    tensors = {k: v.cpu().contiguous() for k, v in to_hf_state_dict(cfg, state).items()}
    path = Path(path)
    weights, config_file = path / SAFETENSORS_FILE, path / CONFIG_FILE
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Each file is written aside and renamed into place, so a failed write never leaves a
        # previous export half-overwritten.
        save_file(tensors, str(weights.with_name(weights.name + ".tmp")), metadata={"format": "pt"})
        config_file.with_name(config_file.name + ".tmp").write_text(json.dumps(config, indent=2) + "\n")
        weights.with_name(weights.name + ".tmp").replace(weights)
        config_file.with_name(config_file.name + ".tmp").replace(config_file)
    except OSError as exc:
        raise InteropError(f"cannot write the model to {path}: {exc.strerror or exc} (errno {exc.errno})") from None
    return path


def read_nanogpt_ckpt(path: str | Path) -> tuple[ModelConfig, State]:
    """(perfgpt config, perfgpt state dict) from a nanoGPT ``ckpt.pt``, loaded weights-only."""
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"nanoGPT checkpoint not found: {path}")
    return from_nanogpt(_read_nanogpt(path))


def _read_nanogpt(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, or pickled objects weights_only refuses: both unusable here
        raise InteropError(f"{path} cannot be read weights-only: {_why(exc)}") from None


def _why(exc: Exception) -> str:
    """The reader's complaint in one line (torch's weights-only refusal is a page of advice)."""
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds pickled objects other than tensors and plain containers, which loading refuses (no code runs)"
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:160]}"
