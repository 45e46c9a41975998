"""Muon against AdamW on one config: loss at equal steps and at equal wall time, each optimizer's
learning rate tuned over a small grid, and the optimizer step timed side by side.

A thin command line over ``analysis/optimizer_bench.py`` (its docstring says what is run and how).

    python -m tools.bench_muon --config configs/tiny.yaml --workers 2 \\
        --markdown docs/results/muon_vs_adamw_cpu.md --plot docs/results/muon_vs_adamw_cpu.png

Runs go under --out, one directory each; run the same command again and finished runs are read,
not repeated (and the timing is read from --out too unless --retime). Extra --section.key=value
arguments go to every run and to the timing (e.g. --optim.muon.scale=original).
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

from analysis.optimizer_bench import OPTIMIZERS, Run, best_lr, over_seeds, step_ratio, time_steps
from analysis.training_runs import (
    add_run_arguments,
    band,
    check_run_arguments,
    final_summary,
    print_progress,
    run_all,
    saved_timing,
)
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import hardware_name, machine_load, summarize
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from training.config import load_config


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3],
                        help="peak learning rates tried for each optimizer (min_lr is a tenth)")
    add_run_arguments(parser, out="runs/bench_muon", rounds=15, eval_interval=100)
    args, extra = parser.parse_known_args(argv)
    check_run_arguments(args)
    if any(lr <= 0 for lr in args.lrs):
        raise ConfigError(f"--lrs must be > 0 (got {args.lrs})")
    bad = [e for e in extra if not e.startswith("--") or "=" not in e]
    if bad:
        raise ConfigError(f"unrecognized argument {bad[0]!r}; config overrides look like --section.key=value")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, extra = parse_args(argv)
        cfg = load_config(args.config, extra)  # a bad override is one line before anything runs
        return run(args, extra, cfg, "python -m tools.bench_muon " + shlex.join(argv))
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, extra: list[str], cfg, command: str) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the timing's, and what the report's hardware line says
    try:
        return measure(args, extra, cfg, command)
    finally:
        torch.set_num_threads(threads)


def measure(args: argparse.Namespace, extra: list[str], cfg, command: str) -> int:
    timing = saved_timing(args, lambda: time_steps(cfg, args.rounds))
    ratio = step_ratio(timing)
    steps = cfg.train.max_steps
    kwargs = dict(config=args.config, extra=extra, out_dir=args.out, threads=args.threads,
                  log_interval=args.log_interval, eval_interval=args.eval_interval)

    first, rest = args.seeds[0], args.seeds[1:]
    curves = run_all([Run(o, lr, first, steps) for o in OPTIMIZERS for lr in args.lrs], args.workers, print_progress,
                     **kwargs)
    tuned = {o: best_lr(curves, o, steps, first) for o in OPTIMIZERS}
    long_steps = round(steps * ratio["median"])  # AdamW's steps in Muon's time
    more = [Run(o, tuned[o], s, steps) for o in OPTIMIZERS for s in rest]
    more += [Run("adamw", tuned["adamw"], s, long_steps) for s in args.seeds] if long_steps != steps else []
    curves |= run_all(more, args.workers, print_progress, **kwargs)
    report = build_report(args, cfg, timing, ratio, curves, tuned, steps, long_steps, command)
    print(report["text"])
    if args.markdown:
        write_results(args.markdown, report["markdown"], report["title"], report["rows"], timing=timing,
                      ratio=ratio, tuned_lr=tuned, command=command)
    if args.plot:
        plot(curves, tuned, steps, long_steps, ratio["median"], args.plot)
    return 0


def build_report(args, cfg, timing, ratio, curves, tuned, steps, long_steps, command) -> dict:
    rows = []
    for o in OPTIMIZERS:
        for lr in args.lrs:
            grid = over_seeds(curves, o, lr, steps)
            rows.append({"optimizer": o, "lr": lr, "steps": steps, "comparison": "equal steps",
                         "tuned": lr == tuned[o], "final_val_loss": final_summary(grid)})
    if long_steps != steps:
        rows.append({"optimizer": "adamw", "lr": tuned["adamw"], "steps": long_steps, "comparison": "equal wall time",
                     "tuned": True, "final_val_loss": final_summary(over_seeds(curves, "adamw", tuned["adamw"],
                                                                                long_steps))})

    def cell(s: dict) -> str:
        return f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f}) n={s['n']}"

    head = ["optimizer", "peak lr", "steps", "comparison", "final val loss median (min-max) over seeds"]
    body = [[r["optimizer"] + (" (tuned)" if r["tuned"] else ""), f"{r['lr']:g}", str(r["steps"]), r["comparison"],
             cell(r["final_val_loss"])] for r in rows]
    opt_s = {o: summarize(timing["optimizer_step_s"][o]) for o in OPTIMIZERS}
    step_s = {o: summarize(timing["train_step_s"][o]) for o in OPTIMIZERS}
    opt_ratio = step_ratio(timing, "optimizer_step_s")
    time_head = ["optimizer", "optimizer step (ms)", "training step (ms)", "optimizer state"]
    time_body = [[o, f"{opt_s[o].median * 1e3:.2f} ({opt_s[o].min * 1e3:.2f}-{opt_s[o].max * 1e3:.2f})",
                  f"{step_s[o].median * 1e3:.1f} ({step_s[o].min * 1e3:.1f}-{step_s[o].max * 1e3:.1f})",
                  f"{timing['state_bytes'][o] / 2**20:.2f} MiB "
                  f"({timing['state_bytes'][o] / timing['parameter_bytes']:.2f}x the parameters)"] for o in OPTIMIZERS]
    title = (f"Muon vs AdamW: {args.config} on {hardware_name(torch.device('cpu'))} per run and for the timing, "
             f"torch {torch.__version__}")
    muon, adamw = rows_for(rows, "muon", tuned, steps), rows_for(rows, "adamw", tuned, steps)
    lines = [
        f"command: `{command}`",
        f"learning-rate grid {args.lrs} per optimizer at seed {args.seeds[0]} (min_lr a tenth of the peak, the config's "
        f"warm-up and cosine schedule); the tuned one (lowest final validation loss) then runs with seeds {args.seeds}",
        f"equal wall time: AdamW runs round({steps} x {ratio['median']:.3f}) = {long_steps} steps, the whole-step "
        f"time ratio Muon/AdamW measured side by side ({ratio['min']:.3f}-{ratio['max']:.3f} over {ratio['n']} "
        f"interleaved rounds; {timing['load']} during the timing), at its tuned learning rate",
        f"optimizer step: Muon/AdamW {opt_ratio['median']:.2f}x ({opt_ratio['min']:.2f}-{opt_ratio['max']:.2f}) "
        f"per round; {machine_load()} when the report was written",
        f"at equal steps Muon's median final validation loss is {muon['median']:.4f} against AdamW's "
        f"{adamw['median']:.4f}: {'Muon' if muon['median'] < adamw['median'] else 'AdamW'} is lower by "
        f"{abs(muon['median'] - adamw['median']):.4f}",
    ]
    markdown = (f"# {title}\n\n" + "".join(f"- {line}\n" for line in lines) + "\n" + markdown_table(head, body)
                + "\n\n" + markdown_table(time_head, time_body) + "\n")
    if args.plot:
        markdown += f"\n![loss curves]({args.plot.name})\n"
    text = title + "\n\n" + text_table(head, body) + "\n\n" + text_table(time_head, time_body) + "\n\n" + "\n".join(lines)
    return {"title": title, "rows": rows, "markdown": markdown, "text": text}


def rows_for(rows: list[dict], optimizer: str, tuned: dict, steps: int) -> dict:
    return next(r["final_val_loss"] for r in rows
                if r["optimizer"] == optimizer and r["lr"] == tuned[optimizer] and r["steps"] == steps)


def plot(curves, tuned, steps, long_steps, ratio, path: Path) -> None:
    """Validation loss (lines, min-max bands over seeds) and training loss (faint) of the tuned runs,
    against steps (equal steps) and against time in AdamW training steps (equal wall time)."""
    fig, (by_step, by_time) = new_figure(ncols=2, width=6.5)
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    series = [(o, tuned[o], steps, 1.0 if o == "adamw" else ratio) for o in OPTIMIZERS]
    shown = []  # validation medians after the first evaluation: the range worth the figure's height
    if long_steps != steps:
        series.append(("adamw", tuned["adamw"], long_steps, 1.0))
    for optimizer, lr, n, time_per_step in series:
        runs = over_seeds(curves, optimizer, lr, n)
        label = f"{optimizer} lr {lr:g}, {n} steps"
        style = "--" if n != steps else "-"
        for ax, scale in ((by_step, 1.0), (by_time, time_per_step)):
            if ax is by_step and n != steps:
                continue
            x, med, lo, hi = band(runs, "val")
            shown += med[1:] + lo[1:]
            ax.plot([s * scale for s in x], med, style, color=colors[optimizer], label=label, marker="o", ms=3)
            ax.fill_between([s * scale for s in x], lo, hi, color=colors[optimizer], alpha=0.15)
            x, med, _, _ = band(runs, "train")
            ax.plot([s * scale for s in x], med, style, color=colors[optimizer], alpha=0.3, lw=0.8)
    by_step.set(xlabel="step", ylabel="loss (val: markers; train: faint)", title="equal steps")
    by_time.set(xlabel="time, in AdamW training steps (ratio measured side by side)", title="equal wall time")
    for ax in (by_step, by_time):
        if shown:
            spread = max(shown) - min(shown)
            ax.set_ylim(min(shown) - 0.1 * spread, max(shown) + 0.3 * spread)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
