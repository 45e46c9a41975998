"""Fused LayerNorm over the last dim, optionally followed by GELU (``layer_norm_gelu``).

Statistics are accumulated in fp32, padded lanes are masked out of the variance, and the output
has the input's dtype. Rows up to ``MAX_BLOCK_N`` columns are held in registers; wider rows are
processed in blocks. The backward recomputes the normalized input (and the GELU input) from the
saved mean and 1/std instead of storing them.

Forward: one program per row. Backward: one program per group of rows, each producing fp32
partial sums of the weight and bias gradients that the host adds up (no atomics, so bf16
weights work and the result does not depend on scheduling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels.triton._common import (
    as_rows,
    block_size,
    gelu,
    gelu_grad,
    interpreter_active,
    kernel_op,
    num_warps_for,
    row_groups,
    unsupported_tensor_reason,
)

INTERPRETED = interpreter_active()
MAX_BLOCK_N = 8192
GELU_VARIANTS = ("tanh", "none")


@triton.jit
def _load_params(W, B, cols, mask, HAS_BIAS: tl.constexpr):
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros_like(w)
    return w, b


@triton.jit
def _affine_epilogue(xhat, w, b, GELU: tl.constexpr, EXACT_GELU: tl.constexpr):
    y = xhat * w + b
    if GELU:
        y = gelu(y, EXACT_GELU)
    return y


@triton.jit
def _grad_through_epilogue(dout, xhat, w, b, GELU: tl.constexpr, EXACT_GELU: tl.constexpr):
    """The gradient at the affine output, given the gradient at the kernel's output."""
    if GELU:
        dout = dout * gelu_grad(xhat * w + b, EXACT_GELU)
    return dout


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    stride_x, stride_y, n_cols, eps,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EXACT_GELU: tl.constexpr,
    BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        # Padded lanes hold 0 - mean: left in, they would add (BLOCK_N - n_cols) * mean^2 to the variance.
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        w, b = _load_params(W, B, cols, mask, HAS_BIAS)
        y = _affine_epilogue(xc * rstd, w, b, GELU, EXACT_GELU)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            acc += tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / n_cols
        # Two passes (mean, then centred squares) rather than E[x^2] - mean^2, which cancels badly.
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean, 0.0)
            acc += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w, b = _load_params(W, B, c, mask, HAS_BIAS)
            y = _affine_epilogue((x - mean) * rstd, w, b, GELU, EXACT_GELU)
            tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    X, W, B, DY, DX, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL,
    stride_x, stride_dy, stride_dx, n_rows, n_cols, rows_per_group,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EXACT_GELU: tl.constexpr,
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
        w, b = _load_params(W, B, cols, mask, HAS_BIAS)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for row in range(row_start, row_end):
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            dout = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            dy = _grad_through_epilogue(dout, xhat, w, b, GELU, EXACT_GELU)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / n_cols
            c2 = tl.sum(wdy, axis=0) / n_cols
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
            x_row += stride_x
            dy_row += stride_dy
            dx_row += stride_dx
        tl.store(DW_PARTIAL + partial + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + partial + cols, db, mask=mask)
    else:
        for row in range(row_start, row_end):
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = c < n_cols
                w, b = _load_params(W, B, c, mask, HAS_BIAS)
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                dout = tl.load(dy_row + c, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                wdy = w * _grad_through_epilogue(dout, xhat, w, b, GELU, EXACT_GELU)
                acc1 += xhat * wdy
                acc2 += wdy
            c1 = tl.sum(acc1, axis=0) / n_cols
            c2 = tl.sum(acc2, axis=0) / n_cols
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = c < n_cols
                w, b = _load_params(W, B, c, mask, HAS_BIAS)
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                dout = tl.load(dy_row + c, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                dy = _grad_through_epilogue(dout, xhat, w, b, GELU, EXACT_GELU)
                dx = (w * dy - (xhat * c1 + c2)) * rstd
                tl.store(dx_row + c, dx.to(DX.dtype.element_ty), mask=mask)
                # This group's own row of the partial buffers: read-modify-write without races.
                dw_ptr = DW_PARTIAL + partial + c
                tl.store(dw_ptr, tl.load(dw_ptr, mask=mask, other=0.0) + dy * xhat, mask=mask)
                if HAS_BIAS:
                    db_ptr = DB_PARTIAL + partial + c
                    tl.store(db_ptr, tl.load(db_ptr, mask=mask, other=0.0) + dy, mask=mask)
            x_row += stride_x
            dy_row += stride_dy
            dx_row += stride_dx


def _launch_params(n_cols: int) -> tuple[int, bool, int]:
    block = block_size(n_cols, MAX_BLOCK_N)
    return block, block >= n_cols, num_warps_for(block)


def _fwd_shapes(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, gelu_variant: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rows = x.numel() // x.shape[-1]
    stats = x.new_empty(n_rows, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@kernel_op("layer_norm_fwd", fake=_fwd_shapes)
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, gelu_variant: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y shaped like x, mean, rstd); gelu_variant None, 'tanh' or 'none' (exact)."""
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    y_rows = y.view(n_rows, n_cols)
    block, one_block, num_warps = _launch_params(n_cols)
    wrap_triton(_layer_norm_fwd_kernel)[(n_rows,)](
        rows, weight, bias if bias is not None else weight, y_rows, mean, rstd,
        rows.stride(0), y_rows.stride(0), n_cols, eps,
        HAS_BIAS=bias is not None, GELU=gelu_variant is not None, EXACT_GELU=gelu_variant == "none",
        BLOCK_N=block, ONE_BLOCK=one_block, num_warps=num_warps,
    )
    return y, mean, rstd


def _bwd_shapes(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor,
    rstd: torch.Tensor, gelu_variant: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dbias = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), dbias


@kernel_op("layer_norm_bwd", fake=_bwd_shapes)
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor,
    rstd: torch.Tensor, gelu_variant: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx shaped like x, dweight, dbias) in the dtypes of x, weight and bias; dbias is empty without a bias
    (an op returns tensors, never None)."""
    rows, dy_rows = as_rows(x), as_rows(dy)
    n_rows, n_cols = rows.shape
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx_rows = dx.view(n_rows, n_cols)
    groups, rows_per_group = row_groups(n_rows, x.device)
    block, one_block, num_warps = _launch_params(n_cols)
    # The blocked path accumulates into the partial buffers, so they must start at zero.
    alloc = torch.empty if one_block else torch.zeros
    dw_partial = alloc((groups, n_cols), dtype=torch.float32, device=x.device)
    db_partial = alloc((groups, n_cols), dtype=torch.float32, device=x.device) if bias is not None else dw_partial
    wrap_triton(_layer_norm_bwd_kernel)[(groups,)](
        rows, weight, bias if bias is not None else weight, dy_rows, dx_rows, mean, rstd, dw_partial, db_partial,
        rows.stride(0), dy_rows.stride(0), dx_rows.stride(0), n_rows, n_cols, rows_per_group,
        HAS_BIAS=bias is not None, GELU=gelu_variant is not None, EXACT_GELU=gelu_variant == "none",
        BLOCK_N=block, ONE_BLOCK=one_block, num_warps=num_warps,
    )
    dweight = dw_partial.sum(0).to(weight.dtype)
    dbias = db_partial.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dx, dweight, dbias


def _save_for_backward(ctx, inputs, output) -> None:
    x, weight, bias, _, gelu_variant = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.gelu_variant = gelu_variant


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.gelu_variant)
    return dx, dweight, dbias if bias is not None else None, None, None


layer_norm_fwd.register_autograd(_backward, setup_context=_save_for_backward)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return layer_norm_fwd(x, weight, bias, eps, None)[0]


def layer_norm_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, approximate: str = "tanh"
) -> torch.Tensor:
    """GELU(LayerNorm(x)) in one pass; approximate='tanh' (GPT-2) or 'none' (exact erf)."""
    return layer_norm_fwd(x, weight, bias, eps, approximate)[0]


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, approximate: str = "tanh"
) -> str | None:
    """Why this call must go to the reference, or None; takes layer_norm's and layer_norm_gelu's arguments."""
    if approximate not in GELU_VARIANTS:
        return f"approximate={approximate!r} (the kernel has {GELU_VARIANTS})"
    reason = unsupported_tensor_reason(x=x, weight=weight, bias=bias)
    if reason:
        return reason
    width = x.shape[-1] if x.dim() else 0
    if weight.shape != (width,) or (bias is not None and bias.shape != (width,)):
        return f"weight/bias shape does not match the last dim of x ({width})"
    return None
