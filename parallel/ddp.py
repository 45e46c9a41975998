"""DDP: every rank holds the whole model; gradients are averaged in buckets during backward.

DDP registers a hook per parameter; when all gradients of a bucket (``ddp_bucket_cap_mb``) are
ready it launches that bucket's all-reduce asynchronously, so communication of late layers
overlaps the backward of early ones, and waits for all buckets before ``backward()`` returns.
An optional comm hook (``parallel.ddp_comm_hook``, parallel/compression.py) replaces the
all-reduce of each bucket; its byte counter is kept on the wrapped model as ``comm_stats``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from parallel.config import ParallelConfig
    from parallel.dims import ParallelDims


def apply_ddp(model: nn.Module, device: torch.device, cfg: ParallelConfig, dims: ParallelDims) -> DistributedDataParallel:
    """Wrap ``model`` in DDP with the configured buckets and comm hook (call on every rank)."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        gradient_as_bucket_view=cfg.ddp_gradient_as_bucket_view,
        static_graph=cfg.ddp_static_graph,
    )
    ddp.comm_stats = _register_hook(ddp, cfg, dims)
    return ddp


def _register_hook(ddp: DistributedDataParallel, cfg: ParallelConfig, dims: ParallelDims):
    if cfg.ddp_comm_hook == "none":
        return None
    from parallel.compression import register_comm_hook

    groups = None
    if cfg.ddp_comm_hook == "hierarchical":
        from parallel.dims import build_node_groups

        groups = build_node_groups(dims)  # a collective: every rank reaches this line
    return register_comm_hook(ddp, cfg, groups)
