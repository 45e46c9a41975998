"""Mixture-of-experts throughput: a MoE GPT (grouped GEMM, and the per-expert loop) against the
dense GPT with the same active parameters, interleaved rounds, ratios as median (min-max).

A thin command line over ``analysis/moe_bench.py`` (its docstring says what is compared and how).

    python -m tools.bench_moe                                   # configs/tiny-moe.yaml on CPU
    python -m tools.bench_moe --rounds 10 --markdown docs/results/moe.md
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from analysis.moe_bench import TABLE_HEADERS, run_moe_benchmark, table_rows
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import hardware_name, machine_load, resolve_device
from common.report import markdown_table, text_table, write_results
from training.config import load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-moe.yaml", help="job config with a MoE model section")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="timed interleaved rounds")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here (rows as JSON next to it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, []).model
        if cfg.moe.experts is None:
            raise ConfigError(f"{args.config} has no MoE model (set model.moe.experts)")
        for flag in ("batch", "seq_len", "rounds"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError("--threads must be >= 1")
            torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, args.seq_len), dropout=0.0)
        variants, grouped = run_moe_benchmark(cfg, batch=args.batch, seq_len=args.seq_len, rounds=args.rounds,
                                              device=device)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = (f"{args.config}: {cfg.moe.experts} experts, top-{cfg.moe.top_k}, width {cfg.expert_d_ff}; batch "
                f"{args.batch} x {args.seq_len}, fp32, {args.rounds} interleaved rounds on {hardware_name(device)} "
                f"({machine_load()})")
    rows = table_rows(variants)
    print(settings)
    print(text_table(TABLE_HEADERS, rows))
    print(f"grouped_mm speed over the per-expert loop: {grouped.text()}")
    if args.markdown:
        text = (f"# MoE throughput\n\n- {settings}\n\n{markdown_table(TABLE_HEADERS, rows)}\n\n"
                f"grouped_mm speed over the per-expert loop: {grouped.text()}\n")
        written = write_results(args.markdown, text, f"MoE throughput: {settings}",
                                [dict(zip(TABLE_HEADERS, r)) for r in rows])
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
