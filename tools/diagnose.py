"""The bottleneck doctor: profile a few real training steps, say where the time goes and what to switch.

    python -m tools.diagnose --config configs/tiny.yaml
    python -m tools.diagnose --config configs/tiny.yaml --model.recompute=selective --try
    torchrun --nproc_per_node=2 -m tools.diagnose --config configs/tiny.yaml --parallel.ddp_bucket_cap_mb=1
    python -m tools.diagnose --config configs/gpt2-124m.yaml --memory-budget-gib 40

Builds the job exactly as train.py does (the one build path, the real data), runs --warmup
steps, then --steps steps under the PyTorch profiler, and splits their wall time into compute,
data wait, optimizer, exposed and overlapped communication and host overhead
(analysis/doctor.py says how each is measured). It compares the compute time with the
estimator's time at the device's peak, checks memory headroom (CUDA: peak allocated vs the
device, or --memory-budget-gib; CPU: peak resident memory vs --memory-budget-gib), and prints
findings worst first, each with the chapter section and the config switch to try. The last
line starts with ``verdict:``. With --try the top finding's switch is run side by side with the
current config (interleaved rounds of --steps steps) and the measured step-time ratio printed.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import math
import os
import resource
import sys
import time

import torch

from analysis.doctor import Job, Span, attribute, verdicts
from common.errors import USER_FACING_ERRORS
from common.hardware import peak_tflops_for
from common.measure import speedup
from common.progress import Progress
from common.report import text_table
from model.flops import flops_per_token
from parallel.distributed import init_distributed, shutdown_distributed
from training.build import build_from_config, resolve_job
from training.config import JobConfig, load_config, parse_known_overrides
from training.loop import train_step

QUIET = ["--logging.progress=plain", "--checkpoint.interval=0", "--checkpoint.save_final=false"]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (compile happens here)")
    parser.add_argument("--memory-budget-gib", type=float, help="memory one rank may use (default: the GPU's)")
    parser.add_argument("--try", dest="try_it", action="store_true", help="run the top finding's switch side by side")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds for --try (default 3)")
    return parse_known_overrides(parser, argv)


class Trainer:
    """One built job and its data, stepping as the training loop does; ``progress`` counts the steps."""

    def __init__(self, cfg: JobConfig, ctx, progress: Progress):
        job = resolve_job(cfg, ctx)  # as train.py resolves it
        self.cfg, self.ctx, self.progress = job.cfg, ctx, progress
        built = build_from_config(job.cfg, ctx, job.initial_state)
        self.engine, self.attention = built.engine, _attention_of(built.notes)
        self.data, self.batches = job.data, job.batches

    def steps(self, n: int) -> tuple[float, float]:
        """Wall seconds and data-wait seconds of ``n`` steps."""
        wall, wait = 0.0, 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            outcome = train_step(self.engine, self.batches, self.cfg.train.grad_accum_steps, self.cfg.optim.lr)
            float(outcome.loss)  # the step is done when its loss is
            wall += time.perf_counter() - t0
            wait += outcome.data_wait_s
            self.progress.update()
        return wall, wait

    def close(self) -> None:
        self.data.train.close()


def _attention_of(notes: list[str]) -> str:
    line = next((n for n in notes if n.startswith("attention:")), "")
    return next((name for name in ("flash_attn", "sdpa", "reference") if name in line.split("(")[0]), "unknown")


def profile(trainer: Trainer, steps: int):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall, wait = trainer.steps(steps)
    main = next((e.thread for e in prof.events() if e.name.startswith("Optimizer.step#")), None)
    spans = [Span(e.name, e.thread, e.time_range.start, e.time_range.end, e.cpu_parent is None)
             for e in prof.events()]
    if main is None:  # no optimizer range (a custom engine): the thread with the most operator time
        totals: dict[int, float] = {}
        for s in (s for s in spans if s.top_level):
            totals[s.thread] = totals.get(s.thread, 0.0) + s.end_us - s.start_us
        main = max(totals, key=totals.get)
    return attribute(spans, main, wall, wait)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def estimator_line(cfg: JobConfig, ctx, compute_s: float, steps: int) -> str:
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    peak, why = ((cfg.train.peak_tflops, "train.peak_tflops") if cfg.train.peak_tflops
                 else peak_tflops_for(device_name, cfg.precision.mode))
    tokens = cfg.train.micro_batch_size * cfg.seq_len * cfg.train.grad_accum_steps
    flops = flops_per_token(cfg.model, cfg.seq_len) * tokens
    if not peak:
        return f"estimator: {flops / 1e9:.2f} GFLOP per step; no peak to compare with ({why})"
    ideal = flops / (peak * 1e12)
    measured = compute_s / steps
    return (f"estimator: {flops / 1e9:.2f} GFLOP per step = {ideal * 1e3:.1f} ms at the {peak:g} TFLOP/s peak; "
            f"measured compute {measured * 1e3:.1f} ms per step ({ideal / measured:.0%} of peak)")


def try_switch(cfg_path: str, overrides: list[str], switch: list[str], ctx, steps: int, rounds: int) -> str:
    """Current config vs the switch, interleaved rounds of ``steps`` steps; the step-time ratio."""
    progress = Progress(2 * (1 + rounds * steps), "diagnose --try: steps", "step", enabled=ctx.is_main)
    current = Trainer(load_config(cfg_path, overrides), ctx, progress)
    changed = Trainer(load_config(cfg_path, overrides + switch), ctx, progress)
    try:
        current.steps(1)
        changed.steps(1)  # warm both (compile, allocator, workers)
        base, new = [], []
        for _ in range(rounds):
            base.append(current.steps(steps)[0])
            new.append(changed.steps(steps)[0])
    finally:
        progress.close()
        current.close()
        changed.close()
    ratio = speedup(new, base)
    word = ("no difference measured" if ratio.min <= 1.0 <= ratio.max
            else f"{ratio.median:.2f}x {'faster' if ratio.median > 1 else 'slower'}")
    return (f"try {' '.join(switch)}: {word} (step-time ratio median {ratio.median:.2f}, min {ratio.min:.2f}, "
            f"max {ratio.max:.2f} over {ratio.n} interleaved rounds of {steps} steps)")


def diagnose(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    cfg = load_config(args.config, QUIET + overrides)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise ValueError("--steps and --rounds must be >= 1, --warmup >= 0")
    budget = args.memory_budget_gib
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"--memory-budget-gib must be a finite number of GiB > 0 (got {budget})")
    ctx = init_distributed(cfg.train.device, cfg.parallel)
    try:
        trainer = Trainer(cfg, ctx, Progress(args.warmup + args.steps, "diagnose: steps", "step", enabled=ctx.is_main))
        cfg = trainer.cfg
        try:
            trainer.steps(args.warmup)
            if ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ctx.device)
            breakdown = profile(trainer, args.steps)
            budget = args.memory_budget_gib
            if budget is None and ctx.device.type == "cuda":
                budget = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
            job = Job(num_workers=cfg.data.num_workers, world_size=ctx.world_size, strategy=cfg.parallel.strategy,
                      recompute=cfg.model.recompute, attention=trainer.attention, compile=cfg.train.compile,
                      fused_optimizer=cfg.optim.fused != "off", peak_memory_gib=peak_memory_gib(ctx.device),
                      memory_budget_gib=budget, device=ctx.device.type, tp=cfg.parallel.tp,
                      zero_bubble=cfg.parallel.pp > 1 and cfg.parallel.pp_schedule == "zero_bubble")
        finally:
            trainer.progress.close()
            trainer.close()
        findings = verdicts(breakdown, job)
        rows = [[name, f"{seconds / args.steps * 1e3:.1f}", f"{share:.0%}"] for name, seconds, share in breakdown.rows()]
        lines = [f"{ctx.world_size} rank(s), {args.steps} profiled steps, {breakdown.wall_s / args.steps * 1e3:.1f} ms "
                 f"per step on {ctx.device}",
                 text_table(["where the step goes", "ms per step", "share"], rows),
                 estimator_line(cfg, ctx, breakdown.compute_s, args.steps),
                 f"memory: peak {job.peak_memory_gib:.2f} GiB" + (f" of {budget:.2f} GiB" if budget else ""),
                 *(f"- {v.text}" for v in findings[1:])]
        if args.try_it:
            top = findings[0].overrides
            lines.append(try_switch(args.config, QUIET + overrides, top, ctx, args.steps, args.rounds) if top
                         else "try: the top finding has no single switch to try")
        lines.append(f"verdict: {findings[0].text}")
        return lines
    finally:
        shutdown_distributed(ctx)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        lines = diagnose(args, overrides)
    except (ValueError, *USER_FACING_ERRORS) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
