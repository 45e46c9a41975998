"""Published training measurements against the estimator: for every row of analysis/published/*.yaml
(Megatron-LM, Korthikanti et al., Llama 3, MosaicML, NeMo, torchtitan), the published figure, the
estimator's prediction for that exact model, layout and system, and the error; then the median and
worst absolute error per source and quantity, calibration and held-out rows apart.

Writes docs/results/published_vs_estimator.md, its rows as JSON next to it, and a PNG (predicted
against published). ``--fit`` refits the estimator's free parameters on the calibration rows and
prints them (they live as the defaults of analysis/estimator/job.py ``Assumptions``; paste them there to
adopt them), without writing anything.

Examples:
  python -m tools.published                     # print the summary, write docs/results/
  python -m tools.published --out /tmp/pub      # write elsewhere
  python -m tools.published --rows              # also print every row
  python -m tools.published --fit               # refit the free parameters (about a minute)
  python -m tools.published --leave-one-source-out   # validation by source (a fit per source, minutes)
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from analysis import estimator as est
from analysis import published as pub
from common.errors import ConfigError
from common.report import text_table, write_results

COMMAND = "python -m tools.published"
NAME = "published_vs_estimator"
LOSO_NAME = "published_leave_one_source_out"
LOSO_COMMAND = "python -m tools.published --leave-one-source-out"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output directory (default docs/results)")
    parser.add_argument("--rows", action="store_true", help="also print every row's comparison")
    parser.add_argument("--fit", action="store_true",
                        help="refit the free parameters on the calibration rows and print them (writes nothing)")
    parser.add_argument("--no-plot", action="store_true", help="write the Markdown and JSON only")
    parser.add_argument("--leave-one-source-out", action="store_true",
                        help="fit on every source but one, predict that one, for each source in turn; writes "
                        f"{LOSO_NAME}.md and .json")
    return parser.parse_args(argv)


def row_table(comparisons: list[pub.Comparison]) -> str:
    headers = ["row", "role", "published", "predicted", "error"]
    rows = [[c.row.key, c.row.role, f"{c.published:g} {c.key}",
             "-" if c.predicted is None else f"{c.predicted:.4g}",
             c.why_not if c.error is None else f"{c.error:+.1%}"] for c in comparisons]
    return text_table(headers, rows)


def json_rows(comparisons: list[pub.Comparison]) -> list[dict]:
    return [{"source": c.row.source.name, "row": c.row.id, "table": c.row.table, "role": c.row.role,
             "quantity": c.quantity, "unit": c.key, "published": c.published, "predicted": c.predicted,
             "error": c.error, "layout": pub.layout_text(c.row), "not_predicted": c.why_not or None}
            for c in comparisons]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        rows = pub.load_rows()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = pub.parameter_count_problems(rows)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.fit:
        fitted = pub.fit(rows)
        before, after = pub.calibration_loss(rows, est.Assumptions()), pub.calibration_loss(rows, fitted)
        print(f"calibration loss (mean |log(predicted/published)|): {before:.4f} with the defaults, {after:.4f} fitted")
        for name in est.FITTED_PARAMETERS:
            print(f"  {name} = {getattr(fitted, name):.4g}  (default {getattr(est.Assumptions(), name):g})")
        return 0
    if args.leave_one_source_out:
        return leave_one_source_out(rows, args.out, start)
    assumptions = est.Assumptions()
    comparisons = pub.compare(rows, assumptions)
    summaries = pub.summarize(comparisons)
    if args.rows:
        print(row_table(comparisons) + "\n")
    print("\n".join(pub.summary_lines(summaries)))
    missing = pub.unexplained(comparisons)
    for c in missing:
        print(f"warning: {c.row.key} is {c.error:+.0%} off and its row gives no reason", file=sys.stderr)
    markdown = pub.render_markdown(comparisons, assumptions, COMMAND)
    written = write_results(args.out / f"{NAME}.md", markdown, "Published measurements against the estimator",
                            json_rows(comparisons), parameters=dataclasses.asdict(assumptions))
    if not args.no_plot:
        png = args.out / f"{NAME}.png"
        pub.plot(comparisons, png)
        written.append(png)
    print(f"\n{len(rows)} rows, {len(comparisons)} figures in {time.perf_counter() - start:.1f} s; wrote "
          + ", ".join(str(p) for p in written))
    return 0


def leave_one_source_out(rows: list[pub.PublishedRow], out: Path, start: float) -> int:
    folds = pub.leave_one_source_out(rows)
    alternate = pub.summarize(pub.compare(rows))
    markdown = pub.render_leave_one_out(folds, alternate, LOSO_COMMAND)
    print("\n".join(line for line in markdown.splitlines() if line.startswith(("|", "- **"))))
    comparisons = [c for f in folds for c in f.comparisons]
    written = write_results(out / f"{LOSO_NAME}.md", markdown, "Published measurements, validated by source",
                            json_rows(comparisons), folds=pub.fold_parameters(folds))
    print(f"\n{len(folds)} folds in {time.perf_counter() - start:.0f} s; wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
