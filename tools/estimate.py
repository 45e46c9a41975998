"""Analytic estimate of a training job: parameters, FLOPs, activation and model-state memory per
GPU, communication, step time, MFU, and whether it fits (the model: analysis/estimator/; its
derivation: docs/estimator.md).

Examples:
  python -m tools.estimate --preset 70b                          # the chapter's 70B activation example
  python -m tools.estimate --preset 70b --plan                   # the cheapest layouts on its 64 H100s
  python -m tools.estimate --preset 70b --tp 8                   # one layout: tensor + sequence parallel
  python -m tools.estimate --preset gpt3-175b --gpus 8           # does GPT-3 fit on 8x H100? (no)
  python -m tools.estimate --config configs/llama-7b.yaml --gpus 48 --device H100 --plan --global-batch 96
  python -m tools.estimate --config configs/tiny.yaml --model.n_layer=12 --gpus 1 --device A100
  python -m tools.estimate --config configs/llama3-8b.yaml --scaling 8,16,32,64,128,256,512,1024 --plot /tmp/s.png
Presets: 70b (h=8192, a=64, L=80, s=4096, b=4 on 64 GPUs), gpt3-175b (h=12288, a=96, L=96, s=2048),
llama2-7b. Devices: H100, H200, H100-96GB (torchtitan's, 500 W), H800, A100 (common/hardware.py, with sources).

--plan searches dp_replicate x dp_shard x cp x tp x pp (x ep for an MoE model) over any GPU count, the pipeline schedule and
virtual stages, the strategy, the recompute policy and the micro-batch, at a fixed global batch
(sequences per step; default: micro-batch x grad-accum x data-parallel ranks of the job as given),
and prints the best --top layouts one per line in the config's own words. Only layouts train.py accepts
are proposed, and a layout given with --tp, --pp, --strategy, ... that train.py would refuse is an error
(the same checks: the config's, training/config.py JobConfig.validate_layout, and the launch's,
parallel/layout.py Layout.of).

--scaling N1,N2,... runs the planner at each GPU count, weak (the same sequences per GPU) and strong (one
global batch), and prints predicted tokens/s, model TFLOP/s per GPU, scaling efficiency, the share of the
step each communication dimension leaves exposed, and the count where each first shows.

How far these predictions are from published runs: docs/results/published_leave_one_source_out.md (each
source predicted by a fit on the others) and docs/results/published_vs_estimator.md (every row).
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import dataclasses
import sys
from pathlib import Path

from analysis import estimator as est
from analysis import scaling
from common.errors import ConfigError, LayoutError
from common.hardware import DEVICES
from common.progress import Progress
from common.report import gib, human_bytes, markdown_table, text_table
from model.flops import FLOPS_CONVENTION
from training.config import JobConfig, load_config, parse_known_overrides

# The parallel keys the command line's layout flags override (dp_shard is what the others leave).
LAYOUT_FLAGS = ("tp", "pp", "cp", "dp_replicate", "pp_schedule", "pp_virtual_stages", "sequence_parallel", "ep")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="job YAML (configs/*.yaml); extra --section.key=value arguments override it")
    source.add_argument("--preset", choices=est.PRESET_NAMES, help="one of the chapter's models")
    parser.add_argument("--gpus", type=int, help="GPUs in all (default: the preset's, or 1)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node: tp stays inside one (default: 8)")
    parser.add_argument("--device", choices=sorted(DEVICES), help="GPU type (default H100)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's or preset's)")
    parser.add_argument("--micro-batch", type=int, help="sequences per GPU per forward/backward")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per step (the pipeline's under --pp)")
    parser.add_argument("--strategy", choices=est.STRATEGIES, help="default: the config's parallel.strategy, or fsdp")
    parser.add_argument("--recompute", choices=est.RECOMPUTE_POLICIES,
                        help="activation recompute policy, as model.recompute (default: the config's, or none)")
    parser.add_argument("--policy", dest="recompute", choices=est.RECOMPUTE_POLICIES, help=argparse.SUPPRESS)  # old name
    parser.add_argument("--precision", choices=est.PRECISION_MODES, help="default: the config's, or bf16_master")
    parser.add_argument("--fp8-scaling", choices=est.FP8_SCALINGS,
                        help="precision=fp8: how each GEMM operand's cast gets its scale, delayed (Transformer Engine) "
                        "or dynamic (torchao, an extra read for the amax); default: the config's fp8_backend, or delayed")
    parser.add_argument("--fp8-weight-casts", choices=est.FP8_WEIGHT_CASTS,
                        help="precision=fp8: each weight cast at every micro-batch (the trainer's, default) or once per "
                        "step (Megatron-Core's Transformer Engine layers, is_first_microbatch)")
    parser.add_argument("--fp8-cast-kernels", choices=est.FP8_CAST_KERNELS,
                        help="precision=fp8: every operand cast in a pass of its own (the trainer's, default) or as "
                        "Megatron-Core's Transformer Engine layers run them (norm and cast fused, operands gathered in FP8)")
    parser.add_argument("--op-selective-saves", choices=est.OP_SELECTIVE_SAVES,
                        help="recompute=op_selective: which matmul outputs it keeps, every one (the trainer's) or "
                        "alternate ones (torchtitan's per-op policy); default every_matmul")
    parser.add_argument("--sink-attention", choices=est.SINK_ATTENTION,
                        help="model.attention_sinks: the core the trainer runs (materialized, model.attention=auto) or "
                        "a fused kernel with the sink term (Megatron-Core on Transformer Engine's cuDNN attention); "
                        "default materialized")
    parser.add_argument("--attention-kernel", choices=est.ATTENTION_KERNELS,
                        help="the kernel of a fused attention core: FlashAttention-2's (flash-attn 2, PyTorch SDPA: the "
                        "trainer's, default) or Transformer Engine's choice, cuDNN's fused attention on Hopper (te)")
    parser.add_argument("--optimizer", choices=est.OPTIMIZERS, help="default: the config's optim.name, or adamw")
    layout = parser.add_argument_group("layout (default: the config's parallel section, or 1)")
    layout.add_argument("--tp", type=int, help="tensor-parallel GPUs (inside a node)")
    layout.add_argument("--pp", type=int, help="pipeline stages")
    layout.add_argument("--cp", type=int, help="context-parallel GPUs: each sequence split over them")
    layout.add_argument("--dp-replicate", type=int, help="HSDP replicas (fsdp only)")
    layout.add_argument("--pp-schedule", choices=est.PP_SCHEDULES, help="pipeline schedule (default 1f1b)")
    layout.add_argument("--pp-virtual-stages", type=int, help="model chunks per GPU (interleaved_1f1b, zero_bubble)")
    layout.add_argument("--sequence-parallel", choices=("true", "false"), help="default: true with tp > 1")
    layout.add_argument("--ep", type=int, help="expert-parallel GPUs, carved out of dp_shard x cp (a multiple of cp; MoE models, fsdp)")
    layout.add_argument("--reshard-after-forward", choices=("true", "false"),
                        help="FSDP frees gathered weights after forward, as parallel.fsdp_reshard_after_forward "
                        "(false: kept until backward, one gather fewer; default: the config's, or true)")
    layout.add_argument("--tp-overlap", action="store_true",
                        help="tensor-parallel collectives hidden behind the GEMMs (Megatron's userbuffers, async TP; "
                        "the trainer does not overlap them)")
    layout.add_argument("--pp-overlap", action="store_true",
                        help="pipeline sends hidden behind compute (Megatron-Core's overlap_p2p_comm, interleaved "
                        "schedule only; the trainer does not overlap them)")
    parser.add_argument("--allow-refused", action="store_true",
                        help="estimate a job train.py refuses (another framework's run: DDP under tp or pp, "
                        "Transformer Engine layers under tp, ...); the output says train.py refuses it and why")
    parser.add_argument("--plan", action="store_true", help="list the cheapest layouts that fit (see above)")
    parser.add_argument("--global-batch", type=int, help="--plan: sequences per optimizer step")
    parser.add_argument("--top", type=int, default=10, help="rows of --plan (default 10)")
    parser.add_argument("--markdown", type=Path, help="also write the tables as Markdown here")
    parser.add_argument("--scaling", type=_counts,
                        help="GPU counts, e.g. 8,16,32,...,1024: the planner's best layout at each, its predicted "
                        "tokens/s, TFLOP/s per GPU, weak and strong scaling efficiency, and where each "
                        "communication dimension becomes exposed")
    parser.add_argument("--plot", type=Path, help="--scaling: also plot the curves into this PNG")
    args, rest = parse_known_overrides(parser, argv)
    if rest and not args.config:
        parser.error("--section.key=value overrides need --config")
    for key in ("gpus", "gpus_per_node", "micro_batch", "grad_accum", "global_batch", "top", "tp", "pp",
                "dp_replicate", "pp_virtual_stages", "seq_len", "ep"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1 (got {value})")
    if args.plot and not args.scaling:
        parser.error("--plot draws the --scaling curves; give --scaling too")
    return args, rest


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(word) for word in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU counts look like 8,16,32") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every GPU count must be >= 1")
    return tuple(sorted(set(counts)))


def load_job_config(args: argparse.Namespace, overrides: list[str]) -> JobConfig | None:
    """The job's trainer configuration (--config with its overrides), or None for a preset."""
    return load_config(args.config, overrides) if args.config else None


def build_job(args: argparse.Namespace, overrides: list[str], cfg: JobConfig | None = None) -> est.JobSpec:
    """The job the command line describes: the config's (or preset's) job with the layout flags put in,
    on --gpus GPUs; dp_shard is what the other degrees leave. Strategy none on several data-parallel
    GPUs becomes what the trainer would run (parallel/layout.py resolve_strategy); on one it is none,
    whatever the config says (nothing to shard). Anything the command line changes in the layout goes
    through the trainer's own checks (estimator.trainer_refusal), so a layout the trainer would refuse
    is an error here too."""
    device = DEVICES[args.device or "H100"]
    if args.preset:
        p = est.preset(args.preset)
        model, seq_len, micro_batch, gpus, grad_accum = p.model, p.seq_len, p.micro_batch, p.world_size, 1
        strategy, recompute, precision, layout, optimizer = "fsdp", "none", "bf16_master", {}, "adamw"
        device, reshard, loss_chunk_tokens, fp8_scaling = DEVICES[args.device or p.device], True, 0, "delayed"
    else:
        cfg = cfg or load_config(args.config, overrides)
        model, seq_len, micro_batch, gpus = cfg.model, cfg.seq_len, cfg.train.micro_batch_size, 1
        grad_accum = cfg.train.grad_accum_steps
        strategy, recompute, precision = cfg.parallel.strategy, cfg.model.recompute, cfg.precision.mode
        optimizer = cfg.optim.name
        layout = {key: getattr(cfg.parallel, key) for key in LAYOUT_FLAGS}
        reshard = cfg.parallel.fsdp_reshard_after_forward
        fp8_scaling = est.fp8_scaling_of(cfg)
        loss_chunk_tokens = cfg.kernels.loss_chunk_tokens
    if args.gpus_per_node:
        device = dataclasses.replace(device, gpus_per_node=args.gpus_per_node)
    for key in LAYOUT_FLAGS:
        value = getattr(args, key)
        if value is not None:
            layout[key] = value == "true" if key == "sequence_parallel" else value
    gpus = args.gpus or gpus
    dp = gpus // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    if args.strategy:
        strategy = args.strategy
    elif dp <= 1 and layout.get("cp", 1) == 1:
        strategy = "none"
    if seq_len > model.max_seq_len or (args.seq_len or 0) > model.max_seq_len:
        raise est.EstimatorError(f"--seq-len {args.seq_len or seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    job = est.JobSpec(
        model=model,
        seq_len=args.seq_len or seq_len,
        micro_batch=args.micro_batch or micro_batch,
        layout=est.layout_of(gpus, strategy=strategy, **layout),
        recompute=args.recompute or recompute,
        precision=args.precision or precision,
        device=device,
        grad_accum=args.grad_accum or grad_accum,
        fsdp_reshard_after_forward=reshard if args.reshard_after_forward is None else args.reshard_after_forward == "true",
        tp_overlap=args.tp_overlap,
        pp_overlap=args.pp_overlap,
        optimizer=args.optimizer or optimizer,
        loss_chunk_tokens=loss_chunk_tokens,
        fp8_scaling=args.fp8_scaling or fp8_scaling,
        fp8_weight_casts=args.fp8_weight_casts or "per_microbatch",
        fp8_cast_kernels=args.fp8_cast_kernels or "separate",
        op_selective_saves=args.op_selective_saves or "every_matmul",
        sink_attention=args.sink_attention or "materialized",
        attention_kernel=args.attention_kernel or "flash_attn2",
    )
    problem = est.trainer_refusal(job, cfg)
    if problem and not args.allow_refused:
        raise est.EstimatorError(f"train.py refuses this layout: {problem} (--allow-refused estimates it all the same)")
    return job


def model_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    cfg = job.model
    n = est.count_parameters(cfg)
    rows = [
        ["parameters", f"{n:,} ({n / 1e9:.2f} B)"],
        ["matmul parameters N", f"{est.matmul_parameters(cfg):,}"],
        ["training FLOPs/token", f"{est.flops_per_token(cfg, job.seq_len):.4g}"],
        ["shape", f"L={cfg.n_layer}, d={cfg.d_model}, heads={cfg.n_head}, kv heads={cfg.kv_heads}, "
                  f"d_ff={cfg.d_ff} {cfg.mlp}, vocab={cfg.vocab_size}, s={job.seq_len}, b={job.micro_batch}"],
        ["layout", est.job_words(job)],
        ["KV cache (sampling)", _kv_cache_words(job)],
    ]
    return ["model", "value"], rows


def _kv_cache_words(job: est.JobSpec) -> str:
    """What model/generate.py's cache holds per token (mean over a sequence of seq_len positions) and per sequence."""
    cfg, p, s = job.model, job.activation_dtype_bytes, job.seq_len
    whole = est.kv_cache_bytes(cfg, s, 1, p)
    kind = (f"latent {cfg.kv_lora_rank} + rotary key {cfg.qk_rope_head_dim} per layer" if cfg.is_mla
            else f"{cfg.kv_heads} KV heads of {cfg.head_dim}" + (", windowed layers their window" if cfg.sliding_window else ""))
    return f"{human_bytes(whole / s)}/token, {human_bytes(whole)} per sequence of {s:,} ({kind}, {p}-byte)"


def activation_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    """Per layer and per GPU for each recompute policy, with the job's tensor/sequence parallelism."""
    cfg = job.model
    layers = cfg.n_layer // job.layout.pp
    # a cp GPU holds seq_len / cp tokens of each sequence, and the keys and values gathered from the others
    args, kw = (job.local_seq_len, job.micro_batch), dict(attention=job.attention, tp=job.layout.tp, sequence_parallel=job.layout.sp)
    rows = []
    for recompute in est.RECOMPUTE_POLICIES:
        per_layer = (est.activation_bytes_per_layer(cfg, *args, recompute, job.activation_dtype_bytes, **kw)
                     + est.cp_attention_bytes_per_layer(job, recompute))
        extra = est.recompute_flops_per_token(cfg, job.seq_len, recompute) / est.flops_per_token(cfg, job.seq_len)
        if recompute == "offload":  # nothing stays on the GPU; the none bytes go to host memory
            host = (est.activation_bytes_per_layer(cfg, *args, "none", job.activation_dtype_bytes, **kw)
                    + est.cp_attention_bytes_per_layer(job, "none"))
            rows.append([recompute, f"0 (host {human_bytes(host)})", f"0 (host {gib(host * layers)})", "0.0% + PCIe"])
            continue
        rows.append([recompute, human_bytes(per_layer), gib(per_layer * layers), f"{extra:.1%}"])
    return ["recompute", "per layer per GPU", f"x {layers} layers", "recompute FLOPs"], rows


def _activation_title(job: est.JobSpec) -> str:
    split = f", tp={job.layout.tp}{' + SP' if job.layout.sp else ' without SP'}" if job.layout.tp > 1 else ""
    split += f", cp={job.layout.cp} ({job.local_seq_len:,} tokens per GPU)" if job.layout.cp > 1 else ""
    return (f"Activations saved for backward per micro-batch ({job.precision}, {job.attention} attention{split}, "
            "Korthikanti et al. 2022)")


def strategy_section(job: est.JobSpec, cfg: JobConfig | None = None) -> tuple[list[str], list[list[str]]]:
    """The job under every strategy the trainer runs it with."""
    rows = []
    if job.layout.dp == 1:
        strategies: tuple[str, ...] = ("none",)
    elif job.layout.dp_replicate > 1:
        strategies = ("zero3", "fsdp")  # HSDP shards inside dp_shard only with these
    else:
        strategies = est.STRATEGIES[1:]
    for strategy in strategies:
        try:
            candidate = dataclasses.replace(job, layout=dataclasses.replace(job.layout, strategy=strategy))
        except (ConfigError, LayoutError):
            continue  # e.g. HSDP's replicas under zero3
        if est.trainer_refusal(candidate, cfg):
            continue  # e.g. DDP or ZeRO around a tensor-parallel model
        result = est.estimate(candidate)
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


def muon_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    """With Muon: what it steps, the state it saves, and its work and traffic per step."""
    m = est.muon_matrices(job.model)
    sent, a2a_s, ns_s = est.muon_step(job)
    n_split, n_whole = est.muon_groups(job)
    rows = [
        ["hidden matrices on Muon", f"{sum(est.muon_numel(k) for k in (m.split, m.whole, m.routed)):,.0f} parameters "
                                    "(embeddings, head, norms, biases, routers on AdamW)"],
        ["optimizer state saved/GPU", f"{gib(est.muon_buffer_saving(job))} (one momentum buffer instead of two moments)"],
        ["matrices sharded over", f"{n_split} GPUs (attention, dense MLPs)" + (f", {n_whole} (shared experts)" if m.whole else "")],
        ["sent to owners and back/GPU/step", human_bytes(sent) + f" (bf16 pieces, all-to-all {a2a_s * 1e3:.3g} ms)"],
        ["Newton-Schulz/GPU/step", f"{ns_s * 1e3:.3g} ms ({est.MUON_NS_STEPS} iterations, owners spread evenly)"],
    ]
    return ["Muon", "value"], rows


def stage_section(job: est.JobSpec) -> tuple[list[str], list[list[str]]]:
    """Under pp: what each stage holds (every GPU must fit, so the largest decides)."""
    rows = []
    for stage in range(job.layout.pp):
        m = est.stage_memory(job, stage)
        held = est.pipeline_in_flight(job.layout.pp_schedule, job.layout.pp, job.grad_accum, job.layout.pp_virtual_stages, stage)
        rows.append([str(stage), f"{est.stage_parameters(job.model, job.layout.tp, job.layout.pp, stage, job.layout.etp) / 1e9:.3g} B",
                     f"{held:g}", gib(m.states), gib(m.activations + m.logits), gib(m.total)])
    return ["stage", "parameters/GPU", "micro-batches held", "states/GPU", "activations/GPU", "total/GPU"], rows


def _pipeline_title(job: est.JobSpec) -> str:
    bubble = est.bubble_fraction(job.layout.pp_schedule, job.layout.pp, job.grad_accum, job.layout.pp_virtual_stages)
    virtual = f", {job.layout.pp_virtual_stages} virtual stages" if job.layout.pp_virtual_stages > 1 else ""
    return (f"Pipeline: {job.layout.pp} stages of {job.model.n_layer // job.layout.pp} layers, {job.layout.pp_schedule}{virtual}, "
            f"{job.grad_accum} micro-batches: bubble {bubble:.1%} of the step")


def plan_lines(job: est.JobSpec, global_batch: int, top: int, cfg: JobConfig | None = None) -> list[str]:
    plans = est.plan_layouts(job.model, job.seq_len, job.layout.world_size, job.device, job.precision,
                             global_batch=global_batch, top=top, config=cfg)
    return [est.describe_plan(p) for p in plans]


def scaling_main(args: argparse.Namespace, overrides: list[str], cfg: JobConfig | None) -> int:
    """--scaling: the job's model on each GPU count, weak and strong (analysis/scaling.py)."""
    # the planner chooses the layout at every count: only the model, sequence, precision and batch are kept
    unlaid = argparse.Namespace(**{**vars(args), **{key: None for key in (*LAYOUT_FLAGS, "gpus", "strategy")}})
    job = build_job(unlaid, overrides, cfg) if args.preset else None
    if job is None:  # a config: its model, sequence, precision and sequences per GPU, on any layout
        model, seq_len, precision = cfg.model, args.seq_len or cfg.seq_len, args.precision or cfg.precision.mode
        per_gpu = (args.micro_batch or cfg.train.micro_batch_size) * (args.grad_accum or cfg.train.grad_accum_steps)
        device = DEVICES[args.device or "H100"]
    else:
        model, seq_len, precision, device = job.model, job.seq_len, job.precision, job.device
        per_gpu = job.micro_batch * job.grad_accum
    if args.gpus_per_node:
        device = dataclasses.replace(device, gpus_per_node=args.gpus_per_node)
    with Progress(2 * len(args.scaling), "estimate --scaling", "planner run") as progress:
        weak, strong = scaling.scaling_curves(model, seq_len, device, precision, args.scaling, per_gpu, config=cfg,
                                              progress=progress)
    headers, rows = scaling.table(weak, strong)
    name = args.config or f"preset {args.preset}"
    title = (f"Scaling {name} on {device.name} ({device.gpus_per_node} per node), {precision}: weak = {per_gpu} "
             f"sequences of {seq_len} tokens per GPU per step, strong = {per_gpu * max(args.scaling)} per step")
    print(f"{title}\n" + text_table(headers, rows))
    print("\n".join(scaling.exposure_lines(weak, strong)))
    print("Predictions of analysis/estimator (error on published runs of a source left out of the fit: "
          "docs/results/published_leave_one_source_out.md), the planner's cheapest layout at each count.")
    if args.plot:
        scaling.plot(weak, strong, args.plot, name)
        print(f"wrote {args.plot}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        body = "\n".join(scaling.exposure_lines(weak, strong))
        args.markdown.write_text(f"# {title}\n\n{markdown_table(headers, rows)}\n\n{body}\n")
        print(f"wrote {args.markdown}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_job_config(args, overrides)
        if args.scaling:
            return scaling_main(args, overrides, cfg)
        job = build_job(args, overrides, cfg)
        sections = [
            ("Model", *model_section(job)),
            (_activation_title(job), *activation_section(job)),
            (f"Per GPU on {job.layout.world_size}x {job.device.name} (recompute {job.recompute}, micro-batch {job.micro_batch})",
             *strategy_section(job, cfg)),
        ]
        if job.optimizer == "muon":
            sections.append(("Muon (optim.name=muon, parallel/muon.py)", *muon_section(job)))
        if job.layout.pp > 1:
            sections.append((_pipeline_title(job), *stage_section(job)))
        global_batch = args.global_batch or job.global_batch
        plan = plan_lines(job, global_batch, args.top, cfg) if args.plan else []
        verdict = est.job_verdict(job, cfg)
        refused = est.trainer_refusal(job, cfg)  # only with --allow-refused
    except (est.EstimatorError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if refused:
        verdict = f"Estimated beyond the trainer: train.py refuses this job ({refused}).\n{verdict}"
        print(verdict.splitlines()[0])
    for title, headers, rows in sections:
        print(f"\n{title}\n" + text_table(headers, rows, numeric=headers[0] != "model"))
    plan_title = (f"Cheapest layouts that fit on {job.layout.world_size}x {job.device.name} ({job.device.gpus_per_node} per "
                  f"node), global batch {global_batch} sequences, {job.precision}")
    if args.plan:
        print(f"\n{plan_title}")
        print("\n".join(plan) if plan else "nothing fits; try more GPUs, a larger device, or a shorter sequence")
    print(f"\n{verdict}\nFLOPs convention: {FLOPS_CONVENTION}; memory in GiB (2^30 bytes).")
    if args.markdown:
        body = [f"## {title}\n\n{markdown_table(headers, rows)}\n" for title, headers, rows in sections]
        if args.plan:
            body.append(f"## {plan_title}\n\n```\n" + ("\n".join(plan) or "nothing fits") + "\n```\n")
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("# Estimate\n\n" + "\n".join(body) + f"\n{verdict}\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
