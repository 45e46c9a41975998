"""The maximal update parametrization (µP) for width: what changes when ``model.mup=true``.

Yang et al., "Tensor Programs V" (2022), as the µTransfer recipe is used in practice (Cerebras-GPT,
EleutherAI's nanoGPT port): with the width multiplier m = d_model / model.mup_base_width,

    hidden matrices (every 2-D weight inside a block: attention's qkv and output, the MLP's)
        initial std x m^-1/2            (after model.init=gpt2 drew them; llama's init is refused)
        AdamW learning rate x 1/m       (``lr_multipliers``; the optimizer's param groups apply it)
    embeddings (token, positions), norm gains, biases: unchanged
    output logits                       x 1/m (``output_multiplier``); the head keeps its init and LR
    attention logits                    q.k / d_head instead of q.k / sqrt(d_head)

so that, as the width grows, every layer's activations and their change per step stay the same
size, and the best learning rate found at the base width stays the best at any width. Each
constant is chosen so that at the base width (m = 1) µP is the standard parametrization exactly:
tune a model of width ``mup_base_width`` as usual, then widen it with µP on. The attention scale
is 1/d_head times sqrt(d_head at the base width), which assumes the heads widen with d_model
(n_head fixed).

Other optimizers: µP's rule for a hidden matrix is the spectral condition (Yang, Simon & Bernstein
2023): its update's spectral norm should stay sqrt(fan_out / fan_in) times a width-free constant.
AdamW's update has entries of size lr and, the gradient being of low rank, a spectral norm of about
lr x width: hence 1/m. An orthogonalised update (Muon) has every singular value equal, so its size
follows from its scale rule: scaled to AdamW's RMS per entry (Moonlight's 0.2 sqrt(max(A, B))), its
spectral norm grows as sqrt(width) and the LR takes m^-1/2; scaled by sqrt(max(1, A/B)) (Keller
Jordan's) or not at all, it is already width-free and takes none. ``hidden_lr_multiplier`` says which;
the embeddings, head, norms and biases a Muon run leaves to AdamW keep AdamW's µP (multiplier 1).
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
import torch.nn as nn

from model.config import ModelConfig

LrScale = Callable[[str, torch.Tensor], float]  # (parameter name, parameter) -> multiplier of the LR
Update = Literal["adam", "rms_matched", "spectral"]  # how an optimizer sizes a hidden matrix's update


def width_multiplier(cfg: ModelConfig) -> float:
    """m = d_model / model.mup_base_width under µP; 1 otherwise."""
    return cfg.d_model / cfg.mup_base_width if cfg.mup else 1.0


def output_multiplier(cfg: ModelConfig) -> float:
    """What the logits are multiplied by: 1/m."""
    return 1.0 / width_multiplier(cfg)


def query_scale(cfg: ModelConfig) -> float:
    """What queries are multiplied by before attention's own 1/sqrt(d_head): m^-1/2, which makes
    the logit scale sqrt(d_base) / d_head = 1/d_head up to the constant that is 1 at the base width."""
    return width_multiplier(cfg) ** -0.5


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A weight whose fan-in grows with the width inside a block. Found by name, so it holds under
    every wrapper (DDP's ``module.``, compile's ``_orig_mod.``, a pipeline stage's kept blocks)."""
    return param.ndim >= 2 and "blocks." in name


def hidden_lr_multiplier(cfg: ModelConfig, update: Update = "adam") -> float:
    """The LR multiplier of hidden matrices for an optimizer whose update is AdamW's ("adam": 1/m), an
    orthogonalised one scaled to AdamW's RMS per entry ("rms_matched": m^-1/2), or one whose spectral
    norm does not grow with the width ("spectral": 1)."""
    m = width_multiplier(cfg)
    return {"adam": 1.0 / m, "rms_matched": m ** -0.5, "spectral": 1.0}[update]


def lr_multipliers(model: nn.Module, update: Update = "adam") -> LrScale | None:
    """Per-parameter LR multipliers of the GPT inside ``model`` (wrapped or not; one pipeline stage
    included), or None when it does not use µP."""
    cfg = next((m.cfg for m in model.modules() if isinstance(getattr(m, "cfg", None), ModelConfig)), None)
    if cfg is None or not cfg.mup:
        return None
    hidden = hidden_lr_multiplier(cfg, update)
    return lambda name, param: hidden if is_hidden_matrix(name, param) else 1.0


@torch.no_grad()
def scale_hidden_init(model: nn.Module, cfg: ModelConfig) -> None:
    """Multiply every hidden matrix, as the model's init drew it, by m^-1/2 (µP's init std)."""
    scale = width_multiplier(cfg) ** -0.5
    if scale == 1.0:
        return
    for name, param in model.named_parameters():
        if is_hidden_matrix(name, param):
            param.mul_(scale)


def describe(cfg: ModelConfig) -> str:
    """One log line: the width multiplier and what it changes."""
    m = width_multiplier(cfg)
    return (f"mup: width {cfg.d_model} = {m:g} x base {cfg.mup_base_width}: hidden matrices' init std x {m ** -0.5:.4g} "
            f"and AdamW LR x {1 / m:.4g}; logits x {1 / m:.4g}; attention logits / d_head "
            f"(x {math.sqrt(1 / m):.4g} on the queries)")
