"""The hierarchical all-reduce's refusals, and its world of one, in one process. Against a flat
all-reduce on 4 gloo processes: tests/integration/parallel/test_hierarchical_comm.py."""

from __future__ import annotations

import pytest
import torch


def test_op_and_dtype_errors_are_clear():
    from parallel.comm import hierarchical_all_reduce
    from parallel.dims import NodeGroups, ParallelDims

    groups = NodeGroups(ParallelDims(1, 1, 0, 0), intra=None, inter=None)
    with pytest.raises(ValueError, match="choose avg or sum"):
        hierarchical_all_reduce(torch.ones(3), groups, op="max")
    with pytest.raises(ValueError, match="op=sum"):
        hierarchical_all_reduce(torch.ones(3, dtype=torch.int64), groups, op="avg")
    x = torch.arange(4.0)
    assert torch.equal(hierarchical_all_reduce(x, groups, op="avg"), torch.arange(4.0))  # world of one
