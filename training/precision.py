"""Precision modes: what the forward runs under, what dtype the weights are, who owns the fp32 copy.

| mode        | weights | forward                      | optimizer sees          | loss scaling |
|-------------|---------|------------------------------|-------------------------|--------------|
| fp32        | fp32    | fp32 (TF32 matmuls on CUDA)  | fp32 params             | no           |
| bf16        | fp32    | bf16 autocast                | fp32 params             | no           |
| fp16        | fp32    | fp16 autocast                | fp32 params             | GradScaler   |
| bf16_master | bf16    | bf16 (norms fp32 inside)     | fp32 master copies      | no           |
| fp8         | fp32    | TE fp8_autocast in bf16      | fp32 params             | no           |

Backward ops run in the dtype of their forward ops (not "automatically in fp32"); ``.grad`` is
fp32 in the autocast modes only because the leaf weights are. With bf16 weights AdamW updates
smaller than bf16's ulp would vanish, hence the fp32 master copies in ``bf16_master``.
"""

from __future__ import annotations

import contextlib

import torch

from training.errors import CapabilityError

AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def check_precision_supported(mode: str, device: torch.device) -> None:
    """Fail before any work when the mode cannot run here, saying why."""
    if mode == "fp8":
        from model.te import require_te

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


def forward_context(mode: str, device: torch.device, precision_cfg) -> contextlib.AbstractContextManager:
    """The context the forward pass (and loss) run under."""
    if mode == "fp8":
        from model.te import fp8_autocast

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        stack.enter_context(fp8_autocast(precision_cfg))
        return stack
    if mode in AUTOCAST_DTYPE:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPE[mode])
    return contextlib.nullcontext()


def compute_dtype(mode: str) -> torch.dtype:
    """The dtype matmuls run in (what attention backends must support)."""
    return AUTOCAST_DTYPE.get(mode, model_dtype(mode))


def model_dtype(mode: str) -> torch.dtype:
    return torch.bfloat16 if mode == "bf16_master" else torch.float32


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
