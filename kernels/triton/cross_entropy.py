"""Fused softmax cross-entropy over the vocabulary, without an fp32 copy of the logits or their gradient.

Forward: one program per row streams the row through an online logsumexp in blocks of
``MAX_BLOCK_V`` columns (fp32 accumulation) and stores the row's loss and logsumexp (8 bytes a row).
Backward: one program per row recomputes softmax from the saved logsumexp, block by block, and
writes (softmax - onehot) * scale straight into a gradient in the logits' dtype. The eager path
instead makes an fp32 copy of the logits, an fp32 log-softmax and an fp32 gradient.

Rows whose target equals ignore_index contribute 0 to the loss and get a zero gradient; 'mean'
divides by the number of other rows, like torch. A target outside [0, V) gives a NaN loss
(torch raises; a kernel cannot without a device sync), so it is never silently wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels.triton._common import interpreter_active, kernel_op, num_warps_for, unsupported_tensor_reason

INTERPRETED = interpreter_active()
MAX_BLOCK_V = 4096
REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS, TARGETS, LOSS, LSE, stride_row, n_cols, ignore_index, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        x = tl.load(row_ptr + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(TARGETS + row).to(tl.int64)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    target_logit = tl.load(row_ptr + target, mask=counted & in_range, other=float("nan")).to(tl.float32)
    loss = tl.where(counted, lse - target_logit, 0.0)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    LOGITS, TARGETS, LSE, DLOSS, DLOGITS, stride_row, stride_drow, stride_dloss, n_cols, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride_row
    drow_ptr = DLOGITS + row * stride_drow
    target = tl.load(TARGETS + row).to(tl.int64)
    lse = tl.load(LSE + row)
    # 'mean' over zero counted rows makes the scale inf; ignored rows must still get exact zeros.
    scale = tl.where(target != ignore_index, tl.load(DLOSS + row * stride_dloss).to(tl.float32), 0.0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        mask = c < n_cols
        x = tl.load(row_ptr + c, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)) * scale
        tl.store(drow_ptr + c, grad.to(DLOGITS.dtype.element_ty), mask=mask)


def _fwd_shapes(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    row_loss = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return row_loss, torch.empty_like(row_loss)


@kernel_op("cross_entropy_fwd", fake=_fwd_shapes)
def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row fp32 loss, per-row logsumexp)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)
    wrap_triton(_cross_entropy_fwd_kernel)[(n_rows,)](
        logits, targets, loss, lse, logits.stride(0), n_cols, ignore_index,
        BLOCK_V=block, num_warps=num_warps_for(block),
    )
    return loss, lse


def reduce_loss(row_loss: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """In PyTorch ops, so autograd hands the kernel one gradient per row (an expanded, stride-0 view
    of one value for 'mean' and 'sum')."""
    if reduction == "none":
        return row_loss
    if reduction == "sum":
        return row_loss.sum()
    return row_loss.sum() / (targets != ignore_index).sum()


def _bwd_shape(
    grad_rows: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@kernel_op("cross_entropy_bwd", fake=_bwd_shape)
def cross_entropy_bwd(
    grad_rows: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """d loss / d logits, (N, V) in the logits' dtype, given d loss / d row loss."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    n_rows, n_cols = logits.shape
    dlogits = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    grad_rows = grad_rows.float()
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)
    wrap_triton(_cross_entropy_bwd_kernel)[(n_rows,)](
        logits, targets, lse, grad_rows, dlogits, logits.stride(0), dlogits.stride(0), grad_rows.stride(0),
        n_cols, ignore_index, BLOCK_V=block, num_warps=num_warps_for(block),
    )
    return dlogits


def _save_for_backward(ctx, inputs, output) -> None:
    logits, targets, ignore_index = inputs
    lse = output[1]
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, targets, lse)
    ctx.ignore_index = ignore_index


def _backward(ctx, grad_rows, _dlse):
    logits, targets, lse = ctx.saved_tensors
    return cross_entropy_bwd(grad_rows, logits, targets, lse, ctx.ignore_index), None, None


cross_entropy_fwd.register_autograd(_backward, setup_context=_save_for_backward)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Softmax cross-entropy of logits (N, V) against class indices (N,); the loss is fp32."""
    row_loss, _ = cross_entropy_fwd(logits, targets, ignore_index)
    return reduce_loss(row_loss, targets, ignore_index, reduction)


def unsupported_reason(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> str | None:
    """Why this call must go to the reference, or None."""
    if reduction not in REDUCTIONS:
        return f"reduction={reduction!r} (the kernel has {REDUCTIONS})"
    reason = unsupported_tensor_reason(logits=logits)
    if reason:
        return reason
    if targets.dtype not in (torch.int64, torch.int32):
        return f"targets have dtype {targets.dtype}; the kernel takes class indices (int64/int32)"
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        return f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} are not (N, V) and (N,)"
    if targets.device != logits.device:
        return f"targets on {targets.device}, logits on {logits.device}"
    return None
