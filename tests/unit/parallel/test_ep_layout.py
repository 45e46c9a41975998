"""Expert parallelism in one process: the exchanged rows' order by expert, and the layouts that
cannot run refused before any work. Training under ep against one process, on gloo ranks:
tests/integration/parallel/test_ep.py (whose MoE model these layouts are checked with)."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError, LayoutError
from parallel.dims import ParallelDims
from parallel.ep import by_expert_order
from tests.integration.parallel.test_ep import MODEL
from training.config import load_config


def test_rows_arriving_by_rank_are_sorted_by_expert():
    """Hand case: 2 source ranks x 2 local experts, blocks (r0e0: 2 rows, r0e1: 1, r1e0: 1, r1e1: 2)
    arrive as [a a b | c d d]; by expert they are [a a c | b d d]."""
    order = by_expert_order(torch.tensor([[2, 1], [1, 2]]))
    assert order.tolist() == [0, 1, 3, 2, 4, 5]
    assert by_expert_order(torch.tensor([[0, 3], [2, 0]])).tolist() == [3, 4, 0, 1, 2]


def test_ep_layouts_are_validated_before_any_work():
    dims = ParallelDims(8, 8, 5, 5, ep=2, dp_shard=4, pp=2)  # ParallelDims' dp_shard counts the ep ranks
    assert dims.mesh_shape() == {"pp": 2, "edp": 2, "ep": 2}
    assert (dims.fsdp_dims(), dims.expert_fsdp_dims(), dims.dp_rank) == (("dp_shard",), ("edp",), 1)
    hsdp = ParallelDims(8, 4, 5, 1, ep=2, dp_shard=4, dp_replicate=2)
    assert (hsdp.fsdp_dims(), hsdp.expert_fsdp_dims(), hsdp.dp_rank) == (("dp_replicate", "dp_shard"),
                                                                         ("dp_replicate", "edp"), 5)
    only_ep = ParallelDims(2, 2, 1, 1, ep=2)
    assert (only_ep.fsdp_dims(), only_ep.expert_fsdp_dims()) == (("ep",), ())
    with pytest.raises(LayoutError, match="parallel.ep=4 must divide the 6 data-parallel shard ranks"):
        ParallelDims(6, 6, 0, 0, ep=4)
    moe = [f"--model.{k}={v}" for k, v in MODEL.items()]
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide model.moe.experts=4"):
        load_config(None, moe + ["--parallel.ep=3"])
    with pytest.raises(ConfigError, match="parallel.ep=2 shards routed experts, but the model has none"):
        load_config(None, ["--parallel.ep=2"])
    for strategy in ("ddp", "zero1", "zero3"):
        with pytest.raises(ConfigError, match=f"parallel.ep=2 with parallel.strategy={strategy}"):
            load_config(None, moe + ["--parallel.ep=2", f"--parallel.strategy={strategy}"])
    with pytest.raises(ConfigError, match="parallel.ep=2 with parallel.cp=4: .* ep must be a multiple of cp"):
        load_config(None, moe + ["--parallel.ep=2", "--parallel.cp=4", "--parallel.strategy=fsdp"])
    cfg = load_config(None, moe + ["--parallel.ep=2", "--parallel.dp_shard=2"])
    assert cfg.parallel.layout(1, 4)["dp_shard"] == 4  # the dense weights shard over dp_shard x ep
    # ep out of dp_shard x cp: ep=4 spans 2 dp_shard ranks x cp=2, and 2 ranks hold the same experts.
    spans = load_config(None, moe + ["--parallel.ep=4", "--parallel.cp=2", "--parallel.dp_shard=2"]).parallel
    assert spans.layout(1, 8)["dp_shard"] == 4
    dims = ParallelDims(8, 8, 5, 5, **spans.layout(1, 8))
    assert dims.mesh_shape() == {"edp": 2, "ep_shard": 2, "cp": 2}
    assert (dims.fsdp_dims(), dims.expert_fsdp_dims(), dims.dp_rank, dims.ep_rank) == (("dp_shard_cp",), ("edp",), 2, 1)
    ep_is_cp = ParallelDims(4, 4, 3, 3, ep=2, cp=2)
    assert (ep_is_cp.mesh_shape(), ep_is_cp.fsdp_dims(), ep_is_cp.expert_fsdp_dims()) == ({"edp": 2, "cp": 2},
                                                                                          ("dp_shard_cp",), ("edp",))
    with pytest.raises(LayoutError, match=r"parallel.ep=4 must divide the dp_shard x cp = 6 ranks"):
        ParallelDims(6, 6, 0, 0, ep=4, cp=2)
    with pytest.raises(LayoutError, match="parallel.ep=2 must be a multiple of parallel.cp=4"):
        ParallelDims(8, 8, 0, 0, ep=2, cp=4)
    resolved, note = cfg.parallel.for_data_parallel(4)
    assert resolved.strategy == "fsdp" and "parallel.ep=2" in note
