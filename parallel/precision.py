"""Precision: the ``precision`` section, and the one policy decided from it and the strategy.

| mode        | weights | forward                      | optimizer sees          | loss scaling |
|-------------|---------|------------------------------|-------------------------|--------------|
| fp32        | fp32    | fp32 (TF32 matmuls on CUDA)  | fp32 params             | no           |
| bf16        | fp32    | bf16 autocast                | fp32 params             | no           |
| fp16        | fp32    | fp16 autocast                | fp32 params             | GradScaler   |
| bf16_master | bf16    | bf16 (norms fp32 inside)     | fp32 master copies      | no           |
| fp8         | fp32    | FP8 GEMMs in bf16 autocast   | fp32 params             | no           |

Backward ops run in the dtype of their forward ops (not "automatically in fp32"); ``.grad`` is
fp32 in the autocast modes only because the leaf weights are. With bf16 weights AdamW updates
smaller than bf16's ulp would vanish, hence the fp32 master copies in ``bf16_master``.

Who keeps those fp32 copies depends on the data-parallel engine, so mode x strategy is decided
once, here, into a ``PrecisionPolicy`` that the build path, the engines and FSDP2 read:
FSDP2 keeps fp32 shards as the masters and casts on gather (``MixedPrecisionPolicy``);
DeepSpeed keeps its own fp32 partitions and loss scaler; plain and DDP models get bf16 weights
and an fp32 copy held by the engine.

The FP8 GEMMs come from Transformer Engine's layers (``fp8_backend=te``, ``model/te.py``) or
from torchao's float8 training on the model's own ``nn.Linear`` layers (``torchao``,
``parallel/float8.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from common.errors import CapabilityError, ConfigError
from common.fields import doc, require_finite
from model.te import fp8_autocast, require_te
from parallel.float8 import check_torchao_float8

AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass
class PrecisionConfig:
    mode: Literal["fp32", "bf16", "fp16", "bf16_master", "fp8"] = doc(
        "fp32",
        "fp32 | bf16 (autocast) | fp16 (autocast + grad scaler) | bf16_master (bf16 weights, "
        "fp32 norms and fp32 master weights) | fp8 (FP8 GEMMs from precision.fp8_backend)",
    )
    fp8_backend: Literal["te", "torchao"] = doc(
        "te", "fp8: te = Transformer Engine layers (model.layers=te), delayed scaling | torchao = the "
        "model's own nn.Linear layers through torchao's float8 training, dynamic scaling (parallel/float8.py)"
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = doc(
        "tensorwise", "fp8 with fp8_backend=torchao: one scale per tensor (fastest; FP8 all-gather under "
        "FSDP2) | rowwise: one per row (more accurate, slower GEMMs)"
    )
    nonfinite: Literal["skip", "stop"] = doc(
        "skip", "on a non-finite loss or grad norm: skip the optimizer step, or stop the run"
    )
    fp16_init_scale: float = doc(2.0**16, "initial loss scale for fp16")
    fp8_format: Literal["hybrid", "e4m3"] = doc("hybrid", "fp8: hybrid = E4M3 forward, E5M2 backward")
    fp8_amax_history_len: int = doc(16, "fp8 delayed scaling: amax history length")
    fp8_amax_compute_algo: Literal["max", "most_recent"] = doc("max", "fp8 delayed scaling: amax reduction")
    fp8_margin: int = doc(0, "fp8 delayed scaling: margin (power-of-two headroom)")
    max_skipped_steps: int = doc(
        10, "with nonfinite=skip, stop after this many consecutive skipped steps"
    )

    def validate(self) -> None:
        require_finite("precision.fp16_init_scale", self.fp16_init_scale, ConfigError)
        if self.fp16_init_scale <= 0:
            raise ConfigError(f"precision.fp16_init_scale must be > 0 (got {self.fp16_init_scale})")
        if self.fp8_amax_history_len < 1:
            raise ConfigError(f"precision.fp8_amax_history_len must be >= 1 (got {self.fp8_amax_history_len})")
        for key in ("fp8_margin", "max_skipped_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"precision.{key} must be >= 0 (got {getattr(self, key)})")
        self._validate_fp8_backend_keys()

    def _validate_fp8_backend_keys(self) -> None:
        """A key of the other FP8 backend would be silently ignored: refuse it."""
        other = {"te": ("fp8_recipe",),
                 "torchao": ("fp8_format", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin")}
        defaults = PrecisionConfig()
        for key in other[self.fp8_backend]:
            if getattr(self, key) != getattr(defaults, key):
                owner = "torchao" if self.fp8_backend == "te" else "te"
                raise ConfigError(f"precision.{key} applies to precision.fp8_backend={owner}, not "
                                  f"{self.fp8_backend}; remove it or set precision.fp8_backend={owner}")


# Which engine keeps the fp32 masters and the loss scale, per data-parallel strategy.
_SHARDED_MASTERS = ("fsdp",)  # fp32 shards, cast on gather
_DEEPSPEED = ("zero1", "zero2", "zero3")  # DeepSpeed's own fp32 partitions and loss scaler
_FSDP_MODES = ("fp32", "bf16", "bf16_master", "fp16")
_ZERO_MODES = ("fp32", "bf16", "bf16_master", "fp16")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Everything precision decides for one run, computed once by ``precision_policy``."""

    config: PrecisionConfig
    module_dtype: torch.dtype  # what the built model is cast to before it is wrapped
    compute_dtype: torch.dtype  # the dtype matmuls run in (what attention backends must support)
    autocast_dtype: torch.dtype | None  # torch.autocast around forward and loss (None: no autocast)
    engine_masters: bool  # the torch engine keeps fp32 copies of bf16 weights
    grad_scaler: bool  # the torch engine scales the loss (fp16 outside DeepSpeed)
    fsdp_param_dtype: torch.dtype | None  # FSDP2 gathers weights in this dtype (None: as stored)
    fsdp_reduce_dtype: torch.dtype | None  # FSDP2 reduces gradients in this dtype

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def fp8_torchao(self) -> bool:
        return self.mode == "fp8" and self.config.fp8_backend == "torchao"

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The context the forward pass (and loss) run under."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        autocast = torch.autocast(device_type=device.type, dtype=self.autocast_dtype)
        if self.mode != "fp8" or self.fp8_torchao:  # torchao's Float8Linear needs no context
            return autocast
        stack = contextlib.ExitStack()
        stack.enter_context(autocast)
        stack.enter_context(fp8_autocast(self.config))
        return stack

    def describe(self, strategy: str) -> str:
        masters = ("fp32 masters in the engine" if self.engine_masters else
                   "FSDP2's fp32 shards are the masters" if strategy in _SHARDED_MASTERS and self.mode == "bf16_master"
                   else "DeepSpeed's fp32 partitions" if strategy in _DEEPSPEED and self.mode != "fp32" else "")
        parts = [f"precision: {self.mode} with parallel.strategy={strategy}",
                 f"weights {_name(self.module_dtype)}", f"compute {_name(self.compute_dtype)}"]
        if self.grad_scaler:
            parts.append("GradScaler")
        if masters:
            parts.append(masters)
        return ", ".join(parts)


def _either(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + f" or {choices[-1]}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def precision_policy(precision_cfg: PrecisionConfig, strategy: str) -> PrecisionPolicy:
    """Decide, once, what the precision mode means under this data-parallel strategy."""
    mode = precision_cfg.mode
    fp8_torchao = mode == "fp8" and precision_cfg.fp8_backend == "torchao"  # FSDP2 gathers its FP8 weights
    if strategy in _SHARDED_MASTERS and mode not in _FSDP_MODES and not fp8_torchao:
        raise ConfigError(f"precision.mode={mode} is not supported with parallel.strategy={strategy}; "
                          f"use {_either(_FSDP_MODES)} (or fp8 with precision.fp8_backend=torchao)")
    if strategy in _DEEPSPEED and mode not in _ZERO_MODES:
        raise ConfigError(f"precision.mode={mode} is not supported with DeepSpeed ZeRO; use {_either(_ZERO_MODES)}")
    weights_bf16 = mode == "bf16_master" and strategy not in _SHARDED_MASTERS
    module_dtype = torch.bfloat16 if weights_bf16 else torch.float32
    sharded_half = {"bf16": torch.bfloat16, "bf16_master": torch.bfloat16, "fp16": torch.float16,
                    "fp8": torch.bfloat16}  # fp8: what stays outside the FP8 linears
    fsdp = strategy in _SHARDED_MASTERS
    return PrecisionPolicy(
        config=precision_cfg,
        module_dtype=module_dtype,
        compute_dtype=AUTOCAST_DTYPE.get(mode, torch.bfloat16 if mode == "bf16_master" else torch.float32),
        autocast_dtype=AUTOCAST_DTYPE.get(mode),
        engine_masters=mode == "bf16_master" and strategy not in _SHARDED_MASTERS + _DEEPSPEED,
        grad_scaler=mode == "fp16" and strategy not in _DEEPSPEED,
        fsdp_param_dtype=sharded_half.get(mode) if fsdp else None,
        fsdp_reduce_dtype=torch.float32 if fsdp and mode in sharded_half else None,
    )


def check_precision_supported(mode: str, device: torch.device, fp8_backend: str = "te",
                              fp8_recipe: str = "tensorwise") -> None:
    """Fail before any work when the mode cannot run here, saying why."""
    if mode == "fp8" and fp8_backend == "torchao":
        check_torchao_float8(device, fp8_recipe)
    elif mode == "fp8":
        require_te("precision.mode=fp8")
        if device.type != "cuda":
            raise CapabilityError("precision.mode=fp8 needs a CUDA GPU with FP8 tensor cores (Hopper or Ada)")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise CapabilityError(
                f"precision.mode=fp8 needs compute capability >= 8.9 (Ada/Hopper); this GPU is {major}.{minor}"
            )
    if mode in ("bf16", "bf16_master") and device.type == "cuda" and not native_bf16(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise CapabilityError(f"precision.mode={mode}: this GPU (compute capability {major}.{minor}) has no bf16 "
                              "tensor cores, bf16 would only be emulated; use fp16 (or fp32)")


def native_bf16(device: torch.device) -> bool:
    """bf16 in hardware: compute capability >= 8.0 (Ampere on), or any ROCm GPU.

    ``torch.cuda.is_bf16_supported()`` also says yes on older GPUs where a bf16 tensor can merely
    be created (emulation: slow, and cuBLAS/cuDNN lack bf16 kernels there). Its
    ``including_emulation=False`` applies this same rule, but only to the current device and only
    in recent torch releases, so the rule is spelled out here for ``device`` itself.
    """
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


class MasterWeights:
    """fp32 copies of bf16 model weights: the optimizer steps these, then they are copied back."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.model_params = params
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]

    def grads_to_masters(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        torch._foreach_copy_(self.model_params, self.masters)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.masters):
            raise ValueError(f"checkpoint has {len(tensors)} master weights, model has {len(self.masters)}")
        for m, t in zip(self.masters, tensors):
            m.copy_(t)
        self.masters_to_model()
