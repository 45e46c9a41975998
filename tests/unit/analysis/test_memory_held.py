"""What the estimator counts as held at the peak (memory.py), against what torch really holds, on CPU in
this process: the loss's peak (``loss_backward_bytes``) from the CPU allocator's running total around one
forward and backward (the profiler's memory events), and what FSDP2 keeps per weight while a pipeline
defers its gradient reduction (the stage gathered in the compute dtype, gradients accumulated in the
reduce dtype). Two ranks of torch's fake process group where a group is needed: collectives move
nothing, shapes and allocations are real."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from analysis import estimator as est
from analysis.estimator.memory import REDUCE_BYTES
from kernels.reference import cross_entropy

TOKENS, VOCAB = 256, 2048


def peak_above_start(step, tmp_path) -> int:
    """The most bytes live during ``step()`` beyond those live when it started, read from the running
    'Total Allocated' of every allocation and free (the chrome trace's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    start = int(events[0]["args"]["Total Allocated"]) - int(events[0]["args"]["Bytes"])
    return max(int(e["args"]["Total Allocated"]) for e in events) - start


def test_the_plain_loss_peaks_at_log_probs_and_two_fp32_gradients(tmp_path, one_thread):
    # kernels/reference.py's loss (torchtitan's too): F.cross_entropy(logits.float())
    logits = torch.randn(TOKENS, VOCAB).bfloat16().requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,))

    def step():
        cross_entropy(logits, targets).backward()

    step()
    logits.grad = None
    per_logit = peak_above_start(step, tmp_path) / (TOKENS * VOCAB)
    assert per_logit == pytest.approx(4 + est.loss_backward_bytes(tp=1), abs=0.05)  # 12, not the 10 counted before


@pytest.fixture
def two_ranks():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_the_vocab_parallel_loss_peaks_at_log_probs_and_three_fp32_tensors(tmp_path, one_thread, two_ranks):
    # torch's loss_parallel on vocab-sharded logits (the trainer's and torchtitan's with tp > 1): each rank
    # holds VOCAB / 2 of them; the fake group's collectives move nothing but allocate as NCCL's would
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    local = torch.randn(TOKENS, VOCAB // 2).bfloat16().requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,))

    def step():
        logits = DTensor.from_local(local, two_ranks, [Shard(-1)])  # a view: no copy of the logits
        with loss_parallel():
            loss = F.cross_entropy(logits.float(), targets)
            del logits  # as torchtitan's train step does before backward
            loss.backward()

    step()
    local.grad = None
    per_logit = peak_above_start(step, tmp_path) / (TOKENS * VOCAB // 2)
    assert per_logit == pytest.approx(4 + est.loss_backward_bytes(tp=2), abs=0.05)  # 16


def test_deferred_sync_holds_bf16_weights_and_fp32_gradients(one_thread, two_ranks):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # the trainer's (parallel/precision.py) and torchtitan's policy: gather bf16, reduce fp32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))
    for layer in model:
        fully_shard(layer, mesh=two_ranks, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=two_ranks, mp_policy=policy, reshard_after_forward=False)
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
