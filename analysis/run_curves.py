"""A run's curves from its metrics.jsonl (training/metrics.py writes it): training and validation
loss, learning rate and tokens/s by step, one figure for one run or several overlaid.

Rows are read as the trainer wrote them: a step row holds ``loss`` (null for a window whose steps
were all skipped), ``lr`` and ``tokens_per_s``; a validation row ``val_loss``. A step logged twice
(a restart re-logs the steps after its checkpoint) counts once, with its last row.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import DataError
from common.report import new_figure, save_figure

METRICS_FILE = "metrics.jsonl"
# (row key, title) of each panel, left to right; validation loss joins the loss panel
PANELS = (("loss", "loss (solid: train, dashed: validation)"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))


@dataclass
class RunCurves:
    name: str  # the label in the legend
    path: Path  # the metrics.jsonl read
    series: dict[str, dict[int, float]] = field(default_factory=dict)  # key -> {step: value}

    def points(self, key: str) -> tuple[list[int], list[float]]:
        steps = sorted(self.series.get(key, {}))
        return steps, [self.series[key][s] for s in steps]

    def summary(self) -> str:
        """One line: steps, the last training loss, the best validation loss, the median tokens/s."""
        steps, loss = self.points("loss")
        parts = [f"{steps[-1]} steps, last loss {loss[-1]:.4f}" if steps else "no training loss rows"]
        _, val = self.points("val_loss")
        if val:
            parts.append(f"best val_loss {min(val):.4f}")
        _, rate = self.points("tokens_per_s")
        if rate:
            parts.append(f"median {statistics.median(rate):,.0f} tokens/s")
        return f"{self.name}: " + ", ".join(parts)


def metrics_path(source: Path) -> Path:
    """The metrics.jsonl of a run directory (or the file itself)."""
    path = source / METRICS_FILE if source.is_dir() else source
    if not path.is_file():
        where = f"{source} has no {METRICS_FILE}" if source.is_dir() else f"{source} does not exist"
        raise DataError(f"{where}; give a run directory that train.py wrote (logging.run_dir, logging.jsonl=true)")
    return path


def read_run(source: Path, name: str | None = None) -> RunCurves:
    """The curves of one run directory (or metrics.jsonl file); a torn last line is skipped."""
    path = metrics_path(source)
    curves = RunCurves(name or (source.name if source.is_dir() else source.parent.name), path)
    keys = ("loss", "val_loss", "lr", "tokens_per_s")
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        for key in keys:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                curves.series.setdefault(key, {})[row["step"]] = float(value)
    if not curves.series:
        raise DataError(f"{path} holds no loss, learning-rate or throughput rows yet")
    return curves


def read_runs(sources: list[Path]) -> list[RunCurves]:
    """Each source's curves, labelled by its directory name (by its path where two names collide)."""
    names = [s.name if s.is_dir() else s.parent.name for s in sources]
    return [read_run(s, str(s) if names.count(n) > 1 else n) for s, n in zip(sources, names)]


def plot_runs(runs: list[RunCurves], path: Path) -> None:
    """One PNG: loss, learning rate and tokens/s by step, every run in its own colour."""
    fig, axes = new_figure(ncols=len(PANELS), width=5.0, height=3.8)
    for ax, (key, title) in zip(axes, PANELS):
        for index, run in enumerate(runs):
            color = f"C{index % 10}"
            steps, values = run.points(key)
            if steps:
                ax.plot(steps, values, "-", color=color, label=run.name)
            if key == "loss":
                steps, values = run.points("val_loss")
                if steps:
                    ax.plot(steps, values, "--o", color=color, markersize=3,
                            label=f"{run.name} (val)" if len(runs) > 1 else "validation")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    save_figure(fig, path)
