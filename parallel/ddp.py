"""DDP: every rank holds the whole model; gradients are averaged in buckets during backward.

DDP registers a hook per parameter; when all gradients of a bucket (``ddp_bucket_cap_mb``) are
ready it launches that bucket's all-reduce asynchronously, so communication of late layers
overlaps the backward of early ones, and waits for all buckets before ``backward()`` returns.
An optional comm hook (``parallel.ddp_comm_hook``, parallel/compression.py) replaces the
all-reduce of each bucket; its byte counter goes to the engine (``DDPEngine.comm_stats``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from parallel.comm import CommStats
from parallel.compression import register_comm_hook
from parallel.config import ParallelConfig
from parallel.dims import ParallelDims, build_node_groups


def apply_ddp(model: nn.Module, device: torch.device, cfg: ParallelConfig,
              dims: ParallelDims) -> tuple[DistributedDataParallel, CommStats | None]:
    """Wrap ``model`` in DDP with the configured buckets and comm hook (call on every rank);
    returns the wrapped model and the hook's byte counter (None without a hook)."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        gradient_as_bucket_view=cfg.ddp_gradient_as_bucket_view,
        static_graph=cfg.ddp_static_graph,
        # The model's only buffers (rotary tables) are computed from the config, the same on every
        # rank; DDP's default would broadcast them from rank 0 before every forward, a blocking
        # collective per step that nothing overlaps.
        broadcast_buffers=False,
    )
    return ddp, _register_hook(ddp, cfg, dims)


def _register_hook(ddp: DistributedDataParallel, cfg: ParallelConfig, dims: ParallelDims) -> CommStats | None:
    if cfg.ddp_comm_hook == "none":
        return None
    groups = build_node_groups(dims) if cfg.ddp_comm_hook == "hierarchical" else None  # a collective
    return register_comm_hook(ddp, cfg, groups)
