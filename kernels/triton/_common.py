"""What every Triton op file shares: device-side activation math and host-side helpers.

Host helpers decide launch parameters, say why a call is unsupported and register the launchers
as custom ops (:func:`kernel_op`); device helpers are ``@triton.jit`` functions inlined into the
kernels that call them.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# sqrt(2/pi) and the cubic coefficient of GPT-2's tanh GELU; 1/sqrt(2) and 1/sqrt(2*pi) for the erf form.
_GELU_K = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


def interpreter_active() -> bool:
    """Whether ``@triton.jit`` builds interpreted kernels now (Triton reads TRITON_INTERPRET then)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def language_interpreted() -> bool:
    """Whether triton.language's own jit functions (tl.sum, tl.sigmoid, ...) were built for the
    interpreter. They are decorated when triton.language is first imported, which ``import
    torch._dynamo`` already does, so TRITON_INTERPRET must be set before that."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


# Recorded when this file's kernels were decorated, so a later change of the flag is detectable.
INTERPRETED = interpreter_active()

OP_NAMESPACE = "perfgpt"


def kernel_op(name: str, fake: Callable, mutates_args: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Register a host launcher as the custom op ``perfgpt::<name>``, so that torch.compile puts
    one node in its graph where it would otherwise break the graph around an opaque call.

    Compiled Triton: a ``torch.library.triton_op``. AOTAutograd replaces the op by its body, the
    kernels launched through ``wrap_triton`` included, so Inductor schedules the kernels itself.
    The body is also the op's shape function (it is traced with fake tensors), so it may only
    launch kernels and call PyTorch ops.

    Interpreted (TRITON_INTERPRET=1): a ``triton_op`` cannot be traced there. ``wrap_triton``
    returns an interpreted kernel unchanged, and tracing the body with fake tensors then runs the
    interpreter on them, which reads their data pointers and fails. So the launcher becomes an
    opaque ``torch.library.custom_op`` whose shapes come from ``fake``: still one graph node, run
    as it is when called eagerly.

    Autograd is registered by the caller (``register_autograd``), in the op's module.
    """

    def register(launcher: Callable) -> Callable:
        qualified = f"{OP_NAMESPACE}::{name}"
        if interpreter_active():
            op = custom_op(qualified, launcher, mutates_args=tuple(mutates_args))
            op.register_fake(fake)
            return op
        return triton_op(qualified, launcher, mutates_args=tuple(mutates_args))

    return register


def unsupported_tensor_reason(**tensors: torch.Tensor | None) -> str | None:
    """Why these tensors cannot go to a Triton kernel (dtype, device, empty), or None when they can."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {t.dtype}; the kernels handle float32, float16 and bfloat16"
        if not t.is_cuda and not INTERPRETED:
            return f"{name} is on {t.device}; the kernels need CUDA (or TRITON_INTERPRET=1 on CPU)"
        if t.numel() == 0:
            return f"{name} is empty"
    return None


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., C) as (M, C) with unit column stride: a view when the layout allows, else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def block_size(width: int, max_block: int) -> int:
    """The power-of-two block that covers ``width`` columns, capped at ``max_block`` (then kernels loop)."""
    return min(triton.next_power_of_2(width), max_block)


def num_warps_for(block: int) -> int:
    """Enough warps that each thread holds at most 8-16 elements of a block, never more than 16
    (norm backwards at 4096 columns need 185 registers a thread with 8 warps, 104 with 16)."""
    if block >= 4096:
        return 16
    if block >= 2048:
        return 8
    return 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def parallel_programs(device: torch.device) -> int:
    """How many programs fill the device: a few per SM on CUDA; a handful in the interpreter,
    where programs run one after another and only the row-group bookkeeping needs exercising."""
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def row_groups(n_rows: int, device: torch.device) -> tuple[int, int]:
    """Split n_rows into (groups, rows per group) for kernels that reduce over rows per program."""
    groups = max(1, min(n_rows, parallel_programs(device)))
    rows_per_group = triton.cdiv(n_rows, groups)
    return triton.cdiv(n_rows, rows_per_group), rows_per_group


@triton.jit
def gelu_tanh(z):
    # tanh(u) = 2*sigmoid(2u) - 1, so 0.5*z*(1 + tanh(u)) = z*sigmoid(2u); triton.language has no tanh.
    u = _GELU_K * (z + _GELU_C * z * z * z)
    return z * tl.sigmoid(2.0 * u)


@triton.jit
def gelu_tanh_grad(z):
    u = _GELU_K * (z + _GELU_C * z * z * z)
    s = tl.sigmoid(2.0 * u)
    du = _GELU_K * (1.0 + 3.0 * _GELU_C * z * z)
    return s + z * s * (1.0 - s) * 2.0 * du


@triton.jit
def gelu_erf(z):
    return 0.5 * z * (1.0 + tl.math.erf(z * _INV_SQRT2))


@triton.jit
def gelu_erf_grad(z):
    cdf = 0.5 * (1.0 + tl.math.erf(z * _INV_SQRT2))
    return cdf + z * _INV_SQRT_2PI * tl.exp(-0.5 * z * z)


@triton.jit
def gelu(z, EXACT: tl.constexpr):
    if EXACT:
        return gelu_erf(z)
    else:
        return gelu_tanh(z)


@triton.jit
def gelu_grad(z, EXACT: tl.constexpr):
    if EXACT:
        return gelu_erf_grad(z)
    else:
        return gelu_tanh_grad(z)
