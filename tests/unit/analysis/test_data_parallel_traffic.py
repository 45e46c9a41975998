"""The estimator's data-parallel bytes per step against the trainer's own engines, measured in this
process: the engine is built as train.py builds it (training/build.py) on torch's fake process group
of 2 ranks, so every collective reaches the dispatcher (``CommBytes`` prices it) without a second
process; the values it reduces are meaningless, the bytes are the real ones."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from analysis import estimator as est
from analysis.collective_bytes import CommBytes
from model.flops import count_parameters
from parallel.distributed import init_distributed
from training.build import build_from_config
from training.config import load_config
from training.loop import train_step

WORLD = 2
# The model tools/bench_parallel.py measures (docs/results/parallel_strategies_cpu.md), one sequence per micro-batch.
SMALL = ["--train.micro_batch_size=1", "--precision.mode=fp32"]
BENCH = Path(__file__).resolve().parents[3] / "docs/results/parallel_strategies_cpu.json"


@pytest.fixture(scope="module")
def fake_world():
    """Rank 0 of a 2-rank job whose collectives go nowhere (what init_distributed finds already set up).
    One for the module: DeepSpeed keeps the groups of the first engine it builds in this process."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
            env.setenv(key, value)
        dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def measured_and_estimated(strategy: str, grad_accum: int) -> tuple[float, float]:
    """Bytes rank 0 sends in one training step of the trainer's engine, and the estimator's figure
    for the same model, strategy and micro-batch count."""
    cfg = load_config("configs/tiny.yaml", [*SMALL, f"--parallel.strategy={strategy}",
                                            f"--train.grad_accum_steps={grad_accum}"])
    engine = build_from_config(cfg, init_distributed("cpu", cfg.parallel)).engine
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.seq_len + 1))
    batches = itertools.repeat((tokens[:, :-1], tokens[:, 1:]))
    with CommBytes() as counter:
        train_step(engine, batches, grad_accum, lr=1e-3)
    measured = sum(counter.sent.values())
    job = est.JobSpec(cfg.model, cfg.seq_len, cfg.train.micro_batch_size, est.layout_of(WORLD, strategy=strategy),
                      precision="fp32", grad_accum=grad_accum)
    return measured, est.dp_volume(job, count_parameters(cfg.model)).sent_per_gpu


# The engines also all-reduce a few scalars per step (DeepSpeed's overflow flag, the gradient norm).
SCALARS = 64


@pytest.mark.parametrize("strategy, grad_accum, reductions", [
    ("zero2", 1, 1), ("zero2", 4, 4),  # DeepSpeed's ZeRO-2 reduces every micro-batch
    ("zero1", 4, 1),  # its ZeRO-1 only at the accumulation boundary
])
def test_bytes_per_step_equal_what_the_trainers_engine_sends(fake_world, strategy, grad_accum, reductions):
    measured, estimated = measured_and_estimated(strategy, grad_accum)
    assert measured == pytest.approx(estimated, abs=SCALARS)
    job = est.JobSpec(load_config("configs/tiny.yaml", SMALL).model, 128, 1, est.layout_of(WORLD, strategy=strategy),
                      grad_accum=grad_accum)
    assert est.gradient_reductions(job) == reductions


def test_one_micro_batch_sends_what_the_gloo_bench_measured(fake_world):
    """The fake group sees the bytes two gloo processes send: the bench's zero2 row, measured with
    torchrun (4,937 KiB per step), is what this process measures and what the estimator counts."""
    bench = next(r for r in json.loads(BENCH.read_text())["rows"] if r["strategy"] == "zero2")
    measured, estimated = measured_and_estimated("zero2", 1)
    assert measured == bench["comm"]["dp"]
    assert estimated == pytest.approx(bench["comm"]["dp"], abs=SCALARS)


def test_ddp_reduces_once_per_step_under_no_sync_and_every_micro_batch_without():
    # torch's DDP cannot run on the fake process group (its comm hook gets no tensor back), so this is
    # the count by hand: 2(n-1)/n of the gradients per all-reduce.
    model = load_config("configs/tiny.yaml", SMALL).model
    grads = 4 * count_parameters(model)  # fp32
    for no_sync, reductions in ((True, 1), (False, 4)):
        job = est.JobSpec(model, 128, 1, est.layout_of(WORLD, strategy="ddp"), precision="fp32", grad_accum=4,
                          ddp_no_sync=no_sync)
        assert est.gradient_reductions(job) == reductions
        assert est.dp_volume(job, count_parameters(model)).sent_per_gpu == pytest.approx(
            reductions * 2 * (WORLD - 1) / WORLD * grads)


def test_a_reduce_scatter_zero_sends_the_zero_papers_volume_once_per_step():
    # Megatron's distributed optimizer: one reduce-scatter of the accumulated gradients, one all-gather.
    model = load_config("configs/tiny.yaml", SMALL).model
    n = count_parameters(model)
    job = est.JobSpec(model, 128, 1, est.layout_of(WORLD, strategy="zero2"), precision="bf16_master", grad_accum=4,
                      zero_reduction="reduce_scatter")
    assert est.gradient_reductions(job) == 1
    assert est.dp_volume(job, n).sent_per_gpu == pytest.approx((WORLD - 1) / WORLD * (2 * n + 2 * n))
