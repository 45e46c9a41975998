"""The LM loss with and without the whole logits (kernels.loss_chunk_tokens): peak memory and time.

A thin command line over ``analysis/loss_bench.py`` (its docstring says what is measured and how):
the head and cross-entropy, forward and backward, on (tokens x d_model) hidden states, plain and in
chunks, interleaved rounds, ratios to the plain loss as median (min-max).

    python -m tools.bench_loss                                  # 4096 tokens, a 32k vocabulary, CPU
    python -m tools.bench_loss --vocab 128256 --tokens 8192 --chunks 1024 4096 --device cuda
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

import torch

from analysis.loss_bench import TABLE_HEADERS, run_loss_benchmark, table_rows
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import hardware_name, machine_load, resolve_device
from common.report import print_and_publish


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (micro-batch x sequence)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024], help="kernels.loss_chunk_tokens values")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here (rows as JSON next to it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        for flag in ("tokens", "d_model", "vocab", "rounds"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
        if any(c < 1 for c in args.chunks):
            raise ConfigError("--chunks must be >= 1 each")
        device = resolve_device(args.device)
        variants = run_loss_benchmark(tokens=args.tokens, d_model=args.d_model, vocab=args.vocab, chunks=args.chunks,
                                      rounds=args.rounds, device=device)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    whole = args.tokens * args.vocab * 4 / 2**20
    settings = (f"{args.tokens} tokens x d_model {args.d_model} -> vocabulary {args.vocab} (fp32 logits "
                f"{whole:.0f} MiB), forward + backward, {args.rounds} interleaved rounds on {hardware_name(device)}, "
                f"torch {torch.__version__} ({machine_load()})")
    command = "python -m tools.bench_loss " + " ".join(argv if argv is not None else sys.argv[1:])
    print_and_publish("The LM loss with and without the whole logits", command, settings, TABLE_HEADERS,
                      table_rows(variants), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
