"""Predicted scaling curves: the planner's best layout at each GPU count, its throughput, and which
communication shows as the count grows.

Two regimes, both with the planner's cheapest layout that fits (``estimator.plan_layouts``, so only what
the trainer accepts) at every count:
- weak scaling: the global batch grows with the GPUs (the same sequences per GPU per step);
- strong scaling: one global batch for every count (that of the largest count).
Scaling efficiency is throughput per GPU relative to the smallest count of the same regime. A
communication dimension "becomes exposed" at the first count where the time it adds to the critical
path (estimator ``TimeEstimate.exposed``) reaches ``EXPOSED_SHARE`` of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from analysis import estimator as est
from common.hardware import DeviceSpec
from common.progress import Progress
from common.report import new_figure, save_figure
from model.config import ModelConfig
from training.config import JobConfig

EXPOSED_SHARE = 0.01  # of the step: below this a dimension's exposed time is called hidden
DIMENSIONS = ("tp", "pp", "cp", "dp", "bubble")


@dataclass(frozen=True)
class Point:
    gpus: int
    global_batch: int  # sequences per step
    plan: est.Estimate | None  # None: nothing fits at this count

    @property
    def tokens_per_s(self) -> float:
        return self.plan.time.tokens_per_s if self.plan else 0.0

    @property
    def tflops_per_gpu(self) -> float:
        """Model FLOPs (recompute excluded) per second per GPU, in TFLOP/s."""
        if not self.plan:
            return 0.0
        t = self.plan.time
        return t.model_flops_per_step / t.step_s / self.gpus / 1e12

    def exposed_share(self) -> dict[str, float]:
        if not self.plan:
            return {d: 0.0 for d in DIMENSIONS}
        t = self.plan.time
        return {d: seconds / t.step_s for d, seconds in t.exposed().items()}


@dataclass(frozen=True)
class Curve:
    regime: str  # weak | strong
    points: list[Point]

    def efficiency(self) -> list[float | None]:
        """Throughput per GPU relative to the first count that fits."""
        base = next((p for p in self.points if p.plan), None)
        if base is None:
            return [None for _ in self.points]
        per_gpu = base.tokens_per_s / base.gpus
        return [p.tokens_per_s / p.gpus / per_gpu if p.plan else None for p in self.points]

    def first_exposed(self) -> dict[str, int | None]:
        """The first GPU count at which each dimension adds EXPOSED_SHARE of the step, or None."""
        first: dict[str, int | None] = {d: None for d in DIMENSIONS}
        for point in self.points:
            for dim, share in point.exposed_share().items():
                if first[dim] is None and share >= EXPOSED_SHARE:
                    first[dim] = point.gpus
        return first


def scaling_curves(model: ModelConfig, seq_len: int, device: DeviceSpec, precision: str, counts: tuple[int, ...],
                   sequences_per_gpu: int, config: JobConfig | None = None,
                   progress: Progress | None = None) -> tuple[Curve, Curve]:
    """(weak, strong) curves over ``counts``: weak keeps ``sequences_per_gpu`` per GPU per step, strong keeps
    the largest count's global batch. ``progress`` counts the 2 x len(counts) planner runs (minutes at
    a thousand GPUs and more)."""
    if sequences_per_gpu < 1:
        raise est.EstimatorError(f"sequences per GPU must be >= 1 (got {sequences_per_gpu})")
    strong_batch = sequences_per_gpu * max(counts)

    def best(gpus: int, global_batch: int) -> Point:
        plans = est.plan_layouts(model, seq_len, gpus, device, precision, global_batch=global_batch, top=1,
                                 config=config)
        if progress is not None:
            progress.update()
        return Point(gpus, global_batch, plans[0] if plans else None)

    weak = Curve("weak", [best(n, sequences_per_gpu * n) for n in counts])
    strong = Curve("strong", [best(n, strong_batch) for n in counts])
    return weak, strong


def table(weak: Curve, strong: Curve) -> tuple[list[str], list[list[str]]]:
    """One row per GPU count: both regimes' throughput and efficiency, and the strong curve's layout and
    exposed shares."""
    headers = ["GPUs", "weak tok/s", "TFLOP/s/GPU", "weak eff", "strong tok/s", "TFLOP/s/GPU", "strong eff",
               "exposed tp/pp/cp/dp/bubble (strong)", "layout (strong)"]
    rows = []
    for w, s, we, se in zip(weak.points, strong.points, weak.efficiency(), strong.efficiency()):
        shares = s.exposed_share()
        rows.append([
            str(w.gpus),
            f"{w.tokens_per_s:,.0f}" if w.plan else "no fit",
            f"{w.tflops_per_gpu:.0f}" if w.plan else "-",
            "-" if we is None else f"{we:.0%}",
            f"{s.tokens_per_s:,.0f}" if s.plan else "no fit",
            f"{s.tflops_per_gpu:.0f}" if s.plan else "-",
            "-" if se is None else f"{se:.0%}",
            "/".join(f"{shares[d]:.0%}" for d in DIMENSIONS) if s.plan else "-",
            est.job_words(s.plan.job) if s.plan else "nothing fits",
        ])
    return headers, rows


def exposure_lines(weak: Curve, strong: Curve) -> list[str]:
    lines = []
    for curve in (weak, strong):
        first = curve.first_exposed()
        words = [f"{d} from {n} GPUs" if n else f"{d} hidden (or absent) throughout" for d, n in first.items()]
        lines.append(f"{curve.regime} scaling, exposed (>= {EXPOSED_SHARE:.0%} of the step): " + "; ".join(words))
    return lines


def plot(weak: Curve, strong: Curve, path: Path, title: str) -> None:
    fig, (left, right) = new_figure(ncols=2, width=6.0, height=4.2)
    for curve, style in ((weak, "o-"), (strong, "s--")):
        xs = [p.gpus for p in curve.points if p.plan]
        left.plot(xs, [p.tflops_per_gpu for p in curve.points if p.plan], style, label=f"{curve.regime} scaling")
    left.set_xscale("log", base=2)
    left.set_xlabel("GPUs")
    left.set_ylabel("model TFLOP/s per GPU (predicted)")
    left.set_title(title, fontsize=9)
    left.legend()
    points = [p for p in strong.points if p.plan]
    xs = [p.gpus for p in points]
    for dim in DIMENSIONS:
        right.plot(xs, [100 * p.exposed_share()[dim] for p in points], "o-", label=dim)
    right.set_xscale("log", base=2)
    right.set_xlabel("GPUs")
    right.set_ylabel("% of the step on the critical path")
    right.set_title("strong scaling: exposed communication and bubble", fontsize=9)
    right.legend()
    save_figure(fig, path)
