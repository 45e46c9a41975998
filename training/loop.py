"""The training loop: steps, log windows, evaluation, checkpoints and signals, around an ``Engine``.

``train_step`` is the step every tool that trains shares (train.py, the benchmarks, the
diagnostics): ``grad_accum_steps`` micro-batches of forward and backward, then one optimizer
step. ``TrainingLoop`` is train.py's loop around it. Scalars (loss, grad norm) stay on the
device and are read once per log interval. So does each step's skip flag where the engine skips
non-finite steps on the device (fused AdamW): the loop reads the flags of all steps since the
last read at once (at log intervals, before saves, on a stop) and then acts on each step in
order, as if it had read them one by one. Skipped steps leave the weights as they were either
way; what waits for the read is the stop on a skip streak longer than
``precision.max_skipped_steps``, which then comes up to ``train.log_interval - 1`` steps late
(``precision.nonfinite=stop`` reads every step and stops at the first non-finite one).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from common.errors import CheckpointError
from data.bundle import IGNORE_INDEX
from model.config import ModelConfig
from model.moe import MoE, moe_layers, router_metrics, take_router_table, update_expert_bias
from parallel.checkpoint import safe_torch_load
from parallel.distributed import DistContext
from parallel.engine import Engine
from parallel.optim import lr_at
from parallel.step import StepResult
from training import checkpoint as ckpt
from training.config import JobConfig, to_dict
from training.faults import FaultInjector
from training.metrics import LearningAlarms, RunLogger, peak_memory_gib
from training.signals import StopAgreement, StopRequest, exit_code, signal_name
from training.straggler import describe_straggler, find_straggler, gather_floats, gather_hosts, own_time_per_step
from training.task_eval import TaskEvaluator
from training.watchdog import HangWatchdog, Phases

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------- one step


@dataclass
class StepOutcome:
    loss: torch.Tensor  # mean over the micro-batches, on the device
    result: StepResult
    data_wait_s: float  # host time spent waiting for batches


def train_step(engine: Engine, batches: Batches, grad_accum_steps: int, lr: float,
               before_optimizer_step: Callable[[], None] | None = None) -> StepOutcome:
    """Forward/backward on ``grad_accum_steps`` micro-batches, then one optimizer step at ``lr``.

    ``before_optimizer_step`` runs while the step's gradients exist (tools that inspect them).
    """
    loss, wait = engine.forward_backward_step(batches, grad_accum_steps)
    if before_optimizer_step is not None:
        before_optimizer_step()
    engine.mark_phase("optimizer")
    return StepOutcome(loss, engine.optimizer_step(lr, loss), wait)


def validation_sums(engine: Engine, val, n_sequences: int, device: torch.device) -> torch.Tensor:
    """This rank's summed validation loss (nats) and its count of real targets, float64 on the device.

    ``eval_loss`` is a batch's mean over its real targets (padding rows' targets are IGNORE_INDEX),
    so it is weighted by their count: the sums of all ranks then give the mean over the whole set.
    A batch of padding only is run all the same (every rank runs as many forwards) and not counted.
    """
    engine.train(False)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for x, y in val.batches(n_sequences):
        real = int((y != IGNORE_INDEX).sum())  # on the host, before the copy: no device sync
        loss = engine.eval_loss(x.to(device), y.to(device))
        if real:
            nats += loss.double() * real
            count += real
    engine.train(True)
    return torch.stack([nats, nats.new_tensor(float(count))])


def evaluate(engine: Engine, val, n_sequences: int, ctx: DistContext) -> float:
    """Mean loss per target over the validation set of ``n_sequences`` windows (a collective).

    Every rank adds its sums; ranks of one tensor-parallel group or pipeline hold the same ones, so
    each data-parallel share counts the same number of times in numerator and denominator.
    """
    sums = ctx.all_reduce_mean(validation_sums(engine, val, n_sequences, ctx.device))
    return float(sums[0] / sums[1].clamp(min=1))


def evaluate_data(engine: Engine, data, n_sequences: int, ctx: DistContext) -> dict[str, float]:
    """``val_loss`` over the data's validation set; for a mixture, each source's as ``val_loss/<name>``
    and ``val_loss`` their mean weighted by the sources' configured weights (fixed for the run, so
    the curve stays comparable across schedule changes). Collectives: every rank calls it alike."""
    if not data.val_sources:
        return {"val_loss": evaluate(engine, data.val, n_sequences, ctx)}
    losses = {name: evaluate(engine, val, n_sequences, ctx) for name, val in data.val_sources.items()}
    weights = data.mixture.configured_weights() if data.mixture is not None else {k: 1 / len(losses) for k in losses}
    metrics = {"val_loss": sum(weights[name] * loss for name, loss in losses.items())}
    return metrics | {f"val_loss/{name}": loss for name, loss in losses.items()}


def describe_validation(step: int, metrics: dict[str, float]) -> str:
    parts = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in metrics.items() if k.startswith("val_loss/")]
    return f"step {step}: val_loss {metrics['val_loss']:.4f}" + (f" ({', '.join(parts)})" if parts else "")


def read_flags(flags: list[bool | torch.Tensor]) -> list[bool]:
    """Skip flags as host bools; those still on the device are copied in one transfer (one sync)."""
    on_device = [f for f in flags if isinstance(f, torch.Tensor)]
    values = iter(torch.stack([f.reshape(()) for f in on_device]).tolist() if on_device else [])
    return [next(values) if isinstance(f, torch.Tensor) else f for f in flags]


def router_load_sum(ctx: DistContext) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Sums a router load over the ranks that hold the same MoE layers and route other tokens; None: one.

    Those are the data-parallel ranks, with the cp and ep ranks FSDP2 folds into them
    (``ParallelDims.fsdp_dims``), and the tp ranks: under sequence parallelism each routes its own
    slice of the sequences; without, all route the same tokens, a uniform factor on the sum that the
    bias step's sign ignores.
    """
    meshes = [mesh for mesh in (ctx.fsdp_mesh(), ctx.submesh("tp")) if mesh is not None]
    if not meshes:
        return None
    groups = [mesh.get_group(i) for mesh in meshes for i in range(mesh.ndim)]

    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
        for group in groups:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    return all_reduce_sum


def engine_moe_layers(engine: Engine) -> list[MoE]:
    """The MoE layers this rank's engine holds (a pipeline rank: those of its stages)."""
    return moe_layers([engine.module()])


def router_window_metrics(layers: list[MoE], model_cfg: ModelConfig, ctx: DistContext) -> dict[str, float]:
    """The log window's router metrics of the whole batch, and fresh windows; every rank calls this.

    Every rank's ``take_router_table`` is summed over the world: the ranks that route other tokens
    of the batch (data, expert, context and tensor-sequence parallel ranks) add their counts, and
    pipeline stages add the rows of the layers they hold, so the log says what one process routing
    every rank's micro-batches logs (ranks routing the same tokens, tp without sequence parallelism,
    scale a layer's row uniformly, which its ratios ignore). One all-reduce of (layers, E + 3)."""
    if model_cfg.moe.experts is None:
        return {}
    # rows for the blocks and the multi-token-prediction modules' blocks, numbered on from them
    table = take_router_table(layers, model_cfg.n_layer + model_cfg.mtp_depth, model_cfg.moe.experts, ctx.device)
    if ctx.backend is not None:
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
    return router_metrics(table)


# --------------------------------------------------------------------------- log windows


@dataclass
class Window:
    """What happened since the last log line: the steps, their losses, data waits and bytes sent.

    Counts and the loss sum are taken once the loop has read the steps' skip flags (``settle``).
    """

    start: float = field(default_factory=time.perf_counter)
    outcomes: list[StepOutcome] = field(default_factory=list)
    data_wait_s: float = 0.0
    comm: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.outcomes)

    @property
    def skipped(self) -> int:
        return sum(bool(o.result.skipped) for o in self.outcomes)

    @property
    def applied(self) -> int:
        return self.steps - self.skipped

    def loss_sum(self) -> torch.Tensor | None:
        """Over applied steps only, on the device; None when every step was skipped."""
        losses = [o.loss.detach() for o in self.outcomes if not o.result.skipped]
        return sum(losses[1:], losses[0].clone()) if losses else None

    def add(self, outcome: StepOutcome, comm: dict[str, int]) -> None:
        self.data_wait_s += outcome.data_wait_s
        for key in ("comm_bytes_sent", "comm_bytes_uncompressed", "muon_bytes_sent"):  # counts add up; ratios are recomputed
            if key in comm:
                self.comm[key] = self.comm.get(key, 0) + comm[key]
        self.outcomes.append(outcome)

    def restart_clock(self) -> None:
        """Evaluation and checkpoint time is not training throughput."""
        self.start = time.perf_counter()


@dataclass
class Throughput:
    tokens_per_step: int
    flops_per_step: float
    peak_tflops: float | None  # per device; None: MFU is not reported


def window_metrics(window: Window, result: StepResult, lr: float, ctx: DistContext, rate: Throughput,
                   skipped_total: int) -> dict:
    """The log row of a window. The regular host syncs: loss and grad norm are read here."""
    elapsed = time.perf_counter() - window.start
    n = max(window.steps, 1)
    # Every rank reduces, even when all steps of the window were skipped (then on every rank alike).
    loss_sum = window.loss_sum()
    local = loss_sum if loss_sum is not None else torch.zeros((), device=ctx.device)
    loss = ctx.all_reduce_mean(local.detach().clone()) / max(window.applied, 1)
    mem, mem_kind = peak_memory_gib(ctx.device)
    metrics = {
        "loss": float(loss) if window.applied else None,  # None, never 0.0: no step of the window counted
        "lr": lr,
        "grad_norm": float(result.grad_norm),
        "tokens_per_s": rate.tokens_per_step * n / elapsed,
        "step_time_s": elapsed / n,
        "data_wait_frac": window.data_wait_s / elapsed if elapsed > 0 else 0.0,
        mem_kind + "_gib": mem,
        "skipped_steps": skipped_total,
        "skipped_in_window": window.skipped,
    }
    if rate.peak_tflops:
        metrics["mfu"] = rate.flops_per_step * n / elapsed / (rate.peak_tflops * 1e12 * ctx.world_size)
    if result.loss_scale is not None:
        metrics["loss_scale"] = result.loss_scale
    metrics.update({k: v / n for k, v in window.comm.items()})
    clip = [(o.result.qk_clipped, o.result.max_logit) for o in window.outcomes if o.result.qk_clipped is not None]
    if clip:  # QK-clip (optim.muon.qk_clip_tau): read here, with the loss
        metrics["qk_clipped_heads"] = int(torch.stack([c for c, _ in clip]).sum())
        metrics["max_attention_logit"] = float(torch.stack([m for _, m in clip]).max())
    if metrics.get("comm_bytes_sent"):
        metrics["comm_saving"] = metrics["comm_bytes_uncompressed"] / metrics["comm_bytes_sent"]
    return metrics


def format_line(step: int, max_steps: int, m: dict, n_steps: int) -> str:
    mfu = f"mfu {m['mfu']:.1%}" if "mfu" in m else "mfu n/a"
    mem_key = next(k for k in m if k.endswith("_gib"))
    loss = "loss skipped" if m["loss"] is None else f"loss {m['loss']:.4f}"
    if m["skipped_in_window"]:
        loss += f" ({m['skipped_in_window']}/{n_steps} steps skipped)"
    line = (f"step {step}/{max_steps} | {loss} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
            f"{m['tokens_per_s']:,.0f} tok/s | {mfu} | data wait {m['data_wait_frac']:.0%} | "
            f"{mem_key[:-4]} {m[mem_key]:.2f} GiB")
    if "mtp_loss" in m:
        line += f" | mtp loss {m['mtp_loss']:.4f}"
    if "moe_aux_loss" in m:
        loads = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("moe_load_max_mean/")}
        worst = max(loads, key=loads.get)
        line += f" | moe aux {m['moe_aux_loss']:.4f}, load max/mean {loads[worst]:.2f} (layer {worst})"
        if m["moe_dropped_frac"]:
            line += f", dropped {m['moe_dropped_frac']:.1%}"
    if "comm_bytes_sent" in m:
        line += (f" | comm {m['comm_bytes_sent'] / 2**20:.2f} MiB/step sent vs "
                 f"{m['comm_bytes_uncompressed'] / 2**20:.2f} uncompressed")
    if m.get("muon_bytes_sent"):
        line += f" | muon {m['muon_bytes_sent'] / 2**20:.2f} MiB/step sent"
    if "max_attention_logit" in m:
        line += f" | max logit {m['max_attention_logit']:.1f}"
        if m["qk_clipped_heads"]:
            line += f", qk-clip fired on {m['qk_clipped_heads']} heads"
    shares = {k.split("/")[1]: v for k, v in m.items() if k.startswith("data/") and k.endswith("/share")}
    if shares:
        line += " | read " + " ".join(f"{name} {share:.0%}" for name, share in shares.items())
    return line


# --------------------------------------------------------------------------- profiling


def profiler_context(cfg: JobConfig, run_dir: Path, ctx: DistContext, log: RunLogger):
    """torch.profiler over a few steps, chrome traces into <run_dir>/profile; a no-op otherwise."""
    if not cfg.train.profile:
        return contextlib.nullcontext(None)
    from torch.profiler import ProfilerActivity, profile, schedule

    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)

    def write_trace(prof) -> None:
        path = out / f"trace_rank{ctx.rank}_step{prof.step_num}.json"
        prof.export_chrome_trace(str(path))
        log.info(f"profiler: wrote {path}")
        if ctx.device.type == "cuda":
            snapshot = out / f"memory_rank{ctx.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))  # open at pytorch.org/memory_viz
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info(f"profiler: wrote {snapshot}")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    if ctx.device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    t = cfg.train
    return profile(
        activities=activities,
        schedule=schedule(wait=t.profile_wait, warmup=t.profile_warmup, active=t.profile_active, repeat=1),
        on_trace_ready=write_trace,
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
    )


# --------------------------------------------------------------------------- the loop


@dataclass
class RunState:
    """What the loop carries across steps besides the current window."""

    step: int = 0
    skips_in_a_row: int = 0
    skipped_total: int = 0
    last_saved: int | None = None
    save_due: bool = False  # an interval save waits for an applied step
    last_val: float | None = None
    unsettled: list[tuple[int, StepResult]] = field(default_factory=list)  # steps whose skip flag is unread

    @property
    def healthy(self) -> bool:
        return self.skips_in_a_row == 0


class TrainingLoop:
    """train.py's loop: resume, then step until ``train.max_steps``, a stop, or a signal."""

    def __init__(self, cfg: JobConfig, ctx: DistContext, engine: Engine, data, batches, run_dir: Path,
                 ckpt_root: Path, log: RunLogger, stop_request: StopRequest, rate: Throughput,
                 tasks: TaskEvaluator | None = None):
        self.cfg, self.ctx, self.engine, self.data, self.batches = cfg, ctx, engine, data, batches
        self.run_dir, self.ckpt_root, self.log, self.stop_request, self.rate = run_dir, ckpt_root, log, stop_request, rate
        self.tasks = tasks  # harness tasks every harness.interval steps, or None
        self.state = RunState()
        t = cfg.train
        self.stragglers = t.straggler_threshold > 0 and ctx.world_size > 1
        # Phase marks for the hang watchdog and the straggler report (and the tests' fault injection).
        self.phases = Phases(ctx.device, timed=self.stragglers, on_mark=FaultInjector.from_env(ctx.rank))
        engine.mark_phase = self.phases.mark
        self.hosts: list[str] = []
        self.background = ckpt.BackgroundSave()  # checkpoint.async_save: the write in flight, if any
        self.moe = engine_moe_layers(engine)  # this rank's MoE layers: router metrics, aux-loss-free bias
        self.load_sum = router_load_sum(ctx)

    # ----------------------------------------------------------------- checkpoints

    def save(self, background: bool = False) -> None:
        """Raises CheckpointError, writing nothing, if the weights are non-finite or the disk fails.

        ``healthy``: the last step was applied, not skipped; keep_last pruning never removes the
        newest healthy checkpoint, whatever is saved after it. ``background``: stage the state and
        write it on a thread (checkpoint.async_save); a save in flight is finished first, either way.
        """
        with self.phases.slow("save"):
            self._save(background)

    def _save(self, background: bool) -> None:
        cfg, ctx, step = self.cfg, self.ctx, self.state.step
        self.finish_background_save(wait=True)
        t0 = time.perf_counter()
        rank_state = {"step": step, "rng": ckpt.capture_rng_state(), "data": self.batches.state_dict()}
        job = ckpt.SaveJob(self.ckpt_root, step, ctx.rank, ctx.world_size, cfg.parallel.strategy, ctx.barrier,
                           cfg.checkpoint.keep_last, healthy=self.state.healthy, device=ctx.device,
                           extra_meta={"model": to_dict(cfg.model), "schedule": cfg.lr_schedule(),
                                       "layout": ckpt.layout_record(self.ctx.layout), "tokenizer": self.data.tokenizer,
                                       "tokenizer_sha256": self.data.tokenizer_sha256, "eot_id": self.data.eot_id})
        if background:
            self.background.start(job, lambda d, staging: self.engine.stage_save(d, ctx.rank, staging), rank_state,
                                  self.engine.local_weights())
            self.log.info(f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f}s, writing in the "
                          "background")
        else:
            job.begin(self.engine.local_weights())
            path = job.finish(job.write(lambda d: self.engine.save(d, ctx.rank), rank_state))
            self.log.info(f"checkpoint: saved {path} in {time.perf_counter() - t0:.1f}s")
        self.state.last_saved = step

    def finish_background_save(self, wait: bool) -> None:
        """Publish the background save in flight once every rank wrote it (collective); ``wait``:
        block until then (logged). Its write error is raised here, as the synchronous save's."""
        done = self.background.finish(wait=wait)
        if done is not None:
            path, waited = done
            if waited is not None:
                self.log.info(f"checkpoint: waited {waited:.2f}s for the background write of {path.name}")
            self.log.info(f"checkpoint: saved {path} (written in the background)")

    def resume(self) -> None:
        """Restore everything a continued run needs and continue from its step."""
        cfg, ctx, log = self.cfg, self.ctx, self.log
        warn = log.warn if ctx.is_main else None
        notes: set[str] = set()  # a multi-checkpoint walk says "no checksums" once

        def verify(p: Path) -> str | None:
            return ckpt.verify_contents(p, lambda line: notes.add(line), rank=ctx.rank, world_size=ctx.world_size)

        spec = cfg.checkpoint.resume
        path = ckpt.resolve_resume("latest" if spec == "auto" else spec, self.ckpt_root, warn=warn, verify=verify)
        for line in sorted(notes) if warn else ():
            warn(f"resume: {line}")
        if path is None:
            if spec in ("latest", "auto"):
                log.info(f"resume{' auto' if spec == 'auto' else ''}: no checkpoint under {self.ckpt_root} yet, "
                         f"starting from step 0{restart_note()}")
                log.keep_rows_up_to(0)  # rows of a run that crashed before its first save
            return
        reshard = cfg.checkpoint.reshard
        meta = ckpt.read_checkpoint_meta(path, ctx.world_size, cfg.parallel.strategy, to_dict(cfg.model),
                                         layout=ckpt.layout_record(self.ctx.layout), reshard=reshard)
        ckpt.check_schedule(path, meta, cfg.lr_schedule(), allow_change=cfg.checkpoint.allow_schedule_change,
                            warn=warn)
        check_tokenizer(path, meta, self.data)
        self.engine.load(path)
        if reshard:
            # RNG states belong to the saved layout's ranks; the model, optimizer and schedule carry
            # over. A mixture's stream state is the same on every rank and means the same in any
            # layout, so it continues; another stream's per-rank position does not map, and it
            # starts again (said, not silent).
            self.state.step = int(meta["step"])
            moved = (f"resume: resharded {path} (saved with {meta.get('world_size')} rank(s), layout "
                     f"{meta.get('layout')}) into {ctx.world_size} rank(s), layout {ckpt.layout_record(self.ctx.layout)}")
            if self.batches.layout_free:
                self.batches.load_state_dict(safe_torch_load(path / "rank_00000.pt")["data"])
                log.info(f"{moved}; the data stream continues where it stopped (its order does not depend on the "
                         f"layout)")
            else:
                log.warn(f"{moved}; the data stream restarts at its first batch")
        else:
            state = safe_torch_load(path / f"rank_{ctx.rank:05d}.pt")
            self.batches.load_state_dict(state["data"])
            ckpt.restore_rng_state(state["rng"])
            self.state.step = int(state["step"])
        log.info(f"resume{' auto' if cfg.checkpoint.resume == 'auto' else ''}: continuing from {path} at step "
                 f"{self.state.step}{restart_note()}")
        log.keep_rows_up_to(self.state.step)

    # ----------------------------------------------------------------- the loop

    def run(self) -> int:
        """Train to ``train.max_steps``; returns the process exit code."""
        cfg, ctx, log, t, s = self.cfg, self.ctx, self.log, self.cfg.train, self.state
        t_start = time.perf_counter()
        schedule = cfg.lr_schedule()
        alarms, agreement = LearningAlarms(log, cfg.precision.mode), StopAgreement(ctx)
        log.set_start(s.step)
        window = Window()
        self.stop_request.arm()  # from here on SIGTERM / Ctrl-C finish the step and save
        self.engine.train(True)
        if self.stragglers:
            self.hosts = gather_hosts(ctx)
        self.phases.start(s.step)
        with self._watchdog(), profiler_context(cfg, self.run_dir, ctx, log) as prof:
            while s.step < t.max_steps:
                lr = lr_at(s.step, **schedule)
                outcome = train_step(self.engine, self.batches, t.grad_accum_steps, lr)
                if cfg.model.moe.bias_update_rate:
                    update_expert_bias(self.moe, cfg.model.moe.bias_update_rate, self.load_sum)
                window.add(outcome, self.engine.comm_stats())
                s.step += 1
                self.phases.step_done(s.step)
                s.unsettled.append((s.step, outcome.result))
                if prof is not None:
                    prof.step()
                result = outcome.result
                log_due = s.step % t.log_interval == 0 or s.step == t.max_steps
                if (log_due or self._settle_now(result)) and self._settle(alarms):
                    self.finish_background_save(wait=True)  # it holds the state from before the streak
                    return 3
                log.advance()

                if log_due:
                    self.phases.mark("collective")
                    window = self._log_window(window, result, lr, alarms)
                    self.finish_background_save(wait=False)
                if t.eval_interval and (s.step % t.eval_interval == 0 or s.step == t.max_steps):
                    with self.phases.slow("evaluation"):
                        val = evaluate_data(self.engine, self.data, t.validation_sequences, ctx)
                    s.last_val = val["val_loss"]
                    log.log(s.step, val)
                    log.info(describe_validation(s.step, val))
                    window.restart_clock()
                if self.tasks is not None and self.tasks.due(s.step):
                    with self.phases.slow("harness tasks"):
                        self._run_tasks()
                    window.restart_clock()
                if self._interval_save_due(result):
                    self.save(background=cfg.checkpoint.async_save)
                    s.save_due = False
                    window.restart_clock()
                self.phases.mark("collective")
                signum = agreement.poll(self.stop_request.requested)
                if signum:
                    if self._settle(alarms):
                        self.finish_background_save(wait=True)
                        return 3
                    return self._stop_on_signal(signum)
            agreement.finish()
            with self.phases.slow("save"):  # the write in flight, then the final one
                self.finish_background_save(wait=True)
            if cfg.checkpoint.save_final:
                self.save()
        summary = f"done: {s.step} steps in {time.perf_counter() - t_start:.1f}s"
        if s.last_val is not None:
            summary += f", final val_loss {s.last_val:.4f} (uniform baseline {math.log(cfg.model.vocab_size):.3f})"
        log.info(summary)
        return 0

    def _watchdog(self) -> contextlib.AbstractContextManager:
        t = self.cfg.train
        if not t.hang_timeout_s:
            return contextlib.nullcontext()
        return HangWatchdog(self.phases, timeout_s=t.hang_timeout_s, grace_s=t.hang_grace_s,
                            dump_dir=self.run_dir / "hang", rank=self.ctx.rank, tag=self.ctx.tag)

    def _run_tasks(self) -> None:
        t0, step = time.perf_counter(), self.state.step
        scores = self.tasks.run(self.engine)
        if scores:
            self.log.log(step, scores)
            shown = " | ".join(f"{k.removeprefix('harness/')} {v:.4f}" for k, v in scores.items())
            self.log.info(f"step {step}: harness {shown} ({time.perf_counter() - t0:.1f}s)")

    def _settle_now(self, result: StepResult) -> bool:
        """Whether this step's skip flag must be read now rather than at the next log line: when
        it is already on the host (free), when a save may follow this step (it must not store a
        skip streak), or when the run is to stop at the first non-finite step."""
        interval, s = self.cfg.checkpoint.interval, self.state
        save_may_follow = s.save_due or bool(interval and s.step % interval == 0)
        return (isinstance(result.skipped, bool) or save_may_follow
                or self.cfg.precision.nonfinite == "stop")

    def _settle(self, alarms: LearningAlarms) -> bool:
        """Read the skip flags of the steps not read yet (one host sync for all of them), then act
        on each step in order: skip streak, totals, warnings. True means stop the run."""
        s = self.state
        steps, results = [step for step, _ in s.unsettled], [result for _, result in s.unsettled]
        s.unsettled = []
        for step, result, skipped in zip(steps, results, read_flags([r.skipped for r in results])):
            result.skipped = skipped  # the window counts from the host value
            if skipped:
                s.skips_in_a_row, s.skipped_total = s.skips_in_a_row + 1, s.skipped_total + 1
                if self._stop_on_nonfinite(step):
                    return True
            else:
                s.skips_in_a_row = 0
            alarms.on_step(step, s.skips_in_a_row, result.loss_scale)
        return False

    def _log_window(self, window: Window, result: StepResult, lr: float, alarms: LearningAlarms) -> Window:
        t, s = self.cfg.train, self.state
        metrics = window_metrics(window, result, lr, self.ctx, self.rate, s.skipped_total)
        straggler = None
        if self.stragglers:  # one all-gather of a float per log interval
            times = gather_floats(self.ctx, own_time_per_step(self.phases.take_window(), window.steps))
            metrics["rank_own_time_s"] = times
            straggler = find_straggler(times, t.straggler_threshold, t.straggler_min_gap_s)
        metrics.update(router_window_metrics(self.moe, self.cfg.model, self.ctx))  # a collective
        if self.cfg.model.mtp_depth:  # a collective: the ranks' mean multi-token-prediction loss
            mtp = self.engine.take_mtp_loss()
            local = mtp if mtp is not None else torch.zeros((), device=self.ctx.device)
            metrics["mtp_loss"] = float(self.ctx.all_reduce_mean(local.detach().float().clone()))
        metrics.update(self.data.position_metrics(self.batches.state_dict()))  # a mixture: read per source
        self.log.log(s.step, metrics, format_line(s.step, t.max_steps, metrics, window.steps))
        if straggler is not None and self.ctx.is_main:
            self.log.warn(describe_straggler(s.step, straggler, metrics["rank_own_time_s"], self.hosts))
        alarms.on_log(s.step, metrics["grad_norm"], result.loss_scale)
        if metrics["data_wait_frac"] > t.data_wait_warn:
            self.log.warn(f"step {s.step}: {metrics['data_wait_frac']:.0%} of step time spent waiting for data "
                          f"(> {t.data_wait_warn:.0%}); raise data.num_workers or check the storage")
        return Window()

    def _interval_save_due(self, result: StepResult) -> bool:
        """Saving during a skip streak would store the state of a diverging run and let keep_last
        prune the checkpoints from before the blow-up: an interval save waits for an applied step."""
        interval, s, max_steps = self.cfg.checkpoint.interval, self.state, self.cfg.train.max_steps
        if interval and s.step % interval == 0 and s.step < max_steps:
            s.save_due = True
            if result.skipped:
                self.log.warn(f"step {s.step}: checkpoint postponed until a step is applied again "
                              "(this one was skipped)")
        return s.save_due and not result.skipped and s.step < max_steps

    def _stop_on_nonfinite(self, step: int) -> bool:
        """Warn about skipped step ``step``; True means stop the run."""
        p, s = self.cfg.precision, self.state
        if p.mode == "fp16" and s.skips_in_a_row <= p.max_skipped_steps:
            return False  # dynamic loss scaling overflows now and then by design; only a long streak matters
        what = f"step {step}: non-finite loss or gradient norm"
        if p.nonfinite == "stop":  # read every step (_settle_now), so step is the last one run
            self.log.warn(f"{what}; stopping (precision.nonfinite=stop). Weights are those of step {step - 1}.")
            return True
        if s.skips_in_a_row > p.max_skipped_steps:
            self.log.warn(f"{what}; {s.skips_in_a_row} steps skipped in a row (> precision.max_skipped_steps), "
                          "stopping")
            return True
        self.log.warn(f"{what}; optimizer step skipped, weights unchanged")
        return False

    def _stop_on_signal(self, signum: int) -> int:
        """Save the step just finished and return the shell's exit code for the signal (143, 130)."""
        step = self.state.step
        self.finish_background_save(wait=True)  # a save of this step in flight counts once it is written
        if self.state.last_saved != step:
            self.save()
        latest = ckpt.find_latest(self.ckpt_root)
        if latest is not None and latest.name == ckpt.step_dir_name(step):
            self.log.info(f"stopped by {signal_name(signum)} at step {step}: saved {latest}; resume with --resume")
        else:  # the save was refused: say which checkpoint a resume would use
            self.log.info(f"stopped by {signal_name(signum)} at step {step}: not saved; --resume continues from "
                          f"{latest if latest is not None else 'step 0 (no checkpoint)'}")
        return exit_code(signum)


def check_tokenizer(path: Path, meta: dict, data) -> None:
    """A checkpoint trained on one tokenizer continued on data from another would read every id as
    a different token: refuse in one line (checkpoints and datasets that record none are not checked)."""
    saved, saved_hash = meta.get("tokenizer"), meta.get("tokenizer_sha256")
    if not saved or not data.tokenizer:
        return
    same = saved_hash == data.tokenizer_sha256 if saved_hash and data.tokenizer_sha256 else saved == data.tokenizer
    if not same:
        raise CheckpointError(f"{path} was trained with tokenizer {saved} and this run's data uses {data.tokenizer}: "
                              f"its ids mean other tokens; train on data prepared with {saved}, or start a new run")


def restart_note() -> str:
    """Which attempt of a torchrun job this is, when torchrun restarted it (--max-restarts)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f" (torchrun restart {count})" if count not in ("", "0") else ""
