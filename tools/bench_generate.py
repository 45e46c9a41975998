"""Greedy generation speed: perfgpt's generate against transformers' generate, same model and weights.

A thin command line over ``analysis/generate_bench.py`` (its docstring says what is compared and
how): a batch of prompts (of unequal lengths by default, as lm-eval's requests come), greedy
decoding with each side's KV cache, interleaved rounds, time per batch and the time ratio as
median (min-max).

    python -m tools.bench_generate                              # configs/tiny.yaml's model, CPU
    python -m tools.bench_generate --prompt-lens 32 --new-tokens 256 --rounds 7   # one prompt
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

from analysis.generate_bench import run_generate_benchmark
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import machine_load
from common.report import print_and_publish
from training.config import load_config

HEADERS = ["generate", "ms per batch median (min-max)", "new tokens/s", "time vs transformers"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="job config whose model is built (random init)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 48, 96, 160],
                        help="one prompt of each length, as one batch")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here (rows as JSON next to it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        for flag in ("new_tokens", "rounds", "threads"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
        if min(args.prompt_lens) < 1:
            raise ConfigError("--prompt-lens must be >= 1 each")
        torch.set_num_threads(args.threads)
        cfg = load_config(args.config, []).model
        cfg = dataclasses.replace(cfg, dropout=0.0, max_seq_len=max(cfg.max_seq_len, max(args.prompt_lens) + args.new_tokens))
        result = run_generate_benchmark(cfg, prompt_lens=args.prompt_lens, new_tokens=args.new_tokens,
                                        rounds=args.rounds)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [[name, f"{s.median * 1e3:.0f} ({s.min * 1e3:.0f}-{s.max * 1e3:.0f})", f"{len(args.prompt_lens) * args.new_tokens / s.median:,.0f}",
             ratio] for name, s, ratio in (("perfgpt", result.perfgpt, result.perfgpt_vs_transformers.text()),
                                           ("transformers", result.transformers, "1.00x"))]
    settings = (f"{args.config}'s model ({cfg.n_layer} layers, d_model {cfg.d_model}), prompts of "
                f"{', '.join(map(str, args.prompt_lens))} tokens as one batch, {args.new_tokens} new tokens each, greedy, fp32, CPU {args.threads} thread(s), {args.rounds} "
                f"interleaved rounds, torch {torch.__version__} ({machine_load()})")
    command = "python -m tools.bench_generate " + " ".join(argv if argv is not None else sys.argv[1:])
    print_and_publish("Generation speed against transformers", command, settings, HEADERS, rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
