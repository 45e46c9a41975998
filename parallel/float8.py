"""FP8 training through torchao: ``precision.mode=fp8`` with ``precision.fp8_backend=torchao``.

The one place that imports torchao. Transformer Engine (``fp8_backend=te``) brings its own layers
and has no wheel for many set-ups; torchao installs with pip wherever torch does, and works on the
GPT's own ``nn.Linear`` layers: ``convert_to_float8_training`` swaps each chosen one for a
``Float8Linear``, which casts its input, weight and output gradient to FP8 with a scale computed
from the tensor itself (dynamic scaling, no amax history) right before each of the layer's three
GEMMs, and runs those GEMMs in ``torch._scaled_mm``. Everything else (attention, norms, the
embedding, the LM head, the loss) runs under the bf16 autocast the precision policy sets for fp8.

Recipes (``precision.fp8_recipe``), torchao's names:

    tensorwise  one scale per tensor; the fastest; E4M3 forward, E5M2 gradients. Under FSDP2 the
                weights are all-gathered already in FP8 (half the bytes of bf16), with the scales of
                all weights computed in one all-reduce after each optimizer step.
    rowwise     one scale per row (power-of-two scales, E4M3 throughout): more accurate, slower
                GEMMs; FSDP2 gathers its weights in bf16, as torchao only gathers tensorwise in FP8.

Which layers: every ``nn.Linear`` of the transformer blocks (qkv, proj, fc, out and, with SwiGLU,
gate), but not the LM head (its logits feed the softmax directly, where FP8's 3-bit mantissa costs
the most, and torchtitan and TE's recipes leave it out too), and not a layer whose in or out
features are not multiples of 16, which ``torch._scaled_mm`` cannot multiply. Embeddings are not
``nn.Linear``. The conversion runs in the build path before tensor parallelism and before
recompute, compile and FSDP2 wrap the blocks (``parallel/parallelize.py``).

Under tensor parallelism a Float8Linear is laid out by the same styles as an ``nn.Linear`` (it is
one): its weight becomes a DTensor shard, and the dynamic scale of a weight, input or gradient is
taken over the whole DTensor (an all-reduce of the amax), as one process takes it. The
activations the styles all-gather or reduce-scatter stay bf16; torchao's float8 parallel styles
would all-gather the inputs of the column-parallel layers in FP8 instead (tensorwise only), which
perfgpt does not use.

Where it runs: FP8 GEMMs need FP8 tensor cores (compute capability 8.9, Ada/Hopper, or newer).
Some CPU builds of torch have a ``torch._scaled_mm`` kernel too; where the device has none, torchao's
own emulation (``Float8LinearConfig.emulate``: the same FP8 casts and scales, the GEMM in fp32)
runs instead on CPU, slowly, so FP8 training can be tested without a GPU. A GPU without FP8 is
refused: emulation there would only be slower than bf16. ``fp8_gemm_path`` says which ran and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
from typing import Callable

import torch
import torch.nn as nn

from common.errors import CapabilityError
from parallel.api_floors import install_floor

FP8_RECIPES = ("tensorwise", "rowwise")
INSTALL_HINT = f"pip install 'perfgpt[torchao]' (or '{install_floor('torchao')}')"
# GPT attributes GPT.init_weights reads from its Linear layers (scaled residual init, grouped qkv
# rows); torchao's swap builds new modules, so they are carried over or a meta-device init would
# lose them.
_INIT_ATTRIBUTES = ("residual_projection", "init_rows")


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def require_torchao(what: str) -> None:
    if not torchao_available():
        raise CapabilityError(f"{what} needs torchao, which is not installed; {INSTALL_HINT}")


@contextlib.contextmanager
def _quiet_import():
    """torchao's import tries to load every compiled extension it ships (MX formats, CUTLASS
    kernels for other Python or CUDA builds) and warns for each that does not load; float8
    training uses none of them (its GEMM is ``torch._scaled_mm``), so those warnings would only
    mislead the training log."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _float8_api():
    """torchao.float8, imported on first use: torchao is optional."""
    with _quiet_import():
        import torchao.float8 as float8
    return float8


# --------------------------------------------------------------------------- capability


def check_torchao_float8(device: torch.device, recipe: str) -> str:
    """Fail before any work when torchao's float8 training cannot run here; else say how it will."""
    require_torchao("precision.fp8_backend=torchao")
    return fp8_gemm_path(device, recipe)[1]


@functools.lru_cache(maxsize=None)
def fp8_gemm_path(device: torch.device, recipe: str) -> tuple[bool, str]:
    """(emulate?, why): real FP8 GEMMs where ``torch._scaled_mm`` runs on ``device`` with this
    recipe's scales, torchao's emulation on a CPU without them, and a CapabilityError on a GPU
    without FP8 tensor cores."""
    if device.type == "cuda" and not torch.version.hip:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise CapabilityError(
                f"precision.mode=fp8 (torchao) needs FP8 tensor cores, compute capability >= 8.9 (Ada/Hopper); "
                f"this GPU is {major}.{minor}: use precision.mode=bf16"
            )
    failure = _scaled_mm_failure(device, recipe)
    if failure is None:
        return False, f"FP8 GEMMs in torch._scaled_mm on {device.type}"
    if device.type == "cpu":
        return True, f"torchao float8 emulated on cpu (FP8 casts and scales, fp32 GEMM): no FP8 GEMM here ({failure})"
    raise CapabilityError(f"precision.mode=fp8 (torchao): torch._scaled_mm does not run on {device} with "
                          f"fp8_recipe={recipe} ({failure}); use precision.mode=bf16")


def _scaled_mm_failure(device: torch.device, recipe: str) -> str | None:
    """Run one 16x16 FP8 GEMM with the recipe's scale shapes; None if it ran, else the error."""
    e4m3 = _float8_api().config.e4m3_dtype  # e4m3fnuz on MI300, which torchao picks itself
    a = torch.ones(16, 16, device=device).to(e4m3)
    b = torch.ones(16, 16, device=device).to(e4m3).t()  # column-major, as _scaled_mm wants its second operand
    if recipe == "rowwise":
        scale_a, scale_b = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    else:
        scale_a, scale_b = torch.ones((), device=device), torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return None


# --------------------------------------------------------------------------- conversion


def float8_linear_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``, emulated or not, FP8 all-gather or not."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    config = _float8_api().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def fp8_skip_reason(module: nn.Module, fqn: str) -> str | None:
    """Why this Linear keeps its higher-precision GEMM, or None to convert it."""
    if fqn == "lm_head" or fqn.endswith(".lm_head"):
        return "LM head"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features}x{module.out_features} not multiples of 16"
    return None


def _recording_filter(skipped: dict[str, str]) -> Callable[[nn.Module, str], bool]:
    def keep(module: nn.Module, fqn: str) -> bool:
        reason = fp8_skip_reason(module, fqn)
        if reason is not None:
            skipped[fqn] = reason
        return reason is None

    return keep


def apply_float8(model: nn.Module, *, mode: str, backend: str, recipe: str, device: torch.device,
                 fsdp: bool) -> str | None:
    """Swap ``model``'s eligible Linear layers for torchao's Float8Linear, in place; returns the log
    line that says what was converted, what was skipped and why, and how the GEMMs run. A no-op
    (None) unless ``mode`` is fp8 with the torchao backend."""
    if mode != "fp8" or backend != "torchao":
        return None
    require_torchao("precision.fp8_backend=torchao")
    emulate, how = fp8_gemm_path(device, recipe)
    all_gather = fsdp and recipe == "tensorwise"
    config = float8_linear_config(recipe, emulate=emulate, fsdp_float8_all_gather=all_gather)
    init_attrs = {name: {a: getattr(m, a) for a in _INIT_ATTRIBUTES if hasattr(m, a)}
                  for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    skipped: dict[str, str] = {}
    _float8_api().convert_to_float8_training(model, module_filter_fn=_recording_filter(skipped), config=config)
    converted = converted_linears(model)
    for name in converted:
        for attr, value in init_attrs[name].items():
            setattr(model.get_submodule(name), attr, value)
    skips = "; ".join(f"{name} ({why})" for name, why in skipped.items()) or "none"
    gather = ("; FSDP2 all-gathers their weights in FP8" if all_gather
              else "; FSDP2 gathers weights in bf16 (FP8 all-gather is tensorwise only)" if fsdp else "")
    return (f"fp8: torchao {recipe} scaling, {len(converted)} Linear layers converted, skipped: {skips}; "
            f"{how}{gather}")


def converted_linears(model: nn.Module) -> list[str]:
    """Names of the modules torchao has swapped for Float8Linear."""
    if not torchao_available():
        return []
    float8_linear = _float8_linear_class()
    return [name for name, m in model.named_modules() if isinstance(m, float8_linear)]


def _float8_linear_class() -> type:
    with _quiet_import():
        from torchao.float8.float8_linear import Float8Linear
    return Float8Linear


# --------------------------------------------------------------------------- FSDP2


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """With FP8 all-gather, compute every sharded weight's FP8 scale in one all-reduce after each
    optimizer step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) instead of one small
    all-reduce per weight inside each all-gather. Returns whether the model has such weights.

    The scale is the one the next all-gathers use, so it must follow every change of the weights:
    the optimizer step is the only one after start-up (a resumed run loads its weights before the
    first step, when no scale has been precomputed yet and torchao computes them itself)."""
    if not torchao_available() or not _has_fp8_all_gather(model):
        return False
    precompute = _float8_api().precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute(model))
    return True


def _has_fp8_all_gather(model: nn.Module) -> bool:
    float8_linear = _float8_linear_class()
    return any(isinstance(m, float8_linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules())
