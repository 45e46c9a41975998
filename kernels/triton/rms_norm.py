"""Fused RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * weight.

Same layout as layer_norm.py: fp32 statistics, output in the input dtype, rows up to
``MAX_BLOCK_N`` columns in registers and wider rows in blocks; the backward recomputes x/rms from
the saved 1/rms and reduces the weight gradient through per-group fp32 partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels.triton._common import (
    as_rows,
    block_size,
    interpreter_active,
    kernel_op,
    num_warps_for,
    row_groups,
    unsupported_tensor_reason,
)

INTERPRETED = interpreter_active()
MAX_BLOCK_N = 8192


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, stride_x, stride_y, n_cols, eps,
    BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + c, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    X, W, DY, DX, RSTD, DW_PARTIAL,
    stride_x, stride_dy, stride_dx, n_rows, n_cols, rows_per_group,
    BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    group = tl.program_id(0)
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    x_row = X + row_start.to(tl.int64) * stride_x
    dy_row = DY + row_start.to(tl.int64) * stride_dy
    dx_row = DX + row_start.to(tl.int64) * stride_dx
    partial = group.to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for row in range(row_start, row_end):
            rstd = tl.load(RSTD + row)
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            xhat = x * rstd
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / n_cols
            tl.store(dx_row + cols, ((wdy - xhat * c1) * rstd).to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            x_row += stride_x
            dy_row += stride_dy
            dx_row += stride_dx
        tl.store(DW_PARTIAL + partial + cols, dw, mask=mask)
    else:
        for row in range(row_start, row_end):
            rstd = tl.load(RSTD + row)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                acc += x * rstd * w * dy
            c1 = tl.sum(acc, axis=0) / n_cols
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                xhat = x * rstd
                tl.store(dx_row + c, ((w * dy - xhat * c1) * rstd).to(DX.dtype.element_ty), mask=mask)
                # This group's own row of the partial buffer: read-modify-write without races.
                dw_ptr = DW_PARTIAL + partial + c
                tl.store(dw_ptr, tl.load(dw_ptr, mask=mask, other=0.0) + dy * xhat, mask=mask)
            x_row += stride_x
            dy_row += stride_dy
            dx_row += stride_dx


def _launch_params(n_cols: int) -> tuple[int, bool, int]:
    block = block_size(n_cols, MAX_BLOCK_N)
    return block, block >= n_cols, num_warps_for(block)


def _fwd_shapes(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32))


@kernel_op("rms_norm_fwd", fake=_fwd_shapes)
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y shaped like x, rstd)."""
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(n_rows, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block, one_block, num_warps = _launch_params(n_cols)
    wrap_triton(_rms_norm_fwd_kernel)[(n_rows,)](
        rows, weight, y_rows, rstd, rows.stride(0), y_rows.stride(0), n_cols, eps,
        BLOCK_N=block, ONE_BLOCK=one_block, num_warps=num_warps,
    )
    return y, rstd


def _bwd_shapes(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@kernel_op("rms_norm_bwd", fake=_bwd_shapes)
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx shaped like x, dweight) in the dtypes of x and weight."""
    rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = rows.shape
    weight = weight.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx_rows = dx.view(n_rows, n_cols)
    groups, rows_per_group = row_groups(n_rows, x.device)
    block, one_block, num_warps = _launch_params(n_cols)
    # The blocked path accumulates into the partial buffer, so it must start at zero.
    alloc = torch.empty if one_block else torch.zeros
    dw_partial = alloc((groups, n_cols), dtype=torch.float32, device=x.device)
    wrap_triton(_rms_norm_bwd_kernel)[(groups,)](
        rows, weight, dy_rows, dx_rows, rstd, dw_partial,
        rows.stride(0), dy_rows.stride(0), dx_rows.stride(0), n_rows, n_cols, rows_per_group,
        BLOCK_N=block, ONE_BLOCK=one_block, num_warps=num_warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)


def _save_for_backward(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    rstd = output[1]
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_fwd.register_autograd(_backward, setup_context=_save_for_backward)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_fwd(x, weight, eps)[0]


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    """Why this call must go to the reference, or None."""
    reason = unsupported_tensor_reason(x=x, weight=weight)
    if reason:
        return reason
    width = x.shape[-1] if x.dim() else 0
    if weight.shape != (width,):
        return f"weight shape {tuple(weight.shape)} does not match the last dim of x ({width})"
    return None
