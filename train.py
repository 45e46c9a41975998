"""perfgpt's one entry point.

    python train.py --config configs/tiny.yaml                       # one process (CPU or one GPU)
    torchrun --nproc_per_node=8 train.py --config configs/gpt2-124m.yaml --parallel.strategy=fsdp
    python train.py --config configs/tiny.yaml --resume latest       # continue where it stopped

Reads top to bottom: parse the config -> join the process group -> resolve the job (every value
not in the config file: training/build.py's resolve_job, which opens the data) -> write it to
<run_dir>/config.yaml and log a summary -> build the engine (model, kernels, precision, recompute,
compile, parallelism: parallel/parallelize.py) -> resume -> loop (training/loop.py). Each stage is
one call into a package.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path

import torch

from analysis.estimator import fit_verdict
from common.errors import USER_FACING_ERRORS, ConfigError, describe_peer_failure, is_peer_failure
from common.hardware import peak_tflops_for
from common.log import configure_logging
from model.flops import FLOPS_CONVENTION, count_parameters, flops_per_token
from parallel.distributed import DistContext, env_rank_tag, init_distributed, shutdown_distributed
from parallel.nccl import apply_flight_recorder_env
from training import checkpoint as ckpt
from training.build import Job, build_from_config, resolve_job
from training.config import (
    RUN_CONFIG_FILE,
    JobConfig,
    describe_fields,
    dump_yaml,
    explicit_keys,
    load_config,
    parse_known_overrides,
    to_dict,
)
from training.loop import Throughput, TrainingLoop
from training.metrics import RunLogger
from training.signals import StopRequest, exit_code
from training.task_eval import TaskEvaluator


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Train a GPT. Any config key can be overridden as --section.key=value "
        "(e.g. --train.max_steps=100 --precision.mode=bf16); --help-config lists them all.",
    )
    parser.add_argument("--config", help="YAML file under configs/ (e.g. configs/tiny.yaml)")
    parser.add_argument("--resume", nargs="?", const="latest",
                        help="'latest' (default), 'auto' (the newest complete checkpoint if one exists, else a fresh "
                        "start: for torchrun --max-restarts) or a checkpoint directory")
    parser.add_argument("--profile", action="store_true", help="write a PyTorch profiler trace to <run_dir>/profile")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its default")
    return parse_known_overrides(parser, argv)


def resolve_config(args: argparse.Namespace, overrides: list[str]) -> tuple[JobConfig, frozenset[str]]:
    """The run's config, and the keys the file and the command line set explicitly."""
    if args.resume is not None:
        overrides = overrides + [f"--checkpoint.resume={args.resume}"]
    if args.profile:
        overrides = overrides + ["--train.profile=true"]
    return load_config(args.config, overrides), explicit_keys(args.config, overrides)


# --------------------------------------------------------------------------- the run


def run(cfg: JobConfig, stop_request: StopRequest, explicit: frozenset[str] = frozenset()) -> int:
    recorder_note = None
    if cfg.parallel.flight_recorder:  # read by the process group when it starts
        recorder_note = apply_flight_recorder_env(str(run_dir_of(cfg) / "flight_recorder" / "rank_"))
    ctx = init_distributed(cfg.train.device, cfg.parallel)
    try:
        configure_logging(ctx.tag, main=ctx.is_main)  # what opening the data says, before the run's logger
        ckpt.refuse_another_run(run_dir_of(cfg), checkpoint_root(cfg), cfg.checkpoint.resume,
                                world_size=ctx.world_size, device=ctx.device)
        # Resolved first, then written and logged: config.yaml is the configuration the run uses.
        job = resolve_job(cfg, ctx, explicit)
        run_dir = prepare_run_dir(job.cfg, ctx)
        with RunLogger(run_dir, job.cfg.logging, is_main=ctx.is_main, tag=ctx.tag, max_steps=job.cfg.train.max_steps,
                       config_dict=to_dict(job.cfg)) as log:
            for line in describe_run(job.cfg, ctx, run_dir) + job.notes + ([recorder_note] if recorder_note else []):
                log.info(line)
            if ctx.is_main:
                for line in job.warnings:
                    log.warn(line)
            return train(job, ctx, run_dir, log, stop_request)
    finally:
        shutdown_distributed(ctx)


def run_dir_of(cfg: JobConfig) -> Path:
    return Path(cfg.logging.run_dir.format(name=cfg.name))


def checkpoint_root(cfg: JobConfig) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir_of(cfg) / "checkpoints"


def prepare_run_dir(cfg: JobConfig, ctx: DistContext) -> Path:
    run_dir = run_dir_of(cfg)
    if ctx.is_main:
        ckpt.ensure_writable_dir(run_dir, "logging.run_dir")
        (run_dir / RUN_CONFIG_FILE).write_text(dump_yaml(cfg))
    ctx.barrier()
    return run_dir


def train(job: Job, ctx: DistContext, run_dir: Path, log: RunLogger, stop_request: StopRequest) -> int:
    cfg, data = job.cfg, job.data
    if ctx.world_size > 1:
        log.info_every_rank(f"ready on {ctx.device}")
    if ctx.device.type == "cuda" and cfg.precision.mode == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True  # the MFU peak for fp32 is the TF32 one
    ckpt_root = checkpoint_root(cfg)
    if cfg.checkpoint.interval or cfg.checkpoint.save_final:  # fail now, not at the first save hours later
        ckpt.ensure_writable_dir(ckpt_root, "checkpoint.dir", rank=ctx.rank, world_size=ctx.world_size,
                                 device=ctx.device)

    built = build_from_config(cfg, ctx, job.initial_state)
    for line in built.notes + describe_model(cfg, ctx):
        log.info(line)
    for line in built.warnings:
        log.warn(line)
    log.info(data.description)
    if cfg.train.eval_interval:
        key = "train.eval_sequences" if cfg.train.eval_sequences else "train.eval_steps x train.micro_batch_size"
        for val in data.val_sources.values() or [data.val]:
            log.info(val.describe(cfg.train.validation_sequences, key))
    # The harness tasks load before the first step (a bad name stops the run there).
    tasks = TaskEvaluator(cfg, ctx, data.tokenizer, data.eot_id) if cfg.harness.tasks else None

    rate, rate_note = throughput(cfg, ctx)
    log.info(rate_note)
    loop = TrainingLoop(cfg, ctx, built.engine, data, job.batches, run_dir, ckpt_root, log, stop_request, rate, tasks)
    loop.resume()
    return loop.run()


def describe_run(cfg: JobConfig, ctx: DistContext, run_dir: Path) -> list[str]:
    """The start of the log: where the run is, what it trains for how long, and the file that holds
    every resolved key (the model, layout and data lines follow once they are built)."""
    t, d = cfg.train, cfg.data
    data = f"a mixture of {len(d.sources)} sources" if d.sources else f"{d.format} {d.path}".rstrip()
    return [
        f"perfgpt: run {cfg.name} in {run_dir} | world {ctx.world_size} ({ctx.backend or 'single process'}) "
        f"| device {ctx.device} | precision {cfg.precision.mode} | {ctx.layout.describe()}",
        f"train: {t.max_steps:,} steps of {t.grad_accum_steps} micro-batch(es) x {t.micro_batch_size} sequences x "
        f"{cfg.seq_len} tokens per data-parallel rank | data {data} | resolved config: {run_dir / RUN_CONFIG_FILE}",
    ]


def describe_model(cfg: JobConfig, ctx: DistContext) -> list[str]:
    m, seq_len = cfg.model, cfg.seq_len
    verdict = fit_verdict(cfg, ctx.layout, _device_name(ctx.device))
    lines = [
        f"model: {count_parameters(m) / 1e6:.2f}M parameters ({count_parameters(m, include_embeddings=False) / 1e6:.2f}M "
        f"without embedding lookups), {m.n_layer} layers, d_model {m.d_model}, "
        f"{m.n_head} heads ({m.kv_heads} key/value), {m.mlp}, {m.norm}, {m.position} positions",
        f"flops: {flops_per_token(m, seq_len) / 1e6:.2f} MFLOP/token, convention {FLOPS_CONVENTION}",
        verdict,
    ]
    if m.moe.experts is not None:
        lines.insert(1, f"moe: {count_parameters(m) / 1e6:.2f}M total, {count_parameters(m, active=True) / 1e6:.2f}M "
                        f"active per token; {m.n_moe_layers} of {m.n_layer} layers route to {m.moe.top_k} of "
                        f"{m.moe.experts} experts (width {m.expert_d_ff}) + {m.moe.shared_experts} shared, "
                        f"{m.moe.router} router, capacity {m.moe.capacity or 'dropless'}")
    return lines


def throughput(cfg: JobConfig, ctx: DistContext) -> tuple[Throughput, str]:
    """Tokens and FLOPs per optimizer step and the device peak MFU is measured against; a log line."""
    t, seq_len = cfg.train, cfg.seq_len
    tokens_per_step = t.micro_batch_size * seq_len * t.grad_accum_steps * ctx.layout.dp
    peak, peak_note = ((t.peak_tflops, f"peak {t.peak_tflops:g} TFLOP/s (train.peak_tflops)") if t.peak_tflops
                       else peak_tflops_for(_device_name(ctx.device), cfg.precision.mode))
    note = (f"mfu: {peak_note}; {tokens_per_step:,} tokens/step; uniform-baseline loss ln(V) = "
            f"{math.log(cfg.model.vocab_size):.3f}")
    return Throughput(tokens_per_step, flops_per_token(cfg.model, seq_len) * tokens_per_step, peak), note


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --------------------------------------------------------------------------- entry


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if args.help_config:
        print("\n".join(describe_fields()))
        return 0
    tag = env_rank_tag()  # under torchrun every rank prints its own line: say which one
    try:
        cfg, explicit = resolve_config(args, overrides)
        # From here a signal never raises inside set-up code: it exits at once until the first
        # step, and from then on finishes the step and saves (training/signals.py).
        with StopRequest(tag) as stop_request:
            return run(cfg, stop_request, explicit)
    except USER_FACING_ERRORS as exc:
        kind = "config error" if isinstance(exc, ConfigError) else "error"
        print(f"{tag}{kind}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the config is read, before StopRequest takes the signals over
        print(f"{tag}interrupted (SIGINT) before the first step; nothing to save", file=sys.stderr)
        return exit_code(signal.SIGINT)
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        print(f"{tag}error: {describe_peer_failure(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
