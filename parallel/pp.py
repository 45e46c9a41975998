"""Pipeline parallelism: the GPT cut into stages, run by ``torch.distributed.pipelining`` schedules.

Splitting (``split_stages``): the built model is copied once per stage this rank holds and
each copy keeps only its blocks (under their original names: ``blocks`` is keyed by layer index,
so a stage's parameter names equal the whole model's and checkpoints load into any layout); the
first stage keeps the embeddings, the last the final norm and the LM head. Layers are split
evenly: ``n_layer`` must divide by ``pp * pp_virtual_stages``. With virtual stages (interleaved
schedules) rank r holds stages r, r + pp, r + 2 pp, ... (the "looped" placement the schedules
expect).

Tied embeddings (GPT-2, GPT-3) are pipelined as Megatron-core does it: the first stage holds the
word embedding, the last stage's LM head keeps a copy of it as a parameter of its own (equal at the
split: every rank built the same model from the same seed, or loaded the same model.init_from
weights, before splitting it), and after each backward the two copies' gradients are
summed over a process group of those two ranks (``TiedEmbedding``, at the end of the step's
backward, as DDP's all-reduce ends it), before the gradient norm and clipping. The same gradient, clip factor and AdamW update then keep the copies bit-equal. The norm
counts the embedding once, as one process does. The looped placement puts stage 0 on pipeline rank
0 and the last stage on rank pp - 1, so the two copies always live on different ranks, with or
without virtual stages; under tensor parallelism both copies are vocab-sharded alike (the
embedding row-wise, the head column-wise: dimension 0 of the same (vocab, d_model) weight), and
under FSDP2 both are sharded alike over the same data-parallel mesh, so the ranks that pair up
hold the same slice. Multi-token prediction (``model.mtp_depth``) needs the same pairing, tied or
not: its modules run on the last stage and read the token embedding, so the last stage keeps a copy
of ``tok_emb`` (under tied embeddings the head's weight is that copy), joined with the first
stage's in the same way; it keeps the name ``tok_emb.weight``, so its model and optimizer entries
are the first stage's in a checkpoint. Checkpoints keep the tied model's names: the copy's optimizer state is saved
and loaded as ``tok_emb.weight``'s (written once; parallel/checkpoint.py), so a pipeline's
checkpoint loads into one process and back.

Schedules (``parallel.pp_schedule``): ``gpipe`` (all forwards, then all backwards: the most
activation memory), ``1f1b`` (one forward, one backward in steady state: at most pp micro-
batches in flight on the first stage), ``interleaved_1f1b`` (virtual stages shrink the bubble
by their number), ``zero_bubble`` (interleaved, with the weight-gradient half of backward moved
into the bubble). The step's ``train.grad_accum_steps`` micro-batches are the pipeline's
micro-batches, and each micro-batch loss is scaled by 1/their number, so loss and gradients
are those of the same run without a pipeline (the mean of the micro-batch losses).

Under FSDP2 the stages keep gradients unreduced until the schedule's last backward of each stage,
where torch's stage runs FSDP2's post-backward (reduce-scatter, reshard) itself. ``zero_bubble``
splits each backward into an input pass and a later weight pass; the input pass records the weights
whose gradients the weight pass computes from the stage's parameters at that moment, so a block
resharded after forward (FSDP2's default) shows its shards there, not the gathered weights forward
used, and its gradients are lost. A zero_bubble pipeline therefore keeps its blocks gathered from
forward on (``ParallelConfig.reshard_blocks_after_forward``, read by parallel/fsdp.py).

A stage after the first receives hidden states only, but its blocks may need what one process
derives from the token ids: the document numbers of a document mask, and under context parallelism
(each stage's attention gathers K/V over its cp group, parallel/cp.py) the whole sequence's length.
Every pipeline rank holds the batch, so ``stage_inputs`` derives them on each, and the schedule
passes them to every stage as keyword arguments, cut into the same micro-batches; under cp the last
stage's loss is over this cp rank's targets, scaled as a context-parallel model scales it. With
multi-token prediction the tokens ahead and their targets come the same way, and the last stage's
logits carry the modules' loss into backward (as MoE balancing losses ride a stage's output).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

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

from common.values import full_value, local_shard
from model.gpt import GPT, document_ids, tokens_ahead
from model.moe import router_stats_paused
from parallel.cp import ContextParallelGPT, local_targets, scale_local_loss
from parallel.engine import ShardedEngine
from parallel.optim import OptimConfig
from parallel.precision import PrecisionPolicy

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")  # schedules that take a list of stages per rank
# Evaluation runs forward only, one micro-batch per call: all-forward (GPipe order) schedules.
EVAL_SCHEDULE = {False: ScheduleGPipe, True: ScheduleLoopedBFS}
# The last stage's copy of a tied embedding is checkpointed (optimizer state) under the original's name.
TIED_COPY_ALIASES = {"lm_head.weight": "tok_emb.weight"}


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages rank ``pp_rank`` holds: rank r has r, r + pp, r + 2 pp, ... (looped placement)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def stage_layers(stage: int, n_stages: int, n_layer: int) -> range:
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


def split_stages(model: GPT, stages: list[int], n_stages: int) -> list[GPT]:
    """One copy of ``model`` per stage in ``stages``, each holding only what that stage runs. With
    tied embeddings the last stage's head keeps the shared weight, now its own parameter: the
    embedding it was tied to stays on the first stage. With multi-token prediction the last stage
    holds the modules and keeps a copy of the token embedding, which they read (``embedding_copy``)."""
    parts = []
    for stage in stages:
        part = copy.deepcopy(model) if len(stages) > 1 else model
        keep = {str(i) for i in stage_layers(stage, n_stages, model.cfg.n_layer)}
        for name in [n for n in part.blocks if n not in keep]:
            del part.blocks[name]
        if stage > 0:
            part.takes_ids, part.pos_emb = False, None
            if stage < n_stages - 1 or part.mtp is None:
                part.tok_emb = None
        if stage < n_stages - 1:
            part.norm_f = part.lm_head = part.mtp = None
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


class QuietInferenceStage(PipelineStage):
    """torch's pipeline stage, whose shape inference leaves the MoE router statistics and the
    logged multi-token-prediction loss alone.

    Before its first micro-batch a stage infers its shapes with a forward (on a detached copy of
    the first micro-batch, or on uninitialised placeholders after the first stage) and a backward
    that may recompute it: routing and losses that are no micro-batch's, which the logged expert
    load, auxiliary loss, dropped copies and MTP loss would otherwise count (NaN from the placeholders)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with router_stats_paused(self.submod), mtp_window_kept(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        with router_stats_paused(self.submod), mtp_window_kept(self.submod):
            return super()._backward_metadata_inference(*args, **kwargs)


@contextlib.contextmanager
def mtp_window_kept(part: GPT):
    """The MTP losses ``part`` logs are those it had before (what runs inside is not counted)."""
    kept = list(part.mtp_window)
    try:
        yield
    finally:
        part.mtp_window = kept


def build_pipeline(parts: list[GPT], stages: list[int], n_stages: int, schedule: str, n_microbatches: int,
                   group: dist.ProcessGroup, device: torch.device) -> tuple[Pipeline, Pipeline]:
    """The training pipeline of ``parts`` (already parallelized, recomputed, compiled and
    sharded) and a forward-only one over the same parts for evaluation."""

    def pipeline(cls: type, multi: bool, n: int) -> Pipeline:
        pipeline_stages = [QuietInferenceStage(part, s, n_stages, device, group=group)
                           for part, s in zip(parts, stages)]
        first = pipeline_stages if multi else pipeline_stages[0]
        driver = cls(first, n_microbatches=n, loss_fn=_loss_fn(parts), scale_grads=True)
        return Pipeline(parts, driver, group, has_first=0 in stages, has_last=n_stages - 1 in stages)

    multi = len(stages) > 1
    return (pipeline(SCHEDULES[schedule], schedule in MULTI_STAGE, n_microbatches),
            pipeline(EVAL_SCHEDULE[multi], multi, 1))


def _loss_fn(parts: list[GPT]):
    """The last stage's loss: the model's own loss op on its logits (mean over the micro-batch).
    Under context parallelism the logits are this cp rank's tokens': the loss is over their
    targets, scaled as a context-parallel model scales it (parallel/cp.py)."""
    ops = parts[0].ops
    cp = parts[0] if isinstance(parts[0], ContextParallelGPT) else None

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mine = targets if cp is None else local_targets(targets, cp.cp, cp.cp_rank)
        out = ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1))
        return out if cp is None else scale_local_loss(out, targets, cp.cp, cp.cp_rank)

    return loss


def stage_inputs(part: GPT, x: torch.Tensor, y: torch.Tensor, train: bool) -> dict[str, object]:
    """What every stage needs besides its input, derived from the token ids ``x`` (and targets
    ``y``) as one process derives it in forward: the document numbers (document mask), under
    context parallelism the whole sequence's length, and in training with multi-token prediction
    the tokens ahead and their targets (``tokens_ahead``, of whole sequences: a context-parallel
    stage takes its chunks), which the last stage's modules read. A stage after the first gets only
    hidden states (this cp rank's chunks of them); every pipeline rank holds the batch, so each
    derives these itself, and the schedule hands each stage its micro-batch's rows."""
    inputs: dict[str, object] = {}
    documents = document_ids(part.cfg, x)
    if documents is not None:
        inputs["documents"] = documents
    if isinstance(part, ContextParallelGPT):
        inputs["seq_len"] = x.shape[1]
    if train and part.cfg.mtp_depth:
        inputs["ahead_ids"], inputs["ahead_targets"] = tokens_ahead(x, y, part.cfg.mtp_depth, documents)
    return inputs


def run_step(pipeline: Pipeline, x: torch.Tensor, y: torch.Tensor, *, train: bool) -> torch.Tensor:
    """One pipelined forward (and backward when ``train``) over the whole batch; every rank of the
    pipeline returns the mean micro-batch loss (a collective over the pipeline group)."""
    losses: list[torch.Tensor] = []
    args = (x,) if pipeline.has_first else ()
    target = y if pipeline.has_last else None
    run = pipeline.schedule.step if train else pipeline.schedule.eval
    run(*args, target=target, losses=losses, **stage_inputs(pipeline.parts[0], x, y, train))
    device = x.device
    if losses:
        loss = torch.stack([full_value(m.detach()).float() for m in losses]).mean()
    else:
        loss = torch.zeros((), device=device)
    # Only the last stage saw the losses; the others contribute zero to the sum.
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=pipeline.group)
    return loss


# --------------------------------------------------------------------------- tied embeddings


def tied_embedding_group(mesh, pp_group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The process group of the first and the last stage's rank of this rank's pipeline (None for
    the ranks in between). Collective: every rank creates every pipeline's group, in the same
    order. With two stages the pipeline's own group is that pair."""
    pp_dim = list(mesh.mesh_dim_names).index("pp")
    ranks = mesh.mesh.movedim(pp_dim, 0).reshape(mesh.mesh.shape[pp_dim], -1)  # [pp rank, pipeline]
    if len(ranks) == 2:
        return pp_group
    group = None
    for first, last in zip(ranks[0].tolist(), ranks[-1].tolist()):
        created = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            group = created
    return group


def embedding_copy(part: GPT) -> nn.Parameter | None:
    """The last stage's copy of the first stage's token embedding, if it has one: the table its
    multi-token-prediction modules read (``tok_emb``, kept by ``split_stages``; under tied embeddings
    the head's weight too), or a tied head's weight."""
    if part.takes_ids:
        return None
    if part.tok_emb is not None:
        return part.tok_emb.weight
    return part.lm_head.weight if part.lm_head is not None and part.cfg.tie_embeddings else None


class TiedEmbedding:
    """The two copies of a pipelined shared embedding on this rank (the first stage's ``tok_emb.weight``
    or the last stage's ``embedding_copy``), and the group that joins them."""

    def __init__(self, parts: list[GPT], group: dist.ProcessGroup | None):
        self.group = group
        self.originals = [part.tok_emb.weight for part in parts if part.takes_ids]
        self.copies = [copy for part in parts if (copy := embedding_copy(part)) is not None]

    @property
    def params(self) -> list[nn.Parameter]:
        return self.originals + self.copies

    @torch.no_grad()
    def sum_grads(self) -> None:
        """After backward: each copy's gradient becomes the sum of both, the tied parameter's gradient."""
        for param in self.params:
            grad = param.grad
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                # The vocab-parallel embedding's backward leaves its gradient replicated, the head's is
                # vocab-sharded: laid out as the parameter (a local slice, no communication), both
                # ranks of the pair hold the same slice.
                param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(local_shard(grad), op=dist.ReduceOp.SUM, group=self.group)


def tie_embedding_copies(parts: list[GPT], mesh, pp_group: dist.ProcessGroup) -> TiedEmbedding | None:
    """The copies of a shared embedding across the pipeline and the group that joins them (collective:
    every rank calls it); None when the embeddings are not tied and there is no multi-token prediction."""
    if not (parts[0].cfg.tie_embeddings or parts[0].cfg.mtp_depth):
        return None
    return TiedEmbedding(parts, tied_embedding_group(mesh, pp_group))


# --------------------------------------------------------------------------- the engine


class PipelineEngine(ShardedEngine):
    """This rank's pipeline stages as an engine: the schedule runs each step's micro-batches; each
    stage part has its own optimizer (and fp32 masters), stepped together by the sharded engine's
    one ``OptimizerStep`` with a gradient norm that spans the pipeline (a tied embedding's copy
    counted once), and saved as its DCP checkpoints are (the copy's state under the original's name)."""

    def __init__(self, pipeline: Pipeline, eval_pipeline: Pipeline, policy: PrecisionPolicy,
                 optim_cfg: OptimConfig, device: torch.device, *, loss_parallel: bool,
                 tied: TiedEmbedding | None = None):
        # FSDP2 syncs a stage's gradients in the schedule's last backward of it (torch's stage runs
        # the post-backward itself), so the engine never toggles it: fsdp=False here.
        super().__init__(nn.ModuleList(pipeline.parts), policy, optim_cfg, device, fsdp=False,
                         loss_parallel=loss_parallel, parts=pipeline.parts, group=pipeline.group,
                         counted_once=tuple(tied.copies) if tied is not None else ())
        self.pipeline, self.eval_pipeline, self.tied = pipeline, eval_pipeline, tied
        # An untied model's copy (the MTP modules' embedding) already has the original's name.
        self.checkpoint_aliases = TIED_COPY_ALIASES if pipeline.parts[0].cfg.tie_embeddings else None

    def take_mtp_loss(self) -> torch.Tensor:
        """The last stage's mean multi-token-prediction loss, on every rank of the pipeline (a
        collective over its group: the other stages add zero)."""
        values = [v for part in self.pipeline.parts if part.mtp is not None and (v := part.take_mtp_loss()) is not None]
        loss = torch.stack(values).mean().float() if values else torch.zeros((), device=self.device)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pipeline.group)
        return loss

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, is_last_micro: bool, n_micro: int) -> torch.Tensor:
        raise RuntimeError("a pipeline runs whole steps: call forward_backward_step")

    def forward_backward_step(self, batches, n_micro: int) -> tuple[torch.Tensor, float]:
        """The schedule needs every micro-batch of the step at once: they are concatenated and the
        schedule cuts them apart again, so each stage sees exactly the un-pipelined micro-batches."""
        self.mark_phase("data")
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(n_micro)]
        wait = time.perf_counter() - t0
        x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
        self.mark_phase("pipeline schedule")  # forward and backward interleaved with stage hand-offs
        with self._loss_context(), self.policy.forward_context(self.device):
            loss = run_step(self.pipeline, x, y, train=True)
        if self.tied is not None:  # the step's gradients are complete: the tied copies' are joined
            self.tied.sum_grads()
        return loss, wait

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._loss_context(), self.policy.forward_context(self.device):
            return run_step(self.eval_pipeline, x, y, train=False)
