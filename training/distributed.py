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
        return rank_tag(self.world_size, self.rank, self.local_rank, self.node)

    def barrier(self) -> None:
        if self.backend is not None:
            dist.barrier()

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.backend is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world_size
        return tensor


def rank_tag(world_size: int, rank: int, local_rank: int, node: int) -> str:
    if world_size == 1:
        return ""
    return f"[rank {rank} local {local_rank} node {node}] "


def env_rank_tag() -> str:
    """The rank prefix from torchrun's environment, for errors raised before (or without) a DistContext."""
    env = os.environ
    try:
        world_size, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        node = int(env.get("GROUP_RANK", str(rank // max(int(env.get("LOCAL_WORLD_SIZE", str(world_size))), 1))))
    except ValueError:
        return ""
    return rank_tag(world_size, rank, local_rank, node)


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


class StopAgreement:
    """Makes every rank stop at the same step when any of them was asked to (SIGTERM, Ctrl-C).

    Ranks receive a signal at different steps, yet must save the same one. Each step every rank
    starts an all-reduce (MAX) of its signal number and reads the result of the previous step's:
    one step of lag, so the read never waits (on CUDA the value comes back through pinned memory
    behind an event, keeping the engine's one host sync per step the only one). A single process
    needs no agreement and stops after the step in which the signal arrived.
    """

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self._pending: tuple | None = None

    def poll(self, local_signum: int) -> int:
        """The agreed signal number (0: keep going). A collective: every rank calls it once per step."""
        if self.ctx.backend is None:
            return local_signum
        agreed = self._collect()
        value = torch.tensor([local_signum], dtype=torch.int32, device=self.ctx.device)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        if value.is_cuda:
            work.wait()  # orders the copy after the all-reduce on the stream; does not block the host
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (None, host, event)
        else:
            self._pending = (work, value, None)
        return agreed

    def finish(self) -> None:
        """Complete the outstanding all-reduce before the process group goes away."""
        self._collect()

    def _collect(self) -> int:
        if self._pending is None:
            return 0
        work, host, event = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return int(host.item())
