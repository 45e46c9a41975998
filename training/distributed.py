"""Process-group set-up from torchrun's environment; a single process needs none of it.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the node index);
``python train.py`` sets none, which means one process and no process group.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.errors import CapabilityError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    device: torch.device
    backend: str | None  # None: no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tag(self) -> str:
        """Log prefix naming rank, local rank and node, as multi-node debugging needs."""
        if self.world_size == 1:
            return ""
        return f"[rank {self.rank} local {self.local_rank} node {self.node}] "

    def barrier(self) -> None:
        if self.backend is not None:
            dist.barrier()

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.backend is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world_size
        return tensor


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise CapabilityError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_request: str, backend_request: str, timeout_s: int, nccl_env: dict[str, str] | None = None) -> DistContext:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    node = int(os.environ.get("GROUP_RANK", str(rank // max(local_world_size, 1))))
    device = pick_device(device_request, local_rank)
    if world_size == 1:
        return DistContext(0, 1, 0, 1, 0, device, None)
    backend = backend_request if backend_request != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise CapabilityError("parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo on CPU")
    if nccl_env and backend == "nccl":
        from parallel.nccl import apply_nccl_env

        apply_nccl_env(nccl_env)  # NCCL reads these once, when the communicator is created
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return DistContext(rank, world_size, local_rank, local_world_size, node, device, backend)


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.backend is not None and dist.is_initialized():
        # Drop wrappers (FSDP state, DDP reducers) that still reference the group before it is
        # destroyed, so nothing tears a gloo context down later during interpreter exit.
        gc.collect()
        dist.destroy_process_group()
