"""Training-step throughput of one config under several variants, measured side by side.

    python -m tools.bench_train --config configs/tiny.yaml
    python -m tools.bench_train --config configs/gpt2-124m.yaml --variants precision.mode=fp32 \
        precision.mode=bf16 "precision.mode=bf16 train.compile=true" --rounds 9 --markdown out.md --plot out.png

Each variant is a space-separated list of config overrides applied on top of the base config.
Every variant builds the real model and engine (the same code train.py runs) and trains on
random tokens, so the numbers measure the step, not the data pipeline (tools/bench_data.py does
that). All variants are built in one process, warmed up (compilation happens there), then timed
in interleaved rounds, A B C, A B C, ..., ``--steps`` steps each per round, so that a busy spell
of a shared machine slows every variant alike. Every figure is a median with its min-max over the
rounds, never one run; ratios against the first variant are taken round by round, and one whose
interval contains 1.0 says "no difference measured" (common/measure.py). ``--threads`` fixes
torch's CPU threads. With --markdown the rows are also written as JSON next to the table (same
stem), which tools/reproduce.py reads.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from common.errors import USER_FACING_ERRORS, ConfigError
from common.hardware import peak_tflops_for
from common.measure import (
    RatioSummary,
    hardware_name,
    interleaved,
    machine_load,
    peak_bytes,
    provenance,
    speedup,
    summarize,
)
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from model.flops import flops_per_token
from parallel.distributed import DistContext, pick_device
from training.build import build_from_config
from training.config import JobConfig, load_config
from training.loop import train_step

DEFAULT_VARIANTS = [
    "precision.mode=fp32",
    "precision.mode=bf16",
    "precision.mode=fp32 model.attention=reference",
    "precision.mode=fp32 train.compile=true",
]


@dataclass
class Variant:
    """A built variant, ready to step, or the reason it could not be built or run here."""

    name: str
    cfg: JobConfig | None = None
    device: torch.device | None = None
    step: Callable[[], None] | None = None
    status: str = "ok"
    peak_gib: float | None = None  # CUDA: one step's peak above what was allocated before it


@dataclass
class Result:
    variant: str
    step_s: float  # median over the rounds
    tokens_per_s: float  # tokens of one step / the median step
    mfu: float | None
    peak_gib: float | None
    status: str = "ok"
    step_s_min: float | None = None
    step_s_max: float | None = None
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    vs_first: dict | None = None  # tokens/s against the first variant, per round: median, min, max, n, text;
    # None for the first variant itself
    rounds_s: list[float] = field(default_factory=list)  # seconds per step, one per round


def build_variant(config: str | None, base_overrides: list[str], variant: str) -> Variant:
    overrides = base_overrides + [f"--{item}" for item in variant.split()]
    try:
        cfg = load_config(config, overrides)
        device = pick_device(cfg.train.device, 0)
        engine = build_from_config(cfg, DistContext.single(device)).engine
    except USER_FACING_ERRORS as exc:
        return Variant(variant, status=f"skipped: {exc}")
    b, t, accum = cfg.train.micro_batch_size, cfg.seq_len, cfg.train.grad_accum_steps
    x = torch.randint(0, cfg.model.vocab_size, (b, t), device=device)
    y = torch.randint(0, cfg.model.vocab_size, (b, t), device=device)
    step = lambda: train_step(engine, iter([(x, y)] * accum), accum, cfg.optim.lr)  # noqa: E731
    return Variant(variant, cfg, device, step)


def warm_up(variant: Variant, steps: int) -> None:
    """Untimed steps (allocation, compilation), then on CUDA one more for the memory peak; a
    variant this machine cannot run is skipped."""
    try:
        for _ in range(steps):
            variant.step()
        # Every variant's model stays resident for the interleaved rounds, so the allocator's
        # absolute peak would mix them: one step's peak above what was allocated before it
        # (activations, gradients, temporaries) is this variant's own.
        peak = peak_bytes(variant.step, variant.device)
        variant.peak_gib = peak / 2**30 if peak is not None else None
    except USER_FACING_ERRORS as exc:
        variant.status, variant.step = f"skipped: {exc}", None


def measure(variants: list[Variant], rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per step of each runnable variant, one sample per round, interleaved."""
    for variant in variants:
        if variant.status == "ok":
            warm_up(variant, warmup)
    ready = [v for v in variants if v.status == "ok"]
    if not ready:
        return {}

    def run(variant: Variant) -> Callable[[], None]:
        return lambda: [variant.step() for _ in range(steps)]

    samples = interleaved({v.name: run(v) for v in ready}, rounds, warmup=0, device=ready[0].device,
                          progress="bench_train: timed rounds")
    return {name: [s / steps for s in seconds] for name, seconds in samples.items()}


def results_of(variants: list[Variant], seconds: dict[str, list[float]]) -> list[Result]:
    base = next((v.name for v in variants if v.name in seconds), None)
    results = []
    for v in variants:
        if v.name not in seconds:
            results.append(Result(v.name, math.nan, math.nan, None, None, status=v.status))
            continue
        cfg, s = v.cfg, summarize(seconds[v.name])
        tokens = cfg.train.micro_batch_size * cfg.seq_len * cfg.train.grad_accum_steps
        peak, _ = peak_tflops_for(hardware_name(v.device), cfg.precision.mode)
        mfu = flops_per_token(cfg.model, cfg.seq_len) * tokens / s.median / (peak * 1e12) if peak else None
        vs_first = ratio_dict(speedup(seconds[v.name], seconds[base])) if v.name != base else None
        results.append(Result(v.name, s.median, tokens / s.median, mfu, v.peak_gib, "ok", s.min, s.max, tokens / s.max,
                              tokens / s.min, vs_first, seconds[v.name]))
    return results


def ratio_dict(summary: RatioSummary) -> dict:
    return {"median": summary.median, "min": summary.min, "max": summary.max, "n": summary.n,
            "measured_difference": summary.measured_difference, "text": summary.text()}


HEAD = ["variant", "step (ms) median (min-max)", "tokens/s median (min-max)", "vs first, per round", "MFU",
        "step peak mem (GiB)", "status"]


def table_rows(results: list[Result]) -> list[list[str]]:
    body = []
    for r in results:
        if r.status != "ok":
            body.append([r.variant, "-", "-", "-", "-", "-", r.status])
            continue
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        mem = f"{r.peak_gib:.2f}" if r.peak_gib is not None else "n/a (CPU)"
        body.append([r.variant, f"{r.step_s * 1e3:.1f} ({r.step_s_min * 1e3:.1f}-{r.step_s_max * 1e3:.1f})",
                     f"{r.tokens_per_s:,.0f} ({r.tokens_per_s_min:,.0f}-{r.tokens_per_s_max:,.0f})",
                     r.vs_first["text"] if r.vs_first else "baseline", mfu, mem, "ok"])
    return body


def format_table(results: list[Result], header: str, lines: list[str] = ()) -> str:
    setup = "".join(f"- {line}\n" for line in lines)
    return f"{header}\n\n{setup}{chr(10) if setup else ''}{markdown_table(HEAD, table_rows(results))}"


def plot(results: list[Result], path: Path) -> None:
    ok = [r for r in results if r.status == "ok"]
    fig, ax = new_figure(width=8, height=0.6 * len(ok) + 1.5)
    errors = [[r.tokens_per_s - r.tokens_per_s_min for r in ok], [r.tokens_per_s_max - r.tokens_per_s for r in ok]]
    ax.barh([r.variant for r in ok], [r.tokens_per_s for r in ok], xerr=errors, capsize=4)
    ax.set_xlabel("tokens/s (median, min-max over rounds)")
    ax.invert_yaxis()
    save_figure(fig, path)


def check_args(args: argparse.Namespace) -> None:
    for key in ("rounds", "steps", "threads"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key} must be >= 1 (got {getattr(args, key)})")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 (got {args.warmup})")
    repeated = [v for i, v in enumerate(args.variants) if v in args.variants[:i]]
    if repeated:
        raise ConfigError(f"--variants lists {repeated[0]!r} twice; each variant is timed once per round already")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="each: space-separated overrides")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (one sample per variant each)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (compile happens here)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here "
                        "(and its rows as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    args, base_overrides = parser.parse_known_args(argv)
    threads = torch.get_num_threads()
    args.threads = threads if args.threads is None else args.threads
    try:
        check_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        return run(args, base_overrides, command="python -m tools.bench_train " + shlex.join(argv))
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, base_overrides: list[str], command: str) -> int:
    variants = [build_variant(args.config, base_overrides, variant) for variant in args.variants]
    results = results_of(variants, measure(variants, args.rounds, args.steps, args.warmup))
    device = next((v.device for v in variants if v.device is not None), torch.device("cpu"))
    where = provenance(device)
    header = (f"bench_train: {args.config} {' '.join(base_overrides)} on {where['hardware']}, torch {where['torch']}, "
              f"{where['date']}; median (min-max) over {args.rounds} interleaved rounds of {args.steps} steps "
              f"after {args.warmup} warm-up").replace("  ", " ")
    lines = [f"command: `{command}`", f"{args.threads} thread(s); {machine_load()} when the rounds ended",
             "ratios are taken round by round against the first variant; an interval containing 1.00 "
             "is no measured difference",
             "step peak mem: the CUDA allocator's peak during one step above what was allocated before it"]
    table = format_table(results, header, lines)
    print(header + "\n\n" + text_table(HEAD, table_rows(results)))
    if args.markdown:
        write_results(args.markdown, table + "\n", header, results, provenance=where, config=args.config,
                      overrides=base_overrides, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                      threads=args.threads, command=command)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
