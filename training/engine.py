"""One training step, whatever the strategy: forward/backward per micro-batch, then an optimizer step.

``train.py`` drives an engine through four calls: ``forward_backward`` per micro-batch,
``optimizer_step`` once per step, ``eval_loss`` and ``save``/``load`` for checkpoints.
``TorchEngine`` serves plain, DDP and FSDP2 models (wrapped beforehand by ``parallel/``);
DeepSpeed ZeRO brings its own engine with the same methods (``parallel/zero.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from training.precision import MasterWeights, forward_context


@dataclass
class StepResult:
    grad_norm: torch.Tensor  # on device; read only at log intervals
    skipped: bool
    loss_scale: float | None = None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP / compile wrappers (FSDP2 shards in place, nothing to unwrap)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def build_adamw(params_or_groups, optim_cfg, device: torch.device) -> torch.optim.Optimizer:
    fused = optim_cfg.fused == "on" or (optim_cfg.fused == "auto" and device.type == "cuda")
    return torch.optim.AdamW(
        params_or_groups,
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        fused=fused or None,
    )


def decay_groups(named_params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on norm gains and biases."""
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class TorchEngine:
    def __init__(self, model: nn.Module, cfg, device: torch.device, world_size: int = 1):
        self.model, self.cfg, self.device = model, cfg, device
        self.mode = cfg.precision.mode
        self.world_size = world_size
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.masters = None
        if self.mode == "bf16_master" and cfg.parallel.strategy != "fsdp":
            # FSDP2 keeps fp32 shards and casts to bf16 itself (MixedPrecisionPolicy): no copies.
            self.masters = MasterWeights([p for _, p in params])
            params = [(n, m) for (n, _), m in zip(params, self.masters.masters)]
        self.optimizer = build_adamw(decay_groups(params, cfg.optim.weight_decay), cfg.optim, device)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.precision.fp16_init_scale) if self.mode == "fp16" else None
        self._grad_params = [p for _, p in params]
        # Bytes sent per step by a DDP comm hook (parallel/ddp.py); None without one.
        self.comm_stats = getattr(model, "comm_stats", None)

    # ----------------------------------------------------------------- step

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, is_last_micro: bool, n_micro: int) -> torch.Tensor:
        with self._grad_sync(is_last_micro):
            with forward_context(self.mode, self.device, self.cfg.precision):
                loss = self.model(x, y)
            scaled = loss / n_micro
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach()

    def _grad_sync(self, is_last_micro: bool) -> contextlib.AbstractContextManager:
        """Skip gradient all-reduce on all but the last micro-batch of a step."""
        if hasattr(self.model, "no_sync") and not is_last_micro:
            return self.model.no_sync()  # DDP
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(is_last_micro)  # FSDP2
        return contextlib.nullcontext()

    def optimizer_step(self, lr: float, loss: torch.Tensor) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.masters is not None:
            self.masters.grads_to_masters()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip_and_norm()
        # The one deliberate host sync per step: a non-finite gradient must never reach the weights.
        finite = bool(torch.isfinite(grad_norm) & torch.isfinite(loss))
        skipped = not finite
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself on inf/nan and lowers the scale
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        if self.masters is not None and finite:
            self.masters.masters_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        scale = self.scaler.get_scale() if self.scaler is not None else None
        return StepResult(grad_norm=grad_norm, skipped=skipped, loss_scale=scale)

    def _clip_and_norm(self) -> torch.Tensor:
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grads = [p for p in self._grad_params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with forward_context(self.mode, self.device, self.cfg.precision):
            return self.model(x, y).detach()

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # ----------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) states for plain and DDP models; FSDP saves through parallel/checkpoint.py."""
        state = {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from training.checkpoint import CheckpointError

        try:
            unwrap(self.model).load_state_dict(state["model"])
        except RuntimeError as exc:
            detail = str(exc).strip().splitlines()[-1].strip()[:200]
            raise CheckpointError(f"checkpoint does not match the model: {detail}") from None
        self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def save(self, directory: Path, rank: int) -> None:
        if self.cfg.parallel.strategy == "fsdp":
            from parallel.checkpoint import save_sharded

            save_sharded(self, directory)
        elif rank == 0:
            torch.save(self.state_dict(), directory / "model_optim.pt")

    def load(self, directory: Path) -> None:
        if self.cfg.parallel.strategy == "fsdp":
            from parallel.checkpoint import load_sharded

            load_sharded(self, directory)
            return
        from training.checkpoint import safe_torch_load

        self.load_state_dict(safe_torch_load(directory / "model_optim.pt", map_location=self.device))
