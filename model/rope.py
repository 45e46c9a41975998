"""Rotary frequencies, plain or stretched for a longer context (``model.rope_scaling``).

Rotary embeddings turn the pair (i, i + D/2) of a head by ``position * inv_freq[i]``, with
``inv_freq[i] = theta^(-2i/D)``: dimension pair i completes a turn every ``2 pi / inv_freq[i]``
positions, its wavelength. A model pre-trained on ``original_max_seq_len`` tokens has seen every
angle of the short wavelengths but only part of a turn of the long ones; the recipes below slow
those down so a longer context stays within the angles seen in training:

    llama3  (Llama 3.1) wavelengths longer than original / low_freq_factor are divided by
            ``factor``, those shorter than original / high_freq_factor kept, and those between
            blended linearly in original / wavelength.
    yarn    (YaRN, Peng et al. 2023; Qwen2.5, gpt-oss, DeepSeek-V3) pairs that turn fewer than
            beta_slow times over the original context are divided by ``factor``, more than
            beta_fast times kept, those between blended linearly in the pair index; and the
            tables are multiplied by an attention factor (0.1 ln(factor) + 1 by default), which
            scales every score by its square: the softmax stays as sharp as in pre-training.

The formulas follow the papers and Hugging Face's parameter names (tests/unit/model compare the
tables with transformers' own rotary implementations).
"""

from __future__ import annotations

import math

import torch

from kernels.reference import rope_inverse_frequencies, rope_tables_from
from model.config import ModelConfig, RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim / 2,) in fp32, attention factor) for ``scaling``."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, device)
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling), yarn_attention_factor(scaling)
    return inv_freq, 1.0


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_seq_len, rope_dim / 2) in fp32 for ``cfg``, the attention factor folded in."""
    inv_freq, factor = rope_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, device)
    return rope_tables_from(inv_freq, cfg.max_seq_len, factor)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    long_limit = s.original_max_seq_len / s.low_freq_factor  # longer: divided by factor
    short_limit = s.original_max_seq_len / s.high_freq_factor  # shorter: kept
    blend = (s.original_max_seq_len / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    out = torch.where(wavelength > long_limit, inv_freq / s.factor, inv_freq)
    return torch.where((wavelength >= short_limit) & (wavelength <= long_limit), between, out)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def pair_turning(turns: float) -> float:
        """The (fractional) pair index whose wavelength fits ``turns`` times into the original context."""
        return head_dim * math.log(s.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    index = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
    interpolated = ((index - low) / (high - low)).clamp(0, 1)  # 0: kept, 1: divided by factor
    return inv_freq / s.factor * interpolated + inv_freq * (1 - interpolated)


def yarn_attention_factor(s: RopeScaling) -> float:
    """What YaRN multiplies cos and sin by (module docstring)."""
    if s.attention_factor is not None:
        return s.attention_factor

    def magnitude(m: float) -> float:
        return 1.0 if s.factor <= 1 else 0.1 * m * math.log(s.factor) + 1.0

    if s.mscale and s.mscale_all_dim:
        return magnitude(s.mscale) / magnitude(s.mscale_all_dim)
    return magnitude(1.0)


def latent_softmax_gain(s: RopeScaling) -> float:
    """What DeepSeek's latent attention multiplies its softmax scale by under YaRN: the square of
    the mscale_all_dim magnitude, 0.1 mscale_all_dim ln(factor) + 1 (1 without YaRN or that key)."""
    if s.type != "yarn" or not s.mscale_all_dim or s.factor <= 1:
        return 1.0
    return (0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0) ** 2
