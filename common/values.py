"""Plain values of tensors that may be DTensors, without importing DTensor.

Two questions, two names: ``full_value`` is the whole tensor (a DTensor's shards gathered, a
collective), ``local_shard`` is what this rank stores of it (a view of its storage, no
communication). Plain tensors are their own full value and local shard.

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


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (e.g. a loss computed under loss
    parallelism, a replicated DTensor), a plain tensor itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``tensor``: a DTensor's local shard (a view of its storage, so
    in-place changes reach the DTensor), a plain tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def loss_parallel_context() -> contextlib.AbstractContextManager:
    """Cross-entropy on vocab-sharded logits (forward and backward must both run inside it)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
