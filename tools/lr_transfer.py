"""Does the best learning rate of one model stay the best of another? Read off a sweep over the LR.

    python -m tools.sweep configs/sweeps/mup-transfer.yaml --workers 2 --threads 1
    python -m tools.lr_transfer runs/sweeps/mup-transfer/sweep.json --plot runs/sweeps/mup-transfer/lr.png

A thin command line over ``analysis/lr_transfer.py`` (its docstring says how curves and the best LR
are found). The table is what ``python -m tools.sweep`` wrote (its .json, which keeps each point's
keys). Prints, per LR, each curve's mean final validation loss over the seeds, the best LR of each
curve and how many grid steps it moved from the first curve's.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

from analysis.lr_transfer import lr_curves, plot_transfer, report_lines
from common.errors import USER_FACING_ERRORS
from common.report import read_results, relative_link, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("table", type=Path, help="a tools.sweep table's .json")
    parser.add_argument("--lr-key", default="optim.lr", help="the swept learning-rate key")
    parser.add_argument("--seed-key", default="train.seed", help="the key whose values are repeats, averaged")
    parser.add_argument("--markdown", type=Path, help="write the report here (its rows as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows = read_results(args.table)["rows"]
        transfer = lr_curves(rows, args.lr_key, args.seed_key)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = "python -m tools.lr_transfer " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = report_lines(transfer)
    print("\n".join(lines))
    if args.markdown:
        title = f"Learning-rate transfer in {args.table.name}"
        text = "\n".join([f"# {title}", "", f"`{command}`", "",
                          f"Final validation loss, mean over {transfer.seeds} seed(s) (their range in brackets); "
                          "the best LR of each curve in bold.", "", *lines, ""])
        if args.plot:
            text += f"\n![final loss against the learning rate]({relative_link(args.plot, args.markdown)})\n"
        out_rows = [{"curve": c.label, "lr": lr, "losses": c.losses[lr], "mean": c.mean(lr)}
                    for c in transfer.curves for lr in transfer.grid]
        best = {c.label: transfer.best(c) for c in transfer.curves}
        for path in write_results(args.markdown, text, title, out_rows, command=command, best_lr=best):
            print(f"wrote {path}")
    if args.plot:
        plot_transfer(transfer, args.plot)
        print(f"wrote {args.plot}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
