"""Loss curves of one run or several, overlaid: training and validation loss, learning rate and
tokens/s by step, from each run directory's metrics.jsonl (analysis/run_curves.py), as one PNG.

    python -m tools.plot runs/tiny                              # -> runs/tiny/curves.png
    python -m tools.plot runs/tiny runs/tiny-moe --out cmp.png  # two runs in one figure

Prints one line per run (steps, last loss, best validation loss, median tokens/s) and the path.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

from analysis.run_curves import plot_runs, read_runs
from common.errors import USER_FACING_ERRORS

DEFAULT_NAME = "curves.png"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or their metrics.jsonl files)")
    parser.add_argument("--out", type=Path, help=f"the PNG to write (default: <run>/{DEFAULT_NAME} for one run, "
                        f"./{DEFAULT_NAME} for several)")
    return parser.parse_args(argv)


def default_out(runs: list[Path]) -> Path:
    if len(runs) == 1:
        run = runs[0]
        return (run if run.is_dir() else run.parent) / DEFAULT_NAME
    return Path(DEFAULT_NAME)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or default_out(args.runs)
    if out.suffix.lower() != ".png" or out.is_dir() or not out.parent.is_dir():
        print(f"error: --out {out} must be a .png file in an existing directory", file=sys.stderr)
        return 2
    try:
        runs = read_runs(args.runs)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plot_runs(runs, out)
    print("\n".join(run.summary() for run in runs))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
