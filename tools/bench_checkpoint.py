"""How long a checkpoint save blocks training, synchronous vs in the background (checkpoint.async_save).

    python -m tools.bench_checkpoint                                  # tiny and ~100M, 1 process and 2 ranks
    python -m tools.bench_checkpoint --models tiny --ranks 1 --rounds 3
    python -m tools.bench_checkpoint --markdown docs/results/bench_checkpoint_cpu.md

Per row: seconds the loop is blocked per save (synchronous: the whole save; background: staging
into host memory + publication), their ratio per interleaved round (median, min-max), the time
the background write took, step time during that write against steps with none, and what the
content checksums cost inside a save. A thin command line over ``analysis/checkpoint_bench.py``
(its docstring says how each figure is taken); every row launches this module again in its hidden
``--worker`` mode (under torchrun for 2 ranks, FSDP2 on gloo). Extra ``--key=value`` overrides
after ``--`` apply to every row.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from analysis.checkpoint_bench import MODELS, launch, run_rank, table, write_markdown


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m", help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts (2+: FSDP2 on gloo)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row")
    parser.add_argument("--max-steps-during", type=int, default=8,
                        help="training steps run beside a background write before the loop waits for it")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    parser.add_argument("--markdown", type=Path, help="write the table here (+ .json rows and a .png plot)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", default="configs/tiny.yaml", help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        parser.error(f"--models {bad[0]!r} is not one of: {', '.join(MODELS)}")
    try:
        args.ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: give comma-separated integers, e.g. 1,2")
    if not args.ranks or min(args.ranks) < 1 or args.rounds < 1 or args.max_steps_during < 1:
        parser.error("--ranks, --rounds and --max-steps-during must be >= 1")
    return args, extra


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    if args.worker is not None:
        run_rank(args.config, extra, args.rounds, args.max_steps_during, args.worker)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint-") as work:
        for model in args.models:
            for ranks in args.ranks:
                print(f"measuring {model} on {ranks} rank(s) ...", flush=True)
                rows.append(launch("tools.bench_checkpoint", model, ranks, args.rounds, args.max_steps_during,
                                   Path(work), args.timeout, extra))
    print(table(rows, markdown=False))
    if args.markdown:
        for path in write_markdown(rows, f"python -m tools.bench_checkpoint {shlex.join(argv)}", args.rounds,
                                   args.markdown):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
