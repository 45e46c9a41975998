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
    loss_chunk_tokens: int = doc(
        0,
        "0: the LM head's logits for every token at once, (tokens x vocab) floats held until backward; N: the head "
        "and cross-entropy N tokens at a time, each chunk's logits recomputed in backward, never the whole (the same "
        "loss and gradients; refused with tp or pp)",
    )
