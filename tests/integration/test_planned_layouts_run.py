"""Every layout the planner proposes for a config in configs/ at 4 and 8 ranks runs.

The planner (``analysis.estimator.plan_layouts``, what ``tools.estimate --plan`` prints: its top 10
on H100s, at the config's own per-GPU batch) proposes layouts for the config's real shape. Each
proposal is trained here for 3 steps on gloo ranks with the config's model scaled down (the same
family: norm, MLP, positions, GQA, query/key norms, head width, document mask, routed experts; small
widths, as many layers as the pipeline has stages) through the trainer's own build path, with its
strategy, tp, pp, schedule, virtual stages, cp, ep, dp_replicate x dp_shard and recompute policy.
None may crash (the first that does ends its launch, named with its traceback); every rank logs
the same finite losses, and the first step's loss (the same
initial weights and batch) is one process's. Proposals that train the same scaled-down model on the same layout run once.
The 8-rank launch also runs the zero-bubble schedule under HSDP (pp=2 x dp_replicate=2 x dp_shard=2),
which no config's proposals include at these sizes.

Cost: planning every config at both sizes (about 2 minutes on a loaded 2-core machine) and one
4-rank and one 8-rank launch that run every distinct layout one after another.
"""

from __future__ import annotations

import math
import traceback
from pathlib import Path

import pytest
import torch

from analysis import estimator as est
from common.hardware import DEVICES
from parallel.distributed import DistContext
from parallel.layout import Layout, microbatch_problem
from tests.conftest import ROOT
from tests.gloo import gloo_context, run_workers
from training.build import build_from_config
from training.config import load_config, to_dict

STEPS, SEQ, VOCAB = 3, 32, 256
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def scaled_model(cfg, stages: int, tp: int) -> list[str]:
    """The config's model family at a size a CPU trains in a second, with ``stages`` pipeline stages
    in all and heads that ``tp`` divides: overrides for ``model.*``."""
    m = cfg.model
    heads = 8
    keys = {"n_layer": max(2, stages), "d_model": 64, "n_head": heads, "vocab_size": VOCAB, "max_seq_len": SEQ}
    if m.is_mla:  # latent attention: its own widths, no key/value head count
        keys |= {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
        if m.q_lora_rank is not None:
            keys["q_lora_rank"] = 16
    else:
        keys["n_kv_head"] = heads if m.kv_heads == m.n_head else max(2, tp)
    if m.d_ff is not None:
        keys["d_ff"] = 128
    if m.attention_head_dim is not None and not m.is_mla:
        keys["attention_head_dim"] = 8
    if m.attention_mask == "document":
        keys["eot_id"] = 0
    if m.moe.experts is not None:
        keys |= {"moe.experts": 8, "moe.top_k": min(m.moe.top_k, 2), "moe.d_ff": 16}
    return [f"--model.{k}={v}" for k, v in keys.items()]


def smallest_accumulation(layout) -> int:
    """Fewest micro-batches per step the schedule takes (a pipeline needs one per stage at least)."""
    accum = 1
    while microbatch_problem(layout, accum):
        accum += 1
    return accum


def overrides_for(path: Path, job) -> tuple[str, ...]:
    precision = "bf16" if job.precision == "fp8" else job.precision
    layout = [w for w in est.job_overrides(job) if not w.startswith(("--train.", "--precision."))]
    return tuple(layout + scaled_model(load_config(path), job.layout.stages, job.layout.tp) + [
        "--train.micro_batch_size=1", f"--train.grad_accum_steps={smallest_accumulation(job.layout)}",
        f"--data.seq_len={SEQ}", f"--precision.mode={precision}", "--train.compile=false",
        "--optim.warmup_steps=1", f"--train.max_steps={STEPS}"])


def signature(key: tuple[str, ...]) -> str:
    """What a run trains: the scaled model, the layout, the micro-batches per step and the precision
    (configs whose scaled-down models coincide, like the GPT-2 sizes, run such a layout once)."""
    cfg = to_dict(load_config(key[0], list(key[1:])))
    return repr((cfg["model"], cfg["parallel"], cfg["train"]["grad_accum_steps"], cfg["precision"]["mode"]))


def proposals() -> dict[int, dict[tuple[str, ...], str]]:
    """world size -> {(config path, overrides...): what proposed it}; one entry per distinct run."""
    out: dict[int, dict[tuple[str, ...], str]] = {4: {}, 8: {}}
    seen: dict[int, set[str]] = {4: set(), 8: set()}
    for path in CONFIGS:
        cfg = load_config(path)
        per_gpu = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
        for world in out:
            for plan in est.plan_layouts(cfg.model, cfg.seq_len, world, DEVICES["H100"], cfg.precision.mode,
                                         global_batch=per_gpu * world, top=10, config=cfg):
                key = (str(path.relative_to(ROOT)), *overrides_for(path, plan.job))
                if signature(key) not in seen[world]:
                    seen[world].add(signature(key))
                    out[world][key] = f"{path.stem} at {world}: {est.describe_plan(plan)}"
    hsdp_zero_bubble = ["--parallel.strategy=fsdp", "--parallel.pp=2", "--parallel.dp_replicate=2",
                        "--parallel.dp_shard=2", "--parallel.pp_schedule=zero_bubble", "--parallel.pp_virtual_stages=2"]
    llama = load_config(ROOT / "configs/llama3-8b.yaml", hsdp_zero_bubble)
    key = ("configs/llama3-8b.yaml", *hsdp_zero_bubble, *scaled_model(llama, 4, 1), "--train.micro_batch_size=1",
           "--train.grad_accum_steps=2", f"--data.seq_len={SEQ}", "--precision.mode=fp32", "--train.compile=false",
           "--optim.warmup_steps=1", f"--train.max_steps={STEPS}")
    out[8][key] = "zero_bubble under HSDP: pp=2 x dp_replicate=2 x dp_shard=2, 2 virtual stages"
    return out


def micro_batches(step: int, dp_rank: int, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for micro in range(accum):
        g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro)
        ids = torch.randint(1, VOCAB, (1, SEQ + 1), generator=g)  # id 0 ends a document (eot_id)
        ids[0, SEQ // 2] = 0
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def run_one(rank: int, world: int, key: tuple[str, ...]) -> list[float]:
    cfg = load_config(key[0], list(key[1:]))
    ctx = gloo_context(rank, world, parallel=cfg.parallel)
    engine = build_from_config(cfg, ctx).engine
    accum, losses = cfg.train.grad_accum_steps, []
    for step in range(STEPS):
        loss, _ = engine.forward_backward_step(iter(micro_batches(step, ctx.dims.dp_rank, accum)), accum)
        engine.optimizer_step(cfg.optim.lr, loss)
        losses.append(float(ctx.all_reduce_mean(loss.detach().float().clone())))
    return losses


def worker(rank: int, world: int, keys: list[tuple[str, ...]], log: str) -> dict:
    """Every layout in turn. The first that raises ends the launch (after a failed collective the
    ranks no longer agree on what runs next), with the layout and the traceback in ``log``."""
    out = {}
    for key in keys:
        try:
            out[key] = run_one(rank, world, key)
        except Exception:
            with open(log, "a") as f:
                f.write(f"rank {rank}: {' '.join(key)}\n{traceback.format_exc(limit=8)}\n")
            raise
    return out


def first_step_of_one_process(key: tuple[str, ...], dp_size: int) -> float:
    cfg = load_config(key[0], [w for w in key[1:] if not w.startswith("--parallel.")] +
                      ["--parallel.strategy=none", "--model.recompute=none"])
    engine = build_from_config(cfg, DistContext.single()).engine
    accum = cfg.train.grad_accum_steps
    batches = [b for r in range(dp_size) for b in micro_batches(0, r, accum)]
    loss, _ = engine.forward_backward_step(iter(batches), dp_size * accum)
    return float(loss)


@pytest.fixture(scope="module")
def planned():
    return proposals()


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", [4, 8])
def test_every_planned_layout_trains_three_steps(planned, world, tmp_path):
    assert planned[world]
    log = tmp_path / "failures.log"
    try:
        ranks = run_workers(worker, world, list(planned[world]), str(log))
    except Exception as exc:
        raise AssertionError(f"a planned layout failed:\n{log.read_text() if log.exists() else exc}") from None
    failures = []
    for key, what in planned[world].items():
        results = [r[key] for r in ranks]
        losses = results[0]
        if not all(math.isfinite(v) for v in losses) or any(r != losses for r in results):
            failures.append(f"{what}: losses {results}")
            continue
        cfg = load_config(key[0], list(key[1:]))
        dp_size = Layout.of(cfg.parallel, world, world).dp
        reference = first_step_of_one_process(key, dp_size)
        tolerance = 1e-4 if cfg.precision.mode == "fp32" else 3e-2
        if abs(losses[0] - reference) > tolerance:
            failures.append(f"{what}: first loss {losses[0]} vs one process {reference}")
    assert not failures, f"{len(failures)} of {len(planned[world])} layouts failed:\n" + "\n".join(failures)
