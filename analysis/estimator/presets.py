"""The chapter's models (``--preset`` of tools/estimate.py)."""

from __future__ import annotations

from dataclasses import dataclass

from analysis.estimator.job import EstimatorError
from model.config import ModelConfig


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: ModelConfig
    seq_len: int
    micro_batch: int
    world_size: int
    device: str


def preset(name: str) -> Preset:
    """The configurations the chapter's tables talk about (fresh objects on every call)."""
    builders = {
        "70b": _preset_70b,
        "gpt3-175b": _preset_gpt3,
        "llama2-7b": _preset_llama2_7b,
    }
    if name not in builders:
        raise EstimatorError(f"unknown preset {name!r}; choose one of: {', '.join(builders)}")
    return builders[name]()


PRESET_NAMES = ("70b", "gpt3-175b", "llama2-7b")


def _preset_70b() -> Preset:
    # The chapter's 8.2 table: h=8192, a=64, L=80, s=4096, b=4. A 4h GELU MLP and dropout, as
    # Korthikanti's formula assumes; the reference attention stores the scores as the paper does.
    cfg = ModelConfig(
        vocab_size=32000, max_seq_len=4096, n_layer=80, n_head=64, d_model=8192, mlp="gelu",
        position="rope", bias=False, tie_embeddings=False, dropout=0.1, attention="reference",
    )
    cfg.validate()
    return Preset("70b", "70B-class GPT (h=8192, a=64, L=80, 4h GELU MLP)", cfg, 4096, 4, 64, "H100")


def _preset_gpt3() -> Preset:
    # Brown et al. 2020 table 2.1: 96 layers, d=12288, 96 heads, context 2048; GPT-2's BPE vocabulary of
    # 50257 padded to 50304 (a multiple of 128), as Megatron-LM pads it (--make-vocab-size-divisible-by):
    # tensor parallelism splits the vocabulary, so tp must divide it, and 50257 = 29 x 1733 admits no
    # tp > 1. The 47 padding rows never see a token; they add 0.0003% to the parameters.
    cfg = ModelConfig(
        vocab_size=50304, max_seq_len=2048, n_layer=96, n_head=96, d_model=12288, mlp="gelu",
        position="learned", bias=True, tie_embeddings=True, dropout=0.0,
    )
    cfg.validate()
    return Preset("gpt3-175b", "GPT-3 175B (h=12288, a=96, L=96)", cfg, 2048, 1, 8, "H100")


def _preset_llama2_7b() -> Preset:
    # Touvron et al. 2023: 32 layers, d=4096, 32 heads, SwiGLU 11008, RMSNorm, RoPE, untied, 4k context.
    cfg = ModelConfig(
        vocab_size=32000, max_seq_len=4096, n_layer=32, n_head=32, d_model=4096, d_ff=11008, mlp="swiglu",
        norm="rmsnorm", position="rope", bias=False, tie_embeddings=False, dropout=0.0,
    )
    cfg.validate()
    return Preset("llama2-7b", "Llama-2-7B-like (h=4096, a=32, L=32, SwiGLU 11008)", cfg, 4096, 1, 8, "H100")
