"""common/comm_names.py: the one communication classifier, on names as the profiler records them.

The CPU names were recorded by torch.profiler around real gloo collectives, FSDP2 and DTensor
(torch 2.13); the NCCL ones are kernel and range names of NCCL 2.x traces."""

from __future__ import annotations

import pytest

from common.comm_names import communication_kind, is_communication

COMMUNICATION = {
    # NCCL kernels (the name is a hint: all-to-all and grouped collectives run in SendRecv kernels)
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "all_reduce",
    "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)": "all_reduce",
    "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "all_gather",
    "ncclKernel_ReduceScatter_RING_LL_Sum___nv_bfloat16(ncclDevComm*, unsigned long, ncclWork*)": "reduce_scatter",
    "ncclDevKernel_Broadcast_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "broadcast",
    "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)": "send_recv",
    "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)": "send_recv",
    "ncclDevKernel_Generic(ncclDevComm*, unsigned long, ncclWork*)": "other",
    # ProcessGroupNCCL's and gloo's ranges
    "nccl:all_reduce": "all_reduce",
    "nccl:_all_gather_base": "all_gather",
    "nccl:all_to_all": "all_to_all",
    "nccl:send 0->1": "send_recv",
    "nccl:recv 1<-0": "send_recv",
    "nccl:coalesced": "other",
    "gloo:all_reduce": "all_reduce",
    "gloo:all_gather": "all_gather",
    "gloo:all_to_all": "all_to_all",
    "gloo:broadcast": "broadcast",
    "gloo:send": "send_recv",
    "gloo:recv": "send_recv",
    "gloo:barrier": "barrier",
    # c10d ops (torch.distributed's calls), functional collectives (DTensor), DTensor's all-to-all
    "c10d::allreduce_": "all_reduce",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::broadcast_": "broadcast",
    "c10d::send": "send_recv",
    "c10d::recv_": "send_recv",
    "c10d::barrier": "barrier",
    "c10d::scatter_": "scatter",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "_c10d_functional_autograd::all_to_all_single": "all_to_all",
    "_c10d_functional::batch_p2p_ops": "send_recv",
    "_c10d_functional::wait_tensor": "wait",
    "_dtensor::shard_dim_alltoall": "all_to_all",
    "record_param_comms": "other",
    # FSDP2's ranges that issue a collective or wait for one
    "FSDP::all_gather (0)": "all_gather",
    "FSDP::all_gather_copy_out (layers.1)": "all_gather",
    "FSDP::post_backward_reduce (0)": "reduce_scatter",
    "FSDP::post_backward_rs_wait (layers.0)": "reduce_scatter",
}

NOT_COMMUNICATION = [
    "aten::broadcast_tensors", "aten::scatter_add_", "aten::gather", "aten::all", "aten::mm",
    "aten::_foreach_copy_", "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "FSDP::pre_forward (0)",
    "FSDP::post_backward_reshard (0)", "_c10d_functional::_wrap_tensor_autograd", "c10d::check_for_nan",
    "Optimizer.step#AdamW.step", "ProfilerStep#6", "autograd::engine::evaluate_function: AddmmBackward0",
    "Memcpy HtoD (Pageable -> Device)", "void at::native::vectorized_elementwise_kernel<4, ...>",
]


@pytest.mark.parametrize("name", list(COMMUNICATION))
def test_communication_names_and_their_collective(name):
    assert communication_kind(name) == COMMUNICATION[name]
    assert is_communication(name)


@pytest.mark.parametrize("name", NOT_COMMUNICATION)
def test_names_that_only_resemble_a_collective_are_not_communication(name):
    assert communication_kind(name) is None and not is_communication(name)
