"""Tensor, sequence and pipeline parallelism, alone and composed with FSDP2.

Every layout is checked against one process running the same global batch: losses and gradient
norms of several steps within 1e-5 (fp32) and, on the first step, every gradient (gathered to full
tensors by parameter name), and the validation loss on a set that leaves padding rows within
1e-5. Checkpoints resume bit for bit on the same layout and load into other
layouts. Layouts named ``*_tied`` train the model with the embedding tied to the LM head: a
pipeline keeps a copy of it on the last stage, and the two copies must stay bit-equal. Process
launches are shared: one 2-rank launch runs every 2-rank layout, one 4-rank launch the 2-D ones;
Muon (optim.name=muon) has a 2-rank and a 4-rank launch of its own.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from data.bundle import ValSource
from parallel.checkpoint import read_verified_metadata, save_sharded
from parallel.distributed import DistContext
from tests.conftest import read_metrics, run_torchrun, run_train, tiny_overrides
from tests.gloo import gloo_context, run_workers, save_on_every_rank
from training.build import build_from_config
from training.config import load_config
from training.loop import evaluate

MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 4, "n_head": 4, "d_model": 32,
         "tie_embeddings": False, "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2}
MICRO, ACCUM, STEPS = 2, 2, 3
SAVE_AFTER = 2  # steps trained before the checkpoint that a fresh engine resumes from
# Validation windows after the last step: 7 over 2 data-parallel ranks in batches of MICRO leave
# padding rows, so the layouts' eval paths (pipeline schedule, vocabulary-parallel loss) meet them.
VAL = 7

# (name, parallel section) per layout; the 2-rank ones, then the 4-rank compositions.
TWO_RANKS = {
    "tp": {"tp": 2},
    "tp_no_sp": {"tp": 2, "sequence_parallel": False, "loss_parallel": False},
    "pp_gpipe": {"pp": 2, "pp_schedule": "gpipe"},
    "pp_1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "pp_interleaved": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
    "pp_zero_bubble": {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2},
    "pp_gpipe_tied": {"pp": 2, "pp_schedule": "gpipe"},
    "pp_1f1b_tied": {"pp": 2, "pp_schedule": "1f1b"},
    "pp_interleaved_tied": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
}
FOUR_RANKS = {
    "fsdp_x_tp": {"strategy": "fsdp", "dp_shard": 2, "tp": 2},
    "pp_x_fsdp": {"strategy": "fsdp", "pp": 2, "dp_shard": 2},
    "pp_x_fsdp_tied": {"strategy": "fsdp", "pp": 2, "dp_shard": 2},
    # The split backward's weight pass under FSDP2: every stage's weights must get their gradients.
    "pp_zero_bubble_x_fsdp": {"strategy": "fsdp", "pp": 2, "dp_shard": 2, "pp_schedule": "zero_bubble",
                              "pp_virtual_stages": 2},
    "pp_x_tp_tied": {"pp": 2, "tp": 2},
    "pp4_tied": {"pp": 4, "pp_schedule": "1f1b"},  # middle stages hold neither copy
}

# Muon (optim.name=muon) on layouts that shard its matrices, or hold them whole on every rank, against
# one process over MUON_STEPS steps; the qk_clip ones with QK-clip at a threshold it crosses. Newton-
# Schulz in fp32 (in bf16 the layouts' last-bit differences would round into 1e-3 ones), and no
# biases: the key bias's gradient is zero up to rounding, and AdamW's normalised step turns that
# rounding into lr-sized noise that differs between layouts.
MUON = {"optim.name": "muon", "optim.muon.ns_dtype": "fp32", "model.bias": False}
QK_CLIP = {"optim.muon.qk_clip_tau": 0.06}  # about the largest logits of this small model: some heads cross it
MUON_STEPS = 10
# (parallel section, other keys, ranks each matrix is sharded over)
MUON_TWO_RANKS = {
    "muon_fsdp": ({"strategy": "fsdp"}, {}, 2),
    "muon_fsdp_qk_clip": ({"strategy": "fsdp"}, QK_CLIP, 2),
    "muon_ddp_qk_clip": ({"strategy": "ddp"}, QK_CLIP, 1),
    "muon_tp": ({"tp": 2}, {}, 2),
    "muon_pp_qk_clip": ({"pp": 2, "pp_schedule": "1f1b"}, QK_CLIP, 1),
}
MUON_SAVE_AFTER = 5  # Muon steps under FSDP2 before the checkpoint that tensor parallelism and one process resume
MUON_FOUR_RANKS = {
    "muon_fsdp_x_tp": ({"strategy": "fsdp", "dp_shard": 2, "tp": 2}, {}, 4),  # strided dim-0 shards, a 2-D group
    "muon_pp_x_fsdp_qk_clip": ({"strategy": "fsdp", "pp": 2, "dp_shard": 2}, QK_CLIP, 2),
}


def is_tied(name: str) -> bool:
    return name.endswith("_tied")


def job(grad_accum: int = ACCUM, tied: bool = False, extra: dict | None = None, **parallel):
    overrides = [f"--model.{k}={v}" for k, v in (MODEL | {"tie_embeddings": tied}).items()]
    overrides += [f"--train.micro_batch_size={MICRO}", f"--train.grad_accum_steps={grad_accum}",
                  "--optim.warmup_steps=1", "--optim.lr=1e-2", "--train.max_steps=10"]
    overrides += [f"--parallel.{k}={v}" for k, v in parallel.items()]
    overrides += [f"--{k}={v}" for k, v in (extra or {}).items()]
    return load_config(None, overrides)


def micro_batches(step: int, dp_rank: int, dp_size: int, accum: int = ACCUM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel rank r's micro-batches of a step; every rank of one tp group or pipeline gets the same."""
    out = []
    for micro in range(accum):
        g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro)
        tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["max_seq_len"] + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def val_source(dp_rank: int, dp_size: int) -> ValSource:
    g = torch.Generator().manual_seed(99)
    windows = torch.randint(0, MODEL["vocab_size"], (VAL, MODEL["max_seq_len"] + 1), generator=g).numpy()
    return ValSource(lambda: iter(windows), available=VAL, seq_len=MODEL["max_seq_len"], batch_size=MICRO,
                     rank=dp_rank, world_size=dp_size)


def full_grads(engine) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in engine.module().named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.split(".", 1)[1] if name.split(".")[0].isdigit() else name] = g.detach().clone()
    return grads


def full_params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module().named_parameters():
        v = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.split(".", 1)[1] if name.split(".")[0].isdigit() else name] = v.detach().clone()
    return out


def accum_steps(parallel: dict) -> int:
    return max(ACCUM, parallel.get("pp", 1))  # a pipeline needs a micro-batch per stage at least


def train_steps(engine, steps: range, ctx, cfg, record_grads: bool = False):
    """Losses and gradient norms of ``steps`` (losses averaged over the data-parallel ranks, as
    train.py logs them), and the gradients of the first step."""
    losses, norms, grads = [], [], {}
    accum = cfg.train.grad_accum_steps
    for step in steps:
        batches = iter(micro_batches(step, ctx.dims.dp_rank, ctx.layout.dp, accum))
        loss, _ = engine.forward_backward_step(batches, accum)
        if record_grads and step == 0:
            grads = full_grads(engine)
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(ctx.all_reduce_mean(loss.detach().clone())))
    return losses, norms, grads


def run_layout(rank: int, world: int, name: str, parallel: dict, ckpt_root: str) -> dict:
    cfg = job(accum_steps(parallel), tied=is_tied(name), **parallel)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    losses, norms, grads = train_steps(engine, range(SAVE_AFTER), ctx, cfg, record_grads=True)
    path = Path(ckpt_root) / name
    save_on_every_rank(engine, path, rank)
    saved = full_params(engine)
    rest, rest_norms, _ = train_steps(engine, range(SAVE_AFTER, STEPS), ctx, cfg)
    val = evaluate(engine, val_source(ctx.dims.dp_rank, ctx.layout.dp), VAL, ctx)
    fresh = build_from_config(cfg, ctx).engine  # a new run that loads the checkpoint
    fresh.load(path)
    resumed, _, _ = train_steps(fresh, range(SAVE_AFTER, STEPS), ctx, cfg)
    return {"losses": losses + rest, "norms": norms + rest_norms, "resumed": resumed, "grads": grads,
            "saved": saved, "final": full_params(engine), "resumed_final": full_params(fresh), "val": val}


def resume_from(rank: int, world: int, name: str, parallel: dict, path: Path) -> dict:
    """A layout that loads a checkpoint saved by another and trains the steps after it."""
    cfg = job(tied=is_tied(name), **parallel)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    engine.load(path)
    loaded = full_params(engine)
    losses, _, _ = train_steps(engine, range(SAVE_AFTER, STEPS), ctx, cfg)
    return {"loaded": loaded, "losses": losses, "final": full_params(engine)}


def run_muon_layout(rank: int, world: int, parallel: dict, extra: dict, sharded_over: int) -> dict:
    """MUON_STEPS steps of a layout with Muon: losses, the final weights, the bytes Muon sent each step,
    the heads QK-clip scaled, and one more step's bytes as the dispatcher-level counter sees them."""
    from analysis.collective_bytes import CommBytes

    cfg = job(accum_steps(parallel), extra=MUON | extra, **parallel)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    losses, sent, clipped = [], [], 0
    for step in range(MUON_STEPS):
        batches = iter(micro_batches(step, ctx.dims.dp_rank, ctx.layout.dp, cfg.train.grad_accum_steps))
        loss, _ = engine.forward_backward_step(batches, cfg.train.grad_accum_steps)
        result = engine.optimizer_step(cfg.optim.lr, loss)
        clipped += int(result.qk_clipped) if result.qk_clipped is not None else 0
        losses.append(float(ctx.all_reduce_mean(loss.detach().clone())))
        sent.append(engine.comm_stats().get("muon_bytes_sent"))
    final = full_params(engine)
    loss, _ = engine.forward_backward_step(iter(micro_batches(MUON_STEPS, ctx.dims.dp_rank, ctx.layout.dp,
                                                              cfg.train.grad_accum_steps)), cfg.train.grad_accum_steps)
    with CommBytes() as counter:
        engine.optimizer_step(cfg.optim.lr, loss)
    seen = sum(b for (_, kind), b in counter.sent.items() if kind == "all_to_all")
    return {"losses": losses, "final": final, "muon_bytes": sent, "clipped": clipped, "all_to_all_bytes": seen,
            "last_muon_bytes": engine.comm_stats().get("muon_bytes_sent")}


def batches_of(step: int, dp_rank: int, dp_size: int, of_ranks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of ``of_ranks`` data-parallel ranks, split over ``dp_size`` of them: one rank of a
    layout with fewer data-parallel ranks takes several ranks' share (the global batch stays the same)."""
    k = of_ranks // dp_size
    return [mb for r in range(dp_rank * k, (dp_rank + 1) * k) for mb in micro_batches(step, r, of_ranks)]


def muon_resume_across_layouts(rank: int, world: int, ckpt_root: str) -> dict:
    """Muon under FSDP2 over both ranks for MUON_SAVE_AFTER steps, saved; tensor parallelism over both
    (one data-parallel rank, the same global batch) loads it and trains to MUON_STEPS."""
    saved_at = Path(ckpt_root) / "muon_fsdp"
    for parallel, steps in (({"strategy": "fsdp"}, range(MUON_SAVE_AFTER)), ({"tp": 2}, range(MUON_SAVE_AFTER, MUON_STEPS))):
        dp = world // parallel.get("tp", 1)
        accum = ACCUM * world // dp
        cfg = job(accum, extra=MUON, **parallel)
        ctx = gloo_context(rank, world, parallel=cfg.parallel)
        engine = build_from_config(cfg, ctx).engine
        if steps.start:
            engine.load(saved_at)
        losses = []
        for step in steps:
            loss, _ = engine.forward_backward_step(iter(batches_of(step, ctx.dims.dp_rank, ctx.layout.dp, world)),
                                                   accum)
            engine.optimizer_step(cfg.optim.lr, loss)
            losses.append(float(ctx.all_reduce_mean(loss.detach().clone())))
        if not steps.start:
            save_on_every_rank(engine, saved_at, rank)
    return {"losses": losses, "final": full_params(engine)}


def two_rank_worker(rank: int, world: int, ckpt_root: str) -> dict:
    results = {name: run_layout(rank, world, name, parallel, ckpt_root) for name, parallel in TWO_RANKS.items()}
    # A tied model's checkpoint saved by one process (the test's own, before this launch) into a
    # pipeline, and into FSDP2 (whose shards take their slices of the whole tensors).
    results["one_into_pp_tied"] = resume_from(rank, world, "pp_1f1b_tied", TWO_RANKS["pp_1f1b_tied"],
                                              Path(ckpt_root) / "one_tied")
    results["one_into_fsdp_tied"] = resume_from(rank, world, "fsdp_tied", {"strategy": "fsdp"},
                                                Path(ckpt_root) / "one_tied_dp2")
    # The tp=2 checkpoint loaded into FSDP2 over 2 data-parallel ranks: another layout, the same weights.
    cfg = job(strategy="fsdp")
    engine = build_from_config(cfg, gloo_context(rank, world, parallel=cfg.parallel)).engine
    engine.load(Path(ckpt_root) / "tp")
    results["tp_into_fsdp"] = full_params(engine)
    results["pp_device_skip"] = pipeline_skip_on_device(rank, world)
    return results


def pipeline_skip_on_device(rank: int, world: int) -> dict:
    """pp=2 (tied embeddings) with fused AdamW: step 0 applies, step 1 has a NaN planted in rank 0's
    gradients and is skipped by every stage, with no value read on the host during either optimizer step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountHostReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                CountHostReads.reads += 1
            return func(*args, **(kwargs or {}))

    cfg = job(tied=True, pp=2, pp_schedule="1f1b")
    cfg.optim.fused = "on"
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    out = {"skipped": [], "changed": [], "steps": []}
    for step in range(2):
        before = full_params(engine)
        loss, _ = engine.forward_backward_step(iter(micro_batches(step, 0, 1)), ACCUM)
        if step == 1 and rank == 0:
            next(p for p in engine.module().parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        with CountHostReads():
            result = engine.optimizer_step(cfg.optim.lr, loss)
        out["skipped"].append(result.skipped.tolist() if torch.is_tensor(result.skipped) else result.skipped)
        out["changed"].append(any(not torch.equal(v, full_params(engine)[k]) for k, v in before.items()))
        out["steps"].append(sorted({int(st["step"]) for s in engine.optimized_parts() for st in s.optimizer.state.values()}))
    out["host_reads"] = CountHostReads.reads
    return out


def four_rank_worker(rank: int, world: int, ckpt_root: str) -> dict:
    return {name: run_layout(rank, world, name, parallel, ckpt_root) for name, parallel in FOUR_RANKS.items()}


def muon_worker(rank: int, world: int, ckpt_root: str) -> dict:
    """Muon's layouts (a launch of their own: the layouts above fill theirs on a loaded machine)."""
    results = {name: run_muon_layout(rank, world, *layout)
               for name, layout in (MUON_TWO_RANKS if world == 2 else MUON_FOUR_RANKS).items()}
    if world == 2:
        results["muon_fsdp_into_tp"] = muon_resume_across_layouts(rank, world, ckpt_root)
    return results


def reference(dp_size: int, tied: bool = False, save_after: Path | None = None, accum: int = ACCUM) -> dict:
    """One process, the same global batch: every data-parallel rank's micro-batches accumulated.
    ``save_after``: where to save its checkpoint after SAVE_AFTER steps; its state is also written
    with the DCP writer of the sharded layouts into ``<save_after>_dcp``."""
    cfg = job(grad_accum=accum * dp_size, tied=tied)
    engine = build_from_config(cfg, DistContext.single()).engine
    losses, norms, grads = [], [], {}
    saved = {}
    for step in range(STEPS):
        if step == SAVE_AFTER and save_after is not None:
            save_after.mkdir()
            engine.save(save_after, 0)
            save_sharded([(engine.module(), engine.optimized_parts()[0].optimizer)], None, save_after.with_name(save_after.name + "_dcp"))
            saved = whole_state(engine)
        batches = iter([mb for r in range(dp_size) for mb in micro_batches(step, r, dp_size, accum)])
        loss, _ = engine.forward_backward_step(batches, accum * dp_size)
        if step == 0:
            grads = full_grads(engine)
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(loss))
    val = evaluate(engine, val_source(0, 1), VAL, DistContext.single())
    return {"losses": losses, "norms": norms, "grads": grads, "saved": saved, "val": val}


def muon_reference(dp_size: int, extra: dict, accum: int = ACCUM) -> dict:
    """One process with Muon over the global batch of ``dp_size`` data-parallel ranks."""
    cfg = job(grad_accum=accum * dp_size, extra=MUON | extra)
    engine = build_from_config(cfg, DistContext.single()).engine
    losses, clipped = [], 0
    for step in range(MUON_STEPS):
        batches = iter([mb for r in range(dp_size) for mb in micro_batches(step, r, dp_size, accum)])
        loss, _ = engine.forward_backward_step(batches, accum * dp_size)
        result = engine.optimizer_step(cfg.optim.lr, loss)
        clipped += int(result.qk_clipped) if result.qk_clipped is not None else 0
        losses.append(float(loss))
    return {"losses": losses, "final": full_params(engine), "clipped": clipped}


def muon_matrix_bytes() -> int:
    """Bytes of the hidden matrices of MODEL in fp32: attention's qkv and proj, SwiGLU's gate, fc and out."""
    d, heads, kv = MODEL["d_model"], MODEL["n_head"], MODEL["n_kv_head"]
    head_dim, d_ff = d // heads, 64 * ((8 * d // 3 + 63) // 64)
    per_layer = (heads + 2 * kv) * head_dim * d + heads * head_dim * d + 3 * d * d_ff
    return 4 * MODEL["n_layer"] * per_layer


def _check_muon(results: list[dict], name: str, layout: tuple[dict, dict, int]) -> None:
    parallel, extra, n = layout
    world = len(results)
    dp_size = world // (parallel.get("pp", 1) * parallel.get("tp", 1))
    ref = muon_reference(dp_size, extra, accum_steps(parallel))
    for got in results:
        got = got[name]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5), name
        for key, value in got["final"].items():
            torch.testing.assert_close(value, ref["final"][key], rtol=0, atol=1e-5, msg=f"{name}: {key}")
        if extra:
            assert ref["clipped"] > 0 and got["clipped"] == ref["clipped"], name  # the same heads, summed over stages
        assert got["last_muon_bytes"] == got["all_to_all_bytes"], name  # its own count, and the dispatcher's
    # A matrix sharded over n ranks crosses to its owner and back: 2 (n - 1) / n of its bytes in all
    # (each matrix is held by one group of ranks here: no replicas).
    expected = 2 * (n - 1) / n * muon_matrix_bytes()
    for step in range(MUON_STEPS):
        assert sum(r[name]["muon_bytes"][step] for r in results) == pytest.approx(expected), name


def test_a_muon_checkpoint_resumes_exactly_in_other_layouts(muon_two_rank_results, checkpoints):
    """Saved by FSDP2 after MUON_SAVE_AFTER steps (each rank its shards of the weights and of Muon's
    momentum): tensor parallelism and one process load it, train to MUON_STEPS, and land where one
    process training all MUON_STEPS without a break lands."""
    ref = muon_reference(2, {})
    for got in muon_two_rank_results:
        got = got["muon_fsdp_into_tp"]
        assert got["losses"] == pytest.approx(ref["losses"][MUON_SAVE_AFTER:], abs=1e-5)
        for key, value in got["final"].items():
            torch.testing.assert_close(value, ref["final"][key], rtol=0, atol=1e-5, msg=key)
    cfg = job(2 * ACCUM, extra=MUON)
    engine = build_from_config(cfg, DistContext.single()).engine
    engine.load(Path(checkpoints) / "muon_fsdp")
    [part] = engine.optimized_parts()
    assert sum("momentum_buffer" in state for state in part.optimizer.state.values()) > 0
    losses = []
    for step in range(MUON_SAVE_AFTER, MUON_STEPS):
        loss, _ = engine.forward_backward_step(iter(batches_of(step, 0, 1, 2)), 2 * ACCUM)
        engine.optimizer_step(cfg.optim.lr, loss)
        losses.append(float(loss))
    assert losses == pytest.approx(ref["losses"][MUON_SAVE_AFTER:], abs=1e-5)
    for key, value in full_params(engine).items():
        torch.testing.assert_close(value, ref["final"][key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", list(MUON_TWO_RANKS))
def test_muon_on_two_ranks_matches_one_process_over_ten_steps(name, muon_two_rank_results):
    _check_muon(muon_two_rank_results, name, MUON_TWO_RANKS[name])


@pytest.mark.parametrize("name", list(MUON_FOUR_RANKS))
def test_muon_on_composed_layouts_matches_one_process_over_ten_steps(name, muon_four_rank_results):
    _check_muon(muon_four_rank_results, name, MUON_FOUR_RANKS[name])


def whole_state(engine) -> dict[str, torch.Tensor]:
    """A one-process model's weights by every name it answers to (a tied head's too)."""
    return {k: v.detach().clone() for k, v in engine.module().state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints():
    with tempfile.TemporaryDirectory() as root:
        yield root


@pytest.fixture(scope="module")
def one_process_tied(checkpoints):
    return reference(dp_size=1, tied=True, save_after=Path(checkpoints) / "one_tied")


@pytest.fixture(scope="module")
def one_process_tied_dp2(checkpoints):
    """The global batch of 2 data-parallel ranks, for the FSDP2 layout that resumes from it."""
    return reference(dp_size=2, tied=True, save_after=Path(checkpoints) / "one_tied_dp2")


@pytest.fixture(scope="module")
def two_rank_results(checkpoints, one_process_tied, one_process_tied_dp2):
    return run_workers(two_rank_worker, 2, checkpoints)


@pytest.fixture(scope="module")
def four_rank_results(checkpoints):
    return run_workers(four_rank_worker, 4, checkpoints)


@pytest.fixture(scope="module")
def muon_two_rank_results(checkpoints):
    return run_workers(muon_worker, 2, checkpoints)


@pytest.fixture(scope="module")
def muon_four_rank_results(checkpoints):
    return run_workers(muon_worker, 4, checkpoints)


def _check_against_reference(results: list[dict], name: str, ref: dict) -> None:
    for rank_result in results:
        got = rank_result[name]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5), name
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), name  # a tied embedding counts once
        assert got["resumed"] == got["losses"][SAVE_AFTER:], f"{name}: resume is not bit-exact"
        assert got["val"] == pytest.approx(ref["val"], abs=1e-5), f"{name}: validation loss"
    # Each rank gathers the gradients of the parameters it holds (a pipeline rank: its stages').
    seen = {}
    for rank_result in results:
        seen.update(rank_result[name]["grads"])
    if is_tied(name):
        _check_tied_copies(results, name)
        # The copy's gradient is the tied weight's whole gradient, as the first stage's is.
        assert torch.equal(seen.pop("lm_head.weight"), seen["tok_emb.weight"]), name
    assert set(seen) == set(ref["grads"]), f"{name}: gradients missing for {set(ref['grads']) - set(seen)}"
    for key, grad in ref["grads"].items():
        torch.testing.assert_close(seen[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def _check_tied_copies(results: list[dict], name: str, keys=("saved", "final", "resumed_final")) -> None:
    """The first stage's embedding and the last stage's copy in the head are bit-equal on every rank
    that holds one, after every step (and after a resume)."""
    for key in keys:
        held = [r[name][key][w] for r in results for w in ("tok_emb.weight", "lm_head.weight") if w in r[name][key]]
        assert len(held) >= 2, f"{name}: the pipeline holds no copy of the embedding in its head"
        assert all(torch.equal(held[0], other) for other in held[1:]), f"{name} ({key}): the copies differ"


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_rank_layouts_match_one_process(name, two_rank_results):
    _check_against_reference(two_rank_results, name, reference(dp_size=1, tied=is_tied(name)))


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_composed_layouts_match_one_process(name, four_rank_results):
    layout = FOUR_RANKS[name]
    dp_size = 4 // (layout.get("pp", 1) * layout.get("tp", 1))
    ref = reference(dp_size=dp_size, tied=is_tied(name), accum=accum_steps(layout))
    _check_against_reference(four_rank_results, name, ref)


def test_a_pipeline_with_fused_adamw_skips_a_nan_step_on_the_device(two_rank_results):
    for got in two_rank_results:
        got = got["pp_device_skip"]
        assert got["host_reads"] == 0  # no host sync in the optimizer step, even with clipping
        assert got["skipped"] == [False, True]  # rank 1's stages skip too: the norm is pipeline-wide
        assert got["changed"] == [True, False]  # the NaN step leaves every weight as it was
        assert got["steps"] == [[1], [1]]  # and the optimizer's step count


def test_a_tied_pipeline_checkpoints_under_the_tied_models_names(two_rank_results, checkpoints, one_process_tied):
    """The copy in the head is no parameter of the tied model: its optimizer state is saved as the
    embedding's, so the pipeline's checkpoint holds exactly the names one process writes."""
    pipeline = read_verified_metadata(Path(checkpoints) / "pp_1f1b_tied" / "dcp").state_dict_metadata
    one = read_verified_metadata(Path(checkpoints) / "one_tied_dcp" / "dcp").state_dict_metadata
    assert set(pipeline) == set(one)
    assert not any(k.startswith("optimizer.state.lm_head") for k in pipeline)


def test_a_tied_pipeline_checkpoint_loads_into_one_process_and_back(two_rank_results, checkpoints,
                                                                    one_process_tied):
    # pp=2 -> one process: the same weights, and the steps after the save give the pipeline's losses
    # (which needs the embedding's AdamW state to have come along).
    cfg = job(tied=True)
    engine = build_from_config(cfg, DistContext.single()).engine
    engine.load(Path(checkpoints) / "pp_1f1b_tied")
    loaded = whole_state(engine)
    for rank_result in two_rank_results:
        for key, value in rank_result["pp_1f1b_tied"]["saved"].items():
            assert torch.equal(loaded[key], value), key
    ctx = DistContext.single()
    losses, _, _ = train_steps(engine, range(SAVE_AFTER, STEPS), ctx, cfg)
    assert losses == pytest.approx(two_rank_results[0]["pp_1f1b_tied"]["losses"][SAVE_AFTER:], abs=1e-5)
    # One process -> pp=2: each stage takes its part, the head's copy the embedding's weight and state.
    for rank_result in two_rank_results:
        got = rank_result["one_into_pp_tied"]
        for key, value in got["loaded"].items():
            assert torch.equal(value, one_process_tied["saved"][key]), key
        assert got["losses"] == pytest.approx(one_process_tied["losses"][SAVE_AFTER:], abs=1e-5)
    _check_tied_copies(two_rank_results, "one_into_pp_tied", keys=("loaded", "final"))


def test_a_one_process_checkpoint_loads_into_sharded_parameters(two_rank_results, one_process_tied_dp2):
    """FSDP2 over 2 ranks from a one-process checkpoint: each rank's shards, and the optimizer
    state behind them, are the slices of the whole tensors (the continued run gives its losses)."""
    for rank_result in two_rank_results:
        got = rank_result["one_into_fsdp_tied"]
        for key, value in got["loaded"].items():
            assert torch.equal(value, one_process_tied_dp2["saved"][key]), key
        assert got["losses"] == pytest.approx(one_process_tied_dp2["losses"][SAVE_AFTER:], abs=1e-5)


def test_a_tensor_parallel_checkpoint_loads_into_other_layouts(two_rank_results, checkpoints):
    saved = two_rank_results[0]["tp"]["saved"]
    for rank_result in two_rank_results:  # FSDP2 over 2 data-parallel ranks
        for key, value in saved.items():
            torch.testing.assert_close(rank_result["tp_into_fsdp"][key], value, rtol=0, atol=0, msg=key)
    engine = build_from_config(job(), DistContext.single()).engine  # and one process, plain tensors
    engine.load(Path(checkpoints) / "tp")
    for key, value in full_params(engine).items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)


# --------------------------------------------------------------------------- through train.py


def test_train_py_resumes_a_tensor_parallel_run_exactly(tmp_path, corpus_cache):
    """The real CLI under torchrun: 6 steps straight (saving at step 3 on the way), and a second run
    resumed from that step-3 checkpoint, give the same losses for steps 4-6. With dropout, so the
    resumed run must also draw the masks the first drew (each rank's generator in the checkpoint)."""
    common = {"model.tie_embeddings": False, "parallel.tp": 2, "model.dropout": 0.1, "optim.decay_steps": 6, "train.max_steps": 6,
              "train.grad_accum_steps": 2, "train.eval_interval": 6, "train.eval_steps": 2,
              "checkpoint.interval": 3}
    full, split = tmp_path / "full", tmp_path / "split"
    tiny = ["--config", "configs/tiny.yaml"]
    first = run_torchrun(2, [*tiny, *tiny_overrides(full, corpus_cache, **common)])
    assert first.returncode == 0, first.stderr[-2000:]
    step3 = full / "checkpoints" / "step_00000003"
    second = run_torchrun(2, [*tiny, "--resume", str(step3), *tiny_overrides(split, corpus_cache, **common)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "layout: strategy=none dp_shard=1 tp=2 pp=1" in second.stdout and "continuing from" in second.stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(split) if "loss" in r}
    assert sorted(losses) == [4, 5, 6]
    assert losses == {r["step"]: r["loss"] for r in read_metrics(full) if "loss" in r and r["step"] > 3}

    # tools/evaluate.py joins the tensor-parallel shards of the final checkpoint in one process: by
    # default its loss is on the run's validation set (train.eval_steps=2 x micro-batch 4 sequences),
    # so it is the tp run's val_loss.
    from tools.evaluate import main as evaluate_main

    result = tmp_path / "eval.json"
    assert evaluate_main([str(full / "checkpoints" / "step_00000006"), "--json", str(result)]) == 0
    val = [r["val_loss"] for r in read_metrics(full) if "val_loss" in r]
    assert json.loads(result.read_text())["loss"] == pytest.approx(val[-1], abs=1e-5)


def test_a_layout_that_does_not_fit_the_ranks_is_one_line(tmp_path, corpus_cache):
    proc = run_train(["--config", "configs/tiny.yaml", *tiny_overrides(tmp_path, corpus_cache, **{"parallel.tp": 2})])
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: parallel.pp=1 x parallel.dp_replicate=1 x parallel.cp=1 x parallel.tp=2 = 2 does not divide "
                                   "the 1 ranks; choose degrees whose product divides it")
