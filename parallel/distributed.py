"""Where this process runs: the validated layout, its device and its process group.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; ``python train.py`` sets none,
which means one process and no process group. ``ParallelDims.from_env`` is the one place that
reads those variables; everything else asks the ``DistContext`` built from it.
"""

from __future__ import annotations

import datetime
import gc
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from common.errors import CapabilityError, LayoutError
from parallel.config import ParallelConfig
from parallel.dims import ParallelDims
from parallel.layout import Layout
from parallel.nccl import apply_nccl_env


@dataclass(frozen=True)
class DistContext:
    dims: ParallelDims
    device: torch.device
    backend: str | None  # None: no process group
    mesh: DeviceMesh | None = None  # the run's one mesh (dimensions of size > 1); None for one process

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> DistContext:
        """One process, no process group (tools and tests that measure in-process)."""
        return cls(ParallelDims(1, 1, 0, 0), torch.device(device), None)

    def submesh(self, *names: str) -> DeviceMesh | None:
        """The mesh over the named dimensions that have more than one rank (None if none does)."""
        present = tuple(n for n in names if self.mesh is not None and n in (self.mesh.mesh_dim_names or ()))
        if not present:
            return None
        return self.mesh[present[0]] if len(present) == 1 else self.mesh[present]

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: the data-parallel dimensions, with context parallelism folded
        into the shard dimension (``ParallelDims.fsdp_dims``); None when that is one rank."""
        names = self.dims.fsdp_dims()
        if self.mesh is None or not names:
            return None
        with warnings.catch_warnings():
            # torch asks callers to keep the flattened mesh themselves; slicing it from the root is
            # the documented way until then, and keeping it here would be a second mesh to pass around.
            warnings.filterwarnings("ignore", message=".*flattened dim from root mesh.*")
            return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards expert-parallel weights over (``ParallelDims.expert_fsdp_dims``)."""
        names = self.dims.expert_fsdp_dims() if self.dims.layout.ep > 1 else ()
        return self.submesh(*names) if names else None

    @property
    def layout(self) -> Layout:
        """The run's parallel layout (parallel/layout.py)."""
        return self.dims.layout

    @property
    def rank(self) -> int:
        return self.dims.rank

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def local_rank(self) -> int:
        return self.dims.local_rank

    @property
    def local_world_size(self) -> int:
        return self.dims.local_world_size

    @property
    def node(self) -> int:
        return self.dims.node_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tag(self) -> str:
        """Log prefix naming rank, local rank and node, as multi-node debugging needs."""
        return self.dims.tag

    def barrier(self) -> None:
        if self.backend is not None:
            dist.barrier()

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.backend is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world_size
        return tensor


def env_rank_tag() -> str:
    """The rank prefix for errors raised before (or without) a DistContext; empty if the
    environment does not describe a layout (that error is reported by the run itself)."""
    try:
        return ParallelDims.from_env().tag
    except LayoutError:
        return ""


def pick_device(requested: str, device_index: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise CapabilityError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(device_index)
        return torch.device("cuda", device_index)
    return torch.device("cpu")


def layout_from_env(parallel_cfg: ParallelConfig) -> ParallelDims:
    """The launcher's ranks and nodes (parallel.local_world_size may regroup them) with the section's
    layout on them (``Layout.of``); every layout check runs here, before any process group exists."""
    launcher = ParallelDims.from_env(local_world_size=parallel_cfg.local_world_size)
    layout = Layout.of(parallel_cfg, launcher.world_size, launcher.local_world_size)
    return replace(launcher, layout=layout)


def init_distributed(device_request: str, parallel_cfg: ParallelConfig) -> DistContext:
    """The context of this process: its layout, device, process group and device mesh (under torchrun)."""
    dims = layout_from_env(parallel_cfg)
    device = pick_device(device_request, dims.device_index)
    if dims.world_size == 1:
        return DistContext(dims, device, None)
    backend = parallel_cfg.backend
    backend = backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise CapabilityError("parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo on CPU")
    if parallel_cfg.nccl and backend == "nccl":
        apply_nccl_env(parallel_cfg.nccl)  # NCCL reads these once, when the communicator is created
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=parallel_cfg.timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return DistContext(dims, device, backend, dims.build_mesh(device.type))


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.backend is not None and dist.is_initialized():
        # Drop wrappers (FSDP state, DDP reducers) that still reference the group before it is
        # destroyed, so nothing tears a gloo context down later during interpreter exit.
        gc.collect()
        dist.destroy_process_group()
