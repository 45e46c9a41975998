"""Where this process sits: world, nodes, ranks per node, and its place in the run's layout —
checked without a process group.

``ParallelDims`` is a plain value built from the launcher's environment (torchrun sets
WORLD_SIZE, RANK, LOCAL_WORLD_SIZE, LOCAL_RANK) and the run's ``Layout`` (parallel/layout.py: the
degrees in the config's words, already validated), so every check runs in a unit test on any
machine. It adds what depends on the ranks: this rank's coordinates, and the meshes. The layout is
a 5-D grid of ranks,

    pp x dp_replicate x dp_shard x cp x tp      (row-major: tp varies fastest)

so a tensor-parallel group is tp consecutive ranks, inside one node, where the bandwidth its
per-layer collectives need is; a context-parallel group (each rank holds a slice of every
sequence, parallel/cp.py) comes next, then data parallelism and pipeline stages, which span nodes.
The ranks of one cp group read the same batches (they share ``dp_rank``) but hold different tokens,
so for gradients they are data-parallel ranks: ``build_mesh`` folds dp_shard x cp into one
``dp_shard_cp`` dimension for FSDP2, as torchtitan does. ``build_mesh`` turns the grid into the one
``DeviceMesh`` of the run, with those dimension names. ``build_node_groups`` turns it into the two
process groups a hierarchical collective
needs: the ranks of this node (intra) and the ranks holding the same local index on every node
(inter). Ranks are assumed node-major, as torchrun assigns them when every node runs the same
number of processes: global rank = node_rank * local_world_size + local_rank.

Expert parallelism (parallel/ep.py) is carved out of dp_shard x cp, cp inner: without cp, dp_shard is
built as (edp, ep); with cp, ep must be a multiple of cp and dp_shard is built as (edp, ep_shard), so
that ep = ep_shard x cp (one ep group spans whole cp groups). ``build_mesh`` flattens the pieces back
into dp_shard / dp_shard_cp for the dense weights and into ep for the experts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from common.errors import LayoutError
from parallel.layout import Layout

if TYPE_CHECKING:  # torch.distributed is only needed once groups are built
    from torch.distributed import ProcessGroup


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost to innermost
FSDP_SHARD_CP = "dp_shard_cp"  # dp_shard and cp flattened into one mesh dimension (build_mesh)
# With expert parallelism dp_shard is built as two mesh dimensions, (edp, ep) with ep inner, and
# flattened back into dp_shard for the dense parameters: ep ranks hold different experts, edp ranks
# (the dp_shard ranks left after ep) hold the same experts and FSDP2 shards those over them.
EXPERT_DIMS = ("edp", "ep")
# With cp as well, ep = (ep_shard, cp) flattened: ep_shard is the part of dp_shard one ep group spans.
EP_SHARD = "ep_shard"


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    local_world_size: int  # ranks per node
    rank: int
    local_rank: int  # index of this rank inside its node
    # The launcher's LOCAL_RANK, which names this process's GPU; differs from local_rank only
    # when parallel.local_world_size regroups the ranks into pretend nodes (-1: same as local_rank).
    device_index: int = -1
    # The run's layout (parallel/layout.py) on these ranks; None: every rank data-parallel.
    layout: Layout | None = None

    def __post_init__(self) -> None:
        if self.device_index < 0:
            object.__setattr__(self, "device_index", self.local_rank)
        self._check_launcher()
        layout = self.layout or Layout(self.world_size)
        if layout.world_size != self.world_size:
            raise LayoutError(f"the layout ({layout.describe()}) is for {layout.world_size} ranks, but "
                              f"WORLD_SIZE={self.world_size}")
        if layout.ranks_per_node is None:  # checked now: tensor-parallel groups must fit in a node
            layout = replace(layout, ranks_per_node=self.local_world_size)
        elif layout.ranks_per_node != self.local_world_size:
            raise LayoutError(f"the layout is for {layout.ranks_per_node} ranks per node, but "
                              f"LOCAL_WORLD_SIZE={self.local_world_size}")
        object.__setattr__(self, "layout", layout)

    def _check_launcher(self) -> None:
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
        """This process among the ranks the torchrun variables describe, every rank data-parallel (the
        run's own layout goes in with ``replace(dims, layout=...)``); no variables at all means a
        single process.

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

    # ----------------------------------------------------------------- this rank in the layout

    def coordinate(self, dim: str) -> int:
        """This rank's index along one mesh dimension (MESH_DIMS)."""
        sizes = {name: getattr(self.layout, name) for name in MESH_DIMS}
        inner = 1
        for name in reversed(MESH_DIMS):
            if name == dim:
                return (self.rank // inner) % sizes[name]
            inner *= sizes[name]
        raise KeyError(dim)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of one tensor-parallel group, of one
        context-parallel group and of one pipeline share it (and their batches)."""
        return self.coordinate("dp_replicate") * self.layout.dp_shard + self.coordinate("dp_shard")

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (cp innermost, as ``build_mesh`` flattens it)."""
        lay = self.layout
        cp_rank = self.coordinate("cp") if lay.ep > 1 and lay.cp > 1 else 0
        return (self.coordinate("dp_shard") % lay.ep_shard) * (lay.ep // lay.ep_shard) + cp_rank

    # ----------------------------------------------------------------- the mesh

    def _dp_shard_parts(self) -> dict[str, int]:
        """The mesh dimensions dp_shard is built from: itself, or (edp, ep) / (edp, ep_shard) with ep."""
        lay = self.layout
        if lay.ep == 1:
            return {"dp_shard": lay.dp_shard}
        return {"edp": lay.edp, "ep" if lay.cp == 1 else EP_SHARD: lay.ep_shard}

    def mesh_shape(self) -> dict[str, int]:
        """The mesh dimensions with more than one rank, outermost first; with ep > 1, dp_shard is
        built from its parts (``_dp_shard_parts``) and flattened back by ``build_mesh``."""
        sizes = {name: getattr(self.layout, name) for name in MESH_DIMS}
        sizes = {k: v for name, size in sizes.items()
                 for k, v in (self._dp_shard_parts() if name == "dp_shard" else {name: size}).items()}
        return {name: size for name, size in sizes.items() if size > 1}

    def _present(self, names) -> list[str]:
        shape = self.mesh_shape()
        return [name for name in names if name in shape]

    def build_mesh(self, device_type: str):
        """The run's DeviceMesh over the dimensions with more than one rank (None for one process).

        A collective: every rank calls it once, at start-up (it creates a process group per
        dimension).
        """
        from torch.distributed.device_mesh import init_device_mesh  # torch.distributed only with a process group

        shape, lay = self.mesh_shape(), self.layout
        if self.world_size == 1 or not shape:
            return None
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        parts = self._present(self._dp_shard_parts())
        if lay.ep > 1 and lay.cp == 1 and len(parts) == 2:  # the dense parameters shard over all dp_shard ranks
            mesh[tuple(parts)]._flatten("dp_shard")
        if parts and lay.cp > 1:  # FSDP2 shards over both (see fsdp_dims): one flat dimension
            mesh[(*parts, "cp")]._flatten(FSDP_SHARD_CP)
        if lay.ep > 1 and lay.cp > 1:  # the expert-parallel group: (ep_shard, cp), or cp alone
            mesh[tuple(self._present((EP_SHARD, "cp")))]._flatten("ep")
        return mesh

    def fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP2 shards (and averages gradients) over, replicate first: the
        data-parallel ones, with cp folded into the shard dimension, since cp ranks hold the same
        weights and see different tokens. Only those with more than one rank."""
        parts = self._present(self._dp_shard_parts())
        shard = ["dp_shard"] if len(parts) == 2 else parts  # with ep, dp_shard may be one of its parts
        shard += ["cp"] if self.layout.cp > 1 else []
        names = ["dp_replicate"] if self.layout.dp_replicate > 1 else []
        return tuple(names + ([FSDP_SHARD_CP] if len(shard) >= 2 else shard))

    def expert_fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP2 shards expert parameters over (ep > 1): the data-parallel ranks
        that hold the same experts, replicate first (cp ranks never: they are inside the ep group);
        empty when there are none (experts then stay whole on their ep rank)."""
        lay = self.layout
        return tuple(name for name, size in (("dp_replicate", lay.dp_replicate), ("edp", lay.edp)) if size > 1)

    # ----------------------------------------------------------------- nodes

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
            f"local {self.local_rank}/{self.local_world_size}, {self.layout.describe()}"
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

