"""KernelsConfig: which implementation of the fused ops the model uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.fields import doc


@dataclass
class KernelsConfig:
    backend: Literal["auto", "triton", "torch"] = doc(
        "torch",
        "auto: Triton kernels on CUDA when Triton is importable, else the PyTorch reference; "
        "triton: require Triton (TRITON_INTERPRET=1 runs them on CPU); torch: the reference ops",
    )
