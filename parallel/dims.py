"""Where this process sits: world, nodes, ranks per node — checked without a process group.

``ParallelDims`` is a plain value built from the launcher's environment (torchrun sets
WORLD_SIZE, RANK, LOCAL_WORLD_SIZE, LOCAL_RANK), so every check runs in a unit test on any
machine. ``build_node_groups`` turns it into the two process groups a hierarchical collective
needs: the ranks of this node (intra) and the ranks holding the same local index on every node
(inter). Ranks are assumed node-major, as torchrun assigns them when every node runs the same
number of processes: global rank = node_rank * local_world_size + local_rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import LayoutError

if TYPE_CHECKING:  # torch.distributed is only needed once groups are built
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    local_world_size: int  # ranks per node
    rank: int
    local_rank: int  # index of this rank inside its node
    # The launcher's LOCAL_RANK, which names this process's GPU; differs from local_rank only
    # when parallel.local_world_size regroups the ranks into pretend nodes (-1: same as local_rank).
    device_index: int = -1

    def __post_init__(self) -> None:
        if self.device_index < 0:
            object.__setattr__(self, "device_index", self.local_rank)
        if self.world_size < 1:
            raise LayoutError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if self.local_world_size < 1:
            raise LayoutError(f"LOCAL_WORLD_SIZE={self.local_world_size} must be >= 1")
        if self.world_size % self.local_world_size:
            raise LayoutError(
                f"WORLD_SIZE={self.world_size} is not divisible by LOCAL_WORLD_SIZE={self.local_world_size}: "
                "every node must run the same number of ranks (same --nproc-per-node on each node)"
            )
        if not 0 <= self.rank < self.world_size:
            raise LayoutError(f"RANK={self.rank} is outside 0..{self.world_size - 1} (WORLD_SIZE={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise LayoutError(
                f"LOCAL_RANK={self.local_rank} is outside 0..{self.local_world_size - 1} "
                f"(LOCAL_WORLD_SIZE={self.local_world_size})"
            )
        if self.rank % self.local_world_size != self.local_rank:
            raise LayoutError(
                f"RANK={self.rank} with LOCAL_RANK={self.local_rank} is not node-major for "
                f"LOCAL_WORLD_SIZE={self.local_world_size} (expected LOCAL_RANK={self.rank % self.local_world_size}); "
                "launch with torchrun, which numbers ranks node by node"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, local_world_size: int | None = None) -> ParallelDims:
        """Read the torchrun variables; no variables at all means a single process.

        ``local_world_size`` overrides LOCAL_WORLD_SIZE, e.g. to treat 4 processes on one
        machine as 2 nodes x 2 when testing hierarchical collectives; the local rank is then
        derived as rank % local_world_size (LOCAL_RANK still names this process's device).
        """
        env = os.environ if env is None else env
        world_size = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        if local_world_size is not None:
            return cls(world_size, local_world_size, rank, rank % local_world_size,
                       device_index=_env_int(env, "LOCAL_RANK", rank % local_world_size))
        if "LOCAL_WORLD_SIZE" not in env and world_size > 1:
            raise LayoutError(
                "LOCAL_WORLD_SIZE is not set: launch with torchrun, export it, or set parallel.local_world_size"
            )
        local = _env_int(env, "LOCAL_WORLD_SIZE", world_size)
        return cls(world_size, local, rank, _env_int(env, "LOCAL_RANK", rank % local))

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def is_multi_node(self) -> bool:
        return self.nodes > 1

    def node_members(self, node_rank: int) -> list[int]:
        """Global ranks on one node (the intra-node group of that node)."""
        start = node_rank * self.local_world_size
        return list(range(start, start + self.local_world_size))

    def peer_members(self, local_rank: int) -> list[int]:
        """Global ranks with this local index on every node (one inter-node group)."""
        return list(range(local_rank, self.world_size, self.local_world_size))

    @property
    def tag(self) -> str:
        """The log prefix naming rank, local rank and node (empty for a single process)."""
        if self.world_size == 1:
            return ""
        return f"[rank {self.rank} local {self.local_rank} node {self.node_rank}] "

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} node {self.node_rank}/{self.nodes} "
            f"local {self.local_rank}/{self.local_world_size}"
        )


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise LayoutError(f"{name}={text!r} is not an integer") from None


@dataclass(frozen=True)
class NodeGroups:
    """The process groups of a two-level layout; a level with one rank has no group (None)."""

    dims: ParallelDims
    intra: ProcessGroup | None  # this node's ranks; None with one rank per node
    inter: ProcessGroup | None  # ranks with this local index, one per node; None on a single node


def build_node_groups(dims: ParallelDims) -> NodeGroups:
    """Create the intra- and inter-node groups; every rank must call this, in the same order.

    Group creation is a collective over the default group: ``new_subgroups_by_enumeration``
    creates every node's group on every rank in one fixed order, which is what makes it safe
    (creating a group lazily inside a rank-dependent branch deadlocks or mismatches).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise LayoutError("build_node_groups needs an initialized default process group (init_process_group first)")
    if dist.get_world_size() != dims.world_size or dist.get_rank() != dims.rank:
        raise LayoutError(
            f"layout says {dims.describe()} but the process group has rank {dist.get_rank()} "
            f"of {dist.get_world_size()}"
        )
    world = dist.group.WORLD
    if dims.nodes == 1:
        return NodeGroups(dims, intra=world, inter=None)
    if dims.local_world_size == 1:
        return NodeGroups(dims, intra=None, inter=world)
    intra, _ = dist.new_subgroups_by_enumeration([dims.node_members(n) for n in range(dims.nodes)])
    inter, _ = dist.new_subgroups_by_enumeration([dims.peer_members(i) for i in range(dims.local_world_size)])
    return NodeGroups(dims, intra=intra, inter=inter)

