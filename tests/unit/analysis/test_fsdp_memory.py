"""What FSDP2 holds per weight while a pipeline defers its gradient reduction, against the estimator's
count (memory.py: the stage gathered in the compute dtype, gradients accumulated in the reduce dtype).
Two ranks of torch's fake process group in this process: collectives move nothing, shapes are real."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from analysis import estimator as est
from analysis.estimator.memory import REDUCE_BYTES


@pytest.fixture
def mesh():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_deferred_sync_holds_bf16_weights_and_fp32_gradients(mesh, one_thread):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the trainer's (parallel/precision.py) and torchtitan's policy: gather bf16, reduce fp32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    # what torch.distributed.pipelining's stage does before every backward but the step's last
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    for _ in range(2):  # two micro-batches: the second adds to the first's gradients
        model(torch.randn(8, 64)).sum().backward()
    held = 0
    for layer in model:
        for param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params:
            held += param._unsharded_param.untyped_storage().nbytes()  # the gathered weight
            held += param.unsharded_accumulated_grad.untyped_storage().nbytes()  # the gradient so far
    weights = 64 * 96 * 2
    assert held == weights * (est.gathered_bytes("bf16_master") + REDUCE_BYTES)  # 2 + 4, not 2 + 2
