"""Which implementation of each fused op the model calls.

The model asks for ops by name through a ``KernelOps`` value built once per run; it never
imports Triton. ``auto`` takes the Triton kernels on CUDA when Triton imports, and the PyTorch
reference otherwise; ``triton`` demands Triton (on CPU that means ``TRITON_INTERPRET=1``);
``torch`` is the reference. The choice and its reason are returned for the log.

With Triton chosen, each op still checks every call: shapes or dtypes its kernel does not handle
(float64, an odd head dim, a CPU tensor without the interpreter, ...) go to the reference, and
the reason is logged once per op and reason. A fallback costs speed, never correctness.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from common.errors import ConfigError
from common.fields import choices
from common.log import get_logger
from kernels import reference
from kernels.config import KernelsConfig
from kernels.triton import load_op_modules

logger = get_logger("kernels")

KERNEL_BACKENDS = choices(KernelsConfig, "backend")

# KernelOps field -> (Triton op file, function in it). The reference function has the field's name.
TRITON_OPS = {
    "layer_norm": ("layer_norm", "layer_norm"),
    "layer_norm_gelu": ("layer_norm", "layer_norm_gelu"),
    "rms_norm": ("rms_norm", "rms_norm"),
    "bias_gelu": ("bias_gelu", "bias_gelu"),
    "swiglu": ("swiglu", "swiglu"),
    "cross_entropy": ("cross_entropy", "cross_entropy"),
    "apply_rope": ("rope", "apply_rope"),
    "moe_permute": ("moe_permute", "moe_permute"),
    "moe_unpermute": ("moe_permute", "moe_unpermute"),
}


@dataclass(frozen=True)
class KernelOps:
    backend: str
    layer_norm: Callable
    rms_norm: Callable
    bias_gelu: Callable
    swiglu: Callable
    cross_entropy: Callable
    apply_rope: Callable
    layer_norm_gelu: Callable = reference.layer_norm_gelu
    moe_permute: Callable = reference.moe_permute
    moe_unpermute: Callable = reference.moe_unpermute
    # head_loss(h, weight, targets): the LM head and its loss in one call, when kernels.loss_chunk_tokens
    # asks for them in chunks; None: the model's head, then cross_entropy on the whole logits
    head_loss: Callable | None = None


def with_loss_chunks(ops: KernelOps, chunk_tokens: int) -> KernelOps:
    """``ops`` computing the LM head and loss ``chunk_tokens`` tokens at a time (with its cross_entropy)."""
    return dataclasses.replace(ops, head_loss=functools.partial(
        reference.chunked_linear_cross_entropy, chunk_tokens=chunk_tokens, cross_entropy=ops.cross_entropy))


REFERENCE_OPS = KernelOps(
    backend="torch",
    layer_norm=reference.layer_norm,
    rms_norm=reference.rms_norm,
    bias_gelu=reference.bias_gelu,
    swiglu=reference.swiglu,
    cross_entropy=reference.cross_entropy,
    apply_rope=reference.apply_rope,
    layer_norm_gelu=reference.layer_norm_gelu,
    moe_permute=reference.moe_permute,
    moe_unpermute=reference.moe_unpermute,
)


class KernelWithFallback:
    """One op: the Triton kernel when it supports the call, else the reference.

    ``unsupported_reason`` takes the op's arguments and returns None or a one-line reason; each
    distinct reason is logged once per instance (one instance per op per resolved KernelOps).
    """

    def __init__(self, name: str, kernel: Callable, unsupported_reason: Callable, fallback: Callable):
        self.name = name
        self.kernel = kernel
        self.unsupported_reason = unsupported_reason
        self.fallback = fallback
        self.logged_reasons: set[str] = set()

    def __call__(self, *args, **kwargs):
        reason = self.unsupported_reason(*args, **kwargs)
        if reason is None:
            return self.kernel(*args, **kwargs)
        if reason not in self.logged_reasons:
            self.logged_reasons.add(reason)
            logger.warning("kernels: %s falls back to the PyTorch reference: %s", self.name, reason)
        return self.fallback(*args, **kwargs)

    def __repr__(self) -> str:
        return f"KernelWithFallback({self.name})"


def triton_version() -> str | None:
    """Triton's version, or None when it does not import (the reason goes to the caller's log)."""
    try:
        import triton
    except Exception:  # not installed, or installed against another torch/CUDA: either way unusable
        return None
    return triton.__version__


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def build_triton_ops() -> KernelOps:
    """Triton kernels for every op, each falling back to its reference per call.

    The kernels are ``perfgpt::`` custom ops (``kernels/triton/_common.py``'s ``kernel_op``), so
    torch.compile traces a model that uses them into one graph: with compiled Triton, Inductor
    sees and schedules the kernels themselves; in the interpreter, each op is one opaque node.
    """
    modules = load_op_modules()
    ops = {
        field: KernelWithFallback(
            field,
            getattr(modules[module], function),
            _unsupported_reason(modules[module], function),
            getattr(reference, field),
        )
        for field, (module, function) in TRITON_OPS.items()
    }
    return KernelOps(backend="triton", **ops)


def _unsupported_reason(module, function: str) -> Callable:
    """The op file's check for ``function``: its ``unsupported_reason``, or, in a file whose ops take
    different arguments, the entry of its ``UNSUPPORTED_REASONS``."""
    return getattr(module, "UNSUPPORTED_REASONS", {}).get(function, getattr(module, "unsupported_reason", None))


def resolve_kernel_ops(backend: str, device: torch.device) -> tuple[KernelOps, str]:
    """The ops for ``kernels.backend`` on ``device``, and one line saying what was chosen and why."""
    device = torch.device(device)
    if backend not in KERNEL_BACKENDS:
        raise ConfigError(f"kernels.backend={backend!r} is not one of {KERNEL_BACKENDS}")
    if backend == "torch":
        return REFERENCE_OPS, "kernels: torch reference ops (kernels.backend=torch)"
    version = triton_version()
    if backend == "auto":
        if device.type != "cuda":
            return REFERENCE_OPS, (
                f"kernels: torch reference ops (kernels.backend=auto on {device.type}: the Triton kernels "
                "run on CUDA; kernels.backend=triton with TRITON_INTERPRET=1 interprets them on CPU)"
            )
        if version is None:
            return REFERENCE_OPS, "kernels: torch reference ops (kernels.backend=auto: triton does not import)"
        return build_triton_ops(), f"kernels: triton {version} ops on {device}, {_mode()} (kernels.backend=auto)"
    if version is None:
        raise ConfigError(
            "kernels.backend=triton needs the triton package: pip install triton, or use kernels.backend=auto"
        )
    if device.type != "cuda" and not interpreter_requested():
        raise ConfigError(
            f"kernels.backend=triton on {device.type} needs TRITON_INTERPRET=1 in the environment "
            "(Triton's CPU interpreter, slow), or kernels.backend=auto/torch"
        )
    return build_triton_ops(), f"kernels: triton {version} ops on {device}, {_mode()} (kernels.backend=triton)"


def _mode() -> str:
    return "interpreted (TRITON_INTERPRET=1, slow)" if interpreter_requested() else "compiled"
