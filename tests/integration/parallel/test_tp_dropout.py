"""Dropout under tensor parallelism, on 2 gloo ranks, against one process that drops the same elements.

Every rank records each dropout mask it draws (``torch.nn.functional.dropout`` wrapped; the
attention runs the reference backend, whose probabilities go through it too). The one-process
reference replays them: where the activation is replicated over the tp ranks the two ranks' masks
must be equal and are used as they are; where each rank holds a part (its heads, or under sequence
parallelism its positions) they must differ and are joined along the split dimension. Then losses,
gradient norms and first-step gradients of STEPS steps must match one process, with and without
sequence parallelism. An MoE model with shared experts under expert tensor parallelism (parallel.etp=2,
with and without sequence parallelism) runs the same check: its MoE layers hold the whole sequence on
every tp rank, so their two dropouts (after the routed experts, in the shared experts) must draw alike.
Each layout also saves after SAVE_AT steps (the weights through its engine, the generator state as
train.py's checkpoint keeps it), and a fresh engine resumed from there must draw the same masks and
give the same losses, bit for bit, as the run that went on. A third layout in the launch, two
data-parallel ranks, must draw different masks.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parallel.distributed import DistContext
from tests.gloo import gloo_context, run_workers, save_on_every_rank
from tests.integration.parallel.test_tp_pp import ACCUM, MICRO
from tests.integration.parallel.test_tp_pp import MODEL as TP_PP_MODEL
from tests.integration.parallel.test_tp_pp import micro_batches as tp_pp_micro_batches
from training.build import build_from_config
from training.checkpoint import capture_rng_state, restore_rng_state
from training.config import load_config

# test_tp_pp.py's model and batches, with fewer layers, dropout and the reference attention
MODEL = TP_PP_MODEL | {"n_layer": 2, "dropout": 0.2, "attention": "reference"}
STEPS, SAVE_AT = 10, 5
LAYOUTS = {"tp": {"tp": 2}, "tp_no_sp": {"tp": 2, "sequence_parallel": False, "loss_parallel": False}}
P = MODEL["dropout"]
# MoE layers with a shared expert, under expert tensor parallelism: two more dropouts per block
MOE_MODEL = MODEL | {"moe.experts": 4, "moe.top_k": 2, "moe.d_ff": 16, "moe.shared_experts": 1}
MOE_LAYOUTS = {"etp": {"tp": 2, "etp": 2},
               "etp_no_sp": {"tp": 2, "etp": 2, "sequence_parallel": False, "loss_parallel": False}}


def model_of(name: str | None) -> dict:
    return MOE_MODEL if name in MOE_LAYOUTS else MODEL


def job(grad_accum: int = ACCUM, model: dict = MODEL, **parallel):
    overrides = [f"--model.{k}={v}" for k, v in model.items()]
    overrides += [f"--train.micro_batch_size={MICRO}", f"--train.grad_accum_steps={grad_accum}",
                  "--optim.warmup_steps=1", "--optim.lr=1e-2", "--train.max_steps=10"]
    overrides += [f"--parallel.{k}={v}" for k, v in parallel.items()]
    return load_config(None, overrides)


@contextlib.contextmanager
def dropout_masks(replay=None):
    """Record every training-mode dropout's mask into the yielded list, or, with ``replay`` (a
    function from the input to a mask), drop what it returns instead of drawing."""
    plain, masks = F.dropout, []

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return plain(x, p, training, inplace)
        if replay is not None:
            return x * (replay(x).to(x.dtype) / (1 - p))
        out = plain(x, p, training, inplace)
        masks.append(((out != 0) | (x == 0)).detach().clone())  # where x is 0 either mask gives 0
        return out

    F.dropout = dropout
    try:
        yield masks
    finally:
        F.dropout = plain


def micro_batches(step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return tp_pp_micro_batches(step, dp_rank, 1)


def full_grads(engine) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in engine.module().named_parameters() if p.grad is not None}


def train(engine, ctx, cfg, micro_batches_of, accum: int, steps: range = range(STEPS)) -> dict:
    losses, norms, grads = [], [], {}
    for step in steps:
        loss, _ = engine.forward_backward_step(iter(micro_batches_of(step)), accum)
        if step == 0:
            grads = full_grads(engine)
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(ctx.all_reduce_mean(loss.detach().clone())))
    return {"losses": losses, "norms": norms, "grads": grads}


def worker(rank: int, world: int, root: str) -> dict:
    results = {}
    for name, parallel in (LAYOUTS | MOE_LAYOUTS).items():
        cfg = job(model=model_of(name), **parallel)
        ctx = gloo_context(rank, world, parallel=cfg.parallel)
        engine = build_from_config(cfg, ctx).engine
        batches_of = lambda step: micro_batches(step, ctx.dims.dp_rank)  # noqa: E731
        with dropout_masks() as masks:
            first = train(engine, ctx, cfg, batches_of, ACCUM, range(SAVE_AT))
            path = Path(root) / name
            save_on_every_rank(engine, path, rank)
            rng = capture_rng_state()
            rest = train(engine, ctx, cfg, batches_of, ACCUM, range(SAVE_AT, STEPS))
        results[name] = {"losses": first["losses"] + rest["losses"], "norms": first["norms"] + rest["norms"],
                         "grads": first["grads"], "masks": masks}
        fresh = build_from_config(cfg, ctx).engine  # a new run: its build drew other numbers
        fresh.load(path)
        restore_rng_state(rng)
        with dropout_masks() as resumed_masks:
            results[name]["resumed"] = train(fresh, ctx, cfg, batches_of, ACCUM, range(SAVE_AT, STEPS))["losses"]
        results[name]["resumed_masks"] = resumed_masks
    cfg = job(strategy="ddp")
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    with dropout_masks() as masks:
        engine.forward_backward_step(iter(micro_batches(0, 0)[:1]), 1)  # the same batch on both ranks
    results["dp"] = masks
    return results


def one_process_replaying(rank_masks: list[list[torch.Tensor]], model: dict = MODEL) -> dict:
    """One process over the same global batch, dropping what the tp ranks dropped."""
    calls = iter(zip(*rank_masks, strict=True))
    seen = {"replicated": 0, "split": 0}

    def replay(x: torch.Tensor) -> torch.Tensor:
        first, second = next(calls)
        if first.shape == x.shape:
            assert torch.equal(first, second), "tp ranks drew different masks for a replicated activation"
            seen["replicated"] += 1
            return first
        dim = next(d for d in range(x.dim()) if first.shape[d] != x.shape[d])
        assert first.shape[dim] * 2 == x.shape[dim]
        assert not torch.equal(first, second), "tp ranks drew the same mask for different elements"
        seen["split"] += 1
        return torch.cat([first, second], dim)

    cfg = job(model=model)
    engine = build_from_config(cfg, DistContext.single()).engine
    with dropout_masks(replay):
        out = train(engine, DistContext.single(), cfg, lambda step: micro_batches(step, 0), ACCUM)
    assert next(calls, None) is None, "the ranks drew more masks than one process"
    return out | seen


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_workers(worker, 2, root)


@pytest.mark.parametrize("name", list(LAYOUTS | MOE_LAYOUTS))
def test_tensor_parallel_dropout_matches_one_process_dropping_the_same_elements(name, results):
    ref = one_process_replaying([r[name]["masks"] for r in results], model_of(name))
    per_forward = 1 + 3 * MODEL["n_layer"]  # embedding, then per block attention core, after attn, after mlp
    # The attention cores always hold their own heads; the residual stream is split only under
    # sequence parallelism.
    split = STEPS * ACCUM * (MODEL["n_layer"] if name.endswith("no_sp") else per_forward)
    if name in MOE_LAYOUTS:  # and per block the shared expert's dropout, on the whole sequence as the MoE's
        per_forward += MODEL["n_layer"]
        split -= 0 if name.endswith("no_sp") else STEPS * ACCUM * MODEL["n_layer"]  # the MoE's own: whole
    calls = STEPS * ACCUM * per_forward
    assert (ref["split"], ref["replicated"]) == (split, calls - split)
    for r in results:
        assert r[name]["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert r[name]["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    for key, grad in ref["grads"].items():
        torch.testing.assert_close(results[0][name]["grads"][key], grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(LAYOUTS | MOE_LAYOUTS))
def test_a_resumed_tensor_parallel_run_draws_the_same_masks(name, results):
    per_step = ACCUM * (1 + (4 if name in MOE_LAYOUTS else 3) * MODEL["n_layer"])  # the shared expert's too
    for r in results:
        got = r[name]
        assert got["resumed"] == got["losses"][SAVE_AT:], f"{name}: resume is not bit-exact"
        after = got["masks"][SAVE_AT * per_step:]
        assert len(got["masks"]) == STEPS * per_step
        assert len(got["resumed_masks"]) == len(after) == (STEPS - SAVE_AT) * per_step
        assert all(torch.equal(a, b) for a, b in zip(got["resumed_masks"], after)), f"{name}: other masks after resume"


def test_data_parallel_ranks_draw_different_masks(results):
    first, second = (r["dp"] for r in results)
    assert len(first) == len(second) == 1 + 3 * MODEL["n_layer"]
    assert all(not torch.equal(a, b) for a, b in zip(first, second))
