"""Parameter count and training FLOPs per token, computed from the config alone.

Convention (stated in every log line that uses it, see ``FLOPS_CONVENTION``):
- N counts the parameters that take part in matmuls: every block's weights and the LM head.
  Embedding *lookups* are not matmuls, so the position table and an untied token table are
  excluded; a tied token table is counted once, as the LM head. Norm gains and biases are
  included (they are a rounding error).
- Mixture of experts: N counts the *active* parameters, those one token runs through (router,
  its top-k experts, the shared experts); idle experts do no work for it, so MFU must not credit
  them. ``count_parameters(cfg)`` is the total held in memory, ``active=True`` the active count.
- Training FLOPs per token = 6·N (forward 2·N, backward 4·N) + attention
  12·L·q·s (QKᵀ and A·V: 2·2·s·q per token per layer forward, times 3 for fwd+bwd, with q =
  n_head·head_dim the query width, d_model unless the heads are set apart; every query head
  still scores every key, so grouped-query attention shrinks only N, not this term; latent
  attention's values are narrower than its queries: 6·L·(q + v)·s, v = n_head·v_head_dim; each
  multi-token-prediction module adds its block as a layer and its run of the head to N), with
  **no causal halving**, as in PaLM appendix B and Megatron-LM's MFU; so MFU here is comparable
  to theirs. A layer with a sliding window of W tokens counts min(W, s) keys per query in
  place of s: each query is counted against the whole span its mask can reach. Activation
  recomputation is *not* counted (that would be HFU, not MFU).
"""

from __future__ import annotations

from model.config import ModelConfig

FLOPS_CONVENTION = ("6*N_matmul + 12*L*q*s per token (q = n_head*head_dim; s: min(window, s) in sliding-window layers; "
                    "latent attention 6*L*(q + v)*s; multi-token-prediction modules count as layers and rerun the head; "
                    "no causal halving, recompute not counted, embeddings lookups excluded)")


def mlp_parameters(cfg: ModelConfig, d_ff: int, bias: bool) -> int:
    """One dense MLP (or one expert, with biases where model.moe.bias) of hidden width ``d_ff``."""
    d, mats = cfg.d_model, (3 if cfg.mlp == "swiglu" else 2)
    return mats * d * d_ff + (((mats - 1) * d_ff + d) if bias else 0)


def moe_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """One MoE layer's MLP: router, routed experts (all, or the top-k one token runs), shared experts."""
    routed = cfg.moe.top_k if active else cfg.moe.experts
    shared = cfg.moe.shared_experts * cfg.expert_d_ff
    router = (cfg.d_model + (1 if cfg.moe.bias else 0)) * cfg.moe.experts
    return (router + routed * mlp_parameters(cfg, cfg.expert_d_ff, bias=cfg.moe.bias)
            + (mlp_parameters(cfg, shared, cfg.bias) if shared else 0))


def block_parameters(cfg: ModelConfig, layer_idx: int = 0, active: bool = False) -> int:
    """Block ``layer_idx``'s parameters (a MoE block's: all, or those ``active`` for one token)."""
    d = cfg.d_model
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    if cfg.is_mla:
        attn = latent_attention_parameters(cfg)
    else:
        qkv_out = cfg.q_dim + 2 * cfg.kv_dim  # query heads, then the (possibly fewer) key and value heads
        biases = (qkv_out if cfg.has_qkv_bias else 0) + (d if cfg.has_proj_bias else 0)
        extras = (2 * cfg.head_dim if cfg.qk_norm else 0) + (cfg.n_head if cfg.attention_sinks else 0)
        attn = d * qkv_out + cfg.q_dim * d + biases + extras
    mlp = moe_parameters(cfg, active) if cfg.is_moe_layer(layer_idx) else mlp_parameters(cfg, cfg.d_ff, cfg.bias)
    return 2 * norm + attn + mlp


def latent_attention_parameters(cfg: ModelConfig) -> int:
    """model.gpt.LatentAttention's: the query (compressed or not), the key/value down-projection with
    its rotary key, the latent's norm and up-projection, the output projection."""
    d, kv_down = cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    bias = cfg.has_qkv_bias
    if cfg.q_lora_rank is None:
        query = d * cfg.q_dim
    else:
        query = d * cfg.q_lora_rank + (cfg.q_lora_rank if bias else 0) + cfg.q_lora_rank + cfg.q_lora_rank * cfg.q_dim
    keys_values = d * kv_down + (kv_down if bias else 0) + cfg.kv_lora_rank + cfg.kv_lora_rank * cfg.n_head * (
        cfg.qk_nope_head_dim + cfg.v_head_dim)
    return query + keys_values + cfg.value_dim * d + (d if cfg.has_proj_bias else 0)


def blocks_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """All blocks' parameters. Dense blocks are alike and so are MoE blocks: two counts, not one per
    layer (the planner counts thousands of layouts)."""
    moe = [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)]
    dense = [i for i in range(cfg.n_layer) if not cfg.is_moe_layer(i)]
    return sum(len(kind) * block_parameters(cfg, kind[0], active) for kind in (moe, dense) if kind)


def mtp_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """The multi-token-prediction modules' own parameters (model.gpt.MTPModule: three norms, the
    2d -> d projection, one block numbered on from the last); embedding and head are the model's."""
    norm = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    return sum(3 * norm + 2 * cfg.d_model * cfg.d_model + block_parameters(cfg, cfg.n_layer + k, active)
               for k in range(cfg.mtp_depth))


def count_parameters(cfg: ModelConfig, include_embeddings: bool = True, active: bool = False) -> int:
    """Unique trainable parameters of ``model.gpt.GPT(cfg)`` (torch layers); with ``active``, only
    those one token runs through (the same for a dense model)."""
    d, v = cfg.d_model, cfg.vocab_size
    final_norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    token_table = v * d
    head = 0 if cfg.tie_embeddings else v * d
    positions = cfg.max_seq_len * d if cfg.position == "learned" else 0
    blocks = blocks_parameters(cfg, active) + mtp_parameters(cfg, active)
    total = blocks + final_norm + token_table + head + positions
    if not include_embeddings:
        total -= positions + (0 if cfg.tie_embeddings else token_table)
    return total


def matmul_parameters(cfg: ModelConfig) -> int:
    """N in 6·N: active parameters used in matmuls (blocks + LM head), embedding lookups excluded."""
    # Multi-token prediction runs the shared head once more per depth (a tied one is the token table).
    return count_parameters(cfg, include_embeddings=False, active=True) + cfg.mtp_depth * cfg.vocab_size * cfg.d_model


def attention_span(cfg: ModelConfig, seq_len: int) -> int:
    """Keys per query summed over the layers, as the FLOP convention counts them: seq_len in a
    layer that sees the whole context, min(window, seq_len) in one with a sliding window."""
    windows = [cfg.window_of(i) for i in range(cfg.n_layer)]
    return sum(seq_len if w is None else min(w, seq_len) for w in windows) + cfg.mtp_depth * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token; see the module docstring."""
    # QK^T over the query width, A.V over the value width: 2 FLOPs per multiply-add, forward and backward 3x
    return 6.0 * matmul_parameters(cfg) + 6.0 * (cfg.q_dim + cfg.value_dim) * attention_span(cfg, seq_len)
