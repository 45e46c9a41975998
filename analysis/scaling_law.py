"""The Chinchilla loss law L(N, D) = E + A / N^alpha + B / D^beta, fitted to measured runs.

N is a model's parameters, D the tokens it trained on, L its final validation loss. The fit is
the one Hoffmann et al. (2022, "Training Compute-Optimal Large Language Models", approach 3)
describe: with A = exp(a), B = exp(b), E = exp(e), minimise over (a, b, e, alpha, beta)

    sum_i  Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),   delta = 1e-3

from a grid of starting points, keeping the best. The Huber loss on *log* residuals makes the fit
relative (a 1% miss costs the same at any loss) and robust to a stray run. Every start is an
independent problem, so all of them (and every bootstrap resample, as point weights) are solved
together as one batch by a damped Newton method (``_minimise``): one tensor program, no scipy.

Compute-optimal allocation for a budget C = 6 N D (the usual training-FLOPs rule): minimising L
along that curve gives

    N_opt = G (C/6)^(beta/(alpha+beta)),   D_opt = (C/6)^(alpha/(alpha+beta)) / G,
    G = (alpha A / (beta B))^(1/(alpha+beta)),

and the frontier L_opt(C) = L(N_opt, D_opt). Confidence intervals come from the bootstrap: the
points are resampled with replacement, the law refitted, and each quantity's percentile interval
read off the refits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from common.errors import DataError
from common.report import new_figure, save_figure

HUBER_DELTA = 1e-3  # Hoffmann et al.'s choice: beyond a 0.1% miss a point counts linearly
PARAMS = ("E", "A", "B", "alpha", "beta")

# The grid of starting points (a = log A, b = log B, e = log E): Hoffmann et al. start from a
# similar grid, because the law's valleys are long and flat (A and alpha trade off) and a
# single start can stop in the wrong one.
INIT_ALPHA = (0.0, 0.5, 1.0, 1.5)
INIT_BETA = (0.0, 0.5, 1.0, 1.5)
INIT_E = (-1.0, 0.0, 1.0)
INIT_A = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
INIT_B = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
SCREEN_STEPS = 30  # every start takes this many steps; then only the best KEEP_STARTS go on
KEEP_STARTS = 64
STALL = 20  # steps in a row without progress after which a problem is done


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def optimal(self, compute: float) -> tuple[float, float]:
        """(N_opt, D_opt) for a budget of ``compute`` = 6 N D FLOPs."""
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / s)
        c = compute / 6.0
        return g * c ** (self.beta / s), c ** (self.alpha / s) / g

    def frontier(self, compute: float) -> float:
        """The lowest loss a budget of ``compute`` = 6 N D FLOPs reaches."""
        return self.loss(*self.optimal(compute))

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARAMS}


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True)
class Fit:
    law: Law
    objective: float  # the Huber sum at the optimum
    points: int
    bootstrap: list[Law]  # refits on resampled points (those that converged to a usable law)
    level: float  # confidence level of the intervals, e.g. 0.95

    def interval(self, name: str) -> Interval:
        """The bootstrap percentile interval of one of the law's parameters."""
        return percentile_interval([getattr(law, name) for law in self.bootstrap], self.level)

    def optimal_interval(self, compute: float) -> tuple[Interval, Interval]:
        """Intervals of (N_opt, D_opt) at ``compute`` over the bootstrap refits."""
        pairs = [law.optimal(compute) for law in self.bootstrap]
        return (percentile_interval([n for n, _ in pairs], self.level),
                percentile_interval([d for _, d in pairs], self.level))

    def frontier_interval(self, compute: float) -> Interval:
        return percentile_interval([law.frontier(compute) for law in self.bootstrap], self.level)


def percentile_interval(values: Sequence[float], level: float) -> Interval:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return Interval(math.nan, math.nan)
    tail = (1.0 - level) / 2.0
    t = torch.tensor(finite, dtype=torch.float64)
    low, high = torch.quantile(t, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return Interval(low, high)


# --------------------------------------------------------------------------- the objective


def _terms(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """theta (K, 5) = (a, b, e, alpha, beta); log_n, log_d (P,) -> log L (K, P) and the softmax
    weights (p1, p2, p3) of its three terms a - alpha log N, b - beta log D and e, each (K, P)."""
    t1 = theta[:, 0:1] - theta[:, 3:4] * log_n
    t2 = theta[:, 1:2] - theta[:, 4:5] * log_d
    t3 = theta[:, 2:3].expand_as(t1)
    top = torch.maximum(torch.maximum(t1, t2), t3)
    e1, e2, e3 = (t1 - top).exp(), (t2 - top).exp(), (t3 - top).exp()
    total = e1 + e2 + e3
    return top + total.log(), e1 / total, e2 / total, e3 / total


def _huber(r: torch.Tensor, delta: float = HUBER_DELTA) -> torch.Tensor:
    small = r.abs() <= delta
    return torch.where(small, 0.5 * r * r, delta * (r.abs() - 0.5 * delta))


def _objective(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """theta (K, 5), weights (K, P) -> the weighted Huber sum of each of the K problems (K,)."""
    return (weights * _huber(_terms(theta, log_n, log_d)[0] - log_l)).sum(-1)


def _derivatives(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor,
                 weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient (K, 5) and Hessian (K, 5, 5) of each problem's objective, in closed form.

    With t = (a - alpha log N, b - beta log D, e) = M theta and r = LSE(t) - log L: dr/dt = p =
    softmax(t) and d2r/dt2 = diag(p) - p p^T, so dr/dtheta = M^T p = (p1, p2, p3, -p1 log N,
    -p2 log D) and d2r/dtheta2 = M^T diag(p) M - (M^T p)(M^T p)^T. The Huber loss has
    h'(r) = clamp(r, -delta, delta) and h''(r) = 1 inside delta, 0 outside; the objective's Hessian
    is sum_i h'' J J^T + h' d2r/dtheta2."""
    log_fit, p1, p2, p3 = _terms(theta, log_n, log_d)
    r = log_fit - log_l
    h1 = weights * r.clamp(-HUBER_DELTA, HUBER_DELTA)
    h2 = weights * (r.abs() <= HUBER_DELTA).to(theta.dtype)
    jac = torch.stack([p1, p2, p3, -p1 * log_n, -p2 * log_d], dim=-1)  # (K, P, 5)
    grad = (h1.unsqueeze(-1) * jac).sum(1)
    hess = torch.einsum("kpq,kpr->kqr", jac * (h2 - h1).unsqueeze(-1), jac)
    # M^T diag(p) M: the a/alpha block from the first term, the b/beta block from the second, e from the third.
    w1, w2 = h1 * p1, h1 * p2
    s1, s1n, s1nn = w1.sum(1), (w1 * log_n).sum(1), (w1 * log_n * log_n).sum(1)
    s2, s2d, s2dd = w2.sum(1), (w2 * log_d).sum(1), (w2 * log_d * log_d).sum(1)
    s3 = (h1 * p3).sum(1)
    hess[:, 0, 0] += s1
    hess[:, 0, 3] -= s1n
    hess[:, 3, 0] -= s1n
    hess[:, 3, 3] += s1nn
    hess[:, 1, 1] += s2
    hess[:, 1, 4] -= s2d
    hess[:, 4, 1] -= s2d
    hess[:, 4, 4] += s2dd
    hess[:, 2, 2] += s3
    return grad, hess


def _minimise(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor,
              weights: torch.Tensor, iterations: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """K independent problems at once by Levenberg-Marquardt-damped Newton steps: each problem
    keeps its own damping, takes a step only when it lowers its objective, and raises its damping
    otherwise, so no problem ever moves uphill. A problem that has not improved by a relative 1e-12
    for ``STALL`` steps in a row is done and drops out of the batch. Returns (theta (K, 5),
    objective (K,))."""
    theta = theta.clone()
    current = _objective(theta, log_n, log_d, log_l, weights)
    damping = torch.full_like(current, 1e-3)
    stalled = torch.zeros_like(current, dtype=torch.long)
    eye = torch.eye(5, dtype=theta.dtype)
    active = torch.arange(theta.shape[0])
    for _ in range(iterations):
        th, w, cur, damp = theta[active], weights[active], current[active], damping[active]
        grad, hess = _derivatives(th, log_n, log_d, log_l, w)
        scale = hess.diagonal(dim1=-2, dim2=-1).abs() + 1e-12  # Marquardt's scaling by the diagonal
        system = hess + damp[:, None, None] * (torch.diag_embed(scale) + 1e-9 * eye)
        step = torch.nan_to_num(torch.linalg.solve_ex(system, -grad)[0], nan=0.0, posinf=0.0, neginf=0.0)
        trial = _objective(th + step, log_n, log_d, log_l, w)
        better = trial < cur
        gain = torch.where(better, (cur - trial) / cur.abs().clamp_min(1e-300), torch.zeros_like(trial))
        theta[active] = torch.where(better[:, None], th + step, th)
        current[active] = torch.where(better, trial, cur)
        damping[active] = torch.where(better, (damp / 3.0).clamp_min(1e-12), (damp * 4.0).clamp_max(1e12))
        stalled[active] = torch.where(gain < 1e-12, stalled[active] + 1, torch.zeros_like(stalled[active]))
        active = active[stalled[active] < STALL]
        if active.numel() == 0:
            break
    return theta, current


def _as_law(theta: Sequence[float]) -> Law:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return Law(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)


def _start_grid() -> torch.Tensor:
    grid = torch.cartesian_prod(*(torch.tensor(v, dtype=torch.float64) for v in (INIT_A, INIT_B, INIT_E,
                                                                                 INIT_ALPHA, INIT_BETA)))
    return grid  # (starts, 5) in (a, b, e, alpha, beta) order


def fit_law(n: Sequence[float], d: Sequence[float], loss: Sequence[float], *, bootstrap: int = 200,
            level: float = 0.95, seed: int = 0, bootstrap_starts: int = 4) -> Fit:
    """The Chinchilla law fitted to points (N_i, D_i, L_i), with ``bootstrap`` resampled refits.

    Each refit starts from the ``bootstrap_starts`` best optima of the full fit (ranked by their
    objective on all points), which finds its optimum at a fraction of the full grid's cost."""
    n_t, d_t, l_t = (torch.tensor(list(map(float, v)), dtype=torch.float64) for v in (n, d, loss))
    if not (len(n_t) == len(d_t) == len(l_t)):
        raise DataError(f"N, D and loss must have one value per point (got {len(n_t)}, {len(d_t)}, {len(l_t)})")
    if len(n_t) < 5:
        raise DataError(f"the law has 5 parameters: fitting it needs at least 5 points (got {len(n_t)})")
    if bool((n_t <= 0).any() | (d_t <= 0).any() | (l_t <= 0).any()) or not bool(torch.isfinite(l_t).all()):
        raise DataError("every point needs N > 0, D > 0 and a finite loss > 0")
    if len(set(n_t.tolist())) < 2 or len(set(d_t.tolist())) < 2:
        raise DataError("the points need at least two model sizes and two token counts to separate the N and D terms")
    log_n, log_d, log_l = n_t.log(), d_t.log(), l_t.log()
    # Every start screened briefly, the best few minimised to the end: the long flat valleys are
    # told apart within a few steps, and the full minimisation of thousands of starts would cost
    # seconds for nothing.
    starts = _start_grid()
    ones = torch.ones(starts.shape[0], len(n_t), dtype=torch.float64)
    screened, objectives = _minimise(starts, log_n, log_d, log_l, ones, iterations=SCREEN_STEPS)
    kept = screened[torch.argsort(objectives)[:KEEP_STARTS]]
    thetas, objectives = _minimise(kept, log_n, log_d, log_l, ones[:kept.shape[0]])
    order = torch.argsort(objectives)
    best = thetas[order[0]]

    laws = []
    if bootstrap:
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randint(0, len(n_t), (bootstrap, len(n_t)), generator=generator)
        weights = torch.zeros(bootstrap, len(n_t), dtype=torch.float64)
        weights.scatter_add_(1, picks, torch.ones_like(picks, dtype=torch.float64))  # resampling as counts
        k = min(bootstrap_starts, len(order))
        batch_theta = thetas[order[:k]].repeat(bootstrap, 1)  # resample-major: rows r*k .. r*k+k-1
        refit, objective = _minimise(batch_theta, log_n, log_d, log_l, weights.repeat_interleave(k, dim=0))
        chosen = refit.view(bootstrap, k, 5)[torch.arange(bootstrap), objective.view(bootstrap, k).argmin(1)]
        for theta in chosen.tolist():
            law = _as_law(theta)
            if all(math.isfinite(v) for v in law.as_dict().values()) and law.alpha > 0 and law.beta > 0:
                laws.append(law)
    return Fit(_as_law(best.tolist()), float(objectives[order[0]]), len(n_t), laws, level)


# --------------------------------------------------------------------------- how far the points are


@dataclass(frozen=True)
class Residual:
    n: float
    d: float
    compute: float  # 6 N D
    measured: float
    fitted: float
    frontier: float  # the lowest loss the law allows at this point's compute

    @property
    def miss(self) -> float:
        """measured - fitted, in nats."""
        return self.measured - self.fitted

    @property
    def relative_miss(self) -> float:
        return self.miss / self.fitted

    @property
    def above_frontier(self) -> float:
        """measured - frontier: what this point's split of its compute between N and D cost, in nats."""
        return self.measured - self.frontier


def residuals(law: Law, n: Sequence[float], d: Sequence[float], loss: Sequence[float]) -> list[Residual]:
    return [Residual(ni, di, 6.0 * ni * di, li, law.loss(ni, di), law.frontier(6.0 * ni * di))
            for ni, di, li in zip(map(float, n), map(float, d), map(float, loss))]


def rms(values: Sequence[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else math.nan


# --------------------------------------------------------------------------- report and figure


def default_budgets(compute: Sequence[float]) -> list[float]:
    """The smallest, middle (geometric) and largest measured compute, and 10x the largest."""
    low, high = min(compute), max(compute)
    return [low, math.sqrt(low * high), high, 10.0 * high]


def report_lines(fit: Fit, names: Sequence[str], n: Sequence[float], d: Sequence[float], loss: Sequence[float],
                 budgets: Sequence[float]) -> list[str]:
    """Markdown: the law with its intervals, the compute-optimal allocation at each budget, and how
    far each measured point lies from the law and from the frontier."""
    pct = f"{fit.level:.0%}"
    law = fit.law
    lines = [f"Fitted on {fit.points} points; {pct} intervals from {len(fit.bootstrap)} bootstrap refits "
             "(points resampled with replacement).", "",
             f"| parameter | fit | {pct} interval |", "|---|---:|---:|"]
    for name in PARAMS:
        iv = fit.interval(name)
        lines.append(f"| {name} | {getattr(law, name):.4g} | {iv.low:.4g} .. {iv.high:.4g} |")
    s = law.alpha + law.beta
    lines += ["", f"Compute-optimal split for C = 6ND: N_opt ~ C^{law.beta / s:.3f}, D_opt ~ C^{law.alpha / s:.3f} "
              f"(Hoffmann et al. found about 0.5 each).", "",
              "| budget C (FLOPs) | N_opt | D_opt | D/N | loss at the frontier |", "|---:|---:|---:|---:|---:|"]
    measured_top = max(6.0 * ni * di for ni, di in zip(n, d))
    for c in budgets:
        (n_iv, d_iv), l_iv = fit.optimal_interval(c), fit.frontier_interval(c)
        n_opt, d_opt = law.optimal(c)
        extra = " (extrapolated)" if c > measured_top * 1.001 else ""
        lines.append(f"| {c:.3g}{extra} | {n_opt:.3g} ({n_iv.low:.3g} .. {n_iv.high:.3g}) | "
                     f"{d_opt:.3g} ({d_iv.low:.3g} .. {d_iv.high:.3g}) | {d_opt / n_opt:.3g} | "
                     f"{law.frontier(c):.4f} ({l_iv.low:.4f} .. {l_iv.high:.4f}) |")
    res = residuals(law, n, d, loss)
    worst = max(range(len(res)), key=lambda i: abs(res[i].relative_miss))
    lines += ["", f"Measured against the fit: RMS miss {rms([r.miss for r in res]):.4f} nats "
              f"({rms([r.relative_miss for r in res]):.2%} of the loss); the largest, {res[worst].relative_miss:+.2%}, "
              f"at {names[worst]}. 'Above frontier' is how much lower the law says the same compute "
              "would reach with the best split of N and D.", "",
              "| point | N | D | C = 6ND | measured | fit | miss | above frontier |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in zip(names, res):
        lines.append(f"| {name} | {r.n:.3g} | {r.d:.3g} | {r.compute:.3g} | {r.measured:.4f} | {r.fitted:.4f} | "
                     f"{r.relative_miss:+.2%} | {r.above_frontier:+.4f} |")
    return lines


def plot_fit(fit: Fit, n: Sequence[float], d: Sequence[float], loss: Sequence[float], path) -> None:
    """Left: loss against compute, each model size's points with its fitted curve, and the
    compute-optimal frontier with its bootstrap band. Right: N_opt and D_opt against compute."""
    law = fit.law
    compute = [6.0 * ni * di for ni, di in zip(n, d)]
    lo, hi = min(compute) / 3.0, max(compute) * 10.0
    grid = [lo * (hi / lo) ** (i / 59) for i in range(60)]
    fig, (ax, ax2) = new_figure(ncols=2, width=6.0, height=4.5)
    sizes = sorted(set(n))
    colors = [f"C{i % 10}" for i in range(len(sizes))]
    for size, color in zip(sizes, colors):
        xs = [c for c, ni in zip(compute, n) if ni == size]
        ys = [li for li, ni in zip(loss, n) if ni == size]
        ax.scatter(xs, ys, color=color, zorder=3, label=f"N = {size / 1e6:.3g}M")
        curve = [c for c in grid if c / (6.0 * size) > 0]
        ax.plot(curve, [law.loss(size, c / (6.0 * size)) for c in curve], color=color, lw=1, alpha=0.7)
    bands = [fit.frontier_interval(c) for c in grid]
    ax.plot(grid, [law.frontier(c) for c in grid], "k--", lw=1.5, label="compute-optimal frontier")
    ax.fill_between(grid, [b.low for b in bands], [b.high for b in bands], color="k", alpha=0.12,
                    label=f"frontier, {fit.level:.0%} bootstrap band")
    ax.set_xscale("log")
    ax.set_xlabel("training compute C = 6ND (FLOPs)")
    ax.set_ylabel("final validation loss (nats/token)")
    top = max(loss)
    ax.set_ylim(min(min(loss), law.frontier(hi)) - 0.1, top + 0.25 * (top - min(loss)) + 0.05)
    ax.set_title(f"L = {law.E:.2f} + {law.A:.3g}/N^{law.alpha:.2f} + {law.B:.3g}/D^{law.beta:.2f}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    optimal = [law.optimal(c) for c in grid]
    intervals = [fit.optimal_interval(c) for c in grid]
    ax2.plot(grid, [o[0] for o in optimal], color="C0", label="N_opt (parameters)")
    ax2.fill_between(grid, [i[0].low for i in intervals], [i[0].high for i in intervals], color="C0", alpha=0.15)
    ax2.plot(grid, [o[1] for o in optimal], color="C1", label="D_opt (tokens)")
    ax2.fill_between(grid, [i[1].low for i in intervals], [i[1].high for i in intervals], color="C1", alpha=0.15)
    ax2.scatter(compute, n, color="C0", marker="x", label="measured N")
    ax2.scatter(compute, d, color="C1", marker="+", label="measured D")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("training compute C = 6ND (FLOPs)")
    ax2.set_title(f"compute-optimal split ({fit.level:.0%} bootstrap bands)", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, which="both")
    save_figure(fig, path)
