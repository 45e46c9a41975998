"""The one place that imports Transformer Engine.

TE is GPU-only (it builds against a CUDA torch); on a machine without it, asking for
``model.layers=te`` or ``precision.mode=fp8`` fails with an install hint before any work starts.
Interface facts checked against TE 2.x's ``TransformerLayer`` source: the epsilon
argument is ``layernorm_epsilon``; dropouts default to 0.1, so they are passed explicitly; the
default layout is ``sbhd`` so ``attn_input_format="bshd"`` is set; the key/value head count is
``num_gqa_groups`` (TE 2.0 has it); the layer returns hidden states, not a loss; FP8 GEMMs need
dimensions divisible by 16 (checked in the config).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math

import torch
import torch.nn as nn

from common.errors import CapabilityError
from model.config import ModelConfig

INSTALL_HINT = "install Transformer Engine on a CUDA machine: pip install 'perfgpt[te]'"


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def require_te(what: str) -> None:
    if not te_available():
        raise CapabilityError(f"{what} needs Transformer Engine, which is not installed; {INSTALL_HINT}")


class TEBlock(nn.Module):
    """A pre-norm transformer block built from ``te.TransformerLayer`` (attention + MLP fused)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        require_te("model.layers=te")
        import transformer_engine.pytorch as te

        std = cfg.init_std
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.layer = te.TransformerLayer(
            hidden_size=cfg.d_model,
            ffn_hidden_size=cfg.d_ff,
            num_attention_heads=cfg.n_head,
            num_gqa_groups=cfg.kv_heads,  # TE's name for the key/value head count (GQA; = n_head is MHA)
            layernorm_epsilon=cfg.norm_eps,
            hidden_dropout=cfg.dropout,
            attention_dropout=cfg.dropout,
            init_method=lambda w: nn.init.normal_(w, 0.0, std),
            output_layer_init_method=lambda w: nn.init.normal_(w, 0.0, out_std),
            layer_number=layer_idx + 1,
            self_attn_mask_type="causal",
            normalization="RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm",
            activation="swiglu" if cfg.mlp == "swiglu" else "gelu",
            bias=cfg.bias,
            fuse_qkv_params=True,
            attn_input_format="bshd",
        )
        self.rotary = _te_rotary(cfg) if cfg.position == "rope" else None

    def forward(self, x: torch.Tensor, rope: object = None, cache: object = None, documents: object = None) -> torch.Tensor:
        if cache is not None or documents is not None:  # the GPT's block interface, which TE's layer lacks
            raise NotImplementedError("Transformer Engine blocks take neither a KV cache nor document masks")
        # TE builds its own rotary table (same halves-split convention); the GPT's is unused here.
        te_rope = self.rotary(x.shape[1]) if self.rotary is not None else None
        return self.layer(x, rotary_pos_emb=te_rope)


def _te_rotary(cfg: ModelConfig) -> nn.Module:
    try:
        from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding
    except ImportError:  # TE < 2.2 kept it one level up
        from transformer_engine.pytorch.attention import RotaryPositionEmbedding
    return RotaryPositionEmbedding(cfg.head_dim, rotary_base=cfg.rope_theta)


def te_checkpoint(forward, *args, **kwargs):
    """Activation recompute for TE layers, through TE's own ``checkpoint``.

    torch's checkpoint restores torch autocast for the recompute but not TE's FP8 autocast, so a
    recomputed TE layer would run its GEMMs outside FP8 (different numbers from the forward) and
    disturb the delayed-scaling amax history. ``te.checkpoint`` records the FP8 recipe of the
    forward and recomputes under it. Non-reentrant, like every other policy here.
    """
    require_te("activation recompute of model.layers=te")
    import transformer_engine.pytorch as te

    return te.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def fp8_autocast(precision_cfg) -> contextlib.AbstractContextManager:
    """TE's FP8 autocast with a delayed-scaling recipe built from the precision config.

    Only TE modules run in FP8 inside it; the embedding, final norm and LM head are plain torch
    modules and stay in higher precision.
    """
    require_te("precision.mode=fp8")
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(
        fp8_format=Format.HYBRID if precision_cfg.fp8_format == "hybrid" else Format.E4M3,
        amax_history_len=precision_cfg.fp8_amax_history_len,
        amax_compute_algo=precision_cfg.fp8_amax_compute_algo,
        margin=precision_cfg.fp8_margin,
    )
    autocast = getattr(te, "autocast", None)  # newer TE: autocast(recipe=); older: fp8_autocast only
    if autocast is not None:
        return autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
