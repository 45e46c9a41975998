"""Run a grid of small training runs (a sweep file) and write one table of their results.

    python -m tools.sweep configs/sweeps/tiny-chinchilla.yaml --dry-run        # the points, N, D, FLOPs
    python -m tools.sweep configs/sweeps/tiny-chinchilla.yaml --out runs/sweeps/tiny-chinchilla
    python -m tools.sweep configs/sweeps/tiny-chinchilla.yaml --workers 2 --threads 1 \
        --table docs/results/scaling_sweep.md

A thin command line over ``analysis/sweep.py`` (its docstring says what a sweep file holds and
how a point runs). Every point is a ``train.py`` run in ``<out>/runs/<point>/``; starting the same
command again skips the points that finished (delete a point's folder to run it again). The table
(``<out>/sweep.md`` unless --table says where) has its rows as JSON and CSV next to it, for
``python -m tools.fit_scaling``. Exit code 0 when every point finished, 1 when some failed (the
table then holds the others), 2 for bad input.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import os
import sys
from pathlib import Path

import torch

from analysis.sweep import describe, load_sweep, resolve, run_sweep, write_table
from common.errors import USER_FACING_ERRORS, ConfigError
from common.measure import machine_load, provenance
from common.report import text_table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("spec", help="sweep file (e.g. configs/sweeps/tiny-chinchilla.yaml)")
    parser.add_argument("--out", type=Path, help="sweep folder (default: runs/sweeps/<spec name>)")
    parser.add_argument("--workers", type=int, default=1, help="points run at once")
    parser.add_argument("--threads", type=int, help="CPU threads per point (default: cores / workers)")
    parser.add_argument("--table", type=Path, help="Markdown table to write (default: <out>/sweep.md); "
                        ".json and .csv next to it")
    parser.add_argument("--dry-run", action="store_true", help="list the points and stop")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.workers < 1 or (args.threads is not None and args.threads < 1):
            raise ConfigError("--workers and --threads must be >= 1")
        sweep = load_sweep(args.spec)
        out = args.out or Path("runs/sweeps") / Path(args.spec).stem
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
        if args.dry_run:
            print(dry_run(sweep, out))
            return 0
        load_at_start = machine_load()
        print(f"sweep: {len(sweep.points)} points from {args.spec} into {out}, {args.workers} at a time with "
              f"{threads} thread(s) each; {load_at_start}")
        outcomes = run_sweep(sweep, out, workers=args.workers, threads=threads)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [o.row for o in outcomes if o.row is not None]
    failed = [o for o in outcomes if o.row is None]
    table = args.table or out / "sweep.md"
    command = "python -m tools.sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    where = provenance(torch.device("cpu"))
    setup = [f"`{command}`", f"sweep file {args.spec}; every point a train.py run of its own, {args.workers} at a "
             f"time, {threads} CPU thread(s) each", f"{os.cpu_count()} cores, torch {where['torch']}, {where['date']}; "
             f"at the start: {load_at_start}; at the end: {machine_load()}",
             "N: matmul parameters (model/flops.py, the N of 6ND); D: tokens trained on; FLOPs: the project's "
             "convention (model/flops.py); val loss: at the last step; CPU s: user + system time of the run"]
    if failed:
        setup.append(f"{len(failed)} point(s) failed and are not in the table: " + ", ".join(o.point for o in failed))
    for path in write_table(rows, table, f"Sweep {Path(args.spec).stem}: {len(rows)} runs", setup,
                            spec=args.spec):
        print(f"wrote {path}")
    for outcome in failed:
        print(f"failed: {outcome.point}: {outcome.error}", file=sys.stderr)
    return 1 if failed else 0


def dry_run(sweep, out: Path) -> str:
    rows = []
    for point in sweep.points:
        d = describe(resolve(sweep, point, out)[0])
        rows.append([point.name, f"{d['params']:,}", f"{d['tokens']:,}", f"{d['flops']:.3g}"])
    return text_table(["point", "N (params)", "D (tokens)", "FLOPs"], rows)


if __name__ == "__main__":
    sys.exit(main())
