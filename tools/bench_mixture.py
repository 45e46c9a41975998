"""Loader throughput of a three-source mixture (local mmap + local WebDataset + WebDataset over HTTP)
against what models consume, the data wait of real training steps, and the realised mixture.

Each source holds a third of --mb MB of Python standard-library source (byte tokens); the HTTP one
is served by `python -m http.server` in its own process on this machine. Timings are median
(min-max) over --rounds rounds taken in turn. The measuring lives in analysis/mixture_bench.py.

    python -m tools.bench_mixture                                  # a few minutes on 2 cores
    python -m tools.bench_mixture --markdown docs/results/mixture_cpu.md --plot docs/results/mixture_cpu.png
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

from analysis.data_bench import CPU, consumer_from_config
from analysis.mixture_bench import MixtureOptions, run_benchmark, tables, write_markdown, write_plot
from common.errors import USER_FACING_ERRORS
from common.measure import provenance
from common.report import text_table
from training.config import load_config


def worker_counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected worker counts >= 0, got {text!r}")
    return values


def float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if len(values) != 3 or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected three positive weights, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    d = MixtureOptions()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=d.mb, help=f"corpus size in MB, a third per source (default {d.mb:g})")
    p.add_argument("--weights", type=float_list, default=d.weights,
                   help="weights of local-mmap, local-wds, http-wds (default 0.5,0.3,0.2)")
    p.add_argument("--workers", type=worker_counts, default=d.workers, help="DataLoader workers, comma-separated (default 0,1)")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"rounds per setting (default {d.rounds})")
    p.add_argument("--batches", type=int, default=d.batches, help=f"timed batches per round (default {d.batches})")
    p.add_argument("--wait-steps", type=int, default=d.wait_steps,
                   help=f"training steps per round for the data wait (default {d.wait_steps})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"steps read for the realised mixture (default {d.steps})")
    p.add_argument("--models", default="configs/tiny.yaml,configs/gpt2-124m.yaml",
                   help="configs whose consumption is compared; the first one also trains for the data wait")
    p.add_argument("--workdir", help="where the prepared sources go (default: a temporary directory)")
    p.add_argument("--markdown", help="also write the tables as Markdown (and the rows as JSON next to it)")
    p.add_argument("--plot", help="also write a PNG chart")
    args = p.parse_args(argv)
    for key in ("rounds", "batches", "wait_steps", "steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = MixtureOptions(mb=args.mb, weights=args.weights, workers=args.workers, rounds=args.rounds,
                          batches=args.batches, wait_steps=args.wait_steps, steps=args.steps)
    try:
        models = [consumer_from_config(path, load_config(path)) for path in args.models.split(",") if path.strip()]
        result = run_benchmark(opts, models, args.workdir, log=lambda line: print(line, flush=True))
    except USER_FACING_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for heading, head, rows in tables(result):
        print(f"\n{heading}")
        print(text_table(head, rows))
    if args.markdown:
        command = "python -m tools.bench_mixture " + " ".join(sys.argv[1:] if argv is None else argv)
        write_markdown(result, provenance(CPU), Path(args.markdown), command)
    if args.plot:
        write_plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
