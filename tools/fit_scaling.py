"""Fit the Chinchilla loss law L(N, D) = E + A/N^alpha + B/D^beta to a sweep's table, with bootstrap
confidence intervals, the compute-optimal N and D for a budget C = 6ND, and a figure.

    python -m tools.fit_scaling runs/sweeps/tiny-chinchilla/sweep.json
    python -m tools.fit_scaling docs/results/scaling_sweep.json --budgets 1e13,1e14 \
        --markdown docs/results/scaling_fit.md --plot docs/results/scaling_fit.png

A thin command line over ``analysis/scaling_law.py`` (its docstring gives the fit, after Hoffmann
et al. 2022, approach 3). The table is what ``python -m tools.sweep`` wrote (.json or .csv):
N is its ``params`` column (matmul parameters), D its ``tokens``, L its ``val_loss``. Prints the
law, the compute-optimal split at each budget (default: the smallest, middle and largest measured
compute and 10x the largest) and each point's miss against the fit.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

from analysis.scaling_law import default_budgets, fit_law, plot_fit, report_lines
from analysis.sweep import read_points
from common.errors import USER_FACING_ERRORS, ConfigError
from common.report import relative_link, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("table", type=Path, help="a tools.sweep table: its .json (or .csv)")
    parser.add_argument("--budgets", help="compute budgets in FLOPs, comma-separated (e.g. 1e13,1e14)")
    parser.add_argument("--bootstrap", type=int, default=400, help="bootstrap refits for the intervals")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    parser.add_argument("--markdown", type=Path, help="write the report here (the fit as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.bootstrap < 0 or not 0 < args.level < 1:
            raise ConfigError("--bootstrap must be >= 0 and --level between 0 and 1 (e.g. 0.95)")
        budgets = parse_budgets(args.budgets)
        points = read_points(args.table)
        names = [p["point"] for p in points]
        n, d, loss = ([p[k] for p in points] for k in ("params", "tokens", "val_loss"))
        fit = fit_law(n, d, loss, bootstrap=args.bootstrap, level=args.level, seed=args.seed)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    budgets = budgets or default_budgets([6.0 * ni * di for ni, di in zip(n, d)])
    command = "python -m tools.fit_scaling " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = report_lines(fit, names, n, d, loss, budgets)
    print("\n".join(lines))
    if args.markdown:
        title = f"Chinchilla fit of {args.table.name}"
        text = "\n".join([f"# {title}", "", f"`{command}`", "", *lines, ""])
        if args.plot:
            text += f"\n![loss against compute with the fitted frontier]({relative_link(args.plot, args.markdown)})\n"
        rows = [{"point": name, "params": ni, "tokens": di, "val_loss": li, "fit": fit.law.loss(ni, di)}
                for name, ni, di, li in zip(names, n, d, loss)]
        for path in write_results(args.markdown, text, title, rows, law=fit.law.as_dict(), command=command,
                                  intervals={k: [fit.interval(k).low, fit.interval(k).high] for k in fit.law.as_dict()},
                                  bootstrap=len(fit.bootstrap), level=fit.level):
            print(f"wrote {path}")
    if args.plot:
        plot_fit(fit, n, d, loss, args.plot)
        print(f"wrote {args.plot}")
    return 0


def parse_budgets(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        budgets = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: give FLOP counts separated by commas, e.g. 1e13,1e14") from None
    if not budgets or any(not b > 0 for b in budgets):
        raise ConfigError(f"--budgets {text!r}: every budget must be a number of FLOPs > 0")
    return budgets



if __name__ == "__main__":
    sys.exit(main())
