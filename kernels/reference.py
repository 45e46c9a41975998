"""Plain-PyTorch definitions of the fused ops: the CPU path and the oracle the kernels are tested against.

Every function computes its reductions in fp32 and returns the input dtype, so a bf16 model gets
fp32 normalization statistics without keeping fp32 weights (the chapter's "LayerNorm back to
fp32" inside a bf16 model receives bf16 inputs; casting in and out is what makes that work).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    w = weight.float()
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def layer_norm_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, approximate: str = "tanh"
) -> torch.Tensor:
    """GELU(LayerNorm(x)), both in fp32, returned in the input dtype (the fused kernel's epilogue form)."""
    w = weight.float()
    b = bias.float() if bias is not None else None
    y = F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)
    return F.gelu(y, approximate=approximate).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> torch.Tensor:
    """GELU(x + bias); approximate='tanh' is GPT-2's GELU, 'none' the exact erf form."""
    if bias is not None:
        x = x + bias
    if approximate == "tanh" and x.device.type == "cpu" and torch.compiler.is_compiling():
        return TanhGeluViaSigmoid.apply(x)
    return F.gelu(x, approximate=approximate)


_GELU_K = 2.0 * math.sqrt(2.0 / math.pi)  # tanh-GELU = x * sigmoid(_GELU_K * (x + _GELU_A * x^3))
_GELU_A = 0.044715


class TanhGeluViaSigmoid(torch.autograd.Function):
    """GPT-2's tanh-GELU written through 0.5 * (1 + tanh(z)) = sigmoid(2z), for Inductor on CPU.

    The same function, spelled so that Inductor's CPU code evaluates an exponential, which torch's
    CPU code does much faster than a tanh (docs/profiling.md; ``tools/bench_peers.py --profile``
    measures the whole step). Only the input is saved, as aten's GELU saves it: the backward
    recomputes the sigmoid inside the same fused kernel, so a compiled model keeps the same
    activations. In eager mode separate kernels for each term cost more than aten's one GELU
    kernel, so eager never takes this.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x * (_GELU_K + (_GELU_K * _GELU_A) * x * x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x2 = x * x
        s = torch.sigmoid(x * (_GELU_K + (_GELU_K * _GELU_A) * x2))
        dz = _GELU_K + (3.0 * _GELU_K * _GELU_A) * x2  # d/dx of the sigmoid's argument
        return grad * s * (1.0 + x * dz * (1.0 - s))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Softmax cross-entropy over the last dim, computed in fp32; logits (N, V), targets (N,)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int, cross_entropy: Callable,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` against ``targets``, ``chunk_tokens`` rows at a
    time; h (..., C), weight (V, C), targets (...). Each chunk runs under activation checkpointing, so
    its (chunk x V) logits exist only while its loss is computed and again while its backward runs:
    the whole (tokens x V) logits never do. Chunks are summed by their counted targets (a chunk whose
    targets are all ``ignore_index`` adds nothing), so the value is the plain loss's up to float order.
    """
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    counted = targets != ignore_index

    def chunk_sum(rows: torch.Tensor, chunk_targets: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return cross_entropy(rows @ weight.t(), chunk_targets, ignore_index=ignore_index) * n

    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        n = counted[start:start + chunk_tokens].sum()
        if n:
            part = checkpoint(chunk_sum, h[start:start + chunk_tokens], targets[start:start + chunk_tokens], n,
                              use_reentrant=False)
            total = total + part
    return total / counted.sum()


def rope_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """(head_dim // 2,) fp32: theta^(-2i / head_dim), the angle per position of each dimension pair."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_tables_from(inv_freq: torch.Tensor, seq_len: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq_len, len(inv_freq)) in fp32 of position * inv_freq, each multiplied by ``scale``."""
    angles = torch.outer(torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32), inv_freq)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2), in fp32: plain rotary frequencies."""
    return rope_tables_from(rope_inverse_frequencies(head_dim, theta, device), seq_len)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Rotate x (B, T, H, D) by position; the two halves of the head dim form the (re, im) pairs.

    cos and sin are (T' >= T, D/2), or (B, T, D/2) when each row has its own positions (documents
    that restart them); inplace=True writes the result into x and returns x.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    if cos.dim() == 3:
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, T, 1, D/2)
    else:
        c = cos[: x.shape[1]].unsqueeze(1)  # (T, 1, D/2), broadcast over heads
        s = sin[: x.shape[1]].unsqueeze(1)
    out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)
    return x.copy_(out) if inplace else out


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped from above and up on both sides at ``limit``, then
    (up + 1) * gate * sigmoid(alpha * gate). The clamps keep a rare huge activation finite in
    low precision; the + 1 lets the up projection pass the gate through at zero."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(alpha * gate))


def moe_permute(x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token rows x (T, C) -> one row per kept assignment (A, C): row i is token slots[i] // top_k.
    ``slots`` are flat (token, choice) indices t*top_k + j, sorted by expert (model/moe.py)."""
    return x[slots // top_k]


def moe_unpermute(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs y (A, C) back to their tokens: (T, C) = sum over a token's slots of weight * row.

    Each (token, slot) is written once and summed in a fixed order, so the result does not depend
    on thread scheduling (a scatter-add would); dropped slots stay zero.
    """
    t, k = weights.shape
    per_slot = y.new_zeros(t * k, y.shape[-1]).index_copy(0, slots, y)
    return (per_slot.view(t, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)
