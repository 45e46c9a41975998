"""A MoE GPT under DDP, FSDP2, expert parallelism (ep=2, and ep=2 over cp=2), tensor parallelism
(sequence parallel: each tp rank routes its own slice) and a 2-stage pipeline on 2 gloo ranks trains
as one process does: the same losses (the auxiliary losses reach every stage's routers), and the same
aux-loss-free routing bias, the loads summed over the ranks that route other tokens (data-parallel,
with the ep and cp ranks among them, and tp) before each update."""

from __future__ import annotations

import pytest
import torch

from model.moe import moe_layers, update_expert_bias
from parallel.distributed import DistContext, init_distributed
from training.build import build_from_config
from training.config import load_config
from training.loop import router_load_sum, train_step

STEPS, RATE, LR = 4, 0.02, 1e-2
OVERRIDES = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.max_seq_len=16",
             "--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.d_ff=16", "--model.moe.z_loss=0.001",
             f"--model.moe.bias_update_rate={RATE}", "--train.micro_batch_size=2"]
PIPELINE = ["--parallel.pp=2", "--train.grad_accum_steps=2", "--model.moe.bias_update_rate=0"]
# The micro-batches each rank runs: ep ranks are data-parallel ranks; the cp pair runs both, each its chunks.
EXPERT_LAYOUTS = {"ep2": (["--parallel.ep=2"], lambda rank: [rank]),
                  "ep2_x_cp2": (["--parallel.ep=2", "--parallel.cp=2", "--train.grad_accum_steps=2"],
                                lambda rank: [0, 1])}


def global_batches(steps: range = range(STEPS)):
    """Each step's 4 sequences, as 2 micro-batches of 2 (one per rank, or both in one process); the
    steps in ``steps`` of one stream, so a resumed run reads what the uninterrupted one did."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps.stop):
        idx = torch.randint(0, 256, (4, 17), generator=g)
        if step in steps:
            yield [(idx[i:i + 2, :-1], idx[i:i + 2, 1:]) for i in (0, 2)]


def train(cfg, ctx: DistContext, micro: list[int], steps: range = range(STEPS),
          engine=None) -> tuple[list[float], list[list[float]]]:
    """Losses (mean over the data-parallel ranks) and this rank's routing biases after each of
    ``steps``, of ``engine`` (one built from ``cfg`` if none)."""
    engine = build_from_config(cfg, ctx).engine if engine is None else engine
    layers = moe_layers([engine.module()])
    reduce = router_load_sum(ctx)
    losses, biases = [], []
    for parts in global_batches(steps):
        out = train_step(engine, iter([parts[i] for i in micro]), len(micro), LR)
        update_expert_bias(layers, RATE, reduce)
        loss = out.loss.detach().clone()
        losses.append(float(ctx.all_reduce_mean(loss) if ctx.layout.dp_shard_cp * ctx.layout.dp_replicate > 1 else loss))
        biases.append([b for m in layers if m.expert_bias is not None for b in m.expert_bias.tolist()])
    return losses, biases


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for strategy in ("ddp", "fsdp"):
        cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + [f"--parallel.strategy={strategy}"])
        results[strategy] = train(cfg, init_distributed("cpu", cfg.parallel), [rank])
    for name, (layout, micro) in EXPERT_LAYOUTS.items():
        cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + layout)
        results[name] = train(cfg, init_distributed("cpu", cfg.parallel), micro(rank))
    # tp=2: both micro-batches on both ranks, each routing its half of every sequence
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + ["--parallel.tp=2", "--train.grad_accum_steps=2"])
    results["tp"] = train(cfg, init_distributed("cpu", cfg.parallel), [0, 1])
    # two pipeline stages, one layer each; both micro-batches go through both (no routing bias:
    # refused with pipelines, see test_routing_bias_with_a_pipeline_is_refused)
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + PIPELINE)
    results["pp"] = train(cfg, init_distributed("cpu", cfg.parallel), [0, 1])
    return results


@pytest.fixture(scope="module")
def ranks():
    from tests.gloo import run_workers

    return run_workers(_worker, 2)


def test_moe_under_ddp_fsdp_ep_tp_and_pp_matches_one_process(ranks):
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + ["--train.grad_accum_steps=2"])
    losses, biases = train(cfg, DistContext.single(), [0, 1])
    assert any(b != 0 for b in biases[-1])  # the bias moved
    for rank in ranks:
        for strategy in ("ddp", "fsdp", *EXPERT_LAYOUTS, "tp"):
            got_losses, got_biases = rank[strategy]
            assert got_losses == pytest.approx(losses, abs=1e-5), strategy
            assert got_biases == biases, strategy  # sign steps of the summed load: exactly equal
    # the auxiliary losses of both stages reach their routers as in one process
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + ["--train.grad_accum_steps=2", "--model.moe.bias_update_rate=0"])
    losses = train(cfg, DistContext.single(), [0, 1])[0]
    for rank in ranks:
        assert rank["pp"][0] == pytest.approx(losses, abs=1e-5)
