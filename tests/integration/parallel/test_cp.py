"""Context parallelism (parallel/cp.py) against one process.

The layouts' numbers are checked against a model that runs whole sequences in one process, built
from the same seed inside each worker: logits and loss of one forward (fp32, within 1e-5) for
multi-head and grouped-query attention, the causal and the document mask, a sliding window that
reaches across chunk borders with attention sinks, and an MoE layer whose capacity drops copies
(kept as one process keeps them over whole sequences); the gradients (a cp
rank's gradients summed over its cp group are cp times the whole-sequence gradient, which is what
FSDP2's average over dp x cp turns into the mean); and the build path's FSDP2 engine over cp, cp x
dp_shard, cp x tp, cp with selective recompute and cp x pp (1f1b with the causal mask, interleaved
1f1b and zero_bubble with the document mask and per-document positions; GQA), and gpt-oss's parts
(windows, sinks, biases, YaRN, expert biases, the clamped SwiGLU, the llama init) under cp, cp x tp,
cp x pp and cp x ep, trained for 10 steps (losses, gradient norms, validation loss, the
first step's gradients and the weights after the last step), resumed bit for bit from its DCP
checkpoint, and loaded into another cp size. A pipeline with the document mask and no cp checks
that the document numbers reach the stages after the first. One 4-rank launch runs all of it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from data.bundle import ValSource
from model.config import ModelConfig, MoEConfig
from model.gpt import GPT
from parallel.cp import local_token_index
from parallel.distributed import DistContext
from tests.gloo import gloo_context, run_workers, save_on_every_rank
from tests.integration.parallel.test_tp_pp import full_grads, full_params
from training.build import build_from_config
from training.config import load_config
from training.loop import evaluate

SEQ, VOCAB, EOT = 16, 64, 3
MODELS = {
    "mha": {"n_kv_head": None},
    "gqa": {"n_kv_head": 2, "position": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
    "gqa_document": {"n_kv_head": 2, "position": "rope", "attention_mask": "document", "eot_id": EOT},
    "mha_document_positions": {"attention_mask": "document", "eot_id": EOT, "document_positions": True},
    # A window of 3 reaches back across chunk borders (chunks of 2 and 4 tokens); sinks; a Q/K/V bias.
    "window_sinks_document": {"n_kv_head": 2, "position": "rope", "norm": "rmsnorm", "mlp": "swiglu",
                              "sliding_window": 3, "sliding_window_every": 2, "attention_sinks": True,
                              "qkv_bias": True, "bias": False, "attention_mask": "document", "eot_id": EOT},
    # capacity 1.0 drops copies: each cp rank must keep the copies one process keeps over whole sequences
    "moe_capacity": {"mlp": "swiglu", "moe": MoEConfig(experts=4, top_k=2, d_ff=16, capacity=1.0)},
}
MICRO, STEPS, SAVE_AFTER, VAL = 2, 10, 6, 5
TRAIN_MODEL = {"vocab_size": VOCAB, "max_seq_len": SEQ, "n_layer": 2, "n_head": 4, "d_model": 32, "n_kv_head": 2,
               "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False}
LAYOUTS = {"cp4": {"cp": 4}, "cp2_x_dp2": {"cp": 2, "dp_shard": 2}, "cp2_x_tp2": {"cp": 2, "tp": 2},
           "cp4_selective_recompute": {"cp": 4}, "cp2_x_pp2": {"cp": 2, "pp": 2},
           "cp2_x_pp2_interleaved_document": {"cp": 2, "pp": 2, "pp_schedule": "interleaved_1f1b",
                                              "pp_virtual_stages": 2},
           "cp2_x_pp2_zero_bubble_document": {"cp": 2, "pp": 2, "pp_schedule": "zero_bubble",
                                              "pp_virtual_stages": 2},
           "pp2_x_dp2_document": {"pp": 2, "dp_shard": 2},
           # gpt-oss's parts (model VARIANTS) under FSDP2 over cp, tp, pp and ep.
           "cp4_variants": {"cp": 4}, "cp2_x_tp2_variants": {"cp": 2, "tp": 2}, "cp2_x_pp2_variants": {"cp": 2, "pp": 2},
           "cp2_x_ep2_variants": {"cp": 2, "ep": 2}}
DOCUMENT = {"attention_mask": "document", "eot_id": EOT, "document_positions": True}
# A sliding window on every other layer crossing the chunk borders, sinks, attention biases, YaRN, the
# llama init, and routed experts with biases and the clamped SwiGLU.
VARIANTS = {"sliding_window": 3, "sliding_window_every": 2, "attention_sinks": True, "qkv_bias": True,
            "proj_bias": True, "bias": False, "rope_scaling.type": "yarn", "rope_scaling.factor": 4.0,
            "rope_scaling.original_max_seq_len": 8, "init": "llama", "swiglu_limit": 1.0, "moe.experts": 4,
            "moe.top_k": 2, "moe.d_ff": 16, "moe.bias": True}
# Per layout, what its model (and the one-process run it is checked against) changes.
MODEL_KEYS = {"cp4_selective_recompute": {"recompute": "selective"},  # the core, K/V gather included, rebuilt in backward
              "cp2_x_pp2_interleaved_document": DOCUMENT | {"n_layer": 4},
              "cp2_x_pp2_zero_bubble_document": DOCUMENT | {"n_layer": 4}, "pp2_x_dp2_document": DOCUMENT,
              **{name: VARIANTS for name in LAYOUTS if name.endswith("_variants")}}
PIPELINE_ACCUM = 2  # micro-batches per step of the pipelined layouts (pipeline micro-batches: >= pp)


def model_cfg(name: str) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=2, n_head=4, d_model=32, **MODELS[name])


def tokens(seed: int, batch: int = 2) -> torch.Tensor:
    """(batch, SEQ + 1) ids with end-of-text ids planted, so packed documents cross chunk borders."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(EOT + 1, VOCAB, (batch, SEQ + 1), generator=g)
    ids[0, [2, 9]] = EOT
    ids[-1, [6]] = EOT
    return ids


# --------------------------------------------------------------------------- on 4 gloo ranks


def forward_and_grads(cp_rank_group, cp: int, name: str) -> dict:
    """This rank's logits, loss and summed-over-cp gradients under cp, and the one-process ones."""
    from model.moe import moe_layers, take_moe_metrics
    from parallel.cp import apply_context_parallel

    torch.manual_seed(0)
    whole = GPT(model_cfg(name))
    torch.manual_seed(0)
    split = GPT(model_cfg(name))
    apply_context_parallel(split, cp_rank_group)
    ids = tokens(7)
    x, y = ids[:, :-1], ids[:, 1:]
    ref_loss = whole(x, y)
    ref_loss.backward()
    dropped = take_moe_metrics(moe_layers([whole])).get("moe_dropped_frac", 0.0)
    loss = split(x, y)
    loss.backward()
    rank = torch.distributed.get_rank(cp_rank_group)
    mean_loss = loss.detach().clone()
    torch.distributed.all_reduce(mean_loss, group=cp_rank_group)
    grads = {}
    for (key, p), q in zip(split.named_parameters(), whole.parameters()):
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=cp_rank_group)
        grads[key] = float((g / cp - q.grad).abs().max())
    with torch.no_grad():
        index = local_token_index(SEQ, cp, rank)
        logits_err = float((split(x) - whole(x)[:, index]).abs().max())
    return {"loss": float(mean_loss / cp), "ref_loss": float(ref_loss), "logits_err": logits_err, "grad_err": grads,
            "dropped": dropped}


def accum_of(layout: dict) -> int:
    return PIPELINE_ACCUM if layout.get("pp", 1) > 1 else 1


def job(name: str | None = None, accum: int = 1, **parallel):
    overrides = [f"--model.{k}={v}" for k, v in (TRAIN_MODEL | MODEL_KEYS.get(name, {})).items()]
    overrides += [f"--train.micro_batch_size={MICRO}", f"--train.grad_accum_steps={accum}", "--optim.warmup_steps=1",
                  "--optim.lr=1e-2", f"--train.max_steps={STEPS}"]
    return load_config(None, overrides + [f"--parallel.{k}={v}" for k, v in parallel.items()])


def batches(step: int, dp_rank: int, accum: int = 1):
    micro = [tokens(100 * step + dp_rank + 10 * m, MICRO) for m in range(accum)]
    return iter([(ids[:, :-1], ids[:, 1:]) for ids in micro])


def val_source(dp_rank: int, dp_size: int) -> ValSource:
    windows = torch.cat([tokens(50 + i, 1) for i in range(VAL)]).numpy()
    return ValSource(lambda: iter(windows), available=VAL, seq_len=SEQ, batch_size=MICRO, rank=dp_rank,
                     world_size=dp_size)


def train(engine, ctx, cfg, steps: range, grads: dict | None = None) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of ``steps``; ``grads`` gets the first step's whole gradients."""
    losses, norms = [], []
    n = cfg.train.grad_accum_steps
    for step in steps:
        loss, _ = engine.forward_backward_step(batches(step, ctx.dims.dp_rank, n), n)
        if grads is not None and step == steps[0]:
            grads.update(full_grads(engine))
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(ctx.all_reduce_mean(loss.detach().clone())))
    return losses, norms


def train_layout(rank: int, world: int, name: str, layout: dict, root: str) -> dict:
    cfg = job(name, accum_of(layout), **layout)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    grads = {}
    losses, norms = train(engine, ctx, cfg, range(SAVE_AFTER), grads)
    path = Path(root) / name
    save_on_every_rank(engine, path, rank)
    rest, rest_norms = train(engine, ctx, cfg, range(SAVE_AFTER, STEPS))
    val = evaluate(engine, val_source(ctx.dims.dp_rank, ctx.layout.dp), VAL, ctx)
    fresh = build_from_config(cfg, ctx).engine
    fresh.load(path)
    final = full_params(engine)
    resumed, _ = train(fresh, ctx, cfg, range(SAVE_AFTER, STEPS))
    return {"losses": losses + rest, "norms": norms + rest_norms, "resumed": resumed, "val": val,
            "dp_size": ctx.layout.dp, "grads": grads, "final": final, "resumed_final": full_params(fresh)}


def cross_load(rank: int, world: int, root: str) -> list[float]:
    """cp=4's checkpoint loaded into cp=2 x dp_shard=2: the steps after it train as cp=2 x dp=2's do."""
    layout = LAYOUTS["cp2_x_dp2"]
    cfg = job(**layout)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    engine.load(Path(root) / "cp4")
    return train(engine, ctx, cfg, range(SAVE_AFTER, STEPS))[0]


def four_rank_worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for cp in (2, 4):
        mesh = gloo_context(rank, world, cp=cp).mesh
        group = mesh["cp"].get_group()
        out[f"cp{cp}"] = {name: forward_and_grads(group, cp, name) for name in MODELS}
    out["train"] = {name: train_layout(rank, world, name, layout, root) for name, layout in LAYOUTS.items()}
    out["cp4_into_cp2_x_dp2"] = cross_load(rank, world, root)
    return out


def one_process(dp_sizes: list[int], name: str | None = None, accum: int = 1) -> dict:
    """Step i on the global batch of dp_sizes[i] data-parallel ranks (``accum`` micro-batches each),
    in one process, with the model of layout ``name``."""
    cfg = job(name)
    ctx = DistContext.single()
    engine = build_from_config(cfg, ctx).engine
    losses, norms, grads = [], [], {}
    for step, dp_size in enumerate(dp_sizes):
        every = iter([b for r in range(dp_size) for b in batches(step, r, accum)])
        loss, _ = engine.forward_backward_step(every, dp_size * accum)
        if step == 0:
            grads = full_grads(engine)
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "val": evaluate(engine, val_source(0, 1), VAL, ctx), "grads": grads,
            "final": full_params(engine)}


@pytest.fixture(scope="module")
def four_ranks():
    with tempfile.TemporaryDirectory() as root:
        yield run_workers(four_rank_worker, 4, root)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_cp_forward_and_gradients_equal_one_process(four_ranks, cp, name):
    for rank_result in four_ranks:
        got = rank_result[f"cp{cp}"][name]
        assert got["logits_err"] < 1e-5, got["logits_err"]
        assert got["loss"] == pytest.approx(got["ref_loss"], abs=1e-5)
        worst = max(got["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
        assert (got["dropped"] > 0) == ("capacity" in name)  # the capacity model does drop copies


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_training_equals_one_process(four_ranks, name):
    ref = one_process([four_ranks[0]["train"][name]["dp_size"]] * STEPS, name, accum_of(LAYOUTS[name]))
    grads, final = {}, {}  # by parameter name; a pipeline rank holds its stage's
    for rank_result in four_ranks:
        got = rank_result["train"][name]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert got["val"] == pytest.approx(ref["val"], abs=1e-5)
        assert got["resumed"] == got["losses"][SAVE_AFTER:], "resume under cp is not bit-exact"
        for key, value in got["resumed_final"].items():
            assert torch.equal(value, got["final"][key]), f"{key}: resumed weights differ"
        grads.update(got["grads"])
        final.update(got["final"])
    assert set(grads) == set(ref["grads"]) and set(final) == set(ref["final"])
    for key, grad in ref["grads"].items():  # the first step's
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: gradient of {key}")
    # After every step. AdamW divides by sqrt(v): an entry whose gradients are near zero moves a
    # step's worth on rounding-sized differences, so 10 steps of lr 1e-2 (weights move up to 0.1)
    # agree to about 3e-5.
    for key, weight in ref["final"].items():
        torch.testing.assert_close(final[key], weight, rtol=1e-4, atol=1e-4, msg=f"{name}: {key} after training")


def test_a_cp4_checkpoint_loads_into_cp2_x_dp2(four_ranks):
    """cp=4 (one data-parallel rank) saved after SAVE_AFTER steps; cp=2 x dp_shard=2 loads it and
    trains on two ranks' batches: one process doing the same (one batch per step, then two) agrees."""
    ref = one_process([1] * SAVE_AFTER + [2] * (STEPS - SAVE_AFTER))
    for rank_result in four_ranks:
        assert rank_result["cp4_into_cp2_x_dp2"] == pytest.approx(ref["losses"][SAVE_AFTER:], abs=1e-5)
