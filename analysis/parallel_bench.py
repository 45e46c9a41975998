"""Loss parity, per-rank model-state memory and bytes communicated of every data-parallel strategy
and of the tensor-, pipeline- and data-parallel layouts, side by side: the library behind
``tools/bench_parallel.py`` (the command line) and the measured file the chapter's priority table
quotes (docs/results/parallel_strategies_cpu.md and its rows, .json).

Every row launches ``torchrun --nproc_per_node=<its ranks>`` on the tool (``run_rank`` in each rank), which
builds the model and engine exactly as train.py does (training/build.py, the one build path, after
train.py's promotion of strategy none to ddp or fsdp), trains ``--steps`` steps, and reports:

- the loss after the last step next to a single-process run that sees the same global batch,
  micro-batch x ``--nproc`` sequences per step. The loader gives data-parallel rank r every
  dp-th window and a step's grad_accum micro-batches are consecutive, so the union over
  data-parallel ranks and micro-batches is the single process's batch. Strategy rows use
  ``--nproc`` ranks; layout rows use the ranks their degrees multiply to, with the per-rank
  micro-batch sized to keep the global batch (pipelines run pp micro-batches per step, the
  smallest count their schedules accept). Layout rows train untied embeddings (a pipeline cannot
  share the table between its first and last stage), so they are compared with a single process
  that has untied embeddings too;
- per-rank bytes of parameters, gradients and optimizer state, measured as the sum of the
  *local* storages each rank holds (DTensor shards via to_local for FSDP2 and tensor
  parallelism, DeepSpeed's partitions for ZeRO), gradients read right after the last backward of
  the step (for pipelines: after the schedule has reduce-scattered them), before the optimizer
  step frees them; against the formula: the ZeRO paper's bytes per parameter (Rajbhandari et al.
  2020, section 5, analysis/estimator.model_state_bytes) applied to the parameters one rank holds
  before data-parallel sharding, analysis/estimator.stage_parameters (its pipeline stage's blocks,
  matmul weights split by tp, norms and output biases whole, embedding ends on the first and last
  stage);
- bytes each rank sends per step, measured during the last step by a dispatch mode
  (analysis/collective_bytes.CommBytes) that sees every collective and point-to-point op (c10d
  and functional, so DTensor's tensor-parallel collectives, FSDP2's all-gathers and
  reduce-scatters, DDP's and DeepSpeed's all-reduces and the pipeline's sends), grouped by the
  mesh dimension of the process group. Bytes sent are those of a ring algorithm on the measured
  tensor sizes ((n-1)/n of the whole tensor for an all-gather or reduce-scatter over n ranks,
  twice that for an all-reduce, the tensor for a send), the same convention as the formula: analysis/estimator.tp_comm_seconds (tensor parallel per
  micro-batch), comm_volume (data parallel), and one activation (or its gradient) per
  micro-batch and pipeline neighbour.

Expert-parallel rows (``ep2``, ``ep2_fsdp``; with an MoE config) also count, in every step, the bytes each
rank sends in the all-to-alls that carry token copies to their experts and back
(``ExpertTraffic``), against analysis/estimator.expert_all_to_all, which assumes balanced routing,
and against ``routed_all_to_all_bytes``, the same count from the step's actual router decisions.

Measured and formula differ where the engines hold or send more than the papers count; the
notes under the tables say where. ``write_markdown`` also writes the rows as JSON next to the
tables (same stem), which tools/reproduce.py reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from analysis.collective_bytes import CommBytes, bytes_by_dimension
from analysis.estimator import (
    STATE_BYTES,
    JobSpec,
    comm_volume,
    cp_comm_seconds,
    estimate_memory,
    expert_all_to_all,
    fsdp_collectives,
    model_state_bytes,
    routed_parameters_per_block,
    stage_parameters,
    tp_comm_seconds,
)
from common.fields import choices
from common.measure import provenance, summarize
from common.progress import Progress
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from common.values import local_shard
from model.flops import count_parameters
from model.moe import moe_layers
from parallel.config import ParallelConfig
from parallel.distributed import DistContext, init_distributed, shutdown_distributed
from parallel.layout import Layout
from parallel.optim import lr_at
from parallel.pp import stage_ids
from parallel.zero import ZeroEngine
from training.build import build_from_config, resolve_job
from training.config import JobConfig, load_config
from training.loop import train_step

ROOT = Path(__file__).resolve().parents[1]  # the repository, where subprocesses run

# Every data-parallel strategy the config accepts ("none" has no data parallelism to measure).
STRATEGIES = tuple(s for s in choices(ParallelConfig, "strategy") if s != "none")
DEFAULT_OVERRIDES = ["--train.eval_interval=0", "--checkpoint.interval=0", "--checkpoint.save_final=false",
                     "--logging.progress=plain", "--logging.jsonl=false", "--train.device=cpu"]
STATE_KEYS = ("params", "grads", "optimizer")
COMM_DIMS = ("tp", "dp", "pp", "other")  # columns of the communication table; dp_shard and dp_replicate are "dp"


@dataclass(frozen=True)
class BenchLayout:
    """A layout row of the benchmark: what --layouts names it by, and its layout (parallel/layout.py),
    whose strategy none becomes what train.py runs."""

    key: str
    layout: Layout

    @classmethod
    def of(cls, key: str, **degrees: int) -> BenchLayout:
        """The row of ``degrees`` (the parallel section's tp, pp, dp_shard, cp, ep) on the ranks they multiply to."""
        ranks = degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("dp_shard", 1) * degrees.get("cp", 1)
        return cls(key, Layout(ranks, **degrees))

    @property
    def ranks(self) -> int:
        return self.layout.world_size

    @property
    def data_ranks(self) -> int:
        """Data-parallel ranks: each reads its own part of the global batch."""
        return self.layout.dp

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: a pipeline needs at least one per stage, more only lengthen the run."""
        return self.layout.pp

    @property
    def label(self) -> str:
        """e.g. ``pp x fsdp: pp=2 dp_shard=2 (1f1b)``: the composition, then the config's words."""
        lay = self.layout
        sizes = (("pp", lay.pp), ("dp_shard", lay.dp_shard), ("ep", lay.ep), ("cp", lay.cp), ("tp", lay.tp))
        words = " ".join(f"{k}={v}" for k, v in sizes if v > 1) + (f" ({lay.pp_schedule})" if lay.pp > 1 else "")
        dims = [("fsdp" if k == "dp_shard" else k) for k, v in sizes if v > 1]
        return f"{' x '.join(dims)}: {words}" if len(dims) > 1 else words

    def overrides(self, global_batch: int) -> list[str]:
        micro = global_batch // (self.data_ranks * self.microbatches)
        return self.layout.overrides() + [f"--train.micro_batch_size={micro}",
                                          f"--train.grad_accum_steps={self.microbatches}"]


LAYOUTS = {
    "tp": BenchLayout.of("tp", tp=2),
    "pp": BenchLayout.of("pp", pp=2),
    "fsdp_tp": BenchLayout.of("fsdp_tp", dp_shard=2, tp=2),
    "pp_fsdp": BenchLayout.of("pp_fsdp", pp=2, dp_shard=2),
    "pp_tp_fsdp": BenchLayout.of("pp_tp_fsdp", pp=2, dp_shard=2, tp=2),
    # Context parallelism beside dp_shard=2, so that FSDP2 shards over the flattened dp_shard x cp
    # group and the cp group carries only the K/V all-gathers and reduce-scatters that the rows report.
    "cp2": BenchLayout.of("cp2", dp_shard=2, cp=2),
    "cp4": BenchLayout.of("cp4", dp_shard=2, cp=4),
    # Expert parallelism (an MoE config: --config configs/tiny-moe.yaml): the experts over 2 ranks, alone
    # (FSDP2 shards the dense weights over the same 2 ranks) and on 4 ranks, where 2 ranks hold the same
    # experts.
    "ep2": BenchLayout.of("ep2", dp_shard=2, ep=2),
    "ep2_fsdp": BenchLayout.of("ep2_fsdp", dp_shard=4, ep=2),
}
DEFAULT_LAYOUTS = ("tp", "pp", "fsdp_tp", "pp_fsdp")  # pp_tp_fsdp (8 ranks) with --with-3d
UNTIED = "--model.tie_embeddings=false"


# --------------------------------------------------------------------------- measuring (inside a rank)


class StorageLedger:
    """Bytes of distinct storages per category; a storage is counted once, in its first category."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.bytes: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}

    def add(self, category: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        storage = local_shard(tensor).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.owner:
            return
        self.owner[key] = category
        self.bytes[category] += storage.nbytes()


def _tensors_in(obj, depth: int = 4):
    """(attribute path, tensor) for tensors reachable from a DeepSpeed object through its
    attributes, lists, tuples and dicts."""
    seen: set[int] = set()
    stack = [(obj, "", depth)]
    while stack:
        item, path, d = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            yield path, item
            continue
        if d == 0 or isinstance(item, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        if isinstance(item, dict):
            stack += [(v, f"{path}[{k!r}]", d - 1) for k, v in item.items()]
        elif isinstance(item, (list, tuple, set)):
            stack += [(v, f"{path}[{i}]", d - 1) for i, v in enumerate(item)]
        elif hasattr(item, "__dict__") and type(item).__module__.startswith("deepspeed"):
            stack += [(v, f"{path}.{k}", d - 1) for k, v in vars(item).items()]


def record_params_and_grads(engine, ledger: StorageLedger) -> None:
    """Call right after the last backward of a step."""
    for p in _model_of(engine).parameters():
        ledger.add("params", getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p)
    for p in _model_of(engine).parameters():
        ledger.add("grads", p.grad)
    ds_optimizer = _deepspeed_optimizer(engine)
    if ds_optimizer is not None:
        # fp32 master partitions (ZeRO-1/2: single_partition_of_fp32_groups; ZeRO-3:
        # fp32_partitioned_groups_flat, handed to the inner optimizer only during its step).
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for t in getattr(ds_optimizer, name, None) or []:
                ledger.add("optimizer", t)
        _add_inner_optimizer(ds_optimizer.optimizer, ledger, with_state=False)
        # DeepSpeed's gradient partitions (attributes named *grad*: grads_in_partition,
        # averaged_gradients, grad_partitions_flat_buffer, ...) and its fixed-size reduce buckets
        # (ipg_buffer, __ipg_bucket_flat_buffer), which ZeRO-R calls constant buffers.
        found = list(_tensors_in(ds_optimizer))
        for path, t in found:
            if "grad" in path.rsplit(".", 1)[-1].lower():
                ledger.add("grads", t)
        for _, t in found:
            ledger.add("buffers", t)


def record_optimizer(engine, ledger: StorageLedger) -> None:
    """Call after the optimizer step (AdamW state exists from the first step on)."""
    ds_optimizer = _deepspeed_optimizer(engine)
    if ds_optimizer is not None:
        _add_inner_optimizer(ds_optimizer.optimizer, ledger, with_state=True)
        return
    # A pipeline rank steps one optimizer per stage it holds.
    for part in engine.optimized_parts():
        _add_inner_optimizer(part.optimizer, ledger, with_state=True)
        if part.masters is not None:
            for m in part.masters.masters:
                ledger.add("optimizer", m)


def _add_inner_optimizer(optimizer, ledger: StorageLedger, with_state: bool) -> None:
    # The optimizer's own parameters are masters when they are not the model's (DeepSpeed's
    # fp32 partitions): the paper counts them with the optimizer state.
    for group in optimizer.param_groups:
        for p in group["params"]:
            ledger.add("optimizer", p)
    for p in optimizer.state:  # keyed by the tensors it steps
        ledger.add("optimizer", p)
    if with_state:
        for state in optimizer.state.values():
            for value in state.values():
                ledger.add("optimizer", value)


def _model_of(engine):
    return engine.module()


def _deepspeed_optimizer(engine):
    return engine.engine.optimizer if isinstance(engine, ZeroEngine) else None



# --------------------------------------------------------------------------- bytes communicated (inside a rank)


def comm_by_dimension(counter: CommBytes, ctx: DistContext) -> tuple[dict[str, float], dict[str, list]]:
    """Bytes sent per mesh dimension (every one of COMM_DIMS, zero if unused), and per
    "<dimension> <collective>": [calls, bytes] (analysis/collective_bytes.bytes_by_dimension)."""
    totals, detail = bytes_by_dimension(counter, ctx.mesh)
    return {**dict.fromkeys(COMM_DIMS, 0.0), **totals}, detail


# --------------------------------------------------------------------------- formulas (per rank)


def rank_parameters(cfg: JobConfig, pp_rank: int) -> float:
    """Parameters this rank holds before data-parallel sharding (estimator.stage_parameters over the
    pipeline stages it runs; the whole model without tp and pp)."""
    p = cfg.parallel
    n_stages = p.pp * p.pp_virtual_stages
    if p.pp == 1:
        return stage_parameters(cfg.model, p.tp, 1, 0)
    return sum(stage_parameters(cfg.model, p.tp, n_stages, s) for s in stage_ids(pp_rank, p.pp, p.pp_virtual_stages))


def rank_routed_parameters(cfg: JobConfig, pp_rank: int) -> float:
    """Routed expert weights among ``rank_parameters`` (all E experts, before ep splits them)."""
    p = cfg.parallel
    n_stages = p.pp * p.pp_virtual_stages
    stages = len(stage_ids(pp_rank, p.pp, p.pp_virtual_stages)) if p.pp > 1 else 1
    return cfg.model.n_layer // n_stages * stages * routed_parameters_per_block(cfg.model)


def formula_states(cfg: JobConfig, pp_rank: int, dp_shard: int) -> dict[str, float]:
    """Model-state bytes of this rank; ``dp_shard``: the ranks its dense weights shard over (ep and cp
    ranks included). With ep the routed experts are split over ep ranks and each split sharded over
    the dp_shard / ep ranks holding it (estimator.stage_state_bytes)."""
    p, precision = cfg.parallel, cfg.precision.mode
    n, routed = rank_parameters(cfg, pp_rank), rank_routed_parameters(cfg, pp_rank) if p.ep > 1 else 0.0
    parts = [model_state_bytes(n - routed, p.strategy, dp_shard, precision)]
    if routed:
        parts.append(model_state_bytes(routed / p.ep, p.strategy, dp_shard // p.ep, precision))
    return {"params": sum(s.param for s in parts), "grads": sum(s.grad for s in parts),
            "optimizer": sum(s.optimizer for s in parts)}


def formula_comm(cfg: JobConfig, pp_rank: int, dp_size: int) -> dict[str, float]:
    """Bytes this rank sends per step by mesh dimension, by the estimator's conventions:

    tp  tp_comm_seconds per micro-batch (per layer 4 all-gather/reduce-scatter pairs of the s*b*h
        activation, forward and backward, plus the embedding and the LM head on their stages)
    pp  one activation forward to the next stage and one gradient back to the previous, per
        micro-batch (s*b*h, divided by tp with sequence parallelism)
    dp  comm_volume on the rank's parameters (DDP: all-reduce; ZeRO-1/2: reduce-scatter + all-gather;
        ZeRO-3/FSDP: + a second all-gather), except that a pipeline's FSDP stage runs
        estimator.fsdp_collectives' gathers (each micro-batch's forward and one backward with
        parallel.fsdp_reshard_after_forward, else one) and one reduce-scatter per step; with ep the
        routed experts (1/ep of them) travel over the dp_size / ep ranks holding the same experts
    The expert-parallel all-to-alls are not here: ``formula_all_to_all_bytes``.
    """
    p, m, precision = cfg.parallel, cfg.train.grad_accum_steps, cfg.precision.mode
    n_stages = p.pp * p.pp_virtual_stages
    stages = stage_ids(pp_rank, p.pp, p.pp_virtual_stages) if p.pp > 1 else [0]
    # Per micro-batch figures only: the stage count stands in for pp (virtual stages are stages
    # here) and the micro-batch count is raised to what the estimator's schedule checks accept.
    job = _formula_job(cfg, dp_size)
    out = {dim: 0.0 for dim in COMM_DIMS}
    out["tp"] = m * sum(tp_comm_seconds(job, s)[1] for s in stages)
    if p.pp > 1:
        activation = job.activation_dtype_bytes * cfg.seq_len * cfg.train.micro_batch_size * cfg.model.d_model
        activation /= p.tp if job.layout.sp else 1
        out["pp"] = m * activation * sum((s < n_stages - 1) + (s > 0) for s in stages)
    n_params = rank_parameters(cfg, pp_rank)
    dp_size *= p.cp  # cp ranks average gradients with the data-parallel ones (FSDP2 over dp_shard x cp)
    if dp_size > 1:
        if p.pp > 1 and p.strategy in ("fsdp", "zero3"):
            per = STATE_BYTES[precision]
            gathers, scatters = fsdp_collectives(dataclasses.replace(
                job, grad_accum=m, fsdp_reshard_after_forward=p.reshard_blocks_after_forward))
            out["dp"] = (dp_size - 1) / dp_size * n_params * (gathers * per.param + scatters * per.grad)
        elif p.ep > 1:
            routed = rank_routed_parameters(cfg, pp_rank)
            out["dp"] = (comm_volume(n_params - routed, p.strategy, dp_size, precision).sent_per_gpu
                         + comm_volume(routed / p.ep, p.strategy, dp_size // p.ep, precision).sent_per_gpu)
        else:
            out["dp"] = comm_volume(n_params, p.strategy, dp_size, precision).sent_per_gpu
    return out


def _formula_job(cfg: JobConfig, dp_size: int) -> JobSpec:
    """The estimator's job of this layout, per micro-batch: the stage count stands in for pp (virtual
    stages are stages here) and the micro-batch count is raised to what its schedule checks accept."""
    p = cfg.parallel
    n_stages = p.pp * p.pp_virtual_stages
    layout = Layout(dp_size * p.tp * n_stages * p.cp, strategy=p.strategy, tp=p.tp, pp=n_stages,
                    sequence_parallel=p.sequence_parallel, cp=p.cp, ep=p.ep)
    return JobSpec(model=cfg.model, seq_len=cfg.seq_len, micro_batch=cfg.train.micro_batch_size, layout=layout,
                   recompute=cfg.model.recompute, precision=cfg.precision.mode,
                   grad_accum=max(cfg.train.grad_accum_steps, n_stages))


def formula_kv_bytes(cfg: JobConfig, dp_size: int) -> float:
    """K/V bytes a cp rank sends per step: estimator.cp_comm_seconds per micro-batch (a forward
    all-gather and a backward reduce-scatter of the whole sequence's K and V per layer, (cp-1)/cp sent)."""
    return cfg.train.grad_accum_steps * cp_comm_seconds(_formula_job(cfg, dp_size))[1]


def formula_all_to_all_bytes(cfg: JobConfig, dp_size: int) -> float:
    """Bytes an ep rank sends per step in the expert-parallel all-to-alls, by the estimator
    (estimator.expert_all_to_all per micro-batch: per MoE layer dispatch and combine in forward and
    their gradients in backward, (ep-1)/ep of the micro-batch's top-k token copies each, as under
    balanced routing)."""
    return cfg.train.grad_accum_steps * expert_all_to_all(_formula_job(cfg, dp_size))[1]


def routed_all_to_all_bytes(routed: torch.Tensor, rank: int, forwards: int, backwards: int, row_bytes: int,
                            count_bytes: int = 8) -> float:
    """Bytes ep rank ``rank`` sends in one step's expert-parallel all-to-alls, given how every ep rank
    routed its tokens: what the estimator's formula becomes without its balanced-routing assumption.

    ``routed`` (ep, layers, E): token copies each ep rank routed to each expert, summed over the
    step's ``forwards`` forward passes per layer (recomputed ones included) of ``backwards``
    micro-batches; dropless (every routed copy is computed). Rank r holds the experts
    r*E/ep .. (r+1)*E/ep - 1 (parallel/ep.py). In each forward, dispatch sends the copies r routed to
    other ranks' experts and combine returns the copies the other ranks routed to r's experts; each
    backward sends the same rows the other way (a recomputed forward adds its exchanges, not a
    backward's). Each forward also exchanges the per-expert counts: (ep-1)/ep of E ``count_bytes``
    integers per layer.
    """
    ep, layers, n_experts = routed.shape
    mine = slice(rank * n_experts // ep, (rank + 1) * n_experts // ep)
    to_others = routed[rank].sum() - routed[rank, :, mine].sum()
    from_others = routed[:, :, mine].sum() - routed[rank, :, mine].sum()
    rows = float(to_others + from_others) * row_bytes * (forwards + backwards) / forwards
    return rows + forwards * layers * n_experts * count_bytes * (ep - 1) / ep


def formula_activation_bytes(cfg: JobConfig, dp_size: int) -> float:
    """The estimator's activations and logits per GPU (estimate_memory) for this layout."""
    memory = estimate_memory(_formula_job(cfg, dp_size))
    return memory.activations + memory.logits


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward while active (parameters excluded):
    what a rank holds for backward at the end of a micro-batch's forward."""

    def __init__(self):
        self.seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        try:
            storage = local_shard(t).untyped_storage()  # a tensor-parallel shard: its local storage
            self.seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a wrapper subclass with no storage of its own (counted through its inner tensors)
            pass
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class ExpertTraffic:
    """Per step, the bytes this ep rank sent in all-to-alls over the ep group (measured by the step's
    CommBytes) and what ``routed_all_to_all_bytes`` makes of the step's routing, read from the MoE
    layers' router statistics and gathered over the ep group (outside the counter)."""

    def __init__(self, ctx: DistContext, model: torch.nn.Module, cfg: JobConfig):
        self.group = ctx.mesh["ep"].get_group()
        self.layers = moe_layers([model])
        self.rank, self.ep = ctx.mesh["ep"].get_local_rank(), ctx.mesh["ep"].size()
        self.microbatches = cfg.train.grad_accum_steps
        self.row_bytes = cfg.model.d_model * _formula_job(cfg, ctx.layout.dp).activation_dtype_bytes
        self.measured: list[float] = []
        self.routed: list[float] = []

    def add_step(self, counter: CommBytes) -> None:
        self.measured.append(counter.sent.get((self.group.group_name, "all_to_all"), 0.0))
        windows = [m.stats.take_window() for m in self.layers]
        mine = torch.stack([w["routed"] for w in windows])  # (layers, E)
        everyone = mine.new_empty((self.ep * mine.shape[0], mine.shape[1]))  # gloo gathers along dim 0
        torch.distributed.all_gather_into_tensor(everyone, mine.contiguous(), group=self.group)
        forwards = int(windows[0]["forwards"])  # per layer, recomputed forwards included
        self.routed.append(routed_all_to_all_bytes(everyone.view(self.ep, *mine.shape), self.rank, forwards,
                                                   self.microbatches, self.row_bytes))


def run_rank(config: str | None, overrides: list[str], steps: int, out: Path) -> None:
    """One rank (or the single process): train like train.py, then write this rank's numbers."""
    cfg = load_config(config, overrides)
    ctx = init_distributed(cfg.train.device, cfg.parallel)
    try:
        job = resolve_job(cfg, ctx)  # as train.py resolves it
        cfg, batches = job.cfg, job.batches
        built = build_from_config(cfg, ctx, job.initial_state)
        n_params = sum(p.numel() for p in built.model.parameters())  # unique tensors: a tied weight once
        engine = built.engine
        engine.train(True)
        losses, ledger, saved = [], StorageLedger(), SavedActivations()
        experts = ExpertTraffic(ctx, _model_of(engine), cfg) if cfg.parallel.ep > 1 else None
        schedule = cfg.optim.schedule(steps)
        for step in range(steps):
            last = step == steps - 1
            # Gradients exist between the last backward and the optimizer step that frees them.
            record = (lambda: record_params_and_grads(engine, ledger)) if last else None
            # Every step's all-to-alls under ep (routing changes step by step); the rest in the last.
            comm = CommBytes() if last or experts is not None else None
            with comm or contextlib.nullcontext(), saved if last else contextlib.nullcontext():
                outcome = train_step(engine, batches, cfg.train.grad_accum_steps, lr_at(step, **schedule),
                                     before_optimizer_step=record)
            if experts is not None:
                experts.add_step(comm)
            losses.append(float(ctx.all_reduce_mean(outcome.loss.detach().clone())))
        record_optimizer(engine, ledger)
        pp_rank = ctx.dims.coordinate("pp")
        sent, sent_detail = comm_by_dimension(comm, ctx)
        result = {"rank": ctx.rank, "world": ctx.world_size, "losses": losses, "bytes": ledger.bytes,
                  "n_params": n_params, "n_params_config": count_parameters(cfg.model),
                  "strategy": cfg.parallel.strategy, "pp_rank": pp_rank,
                  "comm": sent, "comm_detail": sent_detail,
                  "formula": formula_states(cfg, pp_rank, ctx.layout.dp_shard_cp),
                  "formula_comm": formula_comm(cfg, pp_rank, ctx.layout.dp),
                  "activations": saved.bytes, "activations_formula": formula_activation_bytes(cfg, ctx.layout.dp),
                  "kv": sent.get("cp", 0.0), "kv_formula": formula_kv_bytes(cfg, ctx.layout.dp),
                  "micro_batch": cfg.train.micro_batch_size,
                  "a2a": experts.measured if experts is not None else [],
                  "a2a_routed": experts.routed if experts is not None else [],
                  "a2a_formula": formula_all_to_all_bytes(cfg, ctx.layout.dp)}
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    finally:
        shutdown_distributed(ctx)


# --------------------------------------------------------------------------- launching (the parent)


@dataclass
class Row:
    strategy: str  # the strategy, or the layout in config words (tools/reproduce.py reads "ddp" and "fsdp")
    loss: float
    delta: float  # vs the single process of the same model and global batch
    measured: dict[str, float]  # max over ranks, bytes
    formula: dict[str, float]
    status: str = "ok"
    ranks: int = 1
    reference: str = ""  # the single-process row this one is compared with
    comm: dict[str, float] = field(default_factory=dict)  # bytes sent per step, max over ranks, by dimension
    comm_formula: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the launch (start-up included)
    n_params: int = 0  # parameters of the whole model (unique tensors: a tied table once)
    comm_by_rank: list[dict] = field(default_factory=list)  # per rank: {"<dim> <collective>": [calls, bytes]}
    activations: float = 0.0  # bytes saved for backward in the last step, max over ranks
    activations_formula: float = 0.0  # the estimator's activations + logits per GPU
    kv: float = 0.0  # context parallelism: K/V bytes sent in the last step, max over ranks
    kv_formula: float = 0.0
    micro_batch: int = 0  # sequences per micro-batch on a rank
    a2a_by_rank: list[list[float]] = field(default_factory=list)  # ep: all-to-all bytes sent, per rank and step
    a2a_routed_by_rank: list[list[float]] = field(default_factory=list)  # the same from each step's routing
    a2a_formula: float = 0.0  # the estimator's bytes per rank and step (balanced routing)


@dataclass(frozen=True)
class Plan:
    """What to measure, and how a rank is started: ``python -m <worker_module> --worker DIR --steps N
    [--config C] -- <overrides>`` runs ``run_rank`` (the command line's hidden worker mode)."""

    worker_module: str
    config: str | None
    steps: int
    nproc: int  # ranks of every strategy row
    micro_batch_size: int  # sequences per rank per step of the strategy rows
    strategies: tuple[str, ...]
    layouts: tuple[str, ...]  # keys of LAYOUTS
    timeout: float  # seconds per launch
    overrides: tuple[str, ...] = ()  # config overrides for every row

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.nproc


@dataclass(frozen=True)
class Launch:
    """One torchrun (or plain) launch: a row's name, its ranks and its config overrides."""

    name: str
    ranks: int
    overrides: list[str]


def launch(run: Launch, plan: Plan, work: Path) -> tuple[list[dict], float]:
    out = work / run.name.replace(" ", "_").replace("=", "").replace("(", "").replace(")", "")
    out.mkdir(parents=True, exist_ok=True)
    rank_args = ["-m", plan.worker_module, "--worker", str(out), "--steps", str(plan.steps),
                 *(["--config", plan.config] if plan.config else []), "--",
                 *DEFAULT_OVERRIDES, *run.overrides, f"--logging.run_dir={out / 'run'}", *plan.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR": "cpu",
           "PYTHONUNBUFFERED": "1"}
    if run.ranks == 1:
        cmd = [sys.executable, *rank_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.ranks}",
               *rank_args]  # torchrun's -m runs the module as python -m does
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=plan.timeout, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{run.name}: exit {proc.returncode}: " + " | ".join(tail))
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))], seconds


def _max_over_ranks(ranks: list[dict], field_name: str, keys) -> dict[str, float]:
    return {k: max(r[field_name][k] for r in ranks) for k in keys}


def measure_row(run: Launch, plan: Plan, work: Path, reference: Row | None) -> Row:
    """Launch one row and reduce its ranks' numbers to the row (max over ranks: the fullest rank)."""
    try:
        ranks, seconds = launch(run, plan, work)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return Row(run.name, math.nan, math.nan, {}, {}, status=str(exc)[:200], ranks=run.ranks,
                   reference=reference.strategy if reference else "")
    loss = ranks[0]["losses"][-1]
    return Row(
        run.name, loss, loss - reference.loss if reference else 0.0,
        _max_over_ranks(ranks, "bytes", (*STATE_KEYS, "buffers")),
        _max_over_ranks(ranks, "formula", STATE_KEYS),
        ranks=run.ranks, reference=reference.strategy if reference else run.name,
        comm=_max_over_ranks(ranks, "comm", COMM_DIMS), comm_formula=_max_over_ranks(ranks, "formula_comm", COMM_DIMS),
        seconds=seconds, n_params=ranks[0]["n_params_config"], comm_by_rank=[r["comm_detail"] for r in ranks],
        activations=max(r["activations"] for r in ranks), activations_formula=max(r["activations_formula"] for r in ranks),
        kv=max(r["kv"] for r in ranks), kv_formula=max(r["kv_formula"] for r in ranks),
        micro_batch=ranks[0]["micro_batch"],
        a2a_by_rank=[r["a2a"] for r in ranks], a2a_routed_by_rank=[r["a2a_routed"] for r in ranks],
        a2a_formula=max(r["a2a_formula"] for r in ranks),
    )


def measure_all(plan: Plan, progress: Progress | None = None) -> tuple[list[Row], dict]:
    """Every row of the plan: the strategies after their single process, then the layouts after theirs;
    ``progress`` counts the launches (``launch_count``)."""
    precision = load_config(plan.config, [*DEFAULT_OVERRIDES, *plan.overrides]).precision.mode
    global_batch = plan.global_batch
    single = ["--parallel.strategy=none", f"--train.micro_batch_size={global_batch}", "--train.grad_accum_steps=1"]
    rows: list[Row] = []
    info = {"precision": precision, "global_batch": global_batch}
    # The single-process rows see the whole global batch in one micro-batch.
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def measured(run: Launch, reference: Row | None) -> Row:
            row = measure_row(run, plan, work, reference)
            if progress is not None:
                progress.update()
            return row

        if plan.strategies:
            reference = measured(Launch("single process", 1, single), None)
            rows.append(reference)
            for strategy in plan.strategies:
                run = Launch(strategy, plan.nproc, [f"--parallel.strategy={strategy}",
                                                   f"--train.micro_batch_size={plan.micro_batch_size}"])
                rows.append(measured(run, reference))
        if plan.layouts:
            reference = measured(Launch("single process, untied", 1, [*single, UNTIED]), None)
            rows.append(reference)
            for key in plan.layouts:
                layout = LAYOUTS[key]
                rows.append(measured(Launch(layout.label, layout.ranks, [*layout.overrides(global_batch), UNTIED]),
                                     reference))
    return rows, info


def launch_count(plan: Plan) -> int:
    """The launches ``measure_all`` makes: each group of rows after its single-process reference."""
    return (1 + len(plan.strategies) if plan.strategies else 0) + (1 + len(plan.layouts) if plan.layouts else 0)


# --------------------------------------------------------------------------- output


def _kib(x: float) -> str:
    return f"{x / 1024:,.0f}"


def table(rows: list[Row], markdown: bool) -> str:
    """Loss and model-state bytes per rank, measured next to the formula."""
    head = ["strategy / layout", "ranks", "loss", "Δ vs 1 proc", "params KiB", "(formula)", "grads KiB", "(formula)",
            "optim KiB", "(formula)", "states KiB", "(formula)", "+ buckets KiB"]
    body = []
    for r in rows:
        if r.status != "ok":
            body.append([r.strategy, str(r.ranks), "failed: " + r.status] + [""] * (len(head) - 3))
            continue
        m, f = r.measured, r.formula
        cells = [r.strategy, str(r.ranks), f"{r.loss:.6f}", f"{r.delta:+.1e}"]
        for key in STATE_KEYS:
            cells += [_kib(m[key]), _kib(f[key])]
        cells += [_kib(sum(m[k] for k in STATE_KEYS)), _kib(sum(f[k] for k in STATE_KEYS)), _kib(m["buffers"])]
        body.append(cells)
    return markdown_table(head, body) if markdown else text_table(head, body)


def comm_table(rows: list[Row], markdown: bool) -> str:
    """Bytes sent per rank in the last step, by mesh dimension, measured next to the formula."""
    head = ["strategy / layout", "ranks", "tp KiB", "(formula)", "dp KiB", "(formula)", "pp KiB", "(formula)",
            "other KiB", "total KiB", "(formula)", "run s"]
    body = []
    for r in rows:
        if r.status != "ok":
            continue
        if not r.comm:  # a row made without the counter
            body.append([r.strategy, str(r.ranks)] + ["n/m"] * (len(head) - 2))
            continue
        m, f = r.comm, r.comm_formula
        cells = [r.strategy, str(r.ranks)]
        for dim in ("tp", "dp", "pp"):
            cells += [_kib(m[dim]), _kib(f[dim])]
        cells += [_kib(m["other"]), _kib(sum(m.values())), _kib(sum(f.values())), f"{r.seconds:.0f}"]
        body.append(cells)
    return markdown_table(head, body) if markdown else text_table(head, body)


def cp_table(rows: list[Row], markdown: bool) -> str | None:
    """Context-parallel rows next to their single process: loss, activations per rank (measured and the
    estimator's, each against the single process) and K/V bytes sent (measured and formula); None
    without cp rows."""
    cp_rows = [r for r in rows if r.status == "ok" and " cp=" in f" {r.strategy}"]
    single = next((r for r in rows if r.status == "ok" and cp_rows and r.strategy == cp_rows[0].reference), None)
    if not cp_rows or single is None:
        return None
    head = ["layout", "ranks", "Δ loss vs 1 proc", "activations KiB/seq", "vs 1 proc", "estimator KiB/seq",
            "vs 1 proc", "K/V sent KiB", "(formula)"]

    def per_sequence(r: Row) -> tuple[float, float]:
        return r.activations / r.micro_batch, r.activations_formula / r.micro_batch

    one, one_formula = per_sequence(single)
    body = [[single.strategy, "1", "", _kib(one), "1", _kib(one_formula), "1", "", ""]]
    for r in cp_rows:
        measured, formula = per_sequence(r)
        body.append([r.strategy, str(r.ranks), f"{r.delta:+.1e}", _kib(measured), f"{measured / one:.3f}",
                     _kib(formula), f"{formula / one_formula:.3f}", _kib(r.kv), _kib(r.kv_formula)])
    return markdown_table(head, body) if markdown else text_table(head, body)


def ep_table(rows: list[Row], markdown: bool) -> str | None:
    """Expert-parallel rows: loss against their single process, and the all-to-all bytes a rank sends per
    step against the estimator's formula, as per-step ratios, median (min-max) over the steps; None
    without ep rows."""
    ep_rows = [r for r in rows if r.status == "ok" and r.a2a_by_rank and any(r.a2a_by_rank)]
    if not ep_rows:
        return None
    head = ["layout", "ranks", "Δ loss vs 1 proc", "all-to-all KiB/step, fullest rank", "(formula)",
            "fullest rank / formula", "mean rank / formula", "measured vs from routing, worst rel. diff"]
    body = []
    for r in ep_rows:
        steps = list(zip(*r.a2a_by_rank))  # per step: every rank's bytes
        fullest = summarize([max(s) for s in steps])
        worst = max(abs(m / e - 1) for ms, es in zip(r.a2a_by_rank, r.a2a_routed_by_rank) for m, e in zip(ms, es))
        body.append([r.strategy, str(r.ranks), f"{r.delta:+.1e}",
                     f"{fullest.median / 1024:,.1f} ({fullest.min / 1024:,.1f}-{fullest.max / 1024:,.1f})",
                     f"{r.a2a_formula / 1024:,.1f}", _ratio_text([max(s) / r.a2a_formula for s in steps]),
                     _ratio_text([sum(s) / len(s) / r.a2a_formula for s in steps]), f"{worst:.1e}"])
    return markdown_table(head, body) if markdown else text_table(head, body)


def _ratio_text(ratios: list[float]) -> str:
    s = summarize(ratios)
    return f"{s.median:.3f} ({s.min:.3f}-{s.max:.3f})"


EP_NOTES = [
    "Expert parallelism (configs/tiny-moe.yaml, dropless top-k routing): all-to-all bytes are what a rank sent "
    "over the ep group in each step (dispatch and combine in forward, their gradients in backward, plus the "
    "per-expert counts each forward exchanges), measured by the same counter in every step, since the routing "
    "changes step by step; the steps' spread is over all steps of the run. Formula: "
    "analysis/estimator.expert_all_to_all, which assumes balanced routing: each rank keeps 1/ep of its top-k "
    "token copies and sends the rest, in each of the four exchanges per MoE layer. 'fullest rank': the rank that "
    "sent most in the step; 'mean rank': the mean over the ep ranks, whose excess over 1 is the share of token "
    "copies routed to another rank's experts beyond (ep-1)/ep. 'from routing': the bytes "
    "analysis/parallel_bench.routed_all_to_all_bytes computes from the step's router counts of every rank (the "
    "formula without its balance assumption, counts exchange included), against the measured bytes of the same "
    "rank and step: the worst relative difference over ranks and steps.",
    "Measured differs from the formula only through the routing: a rank sends the copies its tokens route to the "
    "other ranks' experts (dispatch) and returns the copies the other ranks route to its own (combine), so the "
    "fullest rank is above the formula whenever the router favours one rank's experts. At ep=2 the two ranks of a "
    "group send the same bytes (each one's dispatch is the other's combine), so fullest and mean agree; the mean "
    "rank's ratio is the share of token copies that left their rank over (ep-1)/ep. The per-expert counts add "
    "(ep-1)/ep x E x 8 bytes per MoE layer and forward, which the formula "
    "leaves out.",
    "Loss: the Switch auxiliary loss is computed over each micro-batch's tokens, so B sequences on each of two "
    "ranks and 2B in the single process give different (equally valid) losses; run with "
    "--model.moe.aux_loss=0 (after '--') the ep rows train the single process's losses.",
]


CP_NOTES = [
    "Context parallelism: activations are the bytes of the distinct storages autograd saved during the last "
    "step's forward (parameters excluded), max over ranks, per sequence of the rank's micro-batch (the single "
    "process runs the whole global batch at once); each cp rank holds 1/cp of every sequence, plus the keys and "
    "values gathered from the others. The estimator's figure (analysis/estimator.estimate_memory: "
    "activations + logits) models a GPU's kernels, not these CPU reference ones, so compare the ratios to the "
    "single process. K/V: bytes the rank sent over the cp mesh dimension (the forward all-gathers and backward "
    "reduce-scatters of every layer), formula analysis/estimator.cp_comm_seconds; FSDP2 runs over the flattened "
    "dp_shard x cp group, counted under dp.",
    "Measured activations exceed the estimator's 1/cp + gathered K/V by about one whole-sequence K/V per layer: "
    "a query chunk that sees more keys than it has queries needs the causal mask aligned bottom-right, an explicit "
    "mask, and CPU SDPA then runs its math path, which stores the chunk's scores (c x keys per head). On CUDA "
    "SDPA's memory-efficient kernel accepts a mask and stores no scores, as the estimator assumes (not "
    "measured here: no GPU).",
]

NOTES = [
    "Measured: max over ranks of the bytes of distinct local storages (DTensor shards, DeepSpeed partitions); "
    "gradients right after the last backward, optimizer state after the step.",
    "Formula: ZeRO paper section 5 (analysis/estimator.model_state_bytes): Psi x bytes/element, divided by the "
    "rank count for what a stage shards (zero1: optimizer; zero2: + gradients; zero3 and fsdp: + parameters). "
    "For the layouts Psi is what one rank holds before data-parallel sharding, analysis/estimator.stage_parameters "
    "(its stage's blocks with matmul weights split by tp, norm gains and row-parallel output biases whole; the "
    "vocab-parallel token table and the learned positions on the first stage, the final norm and the "
    "vocab-parallel LM head on the last), sharded over dp_shard by fsdp; max over the ranks' stages.",
    "DeepSpeed keeps a separate fp32 master partition even in fp32 training (optimizer column: 12 instead of "
    "8 bytes/param over N). zero1 measures partitioned gradients: DeepSpeed frees the full gradients once they are "
    "reduced at the accumulation boundary, so the paper's full-size gradient term is a transient peak during "
    "backward, not what is held afterwards.",
    "'+ buckets': DeepSpeed's fixed-size reduce/all-gather buffers (ZeRO-R's constant buffers, sized by "
    "parallel.ddp_bucket_cap_mb, not by the model); DDP's buckets are the gradients themselves "
    "(gradient_as_bucket_view). Not part of the formula.",
    "FSDP2 pads every tensor to a multiple of the rank count along dim 0 (small extra on each shard). With a "
    "16-bit MixedPrecisionPolicy its sharded parameters and gradients stay fp32 and are the masters, so it "
    "holds 4 + 4 + 8 bytes/param over N where the formula counts 2 + 2 + 12: the same total, split differently.",
    "Layouts: every row trains the same global batch as its single process; a pipeline runs pp micro-batches "
    "per step (train.grad_accum_steps), so its per-rank micro-batch is global / (dp_shard x pp). Pipeline rows "
    "measure gradients after the schedule's last backward, when pipelining has reduce-scattered FSDP's "
    "gradients and resharded its parameters; during the step an FSDP stage holds its whole (1/tp) parameters and "
    "gradients (the estimator counts that peak, this table does not).",
    "tp=2 grads: the vocab-parallel token embedding's gradient comes back from DTensor replicated, the whole "
    "vocab x d_model table on every tp rank (torch's embedding backward has no row-sharded strategy; the "
    "optimizer slices it), V x d x (1 - 1/tp) x 4 bytes more than the formula. Under FSDP the reduce-scatter "
    "reshards it, so fsdp x tp matches.",
    "Bytes sent: what each rank sends in the last step, from the tensors handed to every collective and send "
    "(a dispatch mode over c10d and DTensor's functional collectives), converted with the ring algorithm's "
    "(n-1)/n per all-gather or reduce-scatter and 2(n-1)/n per all-reduce over n ranks, as the formula counts "
    "(gloo's own algorithms may move more or less). Grouped by the mesh dimension of the process group; without "
    "tp and pp all traffic is data parallel (DDP and DeepSpeed use groups of their own); 'other' would be a "
    "group outside the mesh in a tp/pp layout (none here). Max over ranks; the JSON has every rank's "
    "collectives (comm_by_rank: calls and bytes per dimension and collective).",
    "tp formula: analysis/estimator.tp_comm_seconds per micro-batch (per layer 4 all-gathers and 4 "
    "reduce-scatters of the b x s x h activation with sequence parallelism, plus the embedding and the LM "
    "head). Measured adds what it leaves out, all small: the all-reduces of the replicated norm gains' and "
    "output biases' gradients, the gradient of the learned positions, the loss-parallel cross-entropy's "
    "per-token reductions and the gradient-norm reduction.",
    "pp formula: one b x s x h activation (/ tp with sequence parallelism) forward to the next stage and its "
    "gradient back, per micro-batch; a rank at either end of the pipeline sends one of the two. Measured adds "
    "the loss and gradient-norm reductions over the pipeline (bytes).",
    "dp formula: analysis/estimator.comm_volume on the rank's parameters (DDP: 2(n-1)/n of the gradients; "
    "ZeRO-1/2: a reduce-scatter and an all-gather; ZeRO-3/FSDP: a second all-gather in backward); for a "
    "pipeline's FSDP stage the estimator counts an all-gather in each micro-batch's forward and one in backward "
    "(m + 1 with parallel.fsdp_reshard_after_forward, one without) and one reduce-scatter per step. Measured: FSDP2 "
    "does not re-gather its root module (embeddings, final norm, LM head) for backward (reshard_after_forward="
    "False), so fsdp sends a little less. DeepSpeed ZeRO-1/2 all-reduce the whole gradient and then all-gather "
    "the updated partitions (1.5x the paper's figure); ZeRO-3 keeps gathered parameters for reuse between forward "
    "and backward in this small model (stage3_max_reuse_distance), so it gathers once. Under a pipeline FSDP2's "
    "blocks reshard after every micro-batch's forward (parallel.fsdp_reshard_after_forward) and are gathered "
    "again in each forward and once in backward: m + 1 gathers per step, as the estimator counts.",
    "'run s': wall seconds of the row's launch on this machine, process start-up and model build included.",
]


def plot(rows: list[Row], path: Path) -> None:
    ok = [r for r in rows if r.status == "ok"]
    fig, ax = new_figure(width=max(8, 1.1 * len(ok)), height=4.5)
    x = range(len(ok))
    bottom = [0.0] * len(ok)
    for key, colour in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")):
        values = [r.measured[key] / 1024 for r in ok]
        ax.bar(x, values, bottom=bottom, color=colour, label=f"{key} (measured)")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(list(x), [sum(r.formula[k] for k in STATE_KEYS) / 1024 for r in ok], color="black", marker="_", s=600,
               label="formula (total)", zorder=3)
    ax.set_xticks(list(x), [r.strategy.replace(": ", "\n").replace(" (", "\n(").replace(", ", "\n") for r in ok], fontsize=7)
    ax.set_ylabel("KiB per rank (fullest rank)")
    ax.set_title("Model-state memory per rank")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_markdown(rows: list[Row], setting: str, nproc: int, command: str, path: Path) -> list[Path]:
    """The tables with their notes as Markdown, and the rows as JSON next to them (same stem)."""
    where = provenance(torch.device("cpu"))  # the ranks run on CPU (DEFAULT_OVERRIDES)
    title = (f"Data-parallel strategies and tp/pp/fsdp layouts, loss parity, model-state memory and bytes sent: "
             f"gloo, {nproc} processes per strategy, {where['hardware']}, torch {where['torch']}, {where['date']}")
    text = [f"# {title}", "", setting, "", table(rows, markdown=True), "",
            "Bytes sent per rank in one training step (the last), by mesh dimension:", "",
            comm_table(rows, markdown=True), "", *_cp_section(rows), *_ep_section(rows), *[f"- {n}" for n in NOTES],
            "",
            f"Command: `{command}`", ""]
    return write_results(path, "\n".join(text), title, rows, provenance=where, setting=setting, nproc=nproc,
                         command=command, notes=NOTES)


def _cp_section(rows: list[Row]) -> list[str]:
    table_md = cp_table(rows, markdown=True)
    if table_md is None:
        return []
    return ["Context parallelism: loss, activations per rank and K/V traffic:", "", table_md, "",
            *[f"- {n}" for n in CP_NOTES], ""]


def _ep_section(rows: list[Row]) -> list[str]:
    table_md = ep_table(rows, markdown=True)
    if table_md is None:
        return []
    return ["Expert parallelism: loss and all-to-all traffic per step:", "", table_md, "",
            *[f"- {n}" for n in EP_NOTES], ""]
