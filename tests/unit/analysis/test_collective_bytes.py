"""analysis/collective_bytes.py: the bytes each collective and send is priced at, against hand
computations, on a world of 4 ranks in this process (torch's fake process group: every op reaches
the dispatcher as on a real backend, no data moves). tests/integration/test_bench_parallel.py counts
a real tp=2 run on gloo.

Rank 1 of 4 throughout; X is 8 rows x 4 fp32 = 128 bytes (16 bytes a row)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from analysis.collective_bytes import (
    PRICES,
    CommBytes,
    all_to_all_bytes_sent,
    bytes_by_dimension,
    dimension_of_groups,
)
from common.comm_names import communication_kind

RANK, WORLD, ROW = 1, 4, 16


@pytest.fixture
def world():
    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def x() -> torch.Tensor:
    return torch.ones(8, 4)


def sent(counter: CommBytes, kind: str) -> float:
    return sum(nbytes for (_, k), nbytes in counter.sent.items() if k == kind)


def test_ring_collectives_of_torch_distributed(world):
    with CommBytes() as counter:
        dist.all_reduce(x())
        dist.all_gather_into_tensor(torch.empty(32, 4), x())
        dist.all_gather([torch.empty(8, 4) for _ in range(WORLD)], x())
        dist.reduce_scatter_tensor(torch.empty(2, 4), x())
    assert sent(counter, "all_reduce") == 2 * 3 / 4 * 128
    assert sent(counter, "all_gather") == 2 * (3 / 4 * 512)  # (n-1)/n of the gathered 512 bytes, twice
    assert sent(counter, "reduce_scatter") == 3 / 4 * 128
    assert counter.calls == {("0", "all_reduce"): 1, ("0", "all_gather"): 2, ("0", "reduce_scatter"): 1}


def test_all_to_all_counts_what_leaves_the_rank_with_variable_splits(world):
    with CommBytes() as counter:
        dist.all_to_all_single(torch.empty(8, 4), x())  # equal splits: 2 rows stay
    assert sent(counter, "all_to_all") == 6 * ROW
    with CommBytes() as counter:
        dist.all_to_all_single(torch.empty(8, 4), x(), [2, 2, 2, 2], [1, 4, 2, 1])  # rank 1 keeps 4 rows
    assert sent(counter, "all_to_all") == 4 * ROW
    with CommBytes() as counter:  # the list form: one tensor per peer, 1..4 rows
        dist.all_to_all([torch.empty(i + 1, 4) for i in range(WORLD)], [torch.ones(i + 1, 4) for i in range(WORLD)])
    assert sent(counter, "all_to_all") == (1 + 3 + 4) * ROW
    with CommBytes() as counter:  # functional, as expert parallelism dispatches tokens
        funcol.all_to_all_single(x(), [1, 2, 3, 2], [3, 3, 1, 1], world).wait()
    assert sent(counter, "all_to_all") == 5 * ROW
    with CommBytes() as counter:  # context parallelism's ring rotation: the whole tensor to one peer
        funcol.permute_tensor(x().flatten(), [1, 2, 3, 0], world).wait()
    assert sent(counter, "all_to_all") == 128


def test_autograd_all_to_all_counts_forward_and_backward(world):
    data = x().requires_grad_()
    with CommBytes() as counter:
        out = funcol.all_to_all_single_autograd(data, [1, 2, 3, 2], [3, 3, 1, 1], world)
        out.sum().backward()
    # forward: 8 rows, 3 stay; backward: the 8-row gradient split as the output was, 2 stay
    assert sent(counter, "all_to_all") == (5 + 6) * ROW and counter.calls[("0", "all_to_all")] == 2


def test_broadcast_sends_and_p2p(world):
    with CommBytes() as counter:
        dist.broadcast(x(), src=0)  # not the root: sends nothing
        dist.broadcast(x(), src=RANK)
        dist.send(x(), dst=2)
        dist.recv(x(), src=2)  # the peer's send
        dist.scatter(torch.empty(8, 4), None, src=0)  # not priced: listed
    assert sent(counter, "broadcast") == 3 / 4 * 128 and counter.calls[("0", "broadcast")] == 1
    assert sent(counter, "send") == 128
    assert counter.unpriced == {"c10d::scatter_": 1}


def test_dtensor_collectives_are_named_by_mesh_dimension(world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    assert set(dimension_of_groups(mesh).values()) == {"dp", "tp"}
    with CommBytes() as counter:
        distribute_tensor(x(), mesh["tp"], [Shard(0)]).redistribute(mesh["tp"], [Replicate()]).to_local()
        dist.all_reduce(x())  # the default group is outside this mesh
        torch.ops._dtensor.shard_dim_alltoall(x(), 0, 1, mesh["dp_shard"].get_group().group_name)
    totals, detail = bytes_by_dimension(counter, mesh)
    # tp: the 4-row shard gathered over 2 ranks: (2-1)/2 of 8 rows; dp: half the rows leave
    assert totals == {"tp": 4 * ROW, "other": 2 * 3 / 4 * 128, "dp": 4 * ROW}
    assert detail["tp all_gather"] == [1, 4 * ROW] and detail["dp all_to_all"] == [1, 4 * ROW]
    # with data-parallel dimensions only, a group of its own (DDP's, DeepSpeed's) is data parallel too
    dp_only = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    assert bytes_by_dimension(counter, dp_only)[0] == {"dp": 4 * ROW + 2 * 3 / 4 * 128 + 4 * ROW}


def test_all_to_all_bytes_sent_by_hand():
    rows = torch.ones(10, 2)  # 8 bytes a row
    assert all_to_all_bytes_sent(rows, [4, 3, 2, 1], rank=0, n=4) == 6 * 8
    assert all_to_all_bytes_sent(rows, None, rank=3, n=2) == 5 * 8
    assert all_to_all_bytes_sent(torch.ones(0, 2), [0, 0], rank=0, n=2) == 0
    assert all_to_all_bytes_sent([torch.ones(1), torch.ones(2), torch.ones(3)], None, rank=2, n=3) == 3 * 4


def test_every_priced_op_is_communication_to_the_trace_classifier():
    expected = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"}
    assert {name: communication_kind(name) in expected for name in PRICES} == dict.fromkeys(PRICES, True)


def test_expert_parallel_all_to_alls_are_ep_and_its_other_collectives_data_parallel(world):
    """(edp=2, ep=2) as build_mesh makes it, edp x ep flattened back into dp_shard for the dense weights:
    only the all-to-alls on the ep group are expert traffic; FSDP2's collectives on the ep group (its
    shard group when no edp ranks are left), on edp and on the flattened dp_shard are data parallel."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    mesh["edp", "ep"]._flatten("dp_shard")
    ep = mesh["ep"].get_group()
    with CommBytes() as counter:
        dist.all_to_all_single(torch.empty(8, 4), x(), [3, 5], [6, 2], group=ep)  # rank 1 of ep keeps 2 rows
        dist.all_gather_into_tensor(torch.empty(16, 4), x(), group=ep)
        dist.reduce_scatter_tensor(torch.empty(2, 4), x(), group=mesh["dp_shard"].get_group())
        dist.all_reduce(x(), group=mesh["edp"].get_group())
        dist.all_reduce(x())  # the default group: outside the mesh, every rank data parallel
    totals, detail = bytes_by_dimension(counter, mesh)
    assert totals == {"ep": 6 * ROW, "dp": 1 / 2 * 256 + 3 / 4 * 128 + 2 * 1 / 2 * 128 + 2 * 3 / 4 * 128}
    assert detail["ep all_to_all"] == [1, 6 * ROW] and detail["dp all_gather"] == [1, 128.0]
