"""Muon against AdamW on one config: the library behind ``tools/bench_muon.py``.

Two measurements, each side by side:

- time: the optimizer step alone and the whole training step (forward, backward, optimizer) of
  each optimizer, in one process, in interleaved rounds (A B, A B, ...) so that a busy spell of a
  shared machine slows both alike; ratios are taken round by round (common/measure.py). The
  optimizer state each keeps is counted from the tensors it holds after a step;
- loss: real training runs (``analysis/training_runs.py``: train.py in a subprocess, the default
  corpus, its validation set, resumable), one per (optimizer, peak learning rate, seed, steps). Each optimizer's learning rate is tuned over its grid at seed 0; the best
  (lowest final validation loss) is run with the other seeds. Equal steps compares the two at the
  config's steps. Equal wall time gives AdamW the steps it runs in Muon's time, steps x the
  measured whole-step ratio, at its tuned learning rate (its schedule stretched to the longer run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from analysis.training_runs import Curve, standard_overrides, time_train_steps
from common.measure import interleaved, ratio_summary
from model.gpt import GPT
from parallel.optim import build_optimizer
from training.config import JobConfig

OPTIMIZERS = ("adamw", "muon")


# --------------------------------------------------------------------------- time, side by side


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (moments, momentum buffers; step counts too)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def optimizer_variants(cfg: JobConfig) -> dict[str, JobConfig]:
    """The job with each optimizer (everything else as configured)."""
    return {name: replace(cfg, optim=replace(cfg.optim, name=name)) for name in OPTIMIZERS}


def time_steps(cfg: JobConfig, rounds: int, warmup: int = 2) -> dict:
    """Seconds of the optimizer step alone and of a whole training step, per optimizer, one sample per
    interleaved round; and each optimizer's state bytes. One process, random tokens."""
    device = torch.device("cpu")
    variants = optimizer_variants(cfg)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.seq_len + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()  # one set of gradients, stepped again and again
    optimizers = {}
    for name, job in variants.items():
        copy = GPT(cfg.model)
        copy.load_state_dict(model.state_dict())
        for p, q in zip(copy.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        optimizers[name] = build_optimizer(list(copy.named_parameters()), job.optim, device)
    optimizer_s = interleaved({name: opt.step for name, opt in optimizers.items()}, rounds, warmup, device)
    step_s = time_train_steps(variants, rounds, warmup)
    return {"optimizer_step_s": optimizer_s, "train_step_s": step_s,
            "state_bytes": {name: state_bytes(opt) for name, opt in optimizers.items()},
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def step_ratio(timing: dict, key: str = "train_step_s") -> dict:
    """Muon's time over AdamW's, round by round: median, min, max."""
    r = ratio_summary(timing[key]["muon"], timing[key]["adamw"])
    return {"median": r.median, "min": r.min, "max": r.max, "n": r.n}


# --------------------------------------------------------------------------- loss, from training runs


@dataclass(frozen=True)
class Run:
    optimizer: str
    lr: float
    seed: int
    steps: int

    @property
    def name(self) -> str:
        return f"{self.optimizer}_lr{self.lr:g}_seed{self.seed}_steps{self.steps}"

    def overrides(self, log_interval: int, eval_interval: int) -> list[str]:
        return [f"--optim.name={self.optimizer}", f"--optim.lr={self.lr}", f"--optim.min_lr={self.lr / 10}",
                *standard_overrides(self.name, self.seed, self.steps, log_interval, eval_interval)]


def best_lr(curves: dict[Run, Curve], optimizer: str, steps: int, seed: int) -> float:
    """The grid's learning rate with the lowest final validation loss at ``seed``."""
    candidates = {r.lr: c.final_val for r, c in curves.items()
                  if r.optimizer == optimizer and r.steps == steps and r.seed == seed}
    return min(candidates, key=candidates.get)


def over_seeds(curves: dict[Run, Curve], optimizer: str, lr: float, steps: int) -> list[Curve]:
    return [c for r, c in sorted(curves.items(), key=lambda rc: rc[0].seed)
            if (r.optimizer, r.lr, r.steps) == (optimizer, lr, steps)]
