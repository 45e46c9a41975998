"""AdamW and its learning-rate schedule: ``OptimConfig`` (the ``optim`` section) and what it builds.

The engines (``parallel/engine.py``, ``parallel/zero.py``) own the optimizer, so its config and
its construction live next to them. Weight decay applies to matrices only (linear weights and
embeddings), never to norm gains and biases. The schedule is a linear warmup to the peak, a
cosine decay to ``min_lr`` at ``decay_steps`` (counted from step 0), then flat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn as nn

from common.errors import ConfigError
from common.fields import doc, require_finite
from model.mup import LrScale


@dataclass
class OptimConfig:
    lr: float = doc(6e-4, "peak learning rate reached at the end of warmup")
    min_lr: float = doc(6e-5, "learning rate at the end of the cosine decay")
    warmup_steps: int = doc(
        100, "linear warmup length in optimizer steps; without optim.decay_steps a longer one than "
        "train.max_steps is cut to train.max_steps for the run, with a warning (a short smoke run)"
    )
    decay_steps: int | None = doc(
        None, "step at which the cosine decay reaches optim.min_lr (counted from step 0, warmup included; "
        ">= optim.warmup_steps); default: train.max_steps. Set it when one schedule spans several runs"
    )
    weight_decay: float = doc(0.1, "decoupled weight decay, applied to matrices only (not norms, biases)")
    beta1: float = doc(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = doc(0.95, "AdamW beta2, in [0, 1)")
    eps: float = doc(1e-8, "AdamW epsilon, > 0")
    grad_clip: float = doc(1.0, "clip the global gradient norm to this value; 0 disables")
    fused: Literal["auto", "on", "off"] = doc(
        "auto", "fused AdamW kernel (skips a non-finite step without a host sync): auto uses it on CUDA; on "
        "uses it on any device PyTorch's fused AdamW runs on (CPU too)"
    )

    def validate(self) -> None:
        # An infinite lr turns the first update into NaN weights: finiteness comes first.
        for key in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            require_finite(f"optim.{key}", getattr(self, key), ConfigError)
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0 (got {self.lr})")
        # AdamW's decoupled decay multiplies every weight by 1 - lr x weight_decay each step: at 1 or
        # more it zeroes or flips every weight on the first step.
        if self.lr * self.weight_decay >= 1:
            raise ConfigError(f"optim.lr x optim.weight_decay = {self.lr * self.weight_decay:g} must be < 1: AdamW's "
                              "decoupled decay multiplies every weight by 1 - lr x weight_decay each step")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr must be between 0 and optim.lr={self.lr} (got {self.min_lr})")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.decay_steps is not None and self.decay_steps < 0:
            raise ConfigError(f"optim.decay_steps must be >= 0, or null for train.max_steps (got {self.decay_steps})")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise ConfigError(
                f"optim.decay_steps={self.decay_steps} ends the decay before optim.warmup_steps={self.warmup_steps} "
                "ends the warmup; set optim.decay_steps >= optim.warmup_steps"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0 (got {self.eps})")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip must be >= 0, 0 disables clipping (got {self.grad_clip})")

    def schedule(self, max_steps: int) -> dict[str, Any]:
        """The schedule of a run of ``max_steps`` steps: ``lr_at``'s keyword arguments, and what a
        checkpoint records so a resumed run can be checked against it.

        Without decay_steps the schedule ends with the run (decay_steps = max_steps), and a warm-up
        longer than the run, which would never reach ``lr``, is cut to the run's length (the first
        thing a user tries is a short smoke run of a config made for a long one). With decay_steps
        set the run may be the first slice of a longer schedule, and its warm-up stays."""
        if self.decay_steps is None:
            warmup_steps, decay_steps = min(self.warmup_steps, max_steps), max_steps
        else:
            warmup_steps, decay_steps = self.warmup_steps, self.decay_steps
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_steps": warmup_steps, "decay_steps": decay_steps}

    def for_run(self, max_steps: int) -> tuple[OptimConfig, str | None]:
        """This section with the warm-up a run of ``max_steps`` steps uses (``schedule``), and a
        warning line naming the keys if that is shorter than optim.warmup_steps."""
        warmup_steps = self.schedule(max_steps)["warmup_steps"]
        if warmup_steps == self.warmup_steps:
            return self, None
        note = (f"optim.warmup_steps={self.warmup_steps} is longer than train.max_steps={max_steps}: warming up over "
                f"{warmup_steps} steps for this run (set optim.decay_steps to keep the longer schedule)")
        return replace(self, warmup_steps=warmup_steps), note


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def decay_groups(named_params: list[tuple[str, nn.Parameter]], weight_decay: float,
                 lr_scale: LrScale | None = None) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on norm gains and biases.

    ``lr_scale`` (µP's per-parameter LR multipliers, ``model.mup.lr_multipliers``) splits each of
    the two into runs of consecutive parameters with one multiplier, kept as the group's
    ``lr_scale`` (``set_lr`` applies it). The parameters keep their order across the groups, decay
    first: a checkpoint's optimizer numbers them the same with µP and without."""
    decay = [(n, p) for n, p in named_params if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named_params if p.ndim < 2]
    groups = []
    for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
        runs: list[tuple[float, list[nn.Parameter]]] = []
        for name, param in params:
            scale = 1.0 if lr_scale is None else lr_scale(name, param)
            if not runs or runs[-1][0] != scale:
                runs.append((scale, []))
            runs[-1][1].append(param)
        for scale, members in runs or [(1.0, [])]:
            group = {"params": members, "weight_decay": wd}
            if lr_scale is not None:
                group["lr_scale"] = scale
            groups.append(group)
    return groups


def build_adamw(params_or_groups, optim_cfg: OptimConfig, device: torch.device, *,
                allow_fused: bool = True) -> torch.optim.Optimizer:
    """AdamW from the ``optim`` section; ``allow_fused=False`` where the parameters live on another
    device than the one the fused kernel would run on (DeepSpeed's optimizer offload)."""
    fused = allow_fused and (optim_cfg.fused == "on" or (optim_cfg.fused == "auto" and device.type == "cuda"))
    return torch.optim.AdamW(
        params_or_groups,
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        fused=fused or None,
    )
