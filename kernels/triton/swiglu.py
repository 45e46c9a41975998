"""Fused SwiGLU: y = silu(gate) * up, computed in fp32, output in the input dtype.

gate and up may be strided views (the two halves of one fused projection): rows are read through
their own strides, so chunked views are not copied. One program per (rows, columns) tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels.triton._common import as_rows, interpreter_active, kernel_op, unsupported_tensor_reason

INTERPRETED = interpreter_active()
MAX_BLOCK_N = 1024
TILE_ELEMENTS = 4096


@triton.jit
def _swiglu_fwd_kernel(
    GATE, UP, Y, stride_gate, stride_up, stride_y, n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g = tl.load(GATE + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    GATE, UP, DY, DGATE, DUP, stride_gate, stride_up, stride_dy, stride_dgrad, n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g = tl.load(GATE + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig + g * sig * (1 - sig)
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DGATE + rows * stride_dgrad + cols, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + rows * stride_dgrad + cols, (dy * silu).to(DUP.dtype.element_ty), mask=mask)


def _grid_and_tile(n_rows: int, n_cols: int) -> tuple[tuple[int, int], dict]:
    block_n = min(triton.next_power_of_2(n_cols), MAX_BLOCK_N)
    block_m = min(max(1, TILE_ELEMENTS // block_n), triton.next_power_of_2(n_rows))
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    return grid, dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 2048 else 8)


def _fwd_shape(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@kernel_op("swiglu_fwd", fake=_fwd_shape)
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y shaped like gate."""
    g_rows, u_rows = as_rows(gate), as_rows(up)
    n_rows, n_cols = g_rows.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    y_rows = y.view(n_rows, n_cols)
    grid, tile = _grid_and_tile(n_rows, n_cols)
    wrap_triton(_swiglu_fwd_kernel)[grid](
        g_rows, u_rows, y_rows, g_rows.stride(0), u_rows.stride(0), y_rows.stride(0), n_rows, n_cols, **tile
    )
    return y


def _bwd_shapes(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(gate, memory_format=torch.contiguous_format))


@kernel_op("swiglu_bwd", fake=_bwd_shapes)
def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) shaped like gate, in the input dtype."""
    g_rows, u_rows, dy_rows = as_rows(gate), as_rows(up), as_rows(dy)
    n_rows, n_cols = g_rows.shape
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty_like(dgate)
    dgate_rows, dup_rows = dgate.view(n_rows, n_cols), dup.view(n_rows, n_cols)
    grid, tile = _grid_and_tile(n_rows, n_cols)
    wrap_triton(_swiglu_bwd_kernel)[grid](
        g_rows, u_rows, dy_rows, dgate_rows, dup_rows,
        g_rows.stride(0), u_rows.stride(0), dy_rows.stride(0), dgate_rows.stride(0), n_rows, n_cols, **tile,
    )
    return dgate, dup


def _save_for_backward(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(dy, gate, up)


swiglu_fwd.register_autograd(_backward, setup_context=_save_for_backward)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_fwd(gate, up)


def unsupported_reason(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Why this call must go to the reference, or None."""
    reason = unsupported_tensor_reason(gate=gate, up=up)
    if reason:
        return reason
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ (no broadcasting)"
    if gate.dim() == 0:
        return "0-d inputs"
    return None
