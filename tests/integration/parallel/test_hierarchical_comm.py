"""Hierarchical all-reduce on gloo: 4 processes arranged as 2 nodes x 2 must equal a flat all-reduce.

All checks run inside one 4-process launch (process start-up dominates the cost); each test
function then asserts on its part of the results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_workers

# ----------------------------------------------------------------------------- the 4-process worker

SHAPES = [(1,), (7,), (1001,), (3, 5), (13, 4)]  # none divisible by the local size 2 or 4 except 13*4


def _case_tensor(rank: int, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _compare_with_flat(rank: int, world: int, groups, label: str, stats=None) -> list[tuple]:
    from parallel.comm import hierarchical_all_reduce

    rows = []
    for seed, shape in enumerate(SHAPES):
        for op in ("avg", "sum"):
            x = _case_tensor(rank, shape, seed, torch.float64)
            flat = x.clone()
            dist.all_reduce(flat)
            if op == "avg":
                flat /= world
            ours = hierarchical_all_reduce(x, groups, op=op, stats=stats)
            rows.append((label, shape, op, ours is x, (ours - flat).abs().max().item()))
    # non-contiguous input: a transposed view
    base = _case_tensor(rank, (6, 5), 99, torch.float64)
    flat = base.t().clone()
    dist.all_reduce(flat)
    view = base.t()
    hierarchical_all_reduce(view, groups, op="sum")
    rows.append((label, "transposed (5, 6)", "sum", True, (base.t() - flat).abs().max().item()))
    # integer sum must be exact
    xi = _case_tensor(rank, (7,), 7, torch.int64)
    flat_i = xi.clone()
    dist.all_reduce(flat_i)
    int_diff = (hierarchical_all_reduce(xi, groups, "sum") - flat_i).abs().max()
    rows.append((label, "int64 (7,)", "sum", True, float(int_diff)))
    return rows


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def _shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def _ddp_hook_grads(rank: int, world: int, groups) -> dict[str, float]:
    """DDP with the hierarchical hook vs the mean of every shard's gradient computed locally."""
    from parallel.compression import register_comm_hook
    from parallel.config import ParallelConfig

    model = torch.nn.parallel.DistributedDataParallel(_tiny_model(), bucket_cap_mb=0.0001)  # several buckets
    stats = register_comm_hook(model, ParallelConfig(strategy="ddp", ddp_comm_hook="hierarchical"), groups)
    x, y = _shard(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()

    reference = _tiny_model()
    for r in range(world):
        xr, yr = _shard(r)
        (torch.nn.functional.mse_loss(reference(xr), yr) / world).backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return {"max_grad_diff": diff, **stats.pop_step()}


def _hierarchical_worker(rank: int, world: int) -> dict[str, Any]:
    from parallel.comm import CommStats
    from parallel.dims import ParallelDims, build_node_groups

    out: dict[str, Any] = {}
    two_by_two = build_node_groups(ParallelDims.from_env(local_world_size=2))
    out["2x2_groups"] = (dist.get_process_group_ranks(two_by_two.intra), dist.get_process_group_ranks(two_by_two.inter))
    stats_2x2 = CommStats()
    out["2x2"] = _compare_with_flat(rank, world, two_by_two, "2 nodes x 2", stats_2x2)
    out["2x2_stats"] = stats_2x2.pop_step()
    out["ddp_hook"] = _ddp_hook_grads(rank, world, two_by_two)

    one_node = build_node_groups(ParallelDims.from_env())  # LOCAL_WORLD_SIZE=4: a single node
    out["1x4_inter_is_none"] = one_node.inter is None
    stats_1x4 = CommStats()
    out["1x4"] = _compare_with_flat(rank, world, one_node, "1 node x 4", stats_1x4)
    out["1x4_stats"] = stats_1x4.pop_step()

    four_nodes = build_node_groups(ParallelDims.from_env(local_world_size=1))
    out["4x1_intra_is_none"] = four_nodes.intra is None
    out["4x1"] = _compare_with_flat(rank, world, four_nodes, "4 nodes x 1")
    return out


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict[str, Any]]:
    return run_workers(_hierarchical_worker, 4)


# ----------------------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_groups_are_nodes_and_same_local_index_peers(four_rank_results):
    expected = {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}
    for rank, result in enumerate(four_rank_results):
        assert result["2x2_groups"] == expected[rank]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["2x2", "1x4", "4x1"])
def test_hierarchical_equals_flat_all_reduce(four_rank_results, layout):
    for result in four_rank_results:
        rows = result[layout]
        assert len(rows) == 2 * len(SHAPES) + 2
        for label, shape, op, in_place, diff in rows:
            assert in_place, f"{label} {shape} {op}: result is not the input tensor"
            assert diff < 1e-12, f"{label} {shape} {op}: differs from flat all-reduce by {diff}"


@pytest.mark.timeout(120)
def test_single_node_is_one_local_collective(four_rank_results):
    for result in four_rank_results:
        assert result["1x4_inter_is_none"] and result["4x1_intra_is_none"]
        stats = result["1x4_stats"]
        # every call was exactly one all-reduce: 2 ops x 5 shapes, counted as ring bytes of 4 ranks
        assert stats["comm_collectives"] == 2 * len(SHAPES)
        expected = sum(2 * 3 * 8 * torch.Size(s).numel() // 4 for s in SHAPES) * 2
        assert stats["comm_bytes_sent"] == expected


@pytest.mark.timeout(120)
def test_two_level_bytes_match_the_formula(four_rank_results):
    # per call: reduce-scatter (L-1)/L*padded + all-reduce 2(N-1)/N*shard + all-gather (L-1)*shard, L=N=2
    expected = 0
    for s in SHAPES:
        shard = -(-torch.Size(s).numel() // 2) * 8
        expected += 2 * (shard * 2 // 2 + shard + shard)
    for result in four_rank_results:
        assert result["2x2_stats"]["comm_bytes_sent"] == expected
        assert result["2x2_stats"]["comm_collectives"] == 3 * 2 * len(SHAPES)


@pytest.mark.timeout(120)
def test_ddp_hook_averages_exactly_once(four_rank_results):
    for result in four_rank_results:
        hook = result["ddp_hook"]
        assert hook["max_grad_diff"] < 1e-6, hook
        assert hook["comm_bytes_sent"] > 0 and hook["comm_bytes_uncompressed"] > 0
