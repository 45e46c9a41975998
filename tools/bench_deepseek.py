"""A DeepSeek-shaped model against its dense twin at equal active parameters and equal steps, with
and without multi-token prediction: final validation loss over seeds and tokens/s side by side.

A thin command line over ``analysis/deepseek_bench.py`` (its docstring says what is compared and how).

    python -m tools.bench_deepseek --config configs/tiny-mla.yaml --workers 2 --model.d_ff=320 \\
        --markdown docs/results/deepseek_vs_dense_cpu.md --plot docs/results/deepseek_vs_dense_cpu.png

Runs go under --out, one directory each; run the same command again and finished runs are read,
not repeated (and the timing is read from --out too unless --retime). Extra --section.key=value
arguments go to every run and to the timing.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import shlex
import sys
from pathlib import Path

import torch

from analysis.deepseek_bench import BASELINE, TABLE_HEADERS, summary_rows, table_rows, variant_models, variant_runs
from analysis.training_runs import (
    add_run_arguments,
    band,
    check_run_arguments,
    print_progress,
    run_all,
    saved_timing,
    time_train_steps,
)
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import hardware_name, machine_load
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from training.config import load_config, parse_known_overrides


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-mla.yaml", help="job config with a MoE model section")
    parser.add_argument("--mtp-depth", type=int, default=1, help="MTP modules of the -mtp variants")
    parser.add_argument("--mtp-weight", type=float, help="their loss weight (default: the config's "
                        "model.mtp_loss_weight, 0.3 unless set)")
    add_run_arguments(parser, out="runs/bench_deepseek", rounds=10, eval_interval=50)
    args, extra = parse_known_overrides(parser, argv)
    check_run_arguments(args, "mtp_depth")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, extra = parse_args(argv)
        job = load_config(args.config, extra)  # a bad override is one line before anything runs
        if job.model.moe.experts is None:
            raise ConfigError(f"{args.config} has no MoE model (set model.moe.experts)")
        weight = job.model.mtp_loss_weight if args.mtp_weight is None else args.mtp_weight
        models = variant_models(job.model, args.mtp_depth, weight)
        runs = variant_runs(job.model, models, args.seeds, job.train.max_steps)
        jobs = {}
        for run in runs[:len(models)]:  # each variant's job as train.py will read it, validated now
            jobs[run.variant] = load_config(args.config, [*extra, *run.settings])
            if jobs[run.variant].model != models[run.variant]:
                raise AssertionError(f"the overrides {run.settings} do not rebuild variant {run.variant}")
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the timing's, and what the report's hardware line says
    try:
        return measure(args, extra, job, models, runs, jobs, weight, "python -m tools.bench_deepseek " + shlex.join(argv))
    finally:
        torch.set_num_threads(threads)


def measure(args, extra, job, models, runs, jobs, weight, command: str) -> int:
    timing = saved_timing(args, lambda: {"train_step_s": time_train_steps(jobs, args.rounds)})
    curves = run_all(runs, args.workers, print_progress, config=args.config, extra=extra, out_dir=args.out,
                     threads=args.threads, log_interval=args.log_interval, eval_interval=args.eval_interval)
    tokens = job.train.micro_batch_size * job.train.grad_accum_steps * job.seq_len
    rows = summary_rows(models, curves, timing["train_step_s"], tokens)
    moe = models["moe"].moe
    title = (f"DeepSeek-shaped MoE vs its dense twin, with and without MTP: {args.config} on "
             f"{hardware_name(torch.device('cpu'))} per run and for the timing, torch {torch.__version__}")
    lines = [
        f"command: `{command}`",
        f"variants: `moe` is the config's model ({moe.experts} experts, top-{moe.top_k}, {moe.shared_experts} shared, "
        f"width {models['moe'].expert_d_ff}, first {moe.first_dense} layer(s) dense, {moe.router} router); "
        f"`{BASELINE}` has one dense MLP of width {models[BASELINE].d_ff} in every layer (a token's experts "
        f"together: the same active parameters but the routers'); `-mtp` adds model.mtp_depth={args.mtp_depth} "
        f"with model.mtp_loss_weight={weight:g}. Same attention, data, schedule and {job.train.max_steps} steps "
        f"of {tokens} tokens each",
        f"loss: final validation loss (next-token only in every variant: the MTP modules run in training "
        f"alone) at seeds {args.seeds}; `vs dense twin` is the difference to the twin's loss at the same seed",
        f"time: a whole training step of each variant (train.py's train_step, same tokens), {args.rounds} "
        f"interleaved rounds; {timing['load']} during the timing, {machine_load()} when the report was written",
    ]
    lines += [verdict(rows)]
    head, body = TABLE_HEADERS, table_rows(rows)
    print(title + "\n\n" + text_table(head, body) + "\n\n" + "\n".join(lines))
    if args.markdown:
        markdown = f"# {title}\n\n" + "".join(f"- {line}\n" for line in lines) + "\n" + markdown_table(head, body) + "\n"
        if args.plot:
            markdown += f"\n![loss curves and tokens/s]({args.plot.name})\n"
        write_results(args.markdown, markdown, title, rows, timing=timing, command=command)
    if args.plot:
        plot(models, curves, rows, args.plot)
    return 0


def verdict(rows: list[dict]) -> str:
    """Which variant ends lowest and by how much against the dense twin; and each one's speed."""
    by = {r["variant"]: r for r in rows}
    best = min(rows, key=lambda r: r["final_val_loss"]["median"])
    parts = [f"{r['variant']} {r['val_loss_vs_dense_twin']['median']:+.4f} at "
             f"{r['speed_vs_dense_twin']['median']:.2f}x the speed" for r in rows if r["variant"] != BASELINE]
    return (f"lowest median final validation loss: {best['variant']} ({best['final_val_loss']['median']:.4f}; "
            f"the dense twin {by[BASELINE]['final_val_loss']['median']:.4f}); against the dense twin, paired by "
            f"seed (median loss difference, median speed): " + "; ".join(parts))


def plot(models, curves, rows, path: Path) -> None:
    """Validation loss (markers, min-max band over seeds) and training loss (faint) by step; tokens/s
    per variant (median, min-max over rounds as whiskers)."""
    fig, (losses, speed) = new_figure(ncols=2, width=6.5)
    colors = dict(zip(models, ("tab:red", "tab:orange", "tab:blue", "tab:cyan")))
    shown = []
    for name in models:
        runs = [c for r, c in curves.items() if r.variant == name]
        x, med, lo, hi = band(runs, "val")
        shown += lo + hi  # every evaluation's band: the range worth the figure's height
        losses.plot(x, med, "-", color=colors[name], marker="o", ms=3, label=f"{name} (n={len(runs)})")
        losses.fill_between(x, lo, hi, color=colors[name], alpha=0.15)
        x, med, _, _ = band(runs, "train")
        losses.plot(x, med, "-", color=colors[name], alpha=0.3, lw=0.8)
    if shown:
        spread = max(shown) - min(shown)
        losses.set_ylim(min(shown) - 0.1 * spread, max(shown) + 0.3 * spread)
    losses.set(xlabel="step", ylabel="loss (val: markers; train: faint)", title="equal steps")
    losses.legend(fontsize=8)
    losses.grid(alpha=0.3)
    tokens = [r["tokens_per_s"] for r in rows]
    per_ms = [r["tokens_per_s"] * r["step_ms"]["median"] for r in rows]  # tokens per step, in ms
    low = [t - p / r["step_ms"]["max"] for t, p, r in zip(tokens, per_ms, rows)]
    high = [p / r["step_ms"]["min"] - t for t, p, r in zip(tokens, per_ms, rows)]
    names = [r["variant"] for r in rows]
    speed.bar(names, tokens, yerr=[low, high], color=[colors[n] for n in names], capsize=4)
    speed.set(ylabel="tokens/s (median step; whiskers: min-max)", title="training step, interleaved rounds")
    speed.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
