"""Plain values of tensors that may be DTensors, without importing DTensor.

Importing ``torch.distributed.tensor`` costs over a second on a small machine. The engines only
need to ask "is this a DTensor?", and a DTensor can only exist once that module has been imported,
so looking it up in ``sys.modules`` answers without the import: ``train.py --help`` and the one-line
config errors come back without paying for it (a run that trains imports it anyway, through
torch.optim's use of dynamo).
"""

from __future__ import annotations

import contextlib
import sys

import torch


def is_dtensor(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallelism is a replicated DTensor: its plain value."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def loss_parallel_context() -> contextlib.AbstractContextManager:
    """Cross-entropy on vocab-sharded logits (forward and backward must both run inside it)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
