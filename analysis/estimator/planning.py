"""The planner: every layout of a GPU count that the trainer accepts, estimated and ranked; the
trainer's start-up fit verdict; the layout in the config's words."""

from __future__ import annotations

import dataclasses

from analysis.estimator.job import (
    PP_SCHEDULES,
    PRECISION_MODES,
    RECOMPUTE_POLICIES,
    Assumptions,
    EstimatorError,
    JobSpec,
    check_choice,
    layout_of,
)
from analysis.estimator.memory import estimate_memory
from analysis.estimator.step import Estimate, describe_estimate, estimate, estimate_with, memory_problems
from analysis.estimator.time import bubble_fraction
from common.errors import ConfigError, LayoutError
from common.hardware import DEVICES, DeviceSpec, lookup_device
from common.report import gib
from model.config import ModelConfig
from parallel.layout import LAYOUT_KEYS, MULTI_CHUNK_SCHEDULES, Layout, microbatch_problem
from training.config import JobConfig

# zero3 is modelled exactly like fsdp (both shard parameters, gradients and optimizer state), so
# the planner lists fsdp for both.
PLANNER_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
# Sequences from this length on make the planner try context parallelism (context_parallel_sizes).
CP_SEARCH_FROM = 16384


def expert_parallel_sizes(model_cfg: ModelConfig, dp_shard: int, strategy: str, cp: int = 1) -> list[int]:
    """The ep degrees a job can use: 1, and with an MoE model under fsdp every divisor of dp_shard x cp
    that divides the routed experts and, with cp, is a multiple of cp (parallel/layout.py)."""
    if model_cfg.moe.experts is None or strategy not in ("fsdp", "zero3"):
        return [1]
    return [e for e in _divisors(dp_shard * cp) if model_cfg.moe.experts % e == 0 and (e == 1 or e % cp == 0)]


def trainer_config(job: JobSpec, base: JobConfig | None = None) -> JobConfig:
    """The trainer's configuration of ``job``: ``base`` (a loaded config; default: every section's
    defaults) with the job's model, recompute policy, batch, precision and layout put in."""
    base = base or JobConfig()
    parallel = dataclasses.replace(
        base.parallel, **{key: getattr(job.layout, key) for key in LAYOUT_KEYS},
        fsdp_reshard_after_forward=job.fsdp_reshard_after_forward,
        fsdp_hybrid=False,  # HSDP is written as dp_replicate here
    )
    return dataclasses.replace(
        base,
        optim=dataclasses.replace(base.optim, name=job.optimizer),
        model=dataclasses.replace(job.model, recompute=job.recompute),
        data=dataclasses.replace(base.data, seq_len=job.seq_len),
        train=dataclasses.replace(base.train, micro_batch_size=job.micro_batch, grad_accum_steps=job.grad_accum),
        precision=dataclasses.replace(base.precision, mode=job.precision, **_fp8_backend(job)),
        parallel=parallel,
    )


def _fp8_backend(job: JobSpec) -> dict[str, str]:
    """FP8 on the model's own torch layers is torchao's (Transformer Engine's needs model.layers=te)."""
    return {"fp8_backend": "torchao"} if job.precision == "fp8" and job.model.layers == "torch" else {}


def _planned_fp8_scaling(model_cfg: ModelConfig) -> str:
    """The scaling of the FP8 backend a plan runs (``_fp8_backend``): torchao's on torch layers."""
    return "dynamic" if model_cfg.layers == "torch" else "delayed"


def trainer_refusal(job: JobSpec, base: JobConfig | None = None) -> str | None:
    """Why the trainer refuses ``job`` (its one-line error), or None: the checks train.py runs, on
    ``trainer_config(job, base)``: the config's (``JobConfig.validate_layout``), then the layout's at
    launch (``Layout.of`` on the job's GPUs, a node's worth to a node), which must give the job's
    layout back, its strategy resolved as train.py resolves it."""
    cfg = trainer_config(job, base)
    world = job.layout.world_size
    try:
        cfg.validate_layout()
        launched = Layout.of(cfg.parallel, world, min(world, job.device.gpus_per_node))
    except (ConfigError, LayoutError) as exc:
        return str(exc)
    if dataclasses.replace(launched, ranks_per_node=job.layout.ranks_per_node) != job.layout:
        return f"train.py runs this layout as {launched.describe()}, not {job.layout.describe()}"
    return None


def _loss_chunk_tokens(config: JobConfig | None) -> int:
    return config.kernels.loss_chunk_tokens if config is not None else 0


def job_of(config: JobConfig, layout: Layout, device: DeviceSpec | None = None) -> JobSpec:
    """The job a trainer configuration runs on ``layout`` (the inverse of ``trainer_config``), on
    ``device`` (default: an H100)."""
    return JobSpec(config.model, config.seq_len, config.train.micro_batch_size, layout, config.model.recompute,
                   config.precision.mode, device or DEVICES["H100"], config.train.grad_accum_steps,
                   fsdp_reshard_after_forward=config.parallel.fsdp_reshard_after_forward,
                   loss_chunk_tokens=config.kernels.loss_chunk_tokens, fp8_scaling=fp8_scaling_of(config))


def fp8_scaling_of(config: JobConfig) -> str:
    """How the configured FP8 backend scales its casts: torchao's dynamically, Transformer Engine's
    with the delayed recipe model/te.py builds."""
    return "dynamic" if config.precision.fp8_backend == "torchao" else "delayed"


def job_overrides(job: JobSpec) -> list[str]:
    """The job as the trainer's ``--section.key=value`` overrides (what ``job_words`` says)."""
    return job.layout.overrides() + [f"--model.recompute={job.recompute}", f"--train.micro_batch_size={job.micro_batch}",
                                     f"--train.grad_accum_steps={job.grad_accum}", f"--precision.mode={job.precision}"
                                     ] + [f"--precision.{key}={value}" for key, value in _fp8_backend(job).items()]


def plan_fits(
    model_cfg: ModelConfig,
    seq_len: int,
    world_size: int,
    device: DeviceSpec,
    precision: str = "bf16_master",
    *,
    strategies: tuple[str, ...] | None = None,
    recomputes: tuple[str, ...] = RECOMPUTE_POLICIES,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    top: int | None = 10,
    assumptions: Assumptions | None = None,
    config: JobConfig | None = None,
) -> list[Estimate]:
    """Combinations of strategy x recompute policy x micro-batch that fit, cheapest first.

    Cheapest = least predicted time per token (the cost of the run); ties go to less memory. Only
    what the trainer accepts (``trainer_refusal``; ``config`` is the job's own configuration, if any).
    """
    if strategies is None:
        strategies = ("none",) if world_size == 1 else PLANNER_STRATEGIES
    fitting = []
    for strategy in strategies:
        for recompute in recomputes:
            for micro_batch in micro_batches:
                try:
                    job = JobSpec(model_cfg, seq_len, micro_batch, layout_of(world_size, strategy=strategy), recompute,
                                  precision, device, assumptions=assumptions or Assumptions(),
                                  loss_chunk_tokens=_loss_chunk_tokens(config), fp8_scaling=_planned_fp8_scaling(model_cfg))
                except EstimatorError:
                    continue
                if trainer_refusal(job, config):
                    continue
                result = estimate(job)
                if result.fits:
                    fitting.append(result)
    fitting.sort(key=lambda e: (e.time.seconds_per_token, e.memory.total))
    return fitting if top is None else fitting[:top]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_parallel_sizes(model_cfg: ModelConfig, world_size: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every (tp, pp) a job can use: tp divides the heads and the KV heads and stays inside a node;
    pp divides the layers; both divide the GPU count (any count, not only powers of two)."""
    sizes = []
    for tp in _divisors(world_size):
        if tp > gpus_per_node or model_cfg.n_head % tp or model_cfg.kv_heads % tp:
            continue
        sizes += [(tp, pp) for pp in _divisors(world_size // tp) if model_cfg.n_layer % pp == 0]
    return sizes


def _data_parallel_options(dp: int, strategies: tuple[str, ...] | None, cp: int = 1) -> list[tuple[str, int]]:
    """(strategy, dp_replicate) pairs for ``dp`` data-parallel ranks; HSDP replicas are tried at every
    divisor of dp that leaves at least two shards. Which of them the trainer runs with tensor or
    pipeline parallelism is its own rule (``trainer_refusal``), not repeated here. Under context
    parallelism the cp ranks join the shard group, so FSDP2 runs even with one data-parallel rank
    (the trainer turns strategy none into fsdp there)."""
    if cp > 1:
        return [("fsdp", r) for r in _divisors(dp)]
    if dp == 1:
        return [("none", 1)]
    if strategies is None:
        strategies = PLANNER_STRATEGIES
    options = []
    for strategy in strategies:
        options.append((strategy, 1))
        if strategy in ("zero3", "fsdp"):
            options += [(strategy, r) for r in _divisors(dp)[1:] if dp // r >= 2]
    return options


def expert_tp_sizes(model_cfg: ModelConfig, tp: int) -> tuple[int, ...]:
    """The etp degrees a job can use: 1, and tp for an MoE model under tensor parallelism (whether the
    experts' width divides is the layout's rule, ``check_model``)."""
    return (1, tp) if tp > 1 and model_cfg.moe.experts is not None else (1,)


def _pipeline_options(
    model_cfg: ModelConfig, pp: int, schedules: tuple[str, ...], virtual_stages: tuple[int, ...]
) -> list[tuple[str, int]]:
    """(pp_schedule, pp_virtual_stages) pairs whose chunks split the layers evenly."""
    if pp == 1:
        return [("1f1b", 1)]
    options = []
    for schedule in schedules:
        if schedule in MULTI_CHUNK_SCHEDULES:
            low = 2 if schedule == "interleaved_1f1b" else 1
            options += [(schedule, v) for v in virtual_stages if v >= low and model_cfg.n_layer % (pp * v) == 0]
        else:
            options.append((schedule, 1))
    return options


def plan_layouts(
    model_cfg: ModelConfig,
    seq_len: int,
    world_size: int,
    device: DeviceSpec,
    precision: str = "bf16_master",
    *,
    global_batch: int,
    strategies: tuple[str, ...] | None = None,
    recomputes: tuple[str, ...] = RECOMPUTE_POLICIES,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    schedules: tuple[str, ...] = PP_SCHEDULES,
    virtual_stages: tuple[int, ...] = (1, 2, 4),
    top: int | None = 10,
    assumptions: Assumptions | None = None,
    config: JobConfig | None = None,
) -> list[Estimate]:
    """Layouts that fit at a fixed global batch, cheapest per token first.

    Searches dp_replicate x dp_shard x cp x tp x pp over ``world_size`` GPUs (``model_parallel_sizes``,
    ``context_parallel_sizes``, ``_data_parallel_options``), ep and etp for an MoE model
    (``expert_parallel_sizes``, ``expert_tp_sizes``),
    the pipeline schedule and virtual stages, the strategy, the
    recompute policy and the micro-batch; grad_accum follows from micro_batch x grad_accum x dp =
    ``global_batch`` (sequences per step). The GPUs per node come from ``device.gpus_per_node``.
    Every layout passes the trainer's own checks first (``trainer_refusal``, on ``config`` when the
    job has one), so the planner proposes only what train.py runs. Ties in time per token go to
    less memory, then to the simpler layout.
    """
    if global_batch < 1:
        raise EstimatorError(f"global_batch must be >= 1 (got {global_batch})")
    check_choice("precision", precision, PRECISION_MODES)
    fitting = []
    for tp, pp, cp in [(tp, pp, cp) for tp, pp in model_parallel_sizes(model_cfg, world_size, device.gpus_per_node)
                       for cp in context_parallel_sizes(seq_len, world_size // (tp * pp))]:
        dp = world_size // (tp * pp * cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        for strategy, dp_replicate, ep, etp in [(s_, r, e, et) for s_, r in _data_parallel_options(dp, strategies, cp)
                                                for e in expert_parallel_sizes(model_cfg, dp // r, s_, cp)
                                                for et in expert_tp_sizes(model_cfg, tp)]:
            for schedule, v in _pipeline_options(model_cfg, pp, schedules, virtual_stages):
                try:
                    layout = layout_of(world_size, strategy=strategy, dp_replicate=dp_replicate, cp=cp, tp=tp, pp=pp,
                                       ep=ep, etp=etp, pp_schedule=schedule, pp_virtual_stages=v)
                except EstimatorError:
                    continue
                for recompute in recomputes:
                    # Memory never shrinks as the micro-batch grows at a fixed global batch (GPipe
                    # holds b*m = b*per_rank/b sequences either way), so the first miss ends the row.
                    for micro_batch in sorted(b for b in micro_batches if per_rank % b == 0):
                        grad_accum = per_rank // micro_batch
                        if microbatch_problem(layout, grad_accum):
                            continue
                        try:  # the layout's rules against the model (check_model) decide, as in the trainer
                            job = JobSpec(model_cfg, seq_len, micro_batch, layout, recompute, precision, device,
                                          grad_accum, assumptions or Assumptions(),
                                          loss_chunk_tokens=_loss_chunk_tokens(config), fp8_scaling=_planned_fp8_scaling(model_cfg))
                        except EstimatorError:
                            continue
                        if trainer_refusal(job, config):
                            continue
                        memory = estimate_memory(job)
                        if memory_problems(job, memory):
                            break
                        fitting.append(estimate_with(job, memory))
    fitting.sort(key=lambda e: (e.time.seconds_per_token, e.memory.total, e.job.layout.dp_replicate, e.job.layout.pp,
                                e.job.layout.tp, e.job.layout.cp, e.job.layout.ep, e.job.layout.etp))
    return fitting if top is None else fitting[:top]


def context_parallel_sizes(seq_len: int, gpus: int) -> list[int]:
    """The cp degrees the planner tries on ``gpus`` GPUs (what tp and pp leave): 1, and from
    ``CP_SEARCH_FROM`` tokens on every divisor that splits the sequence into 2*cp equal chunks.
    Below that length a sequence's activations are small next to the model states, and cp's
    per-layer K/V traffic buys nothing that data parallelism does not."""
    if seq_len < CP_SEARCH_FROM:
        return [1]
    return [cp for cp in _divisors(gpus) if seq_len % (2 * cp) == 0]


def job_words(job: JobSpec) -> str:
    """The job in the config's own words: the layout's (``Layout.describe``, e.g. ``strategy=fsdp
    dp_shard=8 tp=8 pp=1``), then model.recompute, train.micro_batch_size (micro_batch) and
    train.grad_accum_steps (grad_accum)."""
    return f"{job.layout.describe()} recompute={job.recompute} micro_batch={job.micro_batch} grad_accum={job.grad_accum}"


def describe_plan(result: Estimate) -> str:
    """One planner line: the layout in config words, then predicted memory, step time, tokens/s per GPU and MFU."""
    mem, t, job = result.memory, result.time, result.job
    where = f" (stage {mem.stage})" if job.layout.pp > 1 else ""
    mfu = f", MFU {t.mfu:.0%}" if t.mfu is not None else ""
    idle = bubble_fraction(job.layout.pp_schedule, job.layout.pp, job.grad_accum, job.layout.pp_virtual_stages)
    bubble = f", bubble {idle:.1%}" if job.layout.pp > 1 else ""
    rate = t.tokens_per_s / job.layout.world_size
    return f"{job_words(job)}: {gib(mem.total)}/GPU{where}, {t.step_s:,.3g} s/step, {rate:,.0f} tokens/s/GPU{mfu}{bubble}"


def _fits_on(model_cfg: ModelConfig, seq_len: int, device: DeviceSpec, precision: str, n: int) -> bool:
    layout = Layout(n, strategy="none" if n == 1 else "fsdp")
    return estimate(JobSpec(model_cfg, seq_len, 1, layout, "full", precision, device)).fits


def min_gpus_to_fit(
    model_cfg: ModelConfig, seq_len: int, device: DeviceSpec, precision: str = "bf16_master", limit: int = 1 << 16
) -> int | None:
    """Fewest GPUs, any count, on which fsdp + full recompute at micro-batch 1 fits (None beyond ``limit``).

    Under fsdp only the sharded model states (16 Psi / N) depend on N, so memory per GPU never
    grows with N and the smallest fitting count can be bisected: double until a count fits, then
    bisect between it and the previous power of two. Rounding up to hardware-friendly counts is
    the caller's choice (``smallest_power_of_two``).
    """
    if _fits_on(model_cfg, seq_len, device, precision, 1):
        return 1
    if limit < 2:
        return None
    low, high = 1, 2  # low does not fit; high is the candidate upper bound
    while not _fits_on(model_cfg, seq_len, device, precision, high):
        if high >= limit:
            return None
        low, high = high, min(2 * high, limit)
    while high - low > 1:
        mid = (low + high) // 2
        if _fits_on(model_cfg, seq_len, device, precision, mid):
            high = mid
        else:
            low = mid
    return high


def smallest_power_of_two(n: int) -> int:
    """The smallest power of two >= n (GPU counts are often allocated that way)."""
    return 1 << (n - 1).bit_length()


def resolve_device(device_name: str) -> DeviceSpec | None:
    """A table entry for 'H100' or a torch.cuda.get_device_name() string; None for CPU/unknown."""
    return DEVICES.get(device_name.upper()) or lookup_device(device_name)


def fit_verdict(config: JobConfig, layout: Layout, device_name: str) -> str:
    """One or two lines for the trainer's start-up log: does the job of ``config`` on ``layout`` fit on
    ``device_name`` GPUs (a table entry or a torch.cuda.get_device_name() string), and if not, what
    would (``job_verdict``). On a device the table does not know (a CPU) it says what the job would
    need per GPU."""
    device = resolve_device(device_name)
    try:
        job = job_of(config, layout, device)
    except EstimatorError as exc:
        return f"fit check skipped: {exc}"
    if device is None:
        mem = estimate_memory(job)
        return (
            f"fit check: no memory figures for device {device_name!r}; on a GPU this job would need "
            f"~{gib(mem.total)} per GPU (model states {gib(mem.states)}, activations "
            f"{gib(mem.activations + mem.logits)})"
        )
    return job_verdict(job, config)


def job_verdict(job: JobSpec, config: JobConfig | None = None) -> str:
    """Does ``job`` fit on its device; if not, the cheapest layout that does at the same global batch
    (``plan_layouts``, among what the trainer accepts with ``config``) in the config's words, or the
    fewest GPUs that would hold it."""
    result = estimate(job)
    world, device = job.layout.world_size, job.device
    head = f"{world}x {device.name}, {job.layout.describe()}, recompute={job.recompute}, micro-batch {job.micro_batch}, {job.precision}"
    if result.fits:
        return f"fit: yes, {describe_estimate(result)} ({head})"
    first = f"fit: NO, {result.problems[0]} ({head})"
    plans = plan_layouts(job.model, job.seq_len, world, device, job.precision, global_batch=job.global_batch, top=1,
                         config=config)
    if plans:
        same = f"same global batch: {job.global_batch} sequences"
        return first + f"\n  cheapest that fits: {describe_plan(plans[0])} ({same})"
    need = min_gpus_to_fit(job.model, job.seq_len, device, job.precision)
    more = (
        f"at least {need} GPUs (smallest power of two: {smallest_power_of_two(need)})"
        if need else "more memory than any GPU count provides"
    )
    return first + f"\n  nothing fits on {world} GPUs; fsdp + full recompute at micro-batch 1 needs {more}"
