"""Learning-rate transfer read off a sweep's table: does the best LR of one model stay the best of another?

The sweep (``analysis/sweep.py``) runs a grid whose axes include the learning rate and, optionally, a
seed; every other key that varies between its rows (the width, ``model.mup``, ...) tells the curves
apart. Each curve is the final validation loss against the LR, averaged over the seeds (their spread
kept), and its best LR is the grid point with the lowest mean. The first curve (the sweep's first
point: the base model) is the reference; each other curve's best LR is compared with it in steps of
the grid, so "transfers" means "the same grid point is best". A best LR at the edge of the grid is
flagged: the optimum may lie beyond it. A point that diverged (a non-finite loss) or failed (no row)
counts as worse than any finite loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from common.errors import DataError
from common.report import new_figure, save_figure


@dataclass
class Curve:
    label: str  # the keys that set this curve apart, e.g. "d_model=128, mup=True"
    losses: dict[float, list[float]] = field(default_factory=dict)  # LR -> each seed's final loss (inf: diverged)

    def mean(self, lr: float) -> float:
        values = self.losses.get(lr, [])
        return sum(values) / len(values) if values else math.inf

    def spread(self, lr: float) -> tuple[float, float]:
        values = self.losses.get(lr, [])
        return (min(values), max(values)) if values else (math.inf, math.inf)

    def best_lr(self, grid: Sequence[float]) -> float:
        return min(grid, key=self.mean)


@dataclass
class Transfer:
    grid: list[float]  # the LRs of the sweep, ascending
    curves: list[Curve]  # the reference first
    seeds: int  # the most seeds of any (curve, LR)

    def best(self, curve: Curve) -> float:
        return curve.best_lr(self.grid)

    def shift(self, curve: Curve) -> int:
        """Grid steps from the reference's best LR to this curve's: 0 means the optimum transferred."""
        return self.grid.index(self.best(curve)) - self.grid.index(self.best(self.curves[0]))

    def at_edge(self, curve: Curve) -> bool:
        return self.best(curve) in (self.grid[0], self.grid[-1])

    def margin(self, curve: Curve) -> float:
        """How much worse the curve's second-best LR is than its best (mean loss): how sharp the optimum is."""
        means = sorted(curve.mean(lr) for lr in self.grid)
        return means[1] - means[0] if len(means) > 1 else math.inf


def _number(value: Any) -> float:
    """A row's loss as a float; None (how a results file writes NaN) and non-numbers are non-finite."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.inf
    return value if math.isfinite(value) else math.inf


def lr_curves(rows: list[dict[str, Any]], lr_key: str = "optim.lr", seed_key: str = "train.seed") -> Transfer:
    """The curves of a sweep table's rows (each with its ``overrides`` and ``val_loss``)."""
    if not rows:
        raise DataError("the sweep table has no rows: run the sweep first")
    try:
        settings = [dict(row["overrides"]) for row in rows]
    except (KeyError, TypeError, ValueError):
        raise DataError("a row of the sweep table has no 'overrides': is this a tools.sweep table (its .json)?") from None
    if any(lr_key not in s for s in settings):
        raise DataError(f"not every row sets {lr_key}: give the sweep an {lr_key} axis (or name the key with --lr-key)")
    keys = sorted({k for s in settings for k in s} - {lr_key, seed_key})
    varying = [k for k in keys if len({repr(s.get(k)) for s in settings}) > 1]
    grid = sorted({float(s[lr_key]) for s in settings})
    curves: dict[str, Curve] = {}
    for row, s in zip(rows, settings):
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={s[k]}" for k in varying if k in s) or "all"
        curve = curves.setdefault(label, Curve(label))
        curve.losses.setdefault(float(s[lr_key]), []).append(_number(row.get("val_loss")))
    seeds = max(len(v) for c in curves.values() for v in c.losses.values())
    for curve in curves.values():
        for lr in grid:  # a failed point (no row) counts as diverged, for every seed
            curve.losses.setdefault(lr, [math.inf] * seeds)
    return Transfer(grid, list(curves.values()), seeds)


def _loss_cell(curve: Curve, lr: float) -> str:
    mean, (low, high) = curve.mean(lr), curve.spread(lr)
    if not math.isfinite(mean):
        lost = sum(not math.isfinite(v) for v in curve.losses[lr])
        return f"diverged ({lost} of {len(curve.losses[lr])})"
    return f"{mean:.4f}" if low == high else f"{mean:.4f} ({low:.4f}-{high:.4f})"


def report_lines(transfer: Transfer) -> list[str]:
    """The table (mean final validation loss per LR and curve, the seeds' range in brackets, the best
    in bold) and one verdict line per curve against the reference."""
    curves = transfer.curves
    lines = ["| LR | " + " | ".join(c.label for c in curves) + " |", "|---:|" + "---:|" * len(curves)]
    for lr in transfer.grid:
        cells = [_loss_cell(c, lr) for c in curves]
        cells = [f"**{cell}**" if transfer.best(c) == lr else cell for c, cell in zip(curves, cells)]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    lines.append("")
    reference = curves[0]
    lines.append(f"- reference {reference.label}: best LR {transfer.best(reference):g} "
                 f"(next best {transfer.margin(reference):+.4f} worse)" + _edge(transfer, reference))
    for curve in curves[1:]:
        shift = transfer.shift(curve)
        verdict = "the same grid point: the optimum transferred" if shift == 0 else (
            f"{abs(shift)} grid step(s) {'higher' if shift > 0 else 'lower'}: the optimum moved")
        lines.append(f"- {curve.label}: best LR {transfer.best(curve):g}, {verdict} (next best "
                     f"{transfer.margin(curve):+.4f} worse; loss at the reference's best LR "
                     f"{curve.mean(transfer.best(reference)) - curve.mean(transfer.best(curve)):+.4f} above its own best)"
                     + _edge(transfer, curve))
    return lines


def _edge(transfer: Transfer, curve: Curve) -> str:
    return "; at the edge of the grid, so the optimum may lie beyond it" if transfer.at_edge(curve) else ""


def plot_transfer(transfer: Transfer, path: Path, title: str = "") -> None:
    """Final validation loss against the LR (log scale), one line per curve, the seeds' range as error
    bars, each curve's best LR ringed; diverged points drawn at the top edge as crosses."""
    fig, ax = new_figure(width=6.5, height=4.5)
    finite = [v for c in transfer.curves for vs in c.losses.values() for v in vs if math.isfinite(v)]
    top = max(finite) if finite else 1.0
    bottom = min(finite) if finite else 0.0
    ceiling = top + 0.08 * (top - bottom + 1e-9)
    for i, curve in enumerate(transfer.curves):
        color = f"C{i % 10}"
        lrs = [lr for lr in transfer.grid if math.isfinite(curve.mean(lr))]
        means = [curve.mean(lr) for lr in lrs]
        errors = [[m - curve.spread(lr)[0] for lr, m in zip(lrs, means)],
                  [curve.spread(lr)[1] - m if math.isfinite(curve.spread(lr)[1]) else 0.0 for lr, m in zip(lrs, means)]]
        ax.errorbar(lrs, means, yerr=errors, color=color, marker="o", ms=4, capsize=3, label=curve.label)
        best = transfer.best(curve)
        if math.isfinite(curve.mean(best)):
            ax.scatter([best], [curve.mean(best)], s=160, facecolors="none", edgecolors=color, linewidths=2, zorder=4)
        diverged = [lr for lr in transfer.grid if not math.isfinite(curve.mean(lr))]
        ax.scatter(diverged, [ceiling] * len(diverged), color=color, marker="x", s=50, zorder=4)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate (AdamW)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(title or f"best LR ringed; bars: range over {transfer.seeds} seed(s); x: diverged", fontsize=9)
    ax.set_ylim(bottom - 0.05 * (top - bottom + 1e-9), ceiling + 0.05 * (top - bottom + 1e-9))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_figure(fig, path)
