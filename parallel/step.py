"""The optimizer step of the torch engines, written once.

Every torch engine steps its ``OptimizedPart``s (a module with the optimizer that steps it: the whole
model under one process, DDP, FSDP2 or tensor parallelism; one per pipeline stage this rank holds)
through the same ``OptimizerStep``, in this order:

    1. the step's learning rate into every optimizer
    2. bf16 gradients into their fp32 masters (bf16_master without a sharded strategy)
    3. fp16: the GradScaler unscales the gradients
    4. the gradient norm of the whole model: each part's gradients (DTensors gathered by DTensor
       over their tensor- and data-parallel shards), their squares summed over the pipeline group
       when there is one; parameters that are copies of another (a pipelined tied embedding) count once
    5. the finite check: a non-finite norm or loss skips the step. Fused AdamW takes the flag as a
       device tensor (``found_inf``), so the step reads nothing on the host; the other
       implementations need it there (a sync each step). The GradScaler skips on its own.
    6. clipping to ``optim.grad_clip`` with that norm, on the device (``clip_grad_norm_``'s rule)
    7. the optimizer step (skipped as decided), then QK-clip where Muon has it (parallel/qk_clip.py:
       each stage's heads, counts summed over the pipeline), masters back into the bf16 weights, zero_grad

DeepSpeed's ZeRO engine (parallel/zero.py) shares only step 1 and the ``StepResult``: its
``engine.step()`` owns the rest, and the ZeRO optimizers require it to, because the gradients
live in DeepSpeed's own partitioned buffers and the fp32 masters in its flat partitions, which
only its step reads. It clips, checks for overflow, skips and scales the loss (its own dynamic
scaler) inside that call.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from common.values import full_value, is_dtensor, local_shard
from model.mup import lr_multipliers
from parallel.optim import OptimConfig, build_optimizer, muon_update
from parallel.precision import MasterWeights, PrecisionPolicy
from parallel.qk_clip import QKClip


@dataclass
class StepResult:
    grad_norm: torch.Tensor  # on device; read only at log intervals
    # A host bool, or a 0-d bool tensor on the device where the engine skipped the update there
    # (fused AdamW's found_inf): the loop reads those at log intervals and before saves.
    skipped: bool | torch.Tensor
    loss_scale: float | None = None
    # With QK-clip (optim.muon.qk_clip_tau): heads clipped after this step and the step's largest
    # attention logit, over the whole model (device tensors, read at log intervals).
    qk_clipped: torch.Tensor | None = None
    max_logit: torch.Tensor | None = None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's ``lr`` into every group, times the group's ``lr_scale`` where it has one (µP's
    multipliers; a Muon group with a peak of its own: optim.muon.lr / optim.lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Fused AdamW takes the skip flag as a device tensor (found_inf): no host sync to skip a step."""
    return bool(optimizer.defaults.get("fused"))


def step_unless_skipped(optimizer: torch.optim.Optimizer, skipped: bool | torch.Tensor) -> None:
    """Step, unless ``skipped``: a host bool decides here; a device flag goes to the fused kernel,
    which leaves weights, moments and step count as they were when found_inf is 1."""
    if isinstance(skipped, torch.Tensor):
        optimizer.found_inf = skipped.float()
        optimizer.step()
        del optimizer.found_inf
    elif not skipped:
        optimizer.step()


def muon_comm_stats(parts: list) -> dict[str, float]:
    """Bytes this rank sent since the last call to orthogonalise sharded Muon matrices
    (``muon_bytes_sent``, for ``Engine.comm_stats``); empty where no part steps with Muon."""
    counts = [part.optimizer.pop_comm_bytes() for part in parts if hasattr(part.optimizer, "pop_comm_bytes")]
    return {"muon_bytes_sent": sum(counts)} if counts else {}


@dataclass
class OptimizedPart:
    """A module (a whole model or one pipeline stage) with the optimizer that steps it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    masters: MasterWeights | None  # fp32 copies of bf16 weights, which the optimizer steps instead
    params: list[nn.Parameter]  # the model's trainable parameters
    stepped: list[torch.Tensor]  # what the optimizer steps, aligned with params
    qk_clip: QKClip | None = None  # Muon's QK-clip over this module's attention layers

    @classmethod
    def build(cls, model: nn.Module, policy: PrecisionPolicy, optim_cfg: OptimConfig,
              device: torch.device) -> OptimizedPart:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        masters = MasterWeights([p for _, p in named]) if policy.engine_masters else None
        stepped = named if masters is None else [(n, m) for (n, _), m in zip(named, masters.masters)]
        optimizer = build_optimizer(stepped, optim_cfg, device, lr_multipliers(model),
                                    lr_multipliers(model, muon_update(optim_cfg)))
        tau = optim_cfg.muon.qk_clip_tau if optim_cfg.name == "muon" else None
        qk_clip = QKClip(model, dict(stepped), tau) if tau is not None else None
        return cls(model, optimizer, masters, [p for _, p in named], [p for _, p in stepped], qk_clip)

    def local_weights(self) -> list[torch.Tensor]:
        """The values this rank holds: its shards of the parameters, and the fp32 masters."""
        tensors = [local_shard(p).detach() for p in self.model.parameters()]
        if self.masters is not None:
            tensors += [m.detach() for m in self.masters.masters]
        return [t for t in tensors if t.numel() > 0]


class OptimizerStep:
    """Steps ``parts`` together with one gradient norm, one skip decision and one clip (see the
    module docstring). ``group``: the pipeline's process group, over which the norm's squares are
    summed (None: this rank holds the whole model, up to DTensor shards). ``counted_once``:
    trainable parameters that are copies of a parameter counted elsewhere, left out of the norm
    (they are still clipped and stepped)."""

    def __init__(self, parts: list[OptimizedPart], *, grad_clip: float, device: torch.device,
                 scaler: torch.amp.GradScaler | None = None, group: dist.ProcessGroup | None = None,
                 counted_once: tuple[nn.Parameter, ...] = ()):
        self.parts, self.grad_clip, self.device, self.scaler, self.group = parts, grad_clip, device, scaler, group
        self.counted_once = {id(p) for p in counted_once}

    def __call__(self, lr: float, loss: torch.Tensor) -> StepResult:
        for part in self.parts:
            set_lr(part.optimizer, lr)
            if part.masters is not None:
                part.masters.grads_to_masters()
            if self.scaler is not None:
                self.scaler.unscale_(part.optimizer)
        grads, counted = [], []
        for part in self.parts:
            for param, stepped in zip(part.params, part.stepped):
                if stepped.grad is not None:
                    grads.append(stepped.grad)
                    if id(param) not in self.counted_once:
                        counted.append(stepped.grad)
        grad_norm = self.total_norm(counted)
        # A non-finite gradient must never reach the weights.
        skipped = ~(torch.isfinite(grad_norm) & torch.isfinite(loss))
        on_device = all(skips_on_device(part.optimizer) for part in self.parts)
        if not on_device:
            skipped = bool(skipped)
        if self.grad_clip > 0 and (on_device or not skipped):
            clip_grads_(grads, self.grad_clip, grad_norm)
        for part in self.parts:
            if self.scaler is not None:
                self.scaler.step(part.optimizer)  # skips by itself on inf/nan and lowers the scale
            else:
                step_unless_skipped(part.optimizer, skipped)
        if self.scaler is not None:
            self.scaler.update()
        clipped, max_logit = self.qk_clip(skipped)
        for part in self.parts:
            if part.masters is not None and (on_device or not skipped):
                part.masters.masters_to_model()  # after a skip the masters are unchanged: the copy is a no-op
            part.optimizer.zero_grad(set_to_none=True)
            part.model.zero_grad(set_to_none=True)
        scale = self.scaler.get_scale() if self.scaler is not None else None
        return StepResult(grad_norm=grad_norm, skipped=skipped, loss_scale=scale, qk_clipped=clipped,
                          max_logit=max_logit)

    def qk_clip(self, skipped: bool | torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """QK-clip of every part that has one; the heads clipped and the largest logit, over the
        pipeline when there is one (None, None without QK-clip)."""
        clips = [part.qk_clip for part in self.parts if part.qk_clip is not None]
        if not clips:
            return None, None
        stats = [clip(not bool(skipped)) for clip in clips]  # Muon decides skips on the host anyway
        clipped = torch.stack([c for c, _ in stats]).sum().reshape(1)
        max_logit = torch.stack([m for _, m in stats]).max().reshape(1)
        if self.group is not None:
            dist.all_reduce(clipped, op=dist.ReduceOp.SUM, group=self.group)
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=self.group)
        return clipped[0], max_logit[0]

    def total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, as a plain tensor on every rank."""
        if grads:
            norm = _norm_over_meshes(grads)
        else:
            norm = torch.zeros((), device=self.device)
        if self.group is None:
            return norm
        squared = (norm.float() ** 2).reshape(1)
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.group)
        return squared.sqrt()[0]


def _norm_over_meshes(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of gradients that may be DTensors on different meshes (expert-parallel weights
    live on the expert mesh, the rest on the data-parallel one): one norm per mesh, then combined."""
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_mesh[grad.device_mesh if is_dtensor(grad) else None].append(grad)
    norms = [full_value(torch.nn.utils.get_total_norm(group, 2.0, foreach=True)) for group in by_mesh.values()]
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.float() for n in norms]).square().sum().sqrt()


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """``clip_grad_norm_``'s rule with a norm computed elsewhere, applied on the device (no host
    read): every gradient scaled by min(1, max_norm / (norm + 1e-6)), on each rank's local shards."""
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        shard = local_shard(grad)
        by_device[shard.device].append(shard)
    for device, shards in by_device.items():
        torch._foreach_mul_(shards, scale.to(device))
