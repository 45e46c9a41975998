"""Latent attention (model.attention_kind=mla) under tensor, context and pipeline parallelism (the
1f1b, gpipe, interleaved_1f1b and zero_bubble schedules, the last two with 2 stages a rank) on gloo
ranks trains as one process does: 10 steps' losses and the final weights within 1e-5 (fp32), and a
tensor-parallel run resumed from its checkpoint repeats the uninterrupted one exactly.

The model has a document mask (context parallelism's gathered latents cross document boundaries),
queries compressed (q_lora_rank) or projected directly, and recompute in two layouts. One
2-rank launch runs every 2-rank layout; one 4-rank launch the compositions."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from parallel.distributed import DistContext
from tests.gloo import assert_resumes_exactly, gloo_context, run_workers, train_save_and_resume
from tests.integration.parallel.test_tp_pp import ACCUM, full_grads, full_params, micro_batches, train_steps
from training.build import build_from_config
from training.config import load_config

# vocab_size and max_seq_len are test_tp_pp's (its micro_batches draws the tokens)
MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 32, "attention_kind": "mla",
         "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
         "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False,
         "attention_mask": "document", "eot_id": 3}
STEPS, SAVE_AFTER = 10, 5
DIRECT_QUERY = {"q_lora_rank": None}  # DeepSeek-V2-Lite's form: the query projected straight from the hidden state
FOUR_LAYERS = {"n_layer": 4}

# name -> (parallel section, model keys changed)
TWO_RANKS = {
    "tp": ({"tp": 2}, {}),
    "tp_no_sp_direct_query": ({"tp": 2, "sequence_parallel": False, "loss_parallel": False}, DIRECT_QUERY),
    "cp": ({"cp": 2}, {}),
    "cp_direct_query": ({"cp": 2}, DIRECT_QUERY),
    # recompute re-runs the gather of the latent (full) or the core on the gathered keys (selective)
    "cp_full_recompute": ({"cp": 2}, {"recompute": "full"}),
    "cp_selective_recompute": ({"cp": 2}, {"recompute": "selective"}),
    "tp_selective_recompute": ({"tp": 2}, {"recompute": "selective"}),
    "pp": ({"pp": 2, "pp_schedule": "1f1b"}, {}),
    "pp_gpipe": ({"pp": 2, "pp_schedule": "gpipe"}, {}),
    # two stages a rank: four one-layer stages
    "pp_interleaved_1f1b": ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, FOUR_LAYERS),
    # the backward split into an input-gradient and a weight-gradient pass
    "pp_zero_bubble": ({"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2}, FOUR_LAYERS),
}
FOUR_RANKS = {
    "tp_x_cp": ({"tp": 2, "cp": 2}, {}),
    "pp_x_tp": ({"pp": 2, "tp": 2}, {}),
    "pp_x_cp": ({"pp": 2, "cp": 2}, {}),
    # FSDP2 over 2 data-parallel ranks reduces the replicated down-projections' partial gradients
    "fsdp_x_tp": ({"strategy": "fsdp", "dp_shard": 2, "tp": 2}, {}),
    # FSDP2 over dp_shard x cp: the cp group carries only the latents (their bytes are counted), and
    # selective recompute re-runs the core on them without gathering again
    "fsdp_x_cp_selective_recompute": ({"strategy": "fsdp", "dp_shard": 2, "cp": 2}, {"recompute": "selective"}),
}


def job(parallel: dict, model: dict, accum: int = ACCUM):
    overrides = [f"--model.{k}={'null' if v is None else v}" for k, v in (MODEL | model).items()]
    overrides += ["--train.micro_batch_size=2", f"--train.grad_accum_steps={accum}", "--optim.warmup_steps=1",
                  "--optim.lr=3e-3", f"--train.max_steps={STEPS}"]
    return load_config(None, overrides + [f"--parallel.{k}={v}" for k, v in parallel.items()])


def run_layout(rank: int, world: int, name: str, parallel: dict, model: dict, ckpt_root: str | None) -> dict:
    cfg = job(parallel, model)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    if ckpt_root is None:
        engine = build_from_config(cfg, ctx).engine
        losses, _, grads = train_steps(engine, range(STEPS), ctx, cfg, record_grads=True)
        out = {"losses": losses, "grads": grads, "final": full_params(engine)}
        if name == "fsdp_x_cp_selective_recompute":
            out["cp_bytes"] = cp_bytes(engine, ctx, cfg)
        return out
    engine, fresh, (losses, _, grads), (rest, _, _), (resumed, _, _) = train_save_and_resume(
        lambda: build_from_config(cfg, ctx).engine,
        lambda engine, steps: train_steps(engine, steps, ctx, cfg, record_grads=True),
        Path(ckpt_root) / name, rank, SAVE_AFTER, STEPS)
    return {"losses": losses + rest, "grads": grads, "final": full_params(engine), "resumed": resumed,
            "resumed_final": full_params(fresh)}


def cp_bytes(engine, ctx, cfg) -> tuple[float, float]:
    """Bytes this rank sent over its cp group in one more step's forward and backward, and what the
    estimator counts for them (the latent and rotary key, not the keys and values)."""
    from analysis.collective_bytes import CommBytes
    from analysis.parallel_bench import comm_by_dimension, formula_kv_bytes

    with CommBytes() as counter:
        engine.forward_backward_step(iter(micro_batches(STEPS, ctx.dims.dp_rank, ctx.layout.dp)), ACCUM)
    return comm_by_dimension(counter, ctx)[0]["cp"], formula_kv_bytes(cfg, ctx.layout.dp)


def worker(rank: int, world: int, ckpt_root: str) -> dict:
    layouts = TWO_RANKS if world == 2 else FOUR_RANKS
    return {name: run_layout(rank, world, name, parallel, model, ckpt_root if name == "tp" else None)
            for name, (parallel, model) in layouts.items()}


def reference(model: dict, dp_size: int = 1) -> dict:
    """One process over the global batch of ``dp_size`` data-parallel ranks."""
    cfg = job({}, model, ACCUM * dp_size)
    engine = build_from_config(cfg, DistContext.single()).engine
    losses, grads = [], {}
    for step in range(STEPS):
        batches = [mb for r in range(dp_size) for mb in micro_batches(step, r, dp_size)]
        loss, _ = engine.forward_backward_step(iter(batches), len(batches))
        grads = grads or full_grads(engine)
        engine.optimizer_step(cfg.optim.lr, loss)
        losses.append(float(loss))
    return {"losses": losses, "grads": grads, "final": full_params(engine)}


@pytest.fixture(scope="module")
def references():
    return {"compressed": reference({}), "direct": reference(DIRECT_QUERY), "compressed_dp2": reference({}, 2),
            "four_layers": reference(FOUR_LAYERS)}


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as root:
        return run_workers(worker, 2, root)


@pytest.fixture(scope="module")
def four_ranks():
    with tempfile.TemporaryDirectory() as root:
        return run_workers(worker, 4, root)


def assert_matches(got: dict, want: dict, name: str) -> None:
    """One rank's run against one process: its losses, the first step's gradients and the final weights of
    the parameters it holds (a pipeline stage holds its own layers)."""
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5), name
    for part in ("grads", "final"):
        assert got[part].keys() <= want[part].keys(), name
        for key, value in got[part].items():
            torch.testing.assert_close(value, want[part][key], rtol=0, atol=1e-5, msg=f"{name} {part}: {key}")


def assert_every_layout_matches(ranks: list[dict], layouts: dict, references: dict, reference_of) -> None:
    for name in layouts:
        want = references[reference_of(name)]
        for rank in ranks:
            assert_matches(rank[name], want, name)
        held = set().union(*(rank[name]["final"] for rank in ranks))
        assert held == want["final"].keys(), name  # the ranks hold every parameter between them


def reference_of_two_ranks(name: str) -> str:
    keys = TWO_RANKS[name][1]
    return "direct" if "q_lora_rank" in keys else "four_layers" if "n_layer" in keys else "compressed"


def test_mla_under_tp_cp_and_pp_matches_one_process(two_ranks, references):
    assert any((x == MODEL["eot_id"]).any() for x, _ in micro_batches(0, 0, 1)), "no document boundary in the data"
    assert_every_layout_matches(two_ranks, TWO_RANKS, references, reference_of_two_ranks)


def test_cp_sends_the_latent_and_rotary_key_the_estimator_counts(four_ranks):
    # per layer and micro-batch, a forward all-gather and a backward reduce-scatter of (cp - 1) / cp of
    # the whole sequence's latent and rotary key: fp32, b = 2, s = 16, 8 + 4 numbers a token
    want = 2 * 2 * ACCUM * (1 / 2) * (4 * 2 * 16 * (8 + 4))
    for rank in four_ranks:
        sent, counted = rank["fsdp_x_cp_selective_recompute"]["cp_bytes"]
        assert sent == counted == want


def test_mla_tp_resumes_exactly(two_ranks):
    for rank in two_ranks:
        assert_resumes_exactly(rank["tp"], SAVE_AFTER)


def test_mla_under_tp_x_cp_pp_x_tp_pp_x_cp_fsdp_x_tp_and_fsdp_x_cp_matches_one_process(four_ranks, references):
    assert_every_layout_matches(four_ranks, FOUR_RANKS, references,
                                lambda name: "compressed_dp2" if "fsdp" in name else "compressed")
