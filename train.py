"""perfgpt's one entry point.

    python train.py --config configs/tiny.yaml                       # one process (CPU or one GPU)
    torchrun --nproc_per_node=8 train.py --config configs/gpt2-124m.yaml --parallel.strategy=fsdp
    python train.py --config configs/tiny.yaml --resume latest       # continue where it stopped

Reads top to bottom: config -> process group -> model -> parallelize -> engine and data ->
resume -> loop (step, log, eval, checkpoint). Each stage is one call into a package.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
from pathlib import Path

import torch

from analysis.estimator import fit_verdict
from analysis.hardware import peak_tflops_for
from data.loader import build_data
from data.prefetch import DevicePrefetcher
from kernels.registry import resolve_kernel_ops
from model.attention import select_attention
from model.checkpointing import describe_checkpointing
from model.flops import FLOPS_CONVENTION, count_parameters, flops_per_token
from model.gpt import GPT
from parallel.parallelize import apply_activation_checkpointing, apply_compile, apply_data_parallel
from training import checkpoint as ckpt
from training.config import ConfigError, JobConfig, describe_fields, dump_yaml, load_config, to_dict
from training.distributed import DistContext, StopAgreement, env_rank_tag, init_distributed, shutdown_distributed
from training.engine import TorchEngine
from training.errors import describe_peer_failure, is_peer_failure, user_facing_errors
from training.metrics import LearningAlarms, RunLogger, peak_memory_gib
from training.precision import check_precision_supported, compute_dtype, model_dtype
from training.schedule import lr_at
from training.signals import StopRequest, exit_code, signal_name


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Train a GPT. Any config key can be overridden as --section.key=value "
        "(e.g. --train.max_steps=100 --precision.mode=bf16); --help-config lists them all.",
    )
    parser.add_argument("--config", help="YAML file under configs/ (e.g. configs/tiny.yaml)")
    parser.add_argument("--resume", nargs="?", const="latest", help="'latest' (default) or a checkpoint directory")
    parser.add_argument("--profile", action="store_true", help="write a PyTorch profiler trace to <run_dir>/profile")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its default")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognized argument {bad[0]!r}; config overrides look like --section.key=value")
    return args, rest


def resolve_config(args: argparse.Namespace, overrides: list[str]) -> JobConfig:
    if args.resume is not None:
        overrides = overrides + [f"--checkpoint.resume={args.resume}"]
    if args.profile:
        overrides = overrides + ["--train.profile=true"]
    return load_config(args.config, overrides)


# --------------------------------------------------------------------------- set-up stages


def prepare_run_dir(cfg: JobConfig, ctx: DistContext) -> Path:
    run_dir = Path(cfg.logging.run_dir.format(name=cfg.name))
    if ctx.is_main:
        ckpt.ensure_writable_dir(run_dir, "logging.run_dir")
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    ctx.barrier()
    return run_dir


def build_model(cfg: JobConfig, device: torch.device) -> tuple[GPT, list[str]]:
    """The GPT with its kernels and attention backend chosen for this device; returns log notes."""
    ops, kernel_note = resolve_kernel_ops(cfg.kernels.backend, device)
    dtype = model_dtype(cfg.precision.mode)
    if cfg.model.layers == "te":
        backend, attention_note = "sdpa", "attention: Transformer Engine's own (model.layers=te)"
    else:
        backend, attention_note = select_attention(
            cfg.model.attention, device, compute_dtype(cfg.precision.mode), cfg.model.head_dim)
    # init_on_meta: no memory yet; parallel/fsdp.py allocates and initializes each rank's shards.
    with torch.device("meta" if cfg.parallel.init_on_meta else device):
        model = GPT(cfg.model, ops=ops, attention_backend=backend)
    if cfg.parallel.strategy != "fsdp":  # FSDP2 keeps fp32 shards as masters and casts for compute
        model.to(dtype=dtype)
    return model, [kernel_note, attention_note]


def build_engine(model: GPT, cfg: JobConfig, ctx: DistContext):
    apply_activation_checkpointing(model, cfg.model.checkpointing, cfg.model.checkpoint_every_k)
    apply_compile(model, cfg.train.compile, cfg.train.compile_mode, cfg.train.compile_loss)
    if cfg.parallel.strategy.startswith("zero"):
        from parallel.zero import build_zero_engine

        return build_zero_engine(model, cfg, ctx)
    return TorchEngine(apply_data_parallel(model, cfg.parallel, ctx, cfg.precision.mode), cfg, ctx.device, ctx.world_size)


def describe_model(cfg: JobConfig, seq_len: int, ctx: DistContext) -> list[str]:
    n_total = count_parameters(cfg.model)
    verdict = fit_verdict(cfg.model, seq_len, cfg.train.micro_batch_size, ctx.world_size, cfg.parallel.strategy,
                          cfg.model.checkpointing, cfg.precision.mode, _device_name(ctx.device))
    return [
        f"model: {n_total / 1e6:.2f}M parameters ({count_parameters(cfg.model, include_embeddings=False) / 1e6:.2f}M "
        f"without embedding lookups), {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, "
        f"{cfg.model.n_head} heads, {cfg.model.mlp}, {cfg.model.norm}, {cfg.model.position} positions",
        f"flops: {flops_per_token(cfg.model, seq_len) / 1e6:.2f} MFLOP/token, convention {FLOPS_CONVENTION}",
        verdict,
    ]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profiler_context(cfg: JobConfig, run_dir: Path, ctx: DistContext):
    """torch.profiler over a few steps, chrome traces into <run_dir>/profile; a no-op otherwise."""
    if not cfg.train.profile:
        return contextlib.nullcontext(None)
    from torch.profiler import ProfilerActivity, profile, schedule

    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)

    def write_trace(prof) -> None:
        path = out / f"trace_rank{ctx.rank}_step{prof.step_num}.json"
        prof.export_chrome_trace(str(path))
        print(f"{ctx.tag}profiler: wrote {path}", flush=True)
        if ctx.device.type == "cuda":
            snapshot = out / f"memory_rank{ctx.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))  # open at pytorch.org/memory_viz
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"{ctx.tag}profiler: wrote {snapshot}", flush=True)

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


# --------------------------------------------------------------------------- checkpoints


def save(cfg: JobConfig, ckpt_root: Path, step: int, engine, train_iter, ctx: DistContext, log: RunLogger,
         healthy: bool = True) -> None:
    """Raises CheckpointError, writing nothing, if the weights are non-finite or the disk fails.

    ``healthy``: the last step was applied, not skipped; keep_last pruning never removes the
    newest healthy checkpoint, whatever is saved after it.
    """
    t0 = time.perf_counter()
    rank_state = {"step": step, "rng": ckpt.capture_rng_state(), "data": train_iter.state_dict()}
    path = ckpt.save_checkpoint(
        ckpt_root, step, lambda d: engine.save(d, ctx.rank), rank_state, rank=ctx.rank,
        world_size=ctx.world_size, strategy=cfg.parallel.strategy, barrier=ctx.barrier,
        keep_last=cfg.checkpoint.keep_last, healthy=healthy, weights=ckpt.local_weights(engine), device=ctx.device,
        extra_meta={"model": to_dict(cfg.model), "schedule": cfg.lr_schedule()},
    )
    log.info(f"checkpoint: saved {path} in {time.perf_counter() - t0:.1f}s")


def maybe_resume(cfg: JobConfig, ckpt_root: Path, engine, train_iter, ctx: DistContext, log: RunLogger) -> int:
    """Restore everything a continued run needs; returns the step to continue from."""
    path = ckpt.resolve_resume(cfg.checkpoint.resume, ckpt_root, warn=log.warn if ctx.is_main else None)
    if path is None:
        if cfg.checkpoint.resume == "latest":
            log.info(f"resume: no checkpoint under {ckpt_root} yet, starting from step 0")
        return 0
    meta = ckpt.read_meta(path, ctx.world_size, cfg.parallel.strategy, to_dict(cfg.model))
    ckpt.check_schedule(path, meta, cfg.lr_schedule(), allow_change=cfg.checkpoint.allow_schedule_change,
                        warn=log.warn if ctx.is_main else None)
    engine.load(path)
    state = ckpt.safe_torch_load(path / f"rank_{ctx.rank:05d}.pt")
    train_iter.load_state_dict(state["data"])
    ckpt.restore_rng_state(state["rng"])
    log.info(f"resume: continuing from {path} at step {state['step']}")
    return int(state["step"])


# --------------------------------------------------------------------------- evaluation


def evaluate(engine, val, n_batches: int, ctx: DistContext) -> float:
    engine.train(False)
    total = torch.zeros((), device=ctx.device)
    count = 0
    for x, y in val.batches(n_batches):
        total += engine.eval_loss(x.to(ctx.device), y.to(ctx.device)).float()
        count += 1
    engine.train(True)
    mean = ctx.all_reduce_mean(total / max(count, 1))
    return float(mean)


# --------------------------------------------------------------------------- the run


def run_training(cfg: JobConfig) -> int:
    nccl_env = getattr(cfg.parallel, "nccl", None)
    ctx = init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s, nccl_env)
    try:
        return train(cfg, ctx)
    finally:
        shutdown_distributed(ctx)


def promote_strategy(cfg: JobConfig, ctx: DistContext) -> str | None:
    """Several processes with strategy none would train unsynchronized replicas: use DDP instead."""
    if ctx.world_size > 1 and cfg.parallel.strategy == "none":
        cfg.parallel.strategy = "ddp"
        return f"parallel: strategy none with {ctx.world_size} processes -> ddp (gradients averaged across ranks)"
    return None


def train(cfg: JobConfig, ctx: DistContext) -> int:
    note = promote_strategy(cfg, ctx)
    run_dir = prepare_run_dir(cfg, ctx)
    log = RunLogger(run_dir, cfg.logging, is_main=ctx.is_main, tag=ctx.tag, max_steps=cfg.train.max_steps,
                    config_dict=to_dict(cfg))
    if note:
        log.info(note)
    try:
        with StopRequest(ctx.tag) as stop_request:
            return _train(cfg, ctx, run_dir, log, stop_request)
    finally:
        log.close()


def _train(cfg: JobConfig, ctx: DistContext, run_dir: Path, log: RunLogger, stop_request: StopRequest) -> int:
    t_start = time.perf_counter()
    log.info(f"perfgpt: run {cfg.name} in {run_dir} | world {ctx.world_size} ({ctx.backend or 'single process'}) "
             f"| device {ctx.device} | precision {cfg.precision.mode} | strategy {cfg.parallel.strategy}")
    log.info("resolved config:\n" + dump_yaml(cfg).rstrip())
    if ctx.world_size > 1:
        print(f"{ctx.tag}ready on {ctx.device}", flush=True)
    check_precision_supported(cfg.precision.mode, ctx.device)
    if ctx.device.type == "cuda" and cfg.precision.mode == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True  # the MFU peak for fp32 is the TF32 one
    seq_len, t = cfg.seq_len, cfg.train
    torch.manual_seed(t.seed)

    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    if cfg.checkpoint.interval or cfg.checkpoint.save_final:  # fail now, not at the first save hours later
        ckpt.ensure_writable_dir(ckpt_root, "checkpoint.dir", rank=ctx.rank, world_size=ctx.world_size,
                                 device=ctx.device)

    model, notes = build_model(cfg, ctx.device)
    for line in notes + describe_model(cfg, seq_len, ctx):
        log.info(line)
    engine = build_engine(model, cfg, ctx)
    log.info(describe_checkpointing(model))
    data = build_data(cfg.data, seq_len=seq_len, micro_batch_size=t.micro_batch_size, seed=t.seed, rank=ctx.rank,
                      world_size=ctx.world_size, vocab_size=cfg.model.vocab_size)
    log.info(data.description)
    train_iter = DevicePrefetcher(data.train, ctx.device)

    step = maybe_resume(cfg, ckpt_root, engine, train_iter, ctx, log)
    log.set_start(step)
    if cfg.checkpoint.resume:
        log.keep_rows_up_to(step)

    tokens_per_step = t.micro_batch_size * seq_len * t.grad_accum_steps * ctx.world_size
    flops_per_step = flops_per_token(cfg.model, seq_len) * tokens_per_step
    peak, peak_note = (t.peak_tflops, f"peak {t.peak_tflops:g} TFLOP/s (train.peak_tflops)") if t.peak_tflops \
        else peak_tflops_for(_device_name(ctx.device), cfg.precision.mode)
    log.info(f"mfu: {peak_note}; {tokens_per_step:,} tokens/step; uniform-baseline loss ln(V) = "
             f"{math.log(cfg.model.vocab_size):.3f}")
    schedule = cfg.lr_schedule()

    window_loss = torch.zeros((), device=ctx.device)
    window_steps, window_wait, window_start, skips_in_a_row, skipped_total = 0, 0.0, time.perf_counter(), 0, 0
    last_val, window_comm, window_skipped, last_saved, save_due = None, {}, 0, None, False
    alarms, agreement = LearningAlarms(log, cfg.precision.mode), StopAgreement(ctx)
    stop_request.arm()  # from here on SIGTERM / Ctrl-C finish the step and save
    engine.train(True)
    with profiler_context(cfg, run_dir, ctx) as prof:
        while step < t.max_steps:
            lr = lr_at(step, **schedule)
            step_loss = torch.zeros((), device=ctx.device)
            for micro in range(t.grad_accum_steps):
                t0 = time.perf_counter()
                x, y = next(train_iter)
                window_wait += time.perf_counter() - t0
                loss = engine.forward_backward(x, y, micro == t.grad_accum_steps - 1, t.grad_accum_steps)
                step_loss += loss.float() / t.grad_accum_steps
            result = engine.optimizer_step(lr, step_loss)
            window_comm = _add_comm_bytes(window_comm, getattr(engine, "comm_stats", None))
            step += 1
            if prof is not None:
                prof.step()
            if result.skipped:
                skips_in_a_row, skipped_total = skips_in_a_row + 1, skipped_total + 1
                window_skipped += 1
                stop = _handle_nonfinite(cfg, step, result, skips_in_a_row, log)
                if stop:
                    return 3
            else:
                skips_in_a_row = 0
                window_loss += step_loss
                window_steps += 1
            alarms.on_step(step, skips_in_a_row, result.loss_scale)
            log.advance()

            if step % t.log_interval == 0 or step == t.max_steps:
                elapsed = time.perf_counter() - window_start
                n_steps = window_steps + window_skipped  # exact also in the first window after a resume
                metrics = _window_metrics(ctx, window_loss, window_steps, result, lr, elapsed, window_wait, n_steps,
                                          tokens_per_step, flops_per_step, peak, skipped_total)
                metrics.update(_per_step(window_comm, n_steps))
                log.log(step, metrics, _format_line(step, t.max_steps, metrics, n_steps))
                alarms.on_log(step, metrics["grad_norm"], result.loss_scale)
                if metrics["data_wait_frac"] > t.data_wait_warn:
                    log.warn(f"step {step}: {metrics['data_wait_frac']:.0%} of step time spent waiting for data "
                             f"(> {t.data_wait_warn:.0%}); raise data.num_workers or check the storage")
                window_loss.zero_()
                window_steps, window_wait, window_start, window_comm = 0, 0.0, time.perf_counter(), {}
                window_skipped = 0

            if t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
                last_val = evaluate(engine, data.val, t.eval_steps, ctx)
                log.log(step, {"val_loss": last_val})
                log.info(f"step {step}: val_loss {last_val:.4f}")
                window_start = time.perf_counter()  # evaluation time is not training throughput

            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < t.max_steps:
                save_due = True
                if result.skipped:
                    log.warn(f"step {step}: checkpoint postponed until a step is applied again (this one was skipped)")
            # Saving during a skip streak would store the state of a diverging run and let keep_last
            # prune the checkpoints from before the blow-up: wait for an applied step.
            if save_due and not result.skipped and step < t.max_steps:
                save(cfg, ckpt_root, step, engine, train_iter, ctx, log)
                window_start, last_saved, save_due = time.perf_counter(), step, False

            signum = agreement.poll(stop_request.requested)
            if signum:
                return _stop_on_signal(cfg, ckpt_root, step, signum, last_saved, engine, train_iter, ctx, log,
                                       healthy=skips_in_a_row == 0)
        agreement.finish()

    if cfg.checkpoint.save_final:
        save(cfg, ckpt_root, step, engine, train_iter, ctx, log, healthy=skips_in_a_row == 0)
    summary = f"done: {step} steps in {time.perf_counter() - t_start:.1f}s"
    if last_val is not None:
        summary += f", final val_loss {last_val:.4f} (uniform baseline {math.log(cfg.model.vocab_size):.3f})"
    log.info(summary)
    return 0


def _stop_on_signal(cfg: JobConfig, ckpt_root: Path, step: int, signum: int, last_saved: int | None, engine,
                    train_iter, ctx: DistContext, log: RunLogger, healthy: bool) -> int:
    """Save the step just finished and return the shell's exit code for the signal (143, 130)."""
    if last_saved != step:
        save(cfg, ckpt_root, step, engine, train_iter, ctx, log, healthy=healthy)
    latest = ckpt.find_latest(ckpt_root)
    if latest is not None and latest.name == ckpt.step_dir_name(step):
        log.info(f"stopped by {signal_name(signum)} at step {step}: saved {latest}; resume with --resume")
    else:  # the save was refused (see above): say which checkpoint a resume would use
        log.info(f"stopped by {signal_name(signum)} at step {step}: not saved; --resume continues from "
                 f"{latest if latest is not None else 'step 0 (no checkpoint)'}")
    return exit_code(signum)


def _handle_nonfinite(cfg: JobConfig, step: int, result, skips_in_a_row: int, log: RunLogger) -> bool:
    """Warn about a skipped step; True means stop the run."""
    if cfg.precision.mode == "fp16":
        # Dynamic loss scaling overflows now and then by design; only a long streak is a problem.
        if skips_in_a_row <= cfg.precision.max_skipped_steps:
            return False
    what = f"step {step}: non-finite loss or gradient norm"
    if cfg.precision.nonfinite == "stop":
        log.warn(f"{what}; stopping (precision.nonfinite=stop). Weights are those of step {step - 1}.")
        return True
    if skips_in_a_row > cfg.precision.max_skipped_steps:
        log.warn(f"{what}; {skips_in_a_row} steps skipped in a row (> precision.max_skipped_steps), stopping")
        return True
    log.warn(f"{what}; optimizer step skipped, weights unchanged")
    return False


def _window_metrics(ctx, window_loss, window_steps, result, lr, elapsed, wait, n_steps, tokens_per_step,
                    flops_per_step, peak, skipped_total) -> dict:
    # The only regular host syncs: loss and grad norm are read here, once per log interval.
    # Every rank reduces, even when all steps of the window were skipped (then on every rank alike).
    loss = ctx.all_reduce_mean(window_loss.detach().clone()) / max(window_steps, 1)
    tokens_per_s = tokens_per_step * n_steps / elapsed
    mem, mem_kind = peak_memory_gib(ctx.device)
    metrics = {
        "loss": float(loss) if window_steps else None,  # None, never 0.0: no step of the window counted
        "lr": lr,
        "grad_norm": float(result.grad_norm),
        "tokens_per_s": tokens_per_s,
        "step_time_s": elapsed / n_steps,
        "data_wait_frac": wait / elapsed if elapsed > 0 else 0.0,
        mem_kind + "_gib": mem,
        "skipped_steps": skipped_total,
        "skipped_in_window": n_steps - window_steps,
    }
    if peak:
        metrics["mfu"] = flops_per_step * n_steps / elapsed / (peak * 1e12 * ctx.world_size)
    if result.loss_scale is not None:
        metrics["loss_scale"] = result.loss_scale
    return metrics


def _add_comm_bytes(window: dict, comm_stats) -> dict:
    """Sum a DDP comm hook's per-step byte counts (host-side integers, no device sync)."""
    if comm_stats is None:
        return window
    step = comm_stats.pop_step()
    for key in ("comm_bytes_sent", "comm_bytes_uncompressed"):
        window[key] = window.get(key, 0) + step[key]
    return window


def _per_step(window_comm: dict, n_steps: int) -> dict:
    out = {k: v / n_steps for k, v in window_comm.items()}
    if out.get("comm_bytes_sent"):
        out["comm_saving"] = out["comm_bytes_uncompressed"] / out["comm_bytes_sent"]
    return out


def _format_line(step: int, max_steps: int, m: dict, n_steps: int) -> str:
    mfu = f"mfu {m['mfu']:.1%}" if "mfu" in m else "mfu n/a"
    mem_key = next(k for k in m if k.endswith("_gib"))
    loss = "loss skipped" if m["loss"] is None else f"loss {m['loss']:.4f}"
    if m["skipped_in_window"]:
        loss += f" ({m['skipped_in_window']}/{n_steps} steps skipped)"
    return (f"step {step}/{max_steps} | {loss} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
            f"{m['tokens_per_s']:,.0f} tok/s | {mfu} | data wait {m['data_wait_frac']:.0%} | "
            f"{mem_key[:-4]} {m[mem_key]:.2f} GiB" + _comm_suffix(m))


def _comm_suffix(m: dict) -> str:
    if "comm_bytes_sent" not in m:
        return ""
    return (f" | comm {m['comm_bytes_sent'] / 2**20:.2f} MiB/step sent vs "
            f"{m['comm_bytes_uncompressed'] / 2**20:.2f} uncompressed")


# --------------------------------------------------------------------------- entry


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if args.help_config:
        print("\n".join(describe_fields()))
        return 0
    tag = env_rank_tag()  # under torchrun every rank prints its own line: say which one
    try:
        cfg = resolve_config(args, overrides)
        return run_training(cfg)
    except user_facing_errors() as exc:
        kind = "config error" if isinstance(exc, ConfigError) else "error"
        print(f"{tag}{kind}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during set-up; in the loop it finishes the step and saves
        print(f"{tag}interrupted (SIGINT) before the first step; nothing to save", file=sys.stderr)
        return exit_code(signal.SIGINT)
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        print(f"{tag}error: {describe_peer_failure(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
