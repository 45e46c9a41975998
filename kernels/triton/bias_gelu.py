"""Fused bias + GELU: y = GELU(x + bias), tanh (GPT-2) or exact (erf) form, computed in fp32.

Forward: one program per (rows, columns) tile. Backward: the same tiles for dx, with each program
walking a group of row tiles so the bias gradient is summed in registers and written as one fp32
partial row per group; the host adds the partial rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels.triton._common import (
    as_rows,
    gelu,
    gelu_grad,
    interpreter_active,
    kernel_op,
    parallel_programs,
    unsupported_tensor_reason,
)

INTERPRETED = interpreter_active()
MAX_BLOCK_N = 1024
TILE_ELEMENTS = 4096
APPROXIMATIONS = ("tanh", "none")


@triton.jit
def _bias_gelu_fwd_kernel(
    X, BIAS, Y, stride_x, stride_y, n_rows, n_cols,
    HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], gelu(z, EXACT).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    X, BIAS, DY, DX, DBIAS_PARTIAL, stride_x, stride_dy, stride_dx, n_rows, n_cols, rows_per_group,
    HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dbias = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    for tile_start in range(row_start, row_end, BLOCK_M):
        rows = tile_start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < row_end) & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        z = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += bias
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = dy * gelu_grad(z, EXACT)  # masked lanes have dy = 0, so they add nothing to dbias
        tl.store(DX + rows64 * stride_dx + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)
        dbias += dz
    if HAS_BIAS:
        tl.store(DBIAS_PARTIAL + group.to(tl.int64) * n_cols + cols, tl.sum(dbias, axis=0), mask=col_mask)


def _tile(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): about TILE_ELEMENTS elements per program."""
    block_n = min(triton.next_power_of_2(n_cols), MAX_BLOCK_N)
    block_m = min(max(1, TILE_ELEMENTS // block_n), triton.next_power_of_2(n_rows))
    return block_m, block_n, 4 if block_m * block_n <= 2048 else 8


def _fwd_shape(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@kernel_op("bias_gelu_fwd", fake=_fwd_shape)
def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """y shaped like x."""
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(n_rows, n_cols)
    block_m, block_n, num_warps = _tile(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    wrap_triton(_bias_gelu_fwd_kernel)[grid](
        rows, bias if bias is not None else rows, y_rows, rows.stride(0), y_rows.stride(0), n_rows, n_cols,
        HAS_BIAS=bias is not None, EXACT=approximate == "none", BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y


def _bwd_shapes(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dbias = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dbias


@kernel_op("bias_gelu_bwd", fake=_bwd_shapes)
def bias_gelu_bwd(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx shaped like x, dbias in the bias dtype); dbias is empty without a bias (an op returns
    tensors, never None)."""
    rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = rows.shape
    bias = bias.contiguous() if bias is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx_rows = dx.view(n_rows, n_cols)
    block_m, block_n, num_warps = _tile(n_rows, n_cols)
    col_blocks = triton.cdiv(n_cols, block_n)
    row_tiles = triton.cdiv(n_rows, block_m)
    groups = max(1, min(row_tiles, triton.cdiv(parallel_programs(x.device), col_blocks)))
    rows_per_group = triton.cdiv(row_tiles, groups) * block_m
    groups = triton.cdiv(n_rows, rows_per_group)
    dbias_partial = torch.empty((groups, n_cols), dtype=torch.float32, device=x.device) if bias is not None else dx_rows
    wrap_triton(_bias_gelu_bwd_kernel)[(groups, col_blocks)](
        rows, bias if bias is not None else rows, dy_rows, dx_rows, dbias_partial,
        rows.stride(0), dy_rows.stride(0), dx_rows.stride(0), n_rows, n_cols, rows_per_group,
        HAS_BIAS=bias is not None, EXACT=approximate == "none", BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    dbias = dbias_partial.sum(0).to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx, dbias


def _save_for_backward(ctx, inputs, output) -> None:
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = bias_gelu_bwd(dy, x, bias, ctx.approximate)
    return dx, dbias if bias is not None else None, None


bias_gelu_fwd.register_autograd(_backward, setup_context=_save_for_backward)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> torch.Tensor:
    """GELU(x + bias) over the last dim of x; approximate='tanh' (GPT-2) or 'none' (exact erf)."""
    return bias_gelu_fwd(x, bias, approximate)


def unsupported_reason(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> str | None:
    """Why this call must go to the reference, or None."""
    if approximate not in APPROXIMATIONS:
        return f"approximate={approximate!r} (the kernel has {APPROXIMATIONS})"
    reason = unsupported_tensor_reason(x=x, bias=bias)
    if reason:
        return reason
    width = x.shape[-1] if x.dim() else 0
    if bias is not None and bias.shape != (width,):
        return f"bias shape {tuple(bias.shape)} does not match the last dim of x ({width})"
    return None
