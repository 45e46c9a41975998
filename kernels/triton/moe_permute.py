"""MoE token routing: permute (token rows to their experts' slots) and unpermute (expert outputs back
to their tokens, weighted and summed), forward and backward, as gathers only.

    permute    rows[i] = x[slots[i] // k]                     (A, C) from x (T, C)
    unpermute  out[t]  = sum_j w[t, j] * y[pos[t * k + j]]     (T, C) from y (A, C); pos: the row that
                                                               holds slot t*k + j, -1 where it was dropped

``slots`` (A,) are the kept (token, choice) assignments t*k + j, sorted by expert (model/moe.py's
``permute``). Every output row is written by one program, read from wherever its inputs are, so no
two programs write the same row: no atomics (Triton has none for bf16, and fp32 ones would make the
sums depend on scheduling). Permute's backward is unpermute's gather-sum with unit weights (a token's
gradient is the sum over its kept copies); unpermute's backward gathers each row's dy, times the row's
weight, and takes the row's dot product with dy for the weight's gradient. Sums run in fp32; outputs
come in the rows' dtype, the weights' gradient in the weights' dtype. One program per BLOCK_M rows
(tokens), the columns in steps of BLOCK_N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels.triton._common import as_rows, interpreter_active, kernel_op, unsupported_tensor_reason

INTERPRETED = interpreter_active()
MAX_BLOCK_N = 256
TILE_ELEMENTS = 4096


@triton.jit
def _permute_fwd_kernel(X, SRC, OUT, stride_x, stride_out, n_rows, n_cols, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    src = tl.load(SRC + rows, mask=row_mask, other=0)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        v = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :], v, mask=mask)


@triton.jit
def _sum_slots_kernel(ROWS, POS, W, OUT, stride_rows, stride_out, n_tokens, n_cols, K: tl.constexpr,
                      HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    token_mask = tokens < n_tokens
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = (cols < n_cols)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(K):  # a token's slots in order: the sum does not depend on scheduling
            pos = tl.load(POS + tokens * K + j, mask=token_mask, other=-1)
            kept = token_mask & (pos >= 0)
            v = tl.load(ROWS + pos[:, None] * stride_rows + cols[None, :], mask=kept[:, None] & col_mask,
                        other=0.0).to(tl.float32)
            if HAS_W:
                w = tl.load(W + tokens * K + j, mask=token_mask, other=0.0).to(tl.float32)
                v = v * w[:, None]
            acc += v
        tl.store(OUT + tokens[:, None] * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=token_mask[:, None] & col_mask)


@triton.jit
def _unpermute_bwd_kernel(DY, Y, SRC, W, DROWS, DW, stride_dy, stride_y, stride_drows, n_rows, n_cols,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    src = tl.load(SRC + rows, mask=row_mask, other=0)
    w = tl.load(W + rows, mask=row_mask, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        dy = tl.load(DY + src[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DROWS + rows[:, None] * stride_drows + cols[None, :], (dy * w[:, None]).to(DROWS.dtype.element_ty),
                 mask=mask)
        dot += tl.sum(dy * y, axis=1)
    tl.store(DW + rows, dot, mask=row_mask)


def _grid_and_tile(n_rows: int, n_cols: int) -> tuple[tuple[int], dict]:
    block_n = min(triton.next_power_of_2(n_cols), MAX_BLOCK_N)
    block_m = min(max(1, TILE_ELEMENTS // block_n), triton.next_power_of_2(n_rows))
    return (triton.cdiv(n_rows, block_m),), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)


def _slot_rows(slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """(T*k,) the row of each slot in the permuted rows, -1 for a dropped slot."""
    return torch.full((n_slots,), -1, dtype=torch.int64, device=slots.device).index_copy(
        0, slots, torch.arange(slots.numel(), dtype=torch.int64, device=slots.device))


# --------------------------------------------------------------------------- permute


def _permute_shape(x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    return x.new_empty((slots.shape[0], x.shape[-1]))


@kernel_op("moe_permute_fwd", fake=_permute_shape)
def moe_permute_fwd(x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """(A, C): row i is token slots[i] // top_k of x (T, C)."""
    x_rows = as_rows(x)
    n_rows, n_cols = slots.shape[0], x_rows.shape[1]
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    grid, tile = _grid_and_tile(n_rows, n_cols)
    wrap_triton(_permute_fwd_kernel)[grid](x_rows, slots // top_k, out, x_rows.stride(0), out.stride(0), n_rows,
                                           n_cols, **tile)
    return out


def _permute_setup(ctx, inputs, output) -> None:
    x, slots, top_k = inputs
    ctx.save_for_backward(slots)
    ctx.n_tokens, ctx.top_k = x.shape[0], top_k


def _permute_backward(ctx, drows):
    (slots,) = ctx.saved_tensors
    return moe_unpermute_fwd(drows, slots, None, ctx.n_tokens, ctx.top_k), None, None


moe_permute_fwd.register_autograd(_permute_backward, setup_context=_permute_setup)


# --------------------------------------------------------------------------- unpermute


def _unpermute_shape(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None, n_tokens: int,
                     top_k: int) -> torch.Tensor:
    return y.new_empty((n_tokens, y.shape[-1]))


@kernel_op("moe_unpermute_fwd", fake=_unpermute_shape)
def moe_unpermute_fwd(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None, n_tokens: int,
                      top_k: int) -> torch.Tensor:
    """(n_tokens, C): each token's kept rows of y (A, C), times their weight (T, k) (none: 1), summed."""
    y_rows = as_rows(y)
    n_cols = y_rows.shape[1]
    out = torch.empty((n_tokens, n_cols), dtype=y.dtype, device=y.device)
    pos = _slot_rows(slots, n_tokens * top_k)
    w = weights.contiguous() if weights is not None else pos  # not read without weights (HAS_W)
    grid, tile = _grid_and_tile(n_tokens, n_cols)
    wrap_triton(_sum_slots_kernel)[grid](y_rows, pos, w, out, y_rows.stride(0), out.stride(0), n_tokens, n_cols,
                                         K=top_k, HAS_W=weights is not None, **tile)
    return out


def _unpermute_bwd_shapes(dy: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


@kernel_op("moe_unpermute_bwd", fake=_unpermute_bwd_shapes)
def moe_unpermute_bwd(dy: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy of the rows (A, C) in y's dtype, dweights (T, k) in the weights' dtype)."""
    dy_rows, y_rows = as_rows(dy), as_rows(y)
    n_rows, n_cols = y_rows.shape
    top_k = weights.shape[1]
    drows = torch.empty((n_rows, n_cols), dtype=y.dtype, device=y.device)
    dw_rows = torch.empty((n_rows,), dtype=torch.float32, device=y.device)
    grid, tile = _grid_and_tile(n_rows, n_cols)
    wrap_triton(_unpermute_bwd_kernel)[grid](
        dy_rows, y_rows, slots // top_k, weights.reshape(-1)[slots], drows, dw_rows,
        dy_rows.stride(0), y_rows.stride(0), drows.stride(0), n_rows, n_cols, **tile,
    )
    dweights = torch.zeros(weights.numel(), dtype=torch.float32, device=y.device).index_copy(0, slots, dw_rows)
    return drows, dweights.view(weights.shape).to(weights.dtype)


def _unpermute_setup(ctx, inputs, output) -> None:
    y, slots, weights, n_tokens, top_k = inputs
    ctx.save_for_backward(y, slots, weights)
    ctx.top_k = top_k


def _unpermute_backward(ctx, dy):
    y, slots, weights = ctx.saved_tensors
    if weights is None:  # permute's backward, differentiated once more: a gather back to the rows
        return moe_permute_fwd(dy, slots, ctx.top_k), None, None, None, None
    drows, dweights = moe_unpermute_bwd(dy, y, slots, weights)
    return drows, None, dweights, None, None


moe_unpermute_fwd.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# --------------------------------------------------------------------------- the ops the model calls


def moe_permute(x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    return moe_permute_fwd(x, slots, top_k)


def moe_unpermute(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return moe_unpermute_fwd(y, slots, weights, weights.shape[0], weights.shape[1])


def _slots_reason(slots: torch.Tensor, rows: torch.Tensor, n_slots: int) -> str | None:
    if slots.dtype != torch.int64 or slots.dim() != 1:
        return f"slots are {slots.dtype} of shape {tuple(slots.shape)}; the kernels take int64 (A,)"
    if slots.device != rows.device:
        return f"slots are on {slots.device}, the rows on {rows.device}"
    if slots.numel() == 0:
        return "no token copies were kept (slots are empty)"
    if slots.numel() > n_slots:
        return f"{slots.numel()} slots for {n_slots} (token, choice) assignments"
    return None


def permute_unsupported_reason(x: torch.Tensor, slots: torch.Tensor, top_k: int) -> str | None:
    """Why this permute must go to the reference, or None."""
    reason = unsupported_tensor_reason(x=x)
    if reason:
        return reason
    if x.dim() != 2:
        return f"x has shape {tuple(x.shape)}; the kernel takes token rows (T, C)"
    return _slots_reason(slots, x, x.shape[0] * top_k)


def unpermute_unsupported_reason(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> str | None:
    """Why this unpermute must go to the reference, or None."""
    reason = unsupported_tensor_reason(y=y, weights=weights)
    if reason:
        return reason
    if y.dim() != 2 or weights.dim() != 2:
        return f"y {tuple(y.shape)} and weights {tuple(weights.shape)}: the kernel takes (A, C) rows and (T, k) weights"
    if y.shape[0] != slots.shape[0]:
        return f"{y.shape[0]} rows for {slots.shape[0]} slots"
    return _slots_reason(slots, y, weights.numel())


# The registry's check per function of this file (the two ops take different arguments).
UNSUPPORTED_REASONS = {"moe_permute": permute_unsupported_reason, "moe_unpermute": unpermute_unsupported_reason}
