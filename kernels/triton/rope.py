"""Rotary position embedding for x (B, T, H, D), in place or out of place, q and k alike.

The two halves of the head dim are the (real, imaginary) parts: out = (x1*cos - x2*sin,
x1*sin + x2*cos), computed in fp32 with cos/sin (T' >= T, D/2) and stored in x's dtype. The
backward is the inverse rotation (sin negated) applied to the gradient, so nothing is saved.

x is read through its strides, so q and k sliced out of one fused QKV projection are not copied;
in place, the rotated values overwrite x (see ``apply_rope`` for how that meets autograd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels import reference
from kernels.triton._common import interpreter_active, kernel_op, unsupported_tensor_reason

INTERPRETED = interpreter_active()
MAX_HEAD_DIM = 1024
HEAD_TILE_ELEMENTS = 2048


@triton.jit
def _rope_kernel(
    X, Y, COS, SIN, seq_len, n_heads, half,
    stride_xb, stride_xt, stride_xh, stride_yb, stride_yt, stride_yh, stride_cos, stride_sin,
    INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    position = tl.program_id(0)
    b = (position // seq_len).to(tl.int64)
    t = (position % seq_len).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    cos = tl.load(COS + t * stride_cos + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(SIN + t * stride_sin + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if INVERSE:
        sin = -sin
    mask = (heads[:, None] < n_heads) & d_mask[None, :]
    x_ptr = X + b * stride_xb + t * stride_xt + heads.to(tl.int64)[:, None] * stride_xh + d[None, :]
    y_ptr = Y + b * stride_yb + t * stride_yt + heads.to(tl.int64)[:, None] * stride_yh + d[None, :]
    # Both halves are loaded before either is stored, so Y may be X (in place).
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + half, (x1 * sin + x2 * cos).to(Y.dtype.element_ty), mask=mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool) -> None:
    """Write the rotation of x (B, T, H, D) into out (may be x itself); both need unit stride in D."""
    batch, seq_len, n_heads, head_dim = x.shape
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(n_heads), max(1, HEAD_TILE_ELEMENTS // block_half))
    grid = (batch * seq_len, triton.cdiv(n_heads, block_h))
    wrap_triton(_rope_kernel)[grid](
        x, out, cos, sin, seq_len, n_heads, half,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), sin.stride(0),
        INVERSE=inverse, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
    )


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_shape(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@kernel_op("rope", fake=_rope_shape)
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x rotated into a new tensor (by -angle when inverse: the backward)."""
    x = _unit_stride(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rotate(x, _unit_stride(cos), _unit_stride(sin), out, inverse)
    return out


def _rope_in_place_shape(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    return None


@kernel_op("rope_", fake=_rope_in_place_shape, mutates_args=("x",))
def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x rotated in place (x needs unit stride in D)."""
    rotate(x, _unit_stride(cos), _unit_stride(sin), x, False)


def _save_for_backward(ctx, inputs, output) -> None:
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rope(dy, cos, sin, not ctx.inverse), None, None, None


rope.register_autograd(_backward, setup_context=_save_for_backward)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Rotate x (B, T, H, D) by cos/sin (T' >= T, D/2); inplace=True overwrites x and returns it.

    An op that mutates its input cannot have an autograd formula, so where autograd records x,
    inplace=True rotates into a new tensor and copies it back (autograd sees the copy); without
    autograd (inference, a KV cache) it rotates x where it lies. Per-row tables (B, T, D/2), from
    positions that restart per document, take the PyTorch reference.
    """
    if cos.dim() == 3:
        return reference.apply_rope(x, cos, sin, inplace)
    if not inplace:
        return rope(x, cos, sin, False)
    if torch.is_grad_enabled() and x.requires_grad:
        return x.copy_(rope(x, cos, sin, False))
    rope_(x, cos, sin)
    return x


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k with the same tables (q and k may have different head counts)."""
    return apply_rope(q, cos, sin, inplace), apply_rope(k, cos, sin, inplace)


def unsupported_reason(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> str | None:
    """Why this call must go to the reference, or None."""
    reason = unsupported_tensor_reason(x=x, cos=cos, sin=sin)
    if reason:
        return reason
    if x.dim() != 4:
        return f"x has shape {tuple(x.shape)}; the kernel takes (B, T, H, D)"
    seq_len, head_dim = x.shape[1], x.shape[3]
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        return f"head_dim={head_dim}; the kernel takes an even head_dim <= {MAX_HEAD_DIM}"
    expected = f"(>= {seq_len}, {head_dim // 2})"
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] < seq_len or table.shape[1] != head_dim // 2:
            return f"{name} has shape {tuple(table.shape)}, expected {expected}"
        if table.requires_grad:
            return f"{name} requires grad; the kernel treats the tables as constants"
    if inplace and x.stride(-1) != 1:
        return "in-place rotation of x with a non-unit stride in the head dim"
    return None
