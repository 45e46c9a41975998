"""Pipeline parallelism: the GPT cut into stages, run by ``torch.distributed.pipelining`` schedules.

Splitting (``split_stages``): the built model is copied once per stage this rank holds and
each copy keeps only its blocks (under their original names: ``blocks`` is keyed by layer index,
so a stage's parameter names equal the whole model's and checkpoints load into any layout); the
first stage keeps the embeddings, the last the final norm and the LM head. Layers are split
evenly: ``n_layer`` must divide by ``pp * pp_virtual_stages``. With virtual stages (interleaved
schedules) rank r holds stages r, r + pp, r + 2 pp, ... (the "looped" placement the schedules
expect). A tied LM head cannot live on two stages, so pipeline runs need untied embeddings.

Schedules (``parallel.pp_schedule``): ``gpipe`` (all forwards, then all backwards: the most
activation memory), ``1f1b`` (one forward, one backward in steady state: at most pp micro-
batches in flight on the first stage), ``interleaved_1f1b`` (virtual stages shrink the bubble
by their number), ``zero_bubble`` (interleaved, with the weight-gradient half of backward moved
into the bubble). The step's ``train.grad_accum_steps`` micro-batches are the pipeline's
micro-batches, and each micro-batch loss is scaled by 1/their number, so loss and gradients
are those of the same run without a pipeline (the mean of the micro-batch losses).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from model.gpt import GPT
from parallel.checkpoint import load_sharded, save_sharded
from parallel.engine import Engine, StepResult, TorchEngine, skips_on_device, step_unless_skipped
from parallel.optim import OptimConfig
from parallel.precision import PrecisionPolicy
from parallel.values import local_value, loss_parallel_context

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")  # schedules that take a list of stages per rank
# Evaluation runs forward only, one micro-batch per call: all-forward (GPipe order) schedules.
EVAL_SCHEDULE = {False: ScheduleGPipe, True: ScheduleLoopedBFS}


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages rank ``pp_rank`` holds: rank r has r, r + pp, r + 2 pp, ... (looped placement)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def stage_layers(stage: int, n_stages: int, n_layer: int) -> range:
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


def split_stages(model: GPT, stages: list[int], n_stages: int) -> list[GPT]:
    """One copy of ``model`` per stage in ``stages``, each holding only what that stage runs."""
    parts = []
    for stage in stages:
        part = copy.deepcopy(model) if len(stages) > 1 else model
        keep = {str(i) for i in stage_layers(stage, n_stages, model.cfg.n_layer)}
        for name in [n for n in part.blocks if n not in keep]:
            del part.blocks[name]
        if stage > 0:
            part.tok_emb = part.pos_emb = None
        if stage < n_stages - 1:
            part.norm_f = part.lm_head = None
        parts.append(part)
    return parts


@dataclass
class Pipeline:
    """This rank's share of the pipeline: its stage modules and the schedule that drives them."""

    parts: list[GPT]
    schedule: object  # a torch.distributed.pipelining schedule
    group: dist.ProcessGroup
    has_first: bool
    has_last: bool


def build_pipeline(parts: list[GPT], stages: list[int], n_stages: int, schedule: str, n_microbatches: int,
                   group: dist.ProcessGroup, device: torch.device) -> tuple[Pipeline, Pipeline]:
    """The training pipeline of ``parts`` (already parallelized, recomputed, compiled and
    sharded) and a forward-only one over the same parts for evaluation."""

    def pipeline(cls: type, multi: bool, n: int) -> Pipeline:
        pipeline_stages = [PipelineStage(part, s, n_stages, device, group=group) for part, s in zip(parts, stages)]
        first = pipeline_stages if multi else pipeline_stages[0]
        driver = cls(first, n_microbatches=n, loss_fn=_loss_fn(parts), scale_grads=True)
        return Pipeline(parts, driver, group, has_first=0 in stages, has_last=n_stages - 1 in stages)

    multi = len(stages) > 1
    return (pipeline(SCHEDULES[schedule], schedule in MULTI_STAGE, n_microbatches),
            pipeline(EVAL_SCHEDULE[multi], multi, 1))


def _loss_fn(parts: list[GPT]):
    """The last stage's loss: the model's own loss op on its logits (mean over the micro-batch)."""
    ops = parts[0].ops

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss


def run_step(pipeline: Pipeline, x: torch.Tensor, y: torch.Tensor, *, train: bool) -> torch.Tensor:
    """One pipelined forward (and backward when ``train``) over the whole batch; every rank of the
    pipeline returns the mean micro-batch loss (a collective over the pipeline group)."""
    losses: list[torch.Tensor] = []
    args = (x,) if pipeline.has_first else ()
    target = y if pipeline.has_last else None
    run = pipeline.schedule.step if train else pipeline.schedule.eval
    run(*args, target=target, losses=losses)
    device = x.device
    if losses:
        loss = torch.stack([local_value(m.detach()).float() for m in losses]).mean()
    else:
        loss = torch.zeros((), device=device)
    # Only the last stage saw the losses; the others contribute zero to the sum.
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=pipeline.group)
    return loss


# --------------------------------------------------------------------------- the engine


class PipelineEngine(Engine):
    """This rank's pipeline stages as an ``Engine``: the schedule runs each step's micro-batches;
    each stage part has its own optimizer (and fp32 masters), stepped together."""

    def __init__(self, pipeline: Pipeline, eval_pipeline: Pipeline, policy: PrecisionPolicy,
                 optim_cfg: OptimConfig, device: torch.device, *, loss_parallel: bool):
        self.pipeline, self.eval_pipeline, self.policy, self.device = pipeline, eval_pipeline, policy, device
        self.model = nn.ModuleList(pipeline.parts)
        self.grad_clip = optim_cfg.grad_clip
        self.steppers = [TorchEngine(part, policy, optim_cfg, device) for part in pipeline.parts]
        self._loss_context = loss_parallel_context if loss_parallel else contextlib.nullcontext

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, is_last_micro: bool, n_micro: int) -> torch.Tensor:
        raise RuntimeError("a pipeline runs whole steps: call forward_backward_step")

    def forward_backward_step(self, batches, n_micro: int) -> tuple[torch.Tensor, float]:
        """The schedule needs every micro-batch of the step at once: they are concatenated and the
        schedule cuts them apart again, so each stage sees exactly the un-pipelined micro-batches."""
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(n_micro)]
        wait = time.perf_counter() - t0
        x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
        with self._loss_context(), self.policy.forward_context(self.device):
            loss = run_step(self.pipeline, x, y, train=True)
        return loss, wait

    def optimizer_step(self, lr: float, loss: torch.Tensor) -> StepResult:
        for stepper in self.steppers:
            for group in stepper.optimizer.param_groups:
                group["lr"] = lr
            if stepper.masters is not None:
                stepper.masters.grads_to_masters()
        grads = [p.grad for s in self.steppers for p in s._grad_params if p.grad is not None]
        grad_norm = pipeline_grad_norm(grads, self.pipeline.group)
        # A non-finite gradient must never reach the weights. Fused AdamW skips on the device
        # (found_inf), so with it on every stage the step needs no host sync; the other
        # implementations read the flag on the host.
        skipped = ~(torch.isfinite(grad_norm) & torch.isfinite(loss))
        on_device = all(skips_on_device(s.optimizer) for s in self.steppers)
        if not on_device:
            skipped = bool(skipped)
        if self.grad_clip > 0 and (on_device or not skipped):
            # clip_grad_norm_'s rule with the pipeline-wide norm, computed and applied on the device
            scale = (self.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([local_value_of(g) for g in grads], scale)
        for stepper in self.steppers:
            step_unless_skipped(stepper.optimizer, skipped)
            if stepper.masters is not None and (on_device or not skipped):
                stepper.masters.masters_to_model()
        for stepper in self.steppers:
            stepper.optimizer.zero_grad(set_to_none=True)
            stepper.model.zero_grad(set_to_none=True)
        return StepResult(grad_norm=grad_norm, skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._loss_context(), self.policy.forward_context(self.device):
            return run_step(self.eval_pipeline, x, y, train=False)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def comm_stats(self) -> dict[str, float]:
        return {}

    def local_weights(self) -> list[torch.Tensor]:
        return [t for stepper in self.steppers for t in stepper.local_weights()]

    def module(self) -> nn.Module:
        return self.model

    def save(self, directory: Path, rank: int) -> None:
        save_sharded([(s.model, s.optimizer) for s in self.steppers], None, directory)

    def load(self, directory: Path) -> None:
        load_sharded([(s.model, s.optimizer) for s in self.steppers], None, directory)


def pipeline_grad_norm(grads: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """The 2-norm of the whole model's gradient: each stage's part (itself reduced over its
    tensor- and data-parallel shards by DTensor), squared and summed over the pipeline."""
    local = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True) if grads else torch.zeros(())
    local = local_value_of(local.full_tensor() if isinstance(local, DTensor) else local).float()
    squared = (local ** 2).reshape(1)
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    return squared.sqrt()[0]


def local_value_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
