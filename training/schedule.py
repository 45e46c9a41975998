"""Learning-rate schedule: linear warmup to the peak, cosine decay to min_lr, then flat."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
