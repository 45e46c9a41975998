"""Expert parallelism in one process: the exchanged rows' order by expert, and the layouts that
cannot run refused before any work. Training under ep against one process, on gloo ranks:
tests/integration/parallel/test_ep.py (whose MoE model these layouts are checked with)."""

from __future__ import annotations

import torch

from parallel.dims import ParallelDims
from parallel.ep import by_expert_order
from parallel.layout import Layout
from tests.integration.parallel.test_ep import MODEL
from training.config import load_config


def test_rows_arriving_by_rank_are_sorted_by_expert():
    """Hand case: 2 source ranks x 2 local experts, blocks (r0e0: 2 rows, r0e1: 1, r1e0: 1, r1e1: 2)
    arrive as [a a b | c d d]; by expert they are [a a c | b d d]."""
    order = by_expert_order(torch.tensor([[2, 1], [1, 2]]))
    assert order.tolist() == [0, 1, 3, 2, 4, 5]
    assert by_expert_order(torch.tensor([[0, 3], [2, 0]])).tolist() == [3, 4, 0, 1, 2]


def test_expert_parallel_meshes_carve_ep_out_of_dp_shard_and_cp():
    """ep out of dp_shard x cp: the mesh builds dp_shard as (edp, ep) (with cp, (edp, ep_shard) so that
    ep = ep_shard x cp), FSDP2 shards the dense weights over dp_shard (x cp) and the experts over edp."""
    dims = ParallelDims(8, 8, 5, 5, layout=Layout(8, ep=2, dp_shard=4, pp=2))
    assert dims.mesh_shape() == {"pp": 2, "edp": 2, "ep": 2}
    assert (dims.fsdp_dims(), dims.expert_fsdp_dims(), dims.dp_rank) == (("dp_shard",), ("edp",), 1)
    hsdp = ParallelDims(8, 4, 5, 1, layout=Layout(8, ep=2, dp_shard=4, dp_replicate=2, strategy="fsdp"))
    assert (hsdp.fsdp_dims(), hsdp.expert_fsdp_dims(), hsdp.dp_rank) == (("dp_replicate", "dp_shard"),
                                                                         ("dp_replicate", "edp"), 5)
    only_ep = ParallelDims(2, 2, 1, 1, layout=Layout(2, ep=2))
    assert (only_ep.fsdp_dims(), only_ep.expert_fsdp_dims()) == (("ep",), ())
    moe = [f"--model.{k}={v}" for k, v in MODEL.items()]
    # ep=4 spans 2 dp_shard ranks x cp=2, and 2 ranks hold the same experts
    spans = load_config(None, moe + ["--parallel.ep=4", "--parallel.cp=2", "--parallel.dp_shard=4"]).parallel
    dims = ParallelDims(8, 8, 5, 5, layout=Layout.of(spans, 8, 8))
    assert dims.mesh_shape() == {"edp": 2, "ep_shard": 2, "cp": 2}
    assert (dims.fsdp_dims(), dims.expert_fsdp_dims(), dims.dp_rank, dims.ep_rank) == (("dp_shard_cp",), ("edp",), 2, 1)
    ep_is_cp = ParallelDims(4, 4, 3, 3, layout=Layout(4, ep=2, cp=2))
    assert (ep_is_cp.mesh_shape(), ep_is_cp.fsdp_dims(), ep_is_cp.expert_fsdp_dims()) == ({"edp": 2, "cp": 2},
                                                                                          ("dp_shard_cp",), ("edp",))
