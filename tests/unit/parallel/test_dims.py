"""ParallelDims: the world/node/local ranks and their place in the layout, validated with no process group."""

from __future__ import annotations

import pytest

from common.errors import LayoutError
from parallel.dims import ParallelDims
from parallel.layout import Layout


def _env(world, rank, local_world=None, local_rank=None):
    env = {"WORLD_SIZE": str(world), "RANK": str(rank)}
    if local_world is not None:
        env["LOCAL_WORLD_SIZE"] = str(local_world)
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    return env


def test_layout_from_torchrun_variables():
    dims = ParallelDims.from_env(_env(16, 11, 8, 3))
    assert (dims.world_size, dims.nodes, dims.local_world_size, dims.node_rank, dims.local_rank) == (16, 2, 8, 1, 3)
    assert dims.node_members(1) == list(range(8, 16))
    assert dims.peer_members(3) == [3, 11]
    assert dims.is_multi_node
    assert dims.describe() == f"rank 11/16 node 1/2 local 3/8, {dims.layout.describe()}"
    assert dims.layout == Layout(16, dp_shard=16, ranks_per_node=8)  # every rank data-parallel


def test_no_variables_is_a_single_process():
    dims = ParallelDims.from_env({})
    assert (dims.world_size, dims.nodes, dims.local_world_size, dims.rank, dims.local_rank) == (1, 1, 1, 0, 0)
    assert not dims.is_multi_node


def test_override_pretends_nodes_on_one_machine():
    # 4 processes on one machine (LOCAL_WORLD_SIZE=4) treated as 2 nodes x 2
    dims = ParallelDims.from_env(_env(4, 3, 4, 3), local_world_size=2)
    assert (dims.nodes, dims.node_rank, dims.local_rank) == (2, 1, 1)


def test_every_group_partition_covers_the_world_once():
    dims = ParallelDims(12, 4, 0, 0)
    nodes = [dims.node_members(n) for n in range(dims.nodes)]
    peers = [dims.peer_members(i) for i in range(dims.local_world_size)]
    for partition in (nodes, peers):
        assert sorted(r for group in partition for r in group) == list(range(12))
    # each node group meets each peer group in exactly one rank
    assert all(len(set(a) & set(b)) == 1 for a in nodes for b in peers)


@pytest.mark.parametrize(
    "args, message",
    [
        ((6, 4, 0, 0), "not divisible by LOCAL_WORLD_SIZE=4"),
        ((0, 1, 0, 0), "WORLD_SIZE=0"),
        ((4, 0, 0, 0), "LOCAL_WORLD_SIZE=0"),
        ((4, 2, 4, 0), "RANK=4 is outside 0..3"),
        ((4, 2, 1, 2), "LOCAL_RANK=2 is outside 0..1"),
        ((4, 2, 3, 0), "not node-major"),
    ],
)
def test_bad_layouts_are_one_line_errors(args, message):
    with pytest.raises(LayoutError, match=message) as info:
        ParallelDims(*args)
    assert "\n" not in str(info.value)


def test_missing_local_world_size_with_many_ranks_says_how_to_fix():
    with pytest.raises(LayoutError, match="parallel.local_world_size"):
        ParallelDims.from_env(_env(4, 0))


def test_non_integer_variable():
    with pytest.raises(LayoutError, match="WORLD_SIZE='four'"):
        ParallelDims.from_env({"WORLD_SIZE": "four"})


def test_layout_is_a_value():
    assert ParallelDims(4, 2, 1, 1) == ParallelDims(4, 2, 1, 1)
    with pytest.raises(AttributeError):
        ParallelDims(4, 2, 1, 1).rank = 2  # frozen


def test_build_node_groups_needs_a_process_group():
    from parallel.dims import build_node_groups

    with pytest.raises(LayoutError, match="init_process_group"):
        build_node_groups(ParallelDims(1, 1, 0, 0))
