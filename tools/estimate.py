"""Analytic estimate of a training job: parameters, FLOPs, activation and model-state memory per
GPU, communication, step time, MFU, and whether it fits (analysis/estimator.py explains the model).

Examples:
  python tools/estimate.py --preset 70b                          # the chapter's 70B activation example
  python tools/estimate.py --preset gpt3-175b --gpus 8           # does GPT-3 fit on 8x H100? (no)
  python tools/estimate.py --config configs/llama-7b.yaml --gpus 8 --device H100 --plan
  python tools/estimate.py --config configs/tiny.yaml --model.n_layer=12 --gpus 1 --device A100
Presets: 70b (h=8192, a=64, L=80, s=4096, b=4), gpt3-175b (h=12288, a=96, L=96, s=2048), llama2-7b.
Devices: H100, H200, A100 (analysis/hardware.py, with sources).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis import estimator as est  # noqa: E402
from analysis.hardware import DEVICES  # noqa: E402
from analysis.report import gib, human_bytes, markdown_table, text_table  # noqa: E402
from model.flops import FLOPS_CONVENTION  # noqa: E402
from training.fields import ConfigError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="job YAML (configs/*.yaml); extra --section.key=value arguments override it")
    source.add_argument("--preset", choices=est.PRESET_NAMES, help="one of the chapter's models")
    parser.add_argument("--gpus", type=int, help="data-parallel GPUs (default: the preset's, or 1)")
    parser.add_argument("--device", choices=sorted(DEVICES), help="GPU type (default H100)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's or preset's)")
    parser.add_argument("--micro-batch", type=int, help="sequences per GPU per step")
    parser.add_argument("--strategy", choices=est.STRATEGIES, help="default: the config's parallel.strategy, or fsdp")
    parser.add_argument("--policy", choices=est.POLICIES, help="activation checkpointing (default: the config's, or none)")
    parser.add_argument("--precision", choices=est.PRECISION_MODES, help="default: the config's, or bf16_master")
    parser.add_argument("--plan", action="store_true", help="list the cheapest strategy x policy x micro-batch that fit")
    parser.add_argument("--top", type=int, default=10, help="rows of --plan (default 10)")
    parser.add_argument("--markdown", type=Path, help="also write the tables as Markdown here")
    args, rest = parser.parse_known_args(argv)
    unknown = [r for r in rest if not (r.startswith("--") and "." in r.split("=", 1)[0] and "=" in r)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides look like --model.n_layer=12)")
    if rest and not args.config:
        parser.error("--section.key=value overrides need --config")
    return args, rest


def build_job(args: argparse.Namespace, overrides: list[str]) -> est.JobSpec:
    device = DEVICES[args.device or "H100"]
    if args.preset:
        p = est.preset(args.preset)
        model, seq_len, micro_batch, gpus = p.model, p.seq_len, p.micro_batch, p.world_size
        strategy, policy, precision = "fsdp", "none", "bf16_master"
        device = DEVICES[args.device or p.device]
    else:
        from training.config import load_config

        cfg = load_config(args.config, overrides)
        model, seq_len, micro_batch, gpus = cfg.model, cfg.seq_len, cfg.train.micro_batch_size, 1
        strategy, policy, precision = cfg.parallel.strategy, cfg.model.checkpointing, cfg.precision.mode
    gpus = args.gpus or gpus
    if args.strategy:
        strategy = args.strategy
    elif gpus == 1:
        strategy = "none"  # one process: nothing to shard whatever the config says
    elif strategy == "none":
        strategy = "fsdp"  # a one-process config spread over --gpus: estimate the sharded version
    if seq_len > model.max_seq_len or (args.seq_len or 0) > model.max_seq_len:
        raise est.EstimatorError(f"--seq-len {args.seq_len or seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    return est.JobSpec(
        model=model,
        seq_len=args.seq_len or seq_len,
        micro_batch=args.micro_batch or micro_batch,
        world_size=gpus,
        strategy=strategy,
        policy=args.policy or policy,
        precision=args.precision or precision,
        device=device,
    )


def model_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    cfg = job.model
    n = est.count_parameters(cfg)
    rows = [
        ["parameters", f"{n:,} ({n / 1e9:.2f} B)"],
        ["matmul parameters N", f"{est.matmul_parameters(cfg):,}"],
        ["training FLOPs/token", f"{est.flops_per_token(cfg, job.seq_len):.4g}"],
        ["shape", f"L={cfg.n_layer}, d={cfg.d_model}, heads={cfg.n_head}, d_ff={cfg.d_ff} {cfg.mlp}, "
                  f"vocab={cfg.vocab_size}, s={job.seq_len}, b={job.micro_batch}"],
    ]
    return ["model", "value"], rows


def activation_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    cfg = job.model
    rows = []
    for policy in est.POLICIES:
        per_layer = est.activation_bytes_per_layer(
            cfg, job.seq_len, job.micro_batch, policy, job.activation_dtype_bytes, attention=job.attention
        )
        extra = est.recompute_flops_per_token(cfg, job.seq_len, policy) / est.flops_per_token(cfg, job.seq_len)
        if policy == "offload":  # nothing stays on the GPU; the none bytes go to host memory
            host = est.activation_bytes_per_layer(
                cfg, job.seq_len, job.micro_batch, "none", job.activation_dtype_bytes, attention=job.attention
            )
            rows.append([policy, f"0 (host {human_bytes(host)})", f"0 (host {gib(host * cfg.n_layer)})", "0.0% + PCIe"])
            continue
        rows.append([policy, human_bytes(per_layer), gib(per_layer * cfg.n_layer), f"{extra:.1%}"])
    return ["policy", "per layer", f"x {cfg.n_layer} layers", "recompute FLOPs"], rows


def strategy_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    rows = []
    strategies = ("none",) if job.world_size == 1 else est.STRATEGIES[1:]
    for strategy in strategies:
        result = est.estimate(dataclasses.replace(job, strategy=strategy))
        m, t = result.memory, result.time
        rows.append([
            strategy,
            gib(m.states),
            gib(m.activations + m.logits),
            gib(m.total),
            human_bytes(result.comm.sent_per_gpu),
            f"{t.step_s:.3g}",
            "-" if t.mfu is None else f"{t.mfu:.0%}",
            "yes" if result.fits else "NO",
        ])
    headers = ["strategy", "states/GPU", "activations/GPU", "total/GPU", "comm/GPU/step", "step s", "MFU", "fits"]
    return headers, rows


def plan_section(job: est.JobSpec, top: int) -> tuple[list[str], list[list[str]]]:
    plans = est.plan_fits(job.model, job.seq_len, job.world_size, job.device, job.precision, top=top)
    rows = [
        [p.job.strategy, p.job.policy, str(p.job.micro_batch), gib(p.memory.total), f"{p.time.step_s:.3g}",
         f"{p.time.tokens_per_s:,.0f}", "-" if p.time.mfu is None else f"{p.time.mfu:.0%}"]
        for p in plans
    ]
    return ["strategy", "policy", "micro-batch", "memory/GPU", "step s", "tokens/s", "MFU"], rows


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        job = build_job(args, overrides)
        sections = [
            ("Model", *model_section(job)),
            (f"Activations saved for backward ({job.precision}, {job.attention} attention, Korthikanti et al. 2022)",
             *activation_section(job)),
            (f"Per GPU on {job.world_size}x {job.device.name} (policy {job.policy}, micro-batch {job.micro_batch})",
             *strategy_section(job)),
        ]
        if args.plan:
            sections.append((f"Cheapest that fit on {job.world_size}x {job.device.name}", *plan_section(job, args.top)))
        verdict = est.fit_verdict(
            job.model, job.seq_len, job.micro_batch, job.world_size, job.strategy, job.policy, job.precision, job.device.name
        )
    except (est.EstimatorError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for title, headers, rows in sections:
        print(f"\n{title}\n" + text_table(headers, rows, numeric=headers[0] != "model"))
    if args.plan and not sections[-1][2]:
        print("nothing fits; try more GPUs, a larger device, or a shorter sequence")
    print(f"\n{verdict}\nFLOPs convention: {FLOPS_CONVENTION}; memory in GiB (2^30 bytes).")
    if args.markdown:
        body = [f"## {title}\n\n{markdown_table(headers, rows)}\n" for title, headers, rows in sections]
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("# Estimate\n\n" + "\n".join(body) + f"\n{verdict}\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
