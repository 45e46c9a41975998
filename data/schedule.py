"""The mixture plan: each source's weight at each step, and which source every sample comes from.

The global sample stream is numbered 0, 1, 2, ... across all data-parallel ranks; sample ``i``
belongs to step ``i // samples_per_step`` (``samples_per_step`` = micro-batch x grad-accum x
data-parallel ranks, the global batch). The sources of one step's samples are drawn at once:
``samples_per_step`` independent draws with the step's weights from a generator seeded by
``(seed, step)``. So the source of every sample is a pure function of the seed, the step and
the global batch; it depends neither on how the ranks split the batch nor on what came before,
and a schedule change only moves the draws of the steps it covers.

Weights (``data.sources[].weight``, changed by ``data.schedule``) are normalised to sum to 1.
A schedule entry switches to its weights at ``from_step``, or with ``blend_steps = N`` moves
linearly from the weights before it to its own: at ``from_step + k`` the mix is
``(1 - k/N) * before + (k/N) * after`` (both normalised), reaching ``after`` at ``from_step + N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from data.config import DataConfig

MIXTURE_TAG = 0x4D495854  # separates these draws from every other use of the seed


def _normalised(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


@dataclass(frozen=True)
class Phase:
    from_step: int
    blend_steps: int
    weights: tuple[float, ...]  # normalised


class MixturePlan:
    """Weights by step and the per-sample source draws of one mixture."""

    def __init__(self, names: list[str], base_weights: list[float], phases: list[Phase], *, seed: int,
                 samples_per_step: int):
        self.names, self.seed, self.samples_per_step = list(names), seed, samples_per_step
        self.base = tuple(_normalised(base_weights).tolist())
        self.phases = list(phases)
        self.choices = lru_cache(maxsize=4)(self._choices)  # a step's draws are read by several micro-batches

    @classmethod
    def from_config(cls, cfg: DataConfig, *, seed: int, samples_per_step: int) -> "MixturePlan":
        phases = [Phase(e.from_step, e.blend_steps, tuple(_normalised(w).tolist()))
                  for e, w in zip(cfg.schedule, cfg.phase_weights())]
        return cls([s.label for s in cfg.sources], [s.weight for s in cfg.sources], phases, seed=seed,
                   samples_per_step=samples_per_step)

    def weights_at(self, step: int) -> np.ndarray:
        """The normalised weights used for the samples of ``step``."""
        current = np.asarray(self.base)
        for phase in self.phases:
            if step < phase.from_step:
                break
            target = np.asarray(phase.weights)
            if phase.blend_steps and step < phase.from_step + phase.blend_steps:
                f = (step - phase.from_step) / phase.blend_steps
                return (1 - f) * current + f * target
            current = target
        return current

    def weights_by_name(self, step: int) -> dict[str, float]:
        return dict(zip(self.names, self.weights_at(step).tolist()))

    def configured_weights(self) -> dict[str, float]:
        """The sources' own weights (normalised), before any schedule entry."""
        return dict(zip(self.names, self.base))

    def _choices(self, step: int) -> np.ndarray:
        """The source index of each of ``step``'s samples (int64, ``samples_per_step`` of them)."""
        rng = np.random.default_rng([self.seed, MIXTURE_TAG, step])
        p = self.weights_at(step)
        # Inverse-CDF draws (what Generator.choice does), written out so that a source of weight 0 is
        # never drawn: its interval is empty, and rounding cannot leave room after the last positive one.
        cdf = np.cumsum(p)
        cdf[int(np.flatnonzero(p > 0)[-1]):] = 1.0
        picks = np.searchsorted(cdf, rng.random(self.samples_per_step), side="right")
        return picks.astype(np.int64)

    def metrics(self, taken: list[int], seq_len: int) -> dict[str, float]:
        """Samples and tokens read per source so far (over all ranks), and the share of each."""
        total = max(sum(taken), 1)
        out: dict[str, float] = {}
        for name, n in zip(self.names, taken):
            out[f"data/{name}/samples"] = n
            out[f"data/{name}/tokens"] = n * seq_len
            out[f"data/{name}/share"] = n / total
        return out
