"""Feature x layout combinations that the layout tests of their own features do not reach, each
against one process on the same global batch.

Recompute, the document mask, µP, the chunked loss, Muon, MoE, MTP, reduced precision and FP8 each have
tests of their own in one process and under some layouts; here each runs under the layouts those
leave out (tensor and pipeline parallelism, pipelines under FSDP2 with gpipe and interleaved 1F1B,
HSDP over tp, pp, cp and ep, DeepSpeed's ZeRO, ...). Every layout trains STEPS steps of 2 sequences
per data-parallel rank (as many micro-batches per step as a pipeline needs) and is held to one
process running the same global batch with the same model: fp32 losses within 1e-5, gradient norms
within 1e-5 relative and the weights after the last step within 1e-4, as tests/integration/parallel/
test_cp.py holds its layouts; reduced precision and FP8 within the tolerances named at PRECISION.
Dropout under pp, cp and ep: one process replays the masks the ranks drew (DROPOUT_LAYOUTS), and a
run resumed from a checkpoint draws the masks the uninterrupted run drew. One 4-rank launch runs the
4-rank layouts in sequence, one 8-rank launch the HSDP and 3-D ones; torch.compile'd blocks have a
2-rank launch (after the 2-rank layouts without compile), a 4-rank and an 8-rank one of their own.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from parallel.cp import chunk_ids, local_token_index
from parallel.distributed import DistContext
from tests.gloo import gloo_context, run_workers, save_on_every_rank
from tests.integration.parallel.test_cp import EOT, SEQ, VOCAB, batches
from tests.integration.parallel.test_tp_dropout import dropout_masks
from tests.integration.parallel.test_tp_pp import full_params
from training.build import build_from_config
from training.checkpoint import capture_rng_state, restore_rng_state
from training.config import load_config

MICRO, STEPS = 2, 4
MODEL = {"vocab_size": VOCAB, "max_seq_len": SEQ, "n_layer": 2, "n_head": 4, "d_model": 32, "n_kv_head": 2,
         "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False}
MOE = {"model.moe.experts": 4, "model.moe.top_k": 2, "model.moe.d_ff": 16}
DOCUMENT = {"model.attention_mask": "document", "model.eot_id": EOT, "model.document_positions": True}
MUON = {"optim.name": "muon", "optim.muon.ns_dtype": "fp32", "model.bias": False}
MUP = {"model.mup": True, "model.mup_base_width": 16}
# fp16 on MoE models: seed 1337's one-process reference in fp16 flips the top-2 choice of two near-tied
# tokens at step 4 (score gaps 4e-4 and 5e-4), moving its gradient norm 3.3e-3 from fp32 where ep2_of_dp4
# in fp16 stays 2.7e-4 from it: past fp16's 0.3%, a flip of the reference, not the layout's rounding.
# Seed 4's reference flips none of its 1024 top-2 choices over the 4 steps against fp32.
FP16_MOE = {"precision.mode": "fp16", "train.seed": 4} | MOE
FSDP = {"strategy": "fsdp"}
HSDP = {"strategy": "fsdp", "dp_replicate": 2, "dp_shard": 2}

# name -> (parallel section, other keys of the run and of its one-process reference)
FOUR_RANKS = {
    # recompute under tensor parallelism (policies that re-run the tp collectives in backward) and pipelines
    "tp2_x_dp2_full_recompute": (FSDP | {"tp": 2, "dp_shard": 2}, {"model.recompute": "full"}),
    "tp2_x_dp2_op_selective_recompute": (FSDP | {"tp": 2, "dp_shard": 2}, {"model.recompute": "op_selective"}),
    "tp2_selective_recompute_no_sp": ({"tp": 2, "sequence_parallel": False}, {"model.recompute": "selective"}),
    # pipelines under FSDP2 with the two schedules test_tp_pp.py leaves out, with recompute in the stages
    "pp2_x_dp2_gpipe_full_recompute": (FSDP | {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"},
                                       {"model.recompute": "full"}),
    "pp2_x_dp2_interleaved_selective_recompute": (FSDP | {"pp": 2, "dp_shard": 2, "pp_schedule": "interleaved_1f1b",
                                                          "pp_virtual_stages": 2},
                                                  {"model.recompute": "selective", "model.n_layer": 4}),
    "pp2_x_tp2_op_selective_recompute": ({"pp": 2, "tp": 2}, {"model.recompute": "op_selective"}),
    # the document mask where the heads are split, and where experts are
    "tp2_x_dp2_document": (FSDP | {"tp": 2, "dp_shard": 2}, DOCUMENT),
    "ep2_of_dp4_document": (FSDP | {"ep": 2}, DOCUMENT | MOE),
    # HSDP over expert parallelism: the expert groups inside each replica
    "hsdp_x_ep2": (HSDP | {"ep": 2}, MOE),
    # the chunked loss under data parallelism
    "ddp_chunked_loss": ({"strategy": "ddp"}, {"kernels.loss_chunk_tokens": 8}),
    "fsdp_chunked_loss": (FSDP, {"kernels.loss_chunk_tokens": 8}),
    # Muon under context parallelism (a cp rank's gradients are partial sums until FSDP2 reduces them)
    "cp2_x_dp2_muon": (FSDP | {"cp": 2, "dp_shard": 2}, MUON),
    # µP's multipliers on sharded and split weights
    "tp2_x_dp2_mup": (FSDP | {"tp": 2, "dp_shard": 2}, MUP),
    "pp2_x_dp2_mup": (FSDP | {"pp": 2, "dp_shard": 2}, MUP),
    # MoE under DeepSpeed's ZeRO
    "zero1_moe": ({"strategy": "zero1"}, MOE),
    "zero2_moe": ({"strategy": "zero2"}, MOE),
    "zero3_moe": ({"strategy": "zero3"}, MOE),
    # reduced precision on several ranks
    "ddp_bf16": ({"strategy": "ddp"}, {"precision.mode": "bf16"}),
    "tp2_x_dp2_bf16": (FSDP | {"tp": 2, "dp_shard": 2}, {"precision.mode": "bf16"}),
    "pp2_x_dp2_bf16": (FSDP | {"pp": 2, "dp_shard": 2}, {"precision.mode": "bf16"}),
    "cp2_x_ep2_bf16": (FSDP | {"cp": 2, "ep": 2}, {"precision.mode": "bf16"} | MOE),
    "fsdp_bf16_master": (FSDP, {"precision.mode": "bf16_master"}),
    "zero1_bf16_master": ({"strategy": "zero1"}, {"precision.mode": "bf16_master"}),
    "cp2_x_ep2_bf16_master": (FSDP | {"cp": 2, "ep": 2}, {"precision.mode": "bf16_master"} | MOE),
    "ddp_fp16": ({"strategy": "ddp"}, {"precision.mode": "fp16"}),
    "fsdp_fp16": (FSDP, {"precision.mode": "fp16"}),
    "zero2_fp16": ({"strategy": "zero2"}, {"precision.mode": "fp16"}),
    "fsdp_bf16": (FSDP, {"precision.mode": "bf16"}),
    "zero2_bf16": ({"strategy": "zero2"}, {"precision.mode": "bf16"}),
    "zero3_bf16_master": ({"strategy": "zero3"}, {"precision.mode": "bf16_master"}),
    "zero1_fp16": ({"strategy": "zero1"}, {"precision.mode": "fp16"}),
    "zero3_fp16": ({"strategy": "zero3"}, {"precision.mode": "fp16"}),
    "cp2_x_ep2_fp16": (FSDP | {"cp": 2, "ep": 2}, {"precision.mode": "fp16"} | MOE),
    "zero1_bf16": ({"strategy": "zero1"}, {"precision.mode": "bf16"}),
    "zero3_bf16": ({"strategy": "zero3"}, {"precision.mode": "bf16"}),
    "ddp_bf16_master": ({"strategy": "ddp"}, {"precision.mode": "bf16_master"}),
    "zero2_bf16_master": ({"strategy": "zero2"}, {"precision.mode": "bf16_master"}),
    "tp2_x_dp2_bf16_master": (FSDP | {"tp": 2, "dp_shard": 2}, {"precision.mode": "bf16_master"}),
    "pp2_x_dp2_bf16_master": (FSDP | {"pp": 2, "dp_shard": 2}, {"precision.mode": "bf16_master"}),
    "hsdp_bf16": (HSDP, {"precision.mode": "bf16"}),
    "hsdp_bf16_master": (HSDP, {"precision.mode": "bf16_master"}),
    "hsdp_fp16": (HSDP, {"precision.mode": "fp16"}),
    "tp2_x_dp2_etp2_bf16": (FSDP | {"tp": 2, "dp_shard": 2, "etp": 2}, {"precision.mode": "bf16"} | MOE),
    # reduced precision where the layouts above compose further: HSDP over ep, a 2-D model-parallel
    # layout with no data parallelism (bf16 only: fp16 and bf16_master are refused there), cp and ep
    # without the other
    "hsdp_x_ep2_bf16": (HSDP | {"ep": 2}, {"precision.mode": "bf16"} | MOE),
    "hsdp_x_ep2_bf16_master": (HSDP | {"ep": 2}, {"precision.mode": "bf16_master"} | MOE),
    "hsdp_x_ep2_fp16": (HSDP | {"ep": 2}, FP16_MOE),
    "pp2_x_tp2_bf16": ({"pp": 2, "tp": 2}, {"precision.mode": "bf16"}),
    "cp2_x_dp2_bf16": (FSDP | {"cp": 2, "dp_shard": 2}, {"precision.mode": "bf16"}),
    "cp2_x_dp2_bf16_master": (FSDP | {"cp": 2, "dp_shard": 2}, {"precision.mode": "bf16_master"}),
    "cp2_x_dp2_fp16": (FSDP | {"cp": 2, "dp_shard": 2}, {"precision.mode": "fp16"}),
    "ep2_of_dp4_bf16": (FSDP | {"ep": 2}, {"precision.mode": "bf16"} | MOE),
    "ep2_of_dp4_bf16_master": (FSDP | {"ep": 2}, {"precision.mode": "bf16_master"} | MOE),
    "ep2_of_dp4_fp16": (FSDP | {"ep": 2}, FP16_MOE),
    # FP8 (torchao) under pipelines, cp and ep
    "pp2_x_dp2_fp8": (FSDP | {"pp": 2, "dp_shard": 2}, {"precision.mode": "fp8", "precision.fp8_backend": "torchao"}),
    "cp2_x_dp2_fp8": (FSDP | {"cp": 2, "dp_shard": 2}, {"precision.mode": "fp8", "precision.fp8_backend": "torchao"}),
    "ep2_of_dp4_fp8": (FSDP | {"ep": 2}, {"precision.mode": "fp8", "precision.fp8_backend": "torchao"} | MOE),
}
EIGHT_RANKS = {
    "hsdp_x_tp2": (HSDP | {"tp": 2}, {}),
    "hsdp_x_pp2": (HSDP | {"pp": 2}, {}),
    "hsdp_x_cp2": (HSDP | {"cp": 2}, {}),
    "hsdp_x_tp2_etp2": (HSDP | {"tp": 2, "etp": 2}, MOE),  # split experts inside each replica
    "pp2_x_dp2_x_tp2_gpipe": (FSDP | {"pp": 2, "dp_shard": 2, "tp": 2, "pp_schedule": "gpipe"}, {}),
    "pp2_x_dp2_x_tp2_interleaved": (FSDP | {"pp": 2, "dp_shard": 2, "tp": 2, "pp_schedule": "interleaved_1f1b",
                                            "pp_virtual_stages": 2}, {"model.n_layer": 4}),
    # multi-token prediction: its modules on the last stage, their blocks split over tp, sharded over dp
    "pp2_x_dp2_x_tp2_mtp": (FSDP | {"pp": 2, "dp_shard": 2, "tp": 2}, {"model.mtp_depth": 2, "model.mtp_loss_weight": 0.5}),
    # reduced precision over HSDP × tp, pp, cp and 3-D (fp16 is refused with tp or pp)
    "hsdp_x_tp2_bf16": (HSDP | {"tp": 2}, {"precision.mode": "bf16"}),
    "hsdp_x_tp2_bf16_master": (HSDP | {"tp": 2}, {"precision.mode": "bf16_master"}),
    "hsdp_x_pp2_bf16": (HSDP | {"pp": 2}, {"precision.mode": "bf16"}),
    "hsdp_x_pp2_bf16_master": (HSDP | {"pp": 2}, {"precision.mode": "bf16_master"}),
    "hsdp_x_cp2_bf16": (HSDP | {"cp": 2}, {"precision.mode": "bf16"}),
    "hsdp_x_cp2_bf16_master": (HSDP | {"cp": 2}, {"precision.mode": "bf16_master"}),
    # At fp16's initial loss scale 2^16 a replica's last block's output-bias gradient sums to 65808 on
    # one cp rank at step 1, past fp16's 65504: every rank skips that step and halves the scale, as the
    # scaler should, where one process (its 4 micro-batches each a quarter of the loss) steps. From 2^12
    # neither overflows, and the comparison is of the layout's rounding.
    "hsdp_x_cp2_fp16": (HSDP | {"cp": 2}, {"precision.mode": "fp16", "precision.fp16_init_scale": 4096}),
    "pp2_x_dp2_x_tp2_bf16": (FSDP | {"pp": 2, "dp_shard": 2, "tp": 2}, {"precision.mode": "bf16"}),
    "pp2_x_dp2_x_tp2_bf16_master": (FSDP | {"pp": 2, "dp_shard": 2, "tp": 2}, {"precision.mode": "bf16_master"}),
}
# bf16 on tensor or pipeline parallelism with no data parallelism, on 2 ranks (fp16 and bf16_master are
# refused there); they run first in the 2-rank launch of the compiled layouts below, before any compile.
TWO_RANKS = {
    "tp2_bf16": ({"tp": 2}, {"precision.mode": "bf16"}),
    "pp2_bf16": ({"pp": 2}, {"precision.mode": "bf16"}),
}
# torch.compile'd blocks under FSDP2, a pipeline, context and expert parallelism, on 2 ranks (after
# TWO_RANKS in their launch; each rank compiles), against one process without compile. Tensor
# parallelism is refused with compile (training/config.py).
COMPILE = {"train.compile": True}
COMPILE_LAYOUTS = {
    "fsdp_compile": (FSDP, COMPILE),
    "pp2_compile": ({"pp": 2}, COMPILE),
    "cp2_compile": (FSDP | {"cp": 2}, COMPILE),
    "ep2_compile": (FSDP | {"ep": 2}, COMPILE | MOE),
}
# The same over HSDP and the 2-D layouts, on 4 ranks.
COMPILE_FOUR_RANKS = {
    "hsdp_compile": (HSDP, COMPILE),
    "pp2_x_dp2_compile": (FSDP | {"pp": 2, "dp_shard": 2}, COMPILE),
    "cp2_x_ep2_compile": (FSDP | {"cp": 2, "ep": 2}, COMPILE | MOE),
    "hsdp_x_ep2_compile": (HSDP | {"ep": 2}, COMPILE | MOE),
    "pp2_x_cp2_compile": ({"pp": 2, "cp": 2}, COMPILE),
    "pp2_x_ep2_compile": (FSDP | {"pp": 2, "dp_shard": 2, "ep": 2}, COMPILE | MOE),
}
# And the 3-D ones, on 8 ranks.
COMPILE_EIGHT_RANKS = {
    "hsdp_x_cp2_compile": (HSDP | {"cp": 2}, COMPILE),
    "hsdp_x_pp2_compile": (HSDP | {"pp": 2}, COMPILE),
    "pp2_x_dp2_x_cp2_compile": (FSDP | {"pp": 2, "dp_shard": 2, "cp": 2}, COMPILE),
}

# Reduced precision, against one process in the same mode: both round every matmul alike and only
# the order of the sums differs, which the rounding magnifies about as much as the mode itself moves
# the run from fp32. Measured over STEPS steps of these layouts: losses at most 1.3e-3 apart (bf16,
# bf16_master; 1.7e-3 with split experts, etp; 2.8e-3 for tp2_bf16, whose global batch is 2 sequences,
# on which one process in bf16 ends 3.1e-3 from fp32; one process in bf16 against fp32 up to 9e-4 on
# 4), 1.3e-4 (fp16) and 1.6e-3 (FP8); gradient norms 1.7e-2 relative (bf16, against
# 1.9e-2 for one process against fp32), 3.0e-2 (bf16_master: hsdp_x_tp2 at step 2, 1.1e-2 above fp32
# where one process is 1.9e-2 below it: its micro-batches' gradients add up in the bf16 weights'
# .grad, where FSDP2 reduces in fp32), 1e-3 (fp16; 1.2e-3 with MoE, 1.8e-3 over HSDP x cp), 1.3e-2 (FP8).
# The weights are not compared: AdamW's normalised step moves an entry whose gradient is near zero by
# up to lr on rounding-sized differences (7% of the weights' movement apart, as far as one process in
# bf16 is from fp32). (loss tolerance, gradient-norm relative tolerance, the first Linear's class and
# output dtype on every rank: the mode took effect)
PRECISION = {"bf16": (3e-3, 3e-2, ("Linear", "torch.bfloat16")),
             "bf16_master": (3e-3, 4e-2, ("Linear", "torch.bfloat16")),
             "fp16": (5e-4, 3e-3, ("Linear", "torch.float16")),
             "fp8": (3e-3, 3e-2, ("Float8Linear", "torch.bfloat16"))}


def accum_of(parallel: dict) -> int:
    return 2 if parallel.get("pp", 1) > 1 else 1  # a pipeline needs a micro-batch per stage


def job(parallel: dict, extra: dict):
    overrides = [f"--model.{k}={v}" for k, v in MODEL.items()]
    overrides += [f"--train.micro_batch_size={MICRO}", f"--train.grad_accum_steps={accum_of(parallel)}",
                  "--optim.warmup_steps=1", "--optim.lr=1e-2", f"--train.max_steps={STEPS}"]
    overrides += [f"--{k}={v}" for k, v in extra.items()] + [f"--parallel.{k}={v}" for k, v in parallel.items()]
    return load_config(None, overrides)


def train(engine, ctx, cfg, steps: range = range(STEPS)) -> dict:
    """Losses, gradient norms and final weights of STEPS steps, the class and output dtype of the
    first linear layer this rank runs (what the precision mode made of it; not recorded in compiled
    blocks, where torch's compiler would trace the recording hook and recompile for each record),
    and the graphs torch's compiler has compiled after each step."""
    losses, norms, linear, graphs = [], [], [], []
    first = next(m for m in engine.module().modules() if isinstance(m, torch.nn.Linear))
    hook = None if cfg.train.compile else first.register_forward_hook(
        lambda m, args, out: linear.append((type(m).__name__, str(out.dtype))))
    n = cfg.train.grad_accum_steps
    for step in steps:
        loss, _ = engine.forward_backward_step(batches(step, ctx.dims.dp_rank, n), n)
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(ctx.all_reduce_mean(loss.detach().float().clone())))
        graphs.append(counters["stats"]["unique_graphs"])
    if hook is not None:
        hook.remove()
    return {"losses": losses, "norms": norms, "final": {k: v.float() for k, v in full_params(engine).items()},
            "dp_size": ctx.layout.dp, "linear": linear[0] if linear else None, "graphs": graphs}


# Dropout where ranks hold different activations: pipeline stages (other layers), cp ranks (other
# positions of the same sequences, and keys they share) and ep ranks (other sequences). Each rank
# records every mask it draws (test_tp_dropout.py's ``dropout_masks``); one process replays them,
# joined where one process holds what several ranks hold, and must train as the layout did.
DROPOUT = {"model.dropout": 0.2, "model.attention": "reference"}  # the reference core's probabilities go through F.dropout
DROPOUT_LAYOUTS = {
    "pp2_x_dp2_dropout": (FSDP | {"pp": 2, "dp_shard": 2}, DROPOUT),
    "cp2_x_dp2_dropout": (FSDP | {"cp": 2, "dp_shard": 2}, DROPOUT),
    "ep2_of_dp4_dropout": (FSDP | {"ep": 2}, DROPOUT | MOE),
}


DROPOUT_SAVE_AT = 2  # the dropout layouts save here; a fresh engine resumes and must draw what the run drew


def dropout_run(rank: int, world: int, name: str, root: str) -> dict:
    """STEPS steps of a dropout layout recording its masks, saved at DROPOUT_SAVE_AT (the generator
    state as train.py's checkpoint keeps it), and a fresh engine resumed from there recording its own."""
    parallel, extra = DROPOUT_LAYOUTS[name]
    cfg = job(parallel, extra)
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    with dropout_masks() as masks:
        out = train(engine, ctx, cfg, range(DROPOUT_SAVE_AT))
        path = Path(root) / name
        save_on_every_rank(engine, path, rank)
        rng = capture_rng_state()
        rest = train(engine, ctx, cfg, range(DROPOUT_SAVE_AT, STEPS))
    out = {key: out[key] + rest[key] for key in ("losses", "norms")} | {"final": rest["final"], "masks": masks}
    fresh = build_from_config(cfg, ctx).engine  # a new run: its build drew other numbers
    fresh.load(path)
    restore_rng_state(rng)
    with dropout_masks() as resumed_masks:
        out["resumed"] = train(fresh, ctx, cfg, range(DROPOUT_SAVE_AT, STEPS))["losses"]
    return out | {"resumed_masks": resumed_masks,
                  "where": {"dp": ctx.dims.dp_rank, "pp": ctx.dims.coordinate("pp"), "cp": ctx.dims.coordinate("cp")}}


def worker(rank: int, world: int, layouts: dict, root: str | None = None) -> dict:
    out = {}
    if root is not None:
        out |= {name: dropout_run(rank, world, name, root) for name in DROPOUT_LAYOUTS}
    for name, (parallel, extra) in layouts.items():
        cfg = job(parallel, extra)
        ctx = gloo_context(rank, world, parallel=cfg.parallel)
        if cfg.train.compile:
            # Each compiled layout compiles afresh (code from earlier layouts of the launch, under
            # other wrappers, would fill the compiler's per-function cache, past which it runs
            # blocks eagerly without a word); the compiled graphs are counted from zero.
            torch._dynamo.reset()
            counters.clear()
        try:  # one layout's failure is its test's, not the whole launch's
            out[name] = train(build_from_config(cfg, ctx).engine, ctx, cfg)
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def one_process(dp_size: int, parallel: dict, extra: dict) -> dict:
    """The same model on the global batch of ``dp_size`` data-parallel ranks, in one process."""
    accum = accum_of(parallel)
    cfg = job({}, extra)
    ctx = DistContext.single()
    engine = build_from_config(cfg, ctx).engine
    losses, norms = [], []
    for step in range(STEPS):
        every = iter([b for r in range(dp_size) for b in batches(step, r, accum)])
        loss, _ = engine.forward_backward_step(every, dp_size * accum)
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "final": {k: v.float() for k, v in full_params(engine).items()}}


def deepspeed_fp16_refused(parallel: dict, extra: dict) -> bool:
    """DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels (avx512_fp16 or
    AMX-FP16: is_fp16_supported); elsewhere train.py refuses ZeRO with fp16 in one line, and that
    refusal is what such a machine must show."""
    if not (parallel.get("strategy", "").startswith("zero") and extra.get("precision.mode") == "fp16"):
        return False
    from deepspeed.accelerator import get_accelerator

    return not get_accelerator().is_fp16_supported()


def check(results: list[dict], name: str, layout: tuple[dict, dict]) -> None:
    parallel, extra = layout
    if deepspeed_fp16_refused(parallel, extra):
        for rank_result in results:
            assert rank_result[name].get("error") == (
                "CapabilityError: precision.mode=fp16 with DeepSpeed: its cpu accelerator has no fp16 support here; "
                "use bf16_master (or bf16) with ZeRO on this machine"), name
        return
    for rank_result in results:
        assert "error" not in rank_result[name], f"{name}: {rank_result[name].get('error')}"
    if extra.get("train.compile"):
        # Every graph is compiled in the first step: a recompile later (a guard on a row count or on
        # Python state that changes from step to step) would cost a compile per step.
        for rank_result in results:
            graphs = rank_result[name]["graphs"]
            assert graphs[0] > 0, f"{name}: no graph compiled"
            assert graphs[-1] == graphs[0], f"{name}: {graphs[-1] - graphs[0]} graphs compiled after the first step"
    ref = one_process(results[0][name]["dp_size"], parallel, {k: v for k, v in extra.items() if k != "train.compile"})
    mode = extra.get("precision.mode")
    if mode is not None:
        loss_tol, norm_tol, linear = PRECISION[mode]
        for rank_result in results:
            got = rank_result[name]
            assert got["linear"] == linear, name
            assert got["losses"] == pytest.approx(ref["losses"], abs=loss_tol), name
            assert got["norms"] == pytest.approx(ref["norms"], rel=norm_tol), name
        return
    assert_fp32_equal(results, name, ref)


def assert_fp32_equal(results: list[dict], name: str, ref: dict) -> None:
    """Every rank's losses and gradient norms, and the weights gathered over the ranks, against ``ref``."""
    final = {}
    for rank_result in results:
        got = rank_result[name]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5), name
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
        final.update(got["final"])
    assert set(final) == set(ref["final"]), name
    for key, weight in ref["final"].items():
        torch.testing.assert_close(final[key], weight, rtol=1e-4, atol=1e-4, msg=f"{name}: {key}")


def one_process_masks(results: list[dict], name: str) -> list[torch.Tensor]:
    """The masks the layout's ranks drew, in the order one process draws them over the same global
    batch (steps, then data-parallel ranks, then micro-batches; per micro-batch the embedding, then per
    block the attention core, after attention, after the MLP), joined into one process's shapes."""
    accum, layers = accum_of(DROPOUT_LAYOUTS[name][0]), MODEL["n_layer"]
    records = {(r[name]["where"]["dp"], r[name]["where"]["pp"], r[name]["where"]["cp"]):
               drawn(name, r[name]["masks"], STEPS * accum) for r in results}
    dps, pps, cps = (sorted({key[i] for key in records}) for i in range(3))
    per_micro = {key: len(masks) // (STEPS * accum) for key, masks in records.items()}
    out = []
    for step in range(STEPS):
        for dp in dps:
            for micro in range(accum):
                def of(pp: int, cp: int) -> list[torch.Tensor]:
                    n = per_micro[(dp, pp, cp)]
                    return records[(dp, pp, cp)][(step * accum + micro) * n:(step * accum + micro + 1) * n]
                if len(cps) == 1:  # a pipeline's stages hold the layers one after the other
                    out += [m for pp in pps for m in of(pp, 0)]
                    continue
                parts = [of(0, cp) for cp in cps]  # per cp rank: embedding, then per block 2 cores (its chunks), 2 more
                assert all(len(p) == 1 + 4 * layers for p in parts)
                out.append(join_positions(parts, 0))
                for layer in range(layers):
                    at = 1 + 4 * layer
                    out += [join_cores(parts, at), join_positions(parts, at + 2), join_positions(parts, at + 3)]
    return out


def drawn(name: str, masks: list[torch.Tensor], forwards: int) -> list[torch.Tensor]:
    """The masks that trained, of layout ``name``'s ``forwards`` micro-batches: a pipeline stage first
    infers its shapes with a forward of its own, whose masks are recorded but whose draws torch's
    schedule undoes (it forks the generators around it), so the draws after it are the micro-batches'."""
    if DROPOUT_LAYOUTS[name][0].get("pp", 1) == 1:
        return masks
    per_forward = len(masks) // (forwards + 1)
    assert len(masks) == per_forward * (forwards + 1), f"{name}: {len(masks)} masks over {forwards} forwards"
    return masks[per_forward:]


def join_positions(parts: list[list[torch.Tensor]], at: int) -> torch.Tensor:
    """(B, T, ...) from each cp rank's (B, T / cp, ...) mask of its positions (``local_token_index``)."""
    first = parts[0][at]
    whole = torch.empty((first.shape[0], SEQ, *first.shape[2:]), dtype=torch.bool)
    for cp, part in enumerate(parts):
        whole[:, local_token_index(SEQ, len(parts), cp)] = part[at]
    return whole


def join_cores(parts: list[list[torch.Tensor]], at: int) -> torch.Tensor:
    """(B, H, T, T) attention probabilities' mask from each cp rank's two chunks of queries against the
    keys up to each chunk's end; later keys are masked out (probability 0): any mask keeps them 0."""
    first = parts[0][at]
    whole = torch.ones((*first.shape[:2], SEQ, SEQ), dtype=torch.bool)
    c = SEQ // (2 * len(parts))
    for cp, part in enumerate(parts):
        for j, g in enumerate(chunk_ids(len(parts), cp)):
            whole[:, :, g * c:(g + 1) * c, :(g + 1) * c] = part[at + j]
    return whole


def one_process_replaying(name: str, masks: list[torch.Tensor]) -> dict:
    parallel, extra = DROPOUT_LAYOUTS[name]
    calls = iter(masks)

    def replay(x: torch.Tensor) -> torch.Tensor:
        mask = next(calls)
        assert mask.shape == x.shape, f"{name}: one process drops {tuple(x.shape)}, the ranks gave {tuple(mask.shape)}"
        return mask

    with dropout_masks(replay):
        ref = one_process(4 // (parallel.get("pp", 1) * parallel.get("cp", 1)), parallel, extra)
    assert next(calls, None) is None, f"{name}: the ranks drew more masks than one process"
    return ref


@pytest.fixture(scope="module")
def four_ranks():
    with tempfile.TemporaryDirectory() as root:
        return run_workers(worker, 4, FOUR_RANKS, root)


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(worker, 2, TWO_RANKS | COMPILE_LAYOUTS)


@pytest.fixture(scope="module")
def compile_four_ranks():
    return run_workers(worker, 4, COMPILE_FOUR_RANKS)


@pytest.fixture(scope="module")
def compile_eight_ranks():
    return run_workers(worker, 8, COMPILE_EIGHT_RANKS)


@pytest.fixture(scope="module")
def eight_ranks():
    return run_workers(worker, 8, EIGHT_RANKS)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_features_on_four_rank_layouts_equal_one_process(name, four_ranks):
    check(four_ranks, name, FOUR_RANKS[name])


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_features_on_two_rank_layouts_equal_one_process(name, two_ranks):
    check(two_ranks, name, TWO_RANKS[name])


@pytest.mark.parametrize("name", list(COMPILE_LAYOUTS))
def test_compiled_blocks_on_two_rank_layouts_equal_one_process(name, two_ranks):
    check(two_ranks, name, COMPILE_LAYOUTS[name])


@pytest.mark.parametrize("name", list(COMPILE_FOUR_RANKS))
def test_compiled_blocks_on_hsdp_and_2d_layouts_equal_one_process(name, compile_four_ranks):
    check(compile_four_ranks, name, COMPILE_FOUR_RANKS[name])


@pytest.mark.parametrize("name", list(COMPILE_EIGHT_RANKS))
def test_compiled_blocks_on_3d_layouts_equal_one_process(name, compile_eight_ranks):
    check(compile_eight_ranks, name, COMPILE_EIGHT_RANKS[name])


@pytest.mark.parametrize("name", list(EIGHT_RANKS))
def test_hsdp_and_3d_layouts_equal_one_process(name, eight_ranks):
    check(eight_ranks, name, EIGHT_RANKS[name])


@pytest.mark.parametrize("name", list(DROPOUT_LAYOUTS))
def test_dropout_under_pp_cp_and_ep_equals_one_process_dropping_the_same_elements(name, four_ranks):
    assert_fp32_equal(four_ranks, name, one_process_replaying(name, one_process_masks(four_ranks, name)))
    # Ranks that hold different elements draw different masks: data-parallel ranks (other sequences),
    # cp ranks (other positions), as one process's draws for them would differ.
    heads = [r[name]["masks"][0] for r in four_ranks if r[name]["where"]["pp"] == 0]  # the embedding's dropout
    assert len(heads) >= 2 and all(not torch.equal(heads[0], m) for m in heads[1:]), name
    # Resumed from the checkpoint at DROPOUT_SAVE_AT: the same masks and losses as the run that went on
    # (a pipeline's first step infers its shapes with a forward again, which must shift no draw).
    for rank_result in four_ranks:
        got = rank_result[name]
        assert got["resumed"] == got["losses"][DROPOUT_SAVE_AT:], f"{name}: resume is not bit-exact"
        accum = accum_of(DROPOUT_LAYOUTS[name][0])
        masks = drawn(name, got["masks"], STEPS * accum)
        resumed = drawn(name, got["resumed_masks"], (STEPS - DROPOUT_SAVE_AT) * accum)
        after = masks[len(masks) - len(resumed):]
        assert len(resumed) * STEPS == len(masks) * (STEPS - DROPOUT_SAVE_AT), name
        assert all(torch.equal(a, b) for a, b in zip(resumed, after)), f"{name}: other masks after resume"
