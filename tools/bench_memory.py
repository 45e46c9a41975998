"""Measured activation memory and recompute overhead of each activation recompute policy, side by side.

A thin command line over ``analysis/recompute_bench.py`` (its docstring says what is measured and
how): bytes saved for backward per block, the estimator's two estimates next to them, the
allocator's view on CUDA, and step time relative to ``none`` from interleaved rounds.

    python -m tools.bench_memory                       # default: small GPT, CPU fp32
    python -m tools.bench_memory --attention reference --markdown docs/results/recompute.md \
        --plot docs/results/recompute.png
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from analysis.recompute_bench import (
    DTYPES,
    format_table,
    measure_saved_bytes,
    run_benchmark,
    settings_line,
    write_markdown,
    write_plot,
)
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import resolve_device
from model.config import RECOMPUTE_POLICIES, ModelConfig
from training.config import load_config

# measure_saved_bytes is the library's; tests and callers that know the tool reach it through here.
__all__ = ["main", "measure_saved_bytes"]


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure bytes saved for backward and step-time overhead of each activation "
        "recompute policy on one GPT, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", help="YAML job config; its model section is used (flags below override)")
    parser.add_argument("--d-model", type=int, help="residual width (default 256, or the config's)")
    parser.add_argument("--n-head", type=int, help="attention heads (default 4, or the config's)")
    parser.add_argument("--n-layer", type=int, help="blocks (default 4, or the config's)")
    parser.add_argument("--dropout", type=float, help="dropout (default 0, or the config's)")
    parser.add_argument("--every-k", type=int, help="k for every_k (default 2, or the config's)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=list(RECOMPUTE_POLICIES), choices=RECOMPUTE_POLICIES)
    parser.add_argument(
        "--attention", nargs="+", default=["reference", "sdpa"], choices=["reference", "sdpa", "flash_attn"],
        help="backends to measure; reference stores the (B,H,T,T) scores, sdpa does not",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (median is reported)")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is steadier on a shared machine)"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here "
                        "(and its rows as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    return parser.parse_args(argv)


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    if args.config:
        cfg = load_config(args.config).model
    else:
        cfg = ModelConfig(d_model=256, n_head=4, n_layer=4)
    overrides = {
        "d_model": args.d_model, "n_head": args.n_head, "n_layer": args.n_layer,
        "dropout": args.dropout, "recompute_every_k": args.every_k,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "d_model" in overrides and not args.config:
        overrides["d_ff"] = None  # re-derive from the new width
    cfg = replace(cfg, **overrides, max_seq_len=max(cfg.max_seq_len, args.seq_len))
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_cfg = model_config_from_args(args)
        device = resolve_device(args.device)
        dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        if args.steps < 1:
            raise ConfigError("--steps must be >= 1")
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError("--threads must be >= 1")
            torch.set_num_threads(args.threads)
        rows = run_benchmark(
            model_cfg, args.policies, args.attention, args.seq_len, args.micro_batch, DTYPES[dtype_name], device, args.steps
        )
    except USER_FACING_ERRORS as exc:  # bad flags, a config that cannot work, no CUDA for --device cuda
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = settings_line(model_cfg, args.seq_len, args.micro_batch, DTYPES[dtype_name], device, args.steps)
    print(settings)
    print(format_table(rows))
    if args.markdown:
        written = write_markdown(rows, settings, args.markdown)
        print("wrote " + ", ".join(str(p) for p in written))
    if args.plot:
        write_plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
