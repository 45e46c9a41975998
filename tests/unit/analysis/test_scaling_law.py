"""The Chinchilla fit: it recovers a known law from points drawn from it (exactly without noise,
within its bootstrap intervals with noise), and its compute-optimal split is the minimum a brute
search along C = 6ND finds."""

from __future__ import annotations

import math

import pytest
import torch

from analysis.scaling_law import Law, fit_law, residuals
from common.errors import DataError

# A law shaped like a small model's: the constants Hoffmann et al. fitted would put every point
# of a tiny sweep deep in the N- and D-limited regime.
TRUE = Law(E=1.2, A=80.0, B=250.0, alpha=0.36, beta=0.38)
SIZES = (2e4, 6e4, 2e5, 6e5, 2e6)
TOKENS = (3e5, 1e6, 3e6, 1e7)


def grid(noise: float, seed: int) -> tuple[list[float], list[float], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    n, d, loss = [], [], []
    for size in SIZES:
        for tokens in TOKENS:
            n.append(size)
            d.append(tokens)
            loss.append(TRUE.loss(size, tokens) * math.exp(noise * torch.randn((), generator=gen).item()))
    return n, d, loss


def test_the_fit_recovers_the_law_exactly_from_points_without_noise(one_thread):
    fit = fit_law(*grid(noise=0.0, seed=0), bootstrap=0)
    for name, value in TRUE.as_dict().items():
        assert getattr(fit.law, name) == pytest.approx(value, rel=1e-4), name
    assert fit.objective < 1e-12


def test_with_one_percent_noise_every_true_value_lies_in_its_bootstrap_interval(one_thread):
    # One fixed draw of the noise: the intervals are 95% ones, so some draws miss a true value.
    n, d, loss = grid(noise=0.01, seed=0)
    fit = fit_law(n, d, loss, bootstrap=80, seed=0)
    assert len(fit.bootstrap) >= 75  # nearly every resample gave a usable law
    for name, value in TRUE.as_dict().items():
        interval = fit.interval(name)
        assert interval.contains(value), (name, value, interval)
        assert interval.contains(getattr(fit.law, name)), name
    budget = 1e13
    n_iv, d_iv = fit.optimal_interval(budget)
    n_true, d_true = TRUE.optimal(budget)
    assert n_iv.contains(n_true) and d_iv.contains(d_true), (n_iv, d_iv, n_true, d_true)
    # The fit explains the points to about the noise: RMS relative miss near 1%.
    misses = [r.relative_miss for r in residuals(fit.law, n, d, loss)]
    assert math.sqrt(sum(m * m for m in misses) / len(misses)) < 0.015


@pytest.mark.parametrize("compute", [1e11, 1e14, 1e18])
def test_the_compute_optimal_split_is_the_minimum_along_six_n_d_equals_c(compute):
    n_opt, d_opt = TRUE.optimal(compute)
    assert 6.0 * n_opt * d_opt == pytest.approx(compute, rel=1e-12)
    # Brute force: the loss at 20,001 model sizes spread over eight decades around the optimum.
    sizes = [n_opt * 10 ** (-4 + 8 * i / 20000) for i in range(20001)]
    best = min(sizes, key=lambda size: TRUE.loss(size, compute / (6.0 * size)))
    assert best == pytest.approx(n_opt, rel=2e-3)
    assert TRUE.frontier(compute) <= min(TRUE.loss(s, compute / (6.0 * s)) for s in sizes) + 1e-12


def test_points_that_cannot_determine_the_law_are_one_line_errors():
    n, d, loss = grid(noise=0.0, seed=0)
    with pytest.raises(DataError, match="at least 5 points"):
        fit_law(n[:4], d[:4], loss[:4])
    with pytest.raises(DataError, match="two model sizes"):
        fit_law([1e5] * 6, d[:6], loss[:6])
    with pytest.raises(DataError, match="finite loss > 0"):
        fit_law(n[:6], d[:6], [*loss[:5], float("nan")])
