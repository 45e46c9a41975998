"""ModelConfig: the GPT's architecture (with its mixture-of-experts section, MoEConfig), and the
choices that belong to the model's layers rather than to the optimizer, the data or the layout.

Besides the shape of the network it holds three kinds of keys: which implementation runs each part
(``attention``, ``layers``, ``moe.backend``: the same function either way), which activations the
layers recompute in backward (``recompute``: memory for time in training, no change to the result),
and the weights training starts from (``init_from``). How the model is sharded is parallel.*'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, Mapping

from common.errors import ConfigError
from common.fields import choices, doc


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (model/moe.py): which layers route tokens to experts, and how. Frozen, so a
    config copied with ``dataclasses.replace`` never shares a section that one copy changes."""

    experts: int | None = doc(None, "routed experts per MoE layer (null: a dense MLP in every layer)")
    top_k: int = doc(2, "experts each token is routed to")
    shared_experts: int = doc(0, "always-on shared experts (DeepSeek / Qwen2-MoE style), each moe.d_ff wide")
    d_ff: int | None = doc(None, "hidden width of one expert (fine-grained experts); default: model.d_ff")
    every: int = doc(1, "layer i (from 0) is MoE when (i + 1) % every == 0 (1: every layer, 2: every other)")
    first_dense: int = doc(0, "the first k layers keep a dense MLP (DeepSeek's first_k_dense_replace)")
    router: Literal["softmax", "sigmoid"] = doc(
        "softmax", "router scoring: softmax over experts (Mixtral, Qwen) or per-expert sigmoid (DeepSeek-V3)"
    )
    groups: int = doc(
        1, "group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups, and a token "
        "chooses its top_k only within the groups_kept groups whose two best scores sum highest (1: no groups)"
    )
    groups_kept: int | None = doc(None, "with groups: the groups a token may choose from (DeepSeek-V3's topk_group); "
                                        "null: all")
    score_bias: bool = doc(
        False, "a per-expert bias added to the scores only to choose experts (DeepSeek-V3's e_score_correction_bias, "
        "held with the weights); always on with bias_update_rate > 0, which moves it"
    )
    renormalize: bool = doc(True, "rescale the top-k weights to sum to 1 (Mixtral: true; Qwen norm_topk_prob)")
    routed_scale: float = doc(1.0, "the top-k weights are multiplied by this (DeepSeek-V3's routed_scaling_factor)")
    aux_loss: float = doc(
        0.01, "coefficient of the Switch load-balancing loss E*sum(f_i*P_i) added to the loss (0: off)"
    )
    z_loss: float = doc(0.0, "coefficient of the router z-loss mean(logsumexp(logits)^2) (ST-MoE; 0: off)")
    bias_update_rate: float = doc(
        0.0, "auxiliary-loss-free balancing (DeepSeek-V3): per-expert routing bias moved by this much per "
        "step toward balance (e.g. 0.001; 0: off)"
    )
    capacity: float = doc(
        0.0, "capacity factor: each expert takes at most ceil(factor * tokens * top_k / experts) token copies "
        "and drops the rest (0: dropless); tokens: one micro-batch, each rank's own under data and expert "
        "parallelism, the whole sequences under context parallelism"
    )
    backend: Literal["auto", "grouped_mm", "loop"] = doc(
        "auto", "expert GEMMs: torch._grouped_mm, or one GEMM per expert; auto picks grouped_mm where it runs"
    )
    bias: bool = doc(False, "biases on the router and on each expert's projections (gpt-oss)")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for a context longer than pre-training's (model/rope.py), with
    the published parameters of each recipe under Hugging Face's names where they have one."""

    type: Literal["none", "llama3", "yarn"] = doc(
        "none", "none: plain rotary frequencies; llama3: Llama 3.1's per-wavelength division by factor; yarn: "
        "YaRN's blend of interpolated and kept frequencies, with an attention factor (Qwen2.5, gpt-oss)"
    )
    factor: float = doc(8.0, "context extension factor (Llama 3.1: 8; YaRN: 4 for Qwen2.5, 32 for gpt-oss)")
    original_max_seq_len: int = doc(
        8192, "context length of pre-training, before the extension (original_max_position_embeddings)"
    )
    low_freq_factor: float = doc(1.0, "llama3: wavelengths longer than original_max_seq_len / this are divided by factor")
    high_freq_factor: float = doc(
        4.0, "llama3: wavelengths shorter than original_max_seq_len / this are kept; those between are blended"
    )
    beta_fast: float = doc(32.0, "yarn: dimensions turning more than this often over the original context are kept")
    beta_slow: float = doc(1.0, "yarn: dimensions turning less than this often are divided by factor")
    truncate: bool = doc(True, "yarn: round the blend's bounds to whole dimensions (gpt-oss: false)")
    attention_factor: float | None = doc(
        None, "yarn: cos and sin are multiplied by this (so the scores by its square); null: 0.1 ln(factor) + 1, "
        "or the ratio of the two mscale terms when both are set"
    )
    mscale: float = doc(0.0, "yarn: mscale of the attention factor's numerator, 0.1 mscale ln(factor) + 1 (0: unset)")
    mscale_all_dim: float = doc(0.0, "yarn: mscale of the attention factor's denominator (0: unset)")


@dataclass
class ModelConfig:
    """The model section (``model.*``); see the module docstring for what it holds besides the architecture."""

    # Keys renamed since configs and checkpoints were first written: old key -> (new key, why), both
    # under model. A config or override with an old name is told the new one in one line
    # (training/config.py); a config saved under an old name (checkpoint metadata, exports,
    # measurement files) is read under the new one.
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {
        "checkpointing": ("recompute", "activation recompute; checkpoint.* is saving checkpoints"),
        "checkpoint_every_k": ("recompute_every_k", "activation recompute; checkpoint.* is saving checkpoints"),
        **{f"moe_{key}": (f"moe.{key}", "the mixture-of-experts keys are one section, model.moe")
           for key in MoEConfig.__dataclass_fields__},
    }

    vocab_size: int = doc(256, "vocabulary size (256 for the built-in byte-level tokenizer)")
    max_seq_len: int = doc(256, "longest sequence the model accepts (size of learned positions)")
    n_layer: int = doc(4, "transformer blocks")
    n_head: int = doc(4, "attention heads")
    n_kv_head: int | None = doc(
        None, "key/value heads (grouped-query attention; 1 = multi-query); default: n_head (plain multi-head)"
    )
    d_model: int = doc(128, "residual stream width")
    attention_head_dim: int | None = doc(
        None, "width of one attention head; default d_model / n_head (Qwen3 sets it apart: 128 with d_model 2048)"
    )
    attention_kind: Literal["gqa", "mla"] = doc(
        "gqa", "gqa: query heads over n_kv_head key/value heads (multi-head when equal); mla: DeepSeek's multi-head "
        "latent attention (keys and values up-projected from one compressed latent, a rotary key shared by the heads)"
    )
    q_lora_rank: int | None = doc(None, "mla: width of the compressed query (DeepSeek-V3: 1536); null: a full query "
                                        "projection")
    kv_lora_rank: int = doc(512, "mla: width of the key/value latent, what the KV cache holds per token besides the "
                                 "rotary key")
    qk_nope_head_dim: int = doc(128, "mla: per-head query/key dims without rotary embeddings")
    qk_rope_head_dim: int = doc(64, "mla: per-head query dims with rotary embeddings, and of the one rotary key the "
                                    "heads share")
    v_head_dim: int = doc(128, "mla: per-head value dims")
    mtp_depth: int = doc(
        0, "multi-token prediction (DeepSeek-V3): this many extra modules after the last block, module k predicting "
        "the token k + 1 further on from the previous one's hidden state and the embedding of the token k ahead; "
        "training only (0: off)"
    )
    mtp_loss_weight: float = doc(0.3, "with mtp_depth: the mean of the modules' losses is added to the loss times "
                                      "this (its gradient; the loss logged stays the next-token loss, mtp_loss beside)")
    qk_norm: bool = doc(False, "RMSNorm on each head's queries and keys before rotary embeddings (Qwen3)")
    d_ff: int | None = doc(
        None, "MLP hidden width; default 4*d_model for gelu, 8/3*d_model rounded up to 64 for swiglu"
    )
    norm: Literal["layernorm", "rmsnorm"] = doc("layernorm", "normalization layer")
    norm_eps: float = doc(1e-5, "normalization epsilon")
    mlp: Literal["gelu", "swiglu"] = doc("gelu", "MLP activation")
    gelu: Literal["tanh", "exact"] = doc(
        "tanh", "GELU form of mlp=gelu: tanh approximation (GPT-2, HF gelu_new) or exact erf (nanoGPT, HF gelu)"
    )
    position: Literal["learned", "rope"] = doc("learned", "learned absolute positions or rotary embeddings")
    rope_theta: float = doc(10000.0, "rotary base")
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_embeddings: bool = doc(True, "share the token embedding with the LM head")
    bias: bool = doc(True, "biases in linear layers and norms")
    qkv_bias: bool | None = doc(None, "bias on the query/key/value projection; null: model.bias (Qwen2: true, bias false)")
    proj_bias: bool | None = doc(None, "bias on attention's output projection; null: model.bias")
    sliding_window: int | None = doc(
        None, "attention window in tokens: a query sees itself and the sliding_window - 1 positions before it "
        "(Mistral, gpt-oss); null: the whole context"
    )
    sliding_window_every: int = doc(
        1, "with sliding_window: layer i has the window when i >= sliding_window_first and (i - sliding_window_first) "
        "% every == 0 (1: every such layer, Mistral; 2: layers 0, 2, 4, ..., gpt-oss)"
    )
    sliding_window_first: int = doc(
        0, "with sliding_window: the first layer with the window; those before it see the whole context (Qwen2's "
        "max_window_layers)"
    )
    attention_sinks: bool = doc(
        False, "a learned logit per head in each softmax's denominator, a sink that takes attention and gives "
        "nothing back (gpt-oss)"
    )
    swiglu_limit: float | None = doc(
        None, "gpt-oss's clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], out = (up + 1) * gate * "
        "sigmoid(swiglu_alpha * gate); null: plain SwiGLU, silu(gate) * up"
    )
    swiglu_alpha: float = doc(1.702, "with swiglu_limit: the gain of the clamped SwiGLU's sigmoid")
    dropout: float = doc(0.0, "dropout on attention probabilities and residual branches")
    init: Literal["gpt2", "llama"] = doc(
        "gpt2", "initial weights: gpt2 (normal, std model.init_std; residual projections std/sqrt(2*n_layer)); "
        "llama (torchtitan's scheme: truncated normal, output projections std/sqrt(2*(layer+1)), unit-variance "
        "embedding, head std d_model^-0.5)"
    )
    init_std: float = doc(0.02, "std of the initial weights (model.init says which are scaled down)")
    mup: bool = doc(
        False, "maximal update parametrization for width (model/mup.py): hidden matrices' init std x m^-1/2 and "
        "AdamW LR x 1/m, logits x 1/m, attention logits / d_head, with m = d_model / model.mup_base_width"
    )
    mup_base_width: int | None = doc(
        None, "with model.mup: the d_model the hyperparameters were tuned at (there µP equals the standard "
        "parametrization)"
    )
    attention: Literal["auto", "flash_attn", "sdpa", "reference"] = doc(
        "auto", "attention backend; auto picks flash_attn on CUDA when installed, else sdpa"
    )
    attention_mask: Literal["causal", "document"] = doc(
        "causal", "causal: every earlier token of the packed sequence; document: only earlier tokens of the same "
        "document (documents end with the end-of-text id, model.eot_id)"
    )
    document_positions: bool = doc(
        False, "with attention_mask=document: positions restart at 0 with each document (else they count "
        "through the packed sequence)"
    )
    eot_id: int | None = doc(
        None, "end-of-text id that ends each document, for attention_mask=document; null: the dataset's, "
        "from its meta.json"
    )
    layers: Literal["torch", "te"] = doc("torch", "torch layers, or Transformer Engine layers (needs TE)")
    recompute: Literal["none", "selective", "op_selective", "full", "every_k", "offload"] = doc(
        "none", "activation recompute policy (model/recompute.py): which activations are dropped in "
        "forward and recomputed in backward"
    )
    recompute_every_k: int = doc(2, "with recompute=every_k: recompute every k-th block")
    moe: MoEConfig = field(default_factory=MoEConfig)
    init_from: str | None = doc(
        None, "start training from these weights: a Hugging Face GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE, DeepSeek-V3 or "
        "gpt-oss directory, a nanoGPT ckpt.pt, a perfgpt checkpoint or run directory, or a tools/export.py "
        ".safetensors; the architecture keys come from it"
    )

    def __post_init__(self) -> None:
        if self.d_ff is None:
            if self.mlp == "swiglu":
                self.d_ff = 64 * ((8 * self.d_model // 3 + 63) // 64)
            else:
                self.d_ff = 4 * self.d_model

    def value_of(self, key: str) -> Any:
        """The value of a key under model., dotted for the nested section (``"moe.top_k"``)."""
        value = self
        for part in key.split("."):
            value = getattr(value, part)
        return value

    def with_values(self, values: Mapping[str, Any]) -> ModelConfig:
        """A copy with these keys set (dotted for the nested sections: ``{"moe.top_k": 2}``)."""
        top = {k: v for k, v in values.items() if "." not in k}
        sections = {"moe": self.moe, "rope_scaling": self.rope_scaling}
        unknown = [k for k in values if "." in k and (k.split(".")[0] not in sections or k.split(".", 1)[1]
                                                     not in type(sections[k.split(".")[0]]).__dataclass_fields__)]
        if unknown:
            raise KeyError(f"no model key {sorted(unknown)[0]!r}")
        for name, section in sections.items():
            keys = {k.removeprefix(f"{name}."): v for k, v in values.items() if k.startswith(f"{name}.")}
            if keys:
                top[name] = replace(top.get(name, section), **keys)
        return replace(self, **top)

    @property
    def expert_d_ff(self) -> int:
        """Hidden width of one routed (and of one shared) expert."""
        return self.d_ff if self.moe.d_ff is None else self.moe.d_ff

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` has routed experts in place of its dense MLP."""
        return (self.moe.experts is not None and layer_idx >= self.moe.first_dense
                and (layer_idx + 1) % self.moe.every == 0)

    def window_of(self, layer_idx: int) -> int | None:
        """Block ``layer_idx``'s attention window in tokens (None: it sees the whole context)."""
        first, every = self.sliding_window_first, self.sliding_window_every
        if self.sliding_window is None or layer_idx < first or (layer_idx - first) % every:
            return None
        return self.sliding_window

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def has_proj_bias(self) -> bool:
        return self.bias if self.proj_bias is None else self.proj_bias

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layer))

    @property
    def is_mla(self) -> bool:
        return self.attention_kind == "mla"

    @property
    def rope_dim(self) -> int:
        """Dims of a head the rotary embedding turns: MLA's rotary part, else the whole head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head if self.attention_head_dim is None else self.attention_head_dim

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and of the attention output): n_head * head_dim (MLA: the
        query's, n_head * (qk_nope_head_dim + qk_rope_head_dim))."""
        if self.is_mla:
            return self.n_head * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.n_head * self.head_dim

    @property
    def value_dim(self) -> int:
        """Width of the attention output (the values of every head): q_dim, or MLA's n_head * v_head_dim."""
        return self.n_head * self.v_head_dim if self.is_mla else self.q_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or ``n_head`` when unset (kept unset so a saved config
        re-read with another n_head stays multi-head instead of silently becoming GQA)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    def validate(self) -> None:
        for key in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1 (got {getattr(self, key)})")
        if self.attention_head_dim is not None and self.attention_head_dim < 1:
            raise ConfigError(f"model.attention_head_dim must be >= 1 (got {self.attention_head_dim})")
        if self.attention_head_dim is None and not self.is_mla and self.d_model % self.n_head:
            raise ConfigError(
                f"model.n_head={self.n_head} must divide model.d_model={self.d_model} "
                f"(e.g. n_head in {[h for h in range(1, 65) if self.d_model % h == 0][-6:]})"
            )
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ConfigError(
                f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head} "
                f"(choose one of {[k for k in range(1, min(self.n_head, 1024) + 1) if self.n_head % k == 0]})"
            )
        if self.position == "rope" and not self.is_mla and self.head_dim % 2:
            raise ConfigError(f"model.position=rope needs an even head dim; d_model/n_head={self.head_dim}")
        if self.layers == "te" and (self.attention_head_dim is not None or self.qk_norm):
            raise ConfigError("model.attention_head_dim and model.qk_norm need model.layers=torch")
        if self.layers == "te" and self.mlp == "gelu" and self.gelu == "exact":
            raise ConfigError(
                "model.gelu=exact has no Transformer Engine activation (TE's gelu is the tanh form); "
                "use model.gelu=tanh or model.layers=torch"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.document_positions and self.attention_mask != "document":
            raise ConfigError("model.document_positions=true restarts positions per document: it needs "
                              "model.attention_mask=document")
        if self.attention_mask == "document" and self.layers == "te":
            raise ConfigError("model.attention_mask=document needs model.layers=torch (Transformer Engine's "
                              "attention takes no document mask here)")
        if self.eot_id is not None and not 0 <= self.eot_id < self.vocab_size:
            raise ConfigError(f"model.eot_id={self.eot_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        if self.recompute_every_k < 1:
            raise ConfigError("model.recompute_every_k must be >= 1")
        if self.mtp_depth < 0 or not (math.isfinite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0):
            raise ConfigError(f"model.mtp_depth must be >= 0 and model.mtp_loss_weight a finite number >= 0 (got "
                              f"{self.mtp_depth}, {self.mtp_loss_weight})")
        if self.mtp_depth and self.layers != "torch":
            raise ConfigError("model.mtp_depth needs model.layers=torch")
        if self.mtp_depth >= self.max_seq_len:  # depth k predicts k + 1 ahead: no target would be left
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} needs sequences longer than it (model.max_seq_len="
                              f"{self.max_seq_len}): lower model.mtp_depth or raise model.max_seq_len")
        self._validate_attention_variants()
        if self.is_mla:
            self._validate_mla()
        if self.rope_scaling.type != "none":
            self._validate_rope_scaling()
        if self.moe.experts is not None:
            self._validate_moe()
        if self.mup or self.mup_base_width is not None:
            self._validate_mup()

    def _validate_mup(self) -> None:
        if not self.mup:
            raise ConfigError(f"model.mup_base_width={self.mup_base_width} has no effect without model.mup=true; set "
                              "model.mup=true or leave model.mup_base_width unset")
        if self.mup_base_width is None or self.mup_base_width < 1:
            raise ConfigError(f"model.mup=true needs model.mup_base_width >= 1, the d_model the hyperparameters were "
                              f"tuned at (got {self.mup_base_width})")
        if self.layers == "te":
            raise ConfigError("model.mup=true needs model.layers=torch (Transformer Engine layers take no µP "
                              "multipliers)")
        if self.init != "gpt2":
            raise ConfigError(f"model.mup=true needs model.init=gpt2 (model.init={self.init} draws the embedding and head "
                              "with a std that shrinks with d_model, which µP keeps fixed)")
        if self.moe.experts is not None:
            raise ConfigError("model.mup=true is not defined here for mixture-of-experts layers (the router's and the "
                              "experts' scaling); use a dense model (model.moe.experts=null)")
        if self.is_mla or self.mtp_depth:
            key = "attention_kind=mla" if self.is_mla else f"mtp_depth={self.mtp_depth}"
            raise ConfigError(f"model.mup=true with model.{key} is not supported yet (its attention scale and extra "
                              "modules have no µP multipliers here); use model.mup=false")

    def _validate_attention_variants(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model.sliding_window must be >= 1 (or null for the whole context), got "
                              f"{self.sliding_window}")
        if self.sliding_window_every < 1 or self.sliding_window_first < 0:
            key = "sliding_window_every" if self.sliding_window_every < 1 else "sliding_window_first"
            raise ConfigError(f"model.{key} must be >= {1 if key.endswith('every') else 0}, got {getattr(self, key)}")
        if self.sliding_window is not None and not any(self.window_of(i) for i in range(self.n_layer)):
            raise ConfigError(f"model.sliding_window_first={self.sliding_window_first} leaves none of the "
                              f"{self.n_layer} layers a window; lower it, or set model.sliding_window=null")
        if self.attention_sinks and self.attention in ("sdpa", "flash_attn"):
            raise ConfigError(f"model.attention={self.attention} cannot run model.attention_sinks: it has no sink term "
                              "in its softmax; use model.attention=reference or auto")
        if self.swiglu_limit is not None:
            if self.mlp != "swiglu":
                raise ConfigError(f"model.swiglu_limit clamps a SwiGLU: it needs model.mlp=swiglu (got {self.mlp})")
            for key in ("swiglu_limit", "swiglu_alpha"):
                if not math.isfinite(getattr(self, key)) or getattr(self, key) <= 0:
                    raise ConfigError(f"model.{key} must be a finite number > 0 (got {getattr(self, key)})")
        variants = [key for key, on in (("sliding_window", self.sliding_window is not None),
                                        ("attention_sinks", self.attention_sinks),
                                        ("swiglu_limit", self.swiglu_limit is not None),
                                        ("qkv_bias", self.qkv_bias is not None and self.qkv_bias != self.bias),
                                        ("proj_bias", self.proj_bias is not None and self.proj_bias != self.bias),
                                        ("rope_scaling.type", self.rope_scaling.type != "none")) if on]
        if variants and self.layers == "te":
            raise ConfigError(f"model.{variants[0]} needs model.layers=torch (Transformer Engine's layers have no such "
                              "part here)")
        if self.init != "gpt2" and self.layers == "te":
            raise ConfigError(f"model.init={self.init} needs model.layers=torch (Transformer Engine's layers draw their "
                              "weights by GPT-2's scheme)")

    def _validate_mla(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"model.{key} must be >= 1 with model.attention_kind=mla (got {value})")
        if self.position != "rope" or self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.attention_kind=mla needs model.position=rope and an even model.qk_rope_head_dim "
                              f"(got position={self.position}, qk_rope_head_dim={self.qk_rope_head_dim})")
        for key, on in (("n_kv_head", self.n_kv_head is not None), ("attention_head_dim", self.attention_head_dim),
                        ("qk_norm", self.qk_norm), ("attention_sinks", self.attention_sinks),
                        ("sliding_window", self.sliding_window is not None), ("layers", self.layers != "torch")):
            if on:
                raise ConfigError(f"model.{key}={self.value_of(key)} with model.attention_kind=mla: latent attention "
                                  "here has none (its heads are set by the mla keys); unset it or use attention_kind=gqa")
        if self.attention == "flash_attn":
            raise ConfigError("model.attention=flash_attn with model.attention_kind=mla: flash-attn 2 wants values as "
                              "wide as queries and keys; use model.attention=sdpa, reference or auto")

    def _validate_rope_scaling(self) -> None:
        r = self.rope_scaling
        if self.position != "rope":
            raise ConfigError(f"model.rope_scaling.type={r.type} scales rotary embeddings: it needs model.position=rope")
        numbers = {"factor": r.factor, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                   "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
        for key, value in numbers.items():
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"model.rope_scaling.{key} must be a finite number > 0 (got {value})")
        if r.factor < 1:
            raise ConfigError(f"model.rope_scaling.factor={r.factor} must be >= 1 (it stretches the context)")
        if r.original_max_seq_len < 1:
            raise ConfigError(f"model.rope_scaling.original_max_seq_len must be >= 1 (got {r.original_max_seq_len})")
        if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
            raise ConfigError(f"model.rope_scaling.high_freq_factor={r.high_freq_factor} must be above "
                              f"low_freq_factor={r.low_freq_factor} (llama3 blends the wavelengths between them)")
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(r, key)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ConfigError(f"model.rope_scaling.{key} must be a finite number >= 0 (got {value})")

    def _validate_moe(self) -> None:
        moe, e = self.moe, self.moe.experts
        if e < 1:
            raise ConfigError(f"model.moe.experts={e} must be >= 1 (or null for a dense model)")
        if not 1 <= moe.top_k <= e:
            raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts={e}")
        for key in ("shared_experts", "first_dense"):
            if getattr(moe, key) < 0:
                raise ConfigError(f"model.moe.{key} must be >= 0 (got {getattr(moe, key)})")
        if moe.every < 1:
            raise ConfigError(f"model.moe.every must be >= 1 (got {moe.every})")
        if moe.d_ff is not None and moe.d_ff < 1:
            raise ConfigError(f"model.moe.d_ff must be >= 1 (got {moe.d_ff})")
        if moe.groups < 1 or e % moe.groups:
            raise ConfigError(f"model.moe.groups={moe.groups} must be >= 1 and divide model.moe.experts={e}")
        kept = moe.groups if moe.groups_kept is None else moe.groups_kept
        if not 1 <= kept <= moe.groups:
            raise ConfigError(f"model.moe.groups_kept={kept} must be between 1 and model.moe.groups={moe.groups}")
        if moe.top_k > kept * (e // moe.groups):
            raise ConfigError(f"model.moe.top_k={moe.top_k} is more than the {kept * (e // moe.groups)} experts of the "
                              f"model.moe.groups_kept={kept} groups; keep more groups or lower top_k")
        for key in ("routed_scale", "aux_loss", "z_loss", "bias_update_rate", "capacity"):
            value = getattr(moe, key)
            if not math.isfinite(value) or value < 0 or (key == "routed_scale" and value == 0):
                bound = "> 0" if key == "routed_scale" else ">= 0"
                raise ConfigError(f"model.moe.{key} must be a finite number {bound} (got {value})")
        if moe.capacity > e / moe.top_k:
            # From e / top_k on the capacity is every token, so nothing is dropped; far above it the
            # slot count stops being a finite integer.
            raise ConfigError(f"model.moe.capacity={moe.capacity:g} is above model.moe.experts / model.moe.top_k = "
                              f"{e / moe.top_k:g}, from where an expert takes every token routed to it and none is "
                              "dropped; use at most that, or 0 for dropless")
        if self.n_moe_layers == 0:
            raise ConfigError(f"no layer is MoE: model.moe.first_dense={moe.first_dense} and model.moe.every="
                              f"{moe.every} leave none of the {self.n_layer} layers; lower them")
        if self.layers == "te":
            raise ConfigError("model.moe.experts needs model.layers=torch (Transformer Engine blocks have a dense MLP)")

    def gemm_dims(self) -> dict[str, int]:
        """Dimensions that appear in GEMMs of the transformer blocks (FP8 needs them % 16 == 0)."""
        dims = {"model.d_model": self.d_model, "model.d_ff": self.d_ff}
        if self.moe.experts is not None:
            dims["model.moe.d_ff (expert width)"] = self.expert_d_ff
        if self.kv_heads != self.n_head or self.q_dim != self.d_model:  # the fused QKV GEMM's output width
            dims["(n_head + 2*n_kv_head) * head_dim"] = self.q_dim + 2 * self.kv_dim
        return dims


RECOMPUTE_POLICIES = choices(ModelConfig, "recompute")
