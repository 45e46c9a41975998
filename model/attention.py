"""Attention backends behind one interface: core(q, k, v) -> out, all (B, T, H, D), causal.

- flash_attn: the flash-attn package (CUDA compute capability >= 8.0, fp16/bf16, head_dim <= 256).
  Imported only here.
- sdpa: torch.nn.functional.scaled_dot_product_attention (picks its own fused kernel).
- reference: explicit QK^T / sqrt(d), causal mask, softmax, dropout, @V. It materializes the
  (B, H, T, T) scores, which is what the memory tools measure against.

``select_attention`` resolves ``auto`` and explains the choice in one line for the log.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BACKENDS = ("flash_attn", "sdpa", "reference")
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 builds its kernels for Ampere, Ada and Hopper only


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_attention(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """Resolve model.attention to a concrete backend, with the reason."""
    flash_ok, flash_why = _flash_usable(device, dtype, head_dim)
    if requested == "auto":
        if flash_ok:
            return "flash_attn", "attention: flash_attn (auto: package installed, CUDA >= sm80, half precision)"
        return "sdpa", f"attention: sdpa (auto: flash_attn not used because {flash_why})"
    if requested == "flash_attn" and not flash_ok:
        from training.errors import CapabilityError

        raise CapabilityError(
            f"model.attention=flash_attn cannot run: {flash_why}; "
            "install with `pip install perfgpt[flash]` on a CUDA machine or use model.attention=sdpa"
        )
    return requested, f"attention: {requested} (requested)"


def _flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"device is {device.type}, flash-attn needs CUDA"
    if not flash_attn_available():
        return False, "the flash_attn package is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FLASH_MIN_CAPABILITY:
        return False, f"this GPU has compute capability {major}.{minor}, flash-attn 2 needs 8.0 or newer (Ampere on)"
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"compute dtype is {dtype}, flash-attn needs fp16/bf16"
    if head_dim > 256:
        return False, f"head_dim={head_dim} > 256"
    return True, ""


class AttentionCore(nn.Module):
    """The part Korthikanti-style selective recompute re-runs: scores, softmax, dropout, @V."""

    def __init__(self, backend: str, dropout: float):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.backend == "flash_attn":
            from flash_attn import flash_attn_func

            return flash_attn_func(q, k, v, dropout_p=p, causal=True)  # takes (B, T, H, D) directly
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if self.backend == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            out = reference_attention(q, k, v, p)
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"backend={self.backend}, dropout={self.dropout}"


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + causal mask) V on (B, H, T, D); softmax in fp32."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v
