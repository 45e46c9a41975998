"""Typed run configuration: YAML file < command-line overrides, validated before any work.

Each section is a dataclass owned by the package that uses it (``model/config.py`` for the
model, ``data/config.py`` for data, ...). This module only assembles them into one
``JobConfig``, merges YAML and ``--section.key=value`` overrides with strict type checking,
and runs the cross-section checks. Every error is a ``ConfigError`` whose message is one line
naming the key and, where there is a fixed set, the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from common.errors import ConfigError
from common.fields import doc, require_finite
from data.config import DataConfig
from kernels.config import KernelsConfig
from model.config import ModelConfig
from parallel.config import ParallelConfig
from parallel.layout import check_model, check_section
from parallel.optim import OptimConfig
from parallel.precision import PrecisionConfig

RUN_CONFIG_FILE = "config.yaml"  # the resolved configuration a run writes into its run directory


@dataclass
class TrainConfig:
    max_steps: int = doc(1000, "optimizer steps to train for")
    micro_batch_size: int = doc(8, "sequences per rank per forward/backward")
    grad_accum_steps: int = doc(1, "micro-batches accumulated per optimizer step")
    eval_interval: int = doc(200, "evaluate on the validation split every N steps; 0 disables")
    eval_steps: int = doc(
        20, "validation set size when train.eval_sequences=0: eval_steps x train.micro_batch_size sequences "
        "for the whole run, shared out among the data-parallel ranks"
    )
    eval_sequences: int = doc(
        0, "validation set: the first N windows of the val split, the same for every layout (split across "
        "data-parallel ranks, loss averaged over all their tokens); 0: train.eval_steps x train.micro_batch_size"
    )
    log_interval: int = doc(10, "read scalars back from the device and log every N steps")
    seed: int = doc(1337, "seed for parameters, data order and dropout")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto: cuda when available, else cpu")
    compile: bool = doc(False, "torch.compile each transformer block")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = doc(
        "default", "torch.compile mode"
    )
    compile_loss: bool = doc(False, "also compile the loss computation")
    profile: bool = doc(False, "write a PyTorch profiler trace for a few steps (also --profile)")
    profile_wait: int = doc(2, "profiler: steps skipped before warmup")
    profile_warmup: int = doc(1, "profiler: warmup steps (recorded but discarded)")
    profile_active: int = doc(3, "profiler: steps recorded")
    peak_tflops: float | None = doc(
        None, "per-device dense peak TFLOP/s for MFU; default: the device table in common/hardware.py"
    )
    data_wait_warn: float = doc(0.2, "warn when the fraction of step time spent waiting for data exceeds this")
    hang_timeout_s: float = doc(
        0.0, "hang watchdog: when no step finishes for this many seconds, write every thread's stack to "
        "<run_dir>/hang/rank<R>.txt and exit with code 4 (torchrun --max-restarts then restarts); 0: off"
    )
    hang_grace_s: float = doc(
        1800.0, "hang watchdog: the deadline instead of train.hang_timeout_s for the first step (compile, "
        "warm-up), checkpoint saves, evaluation and harness tasks"
    )
    straggler_threshold: float = doc(
        0.2, "every log interval, name the rank whose data+forward+optimizer time per step exceeds the median "
        "of the other ranks' by more than this fraction (0.2: 20%) and by more than train.straggler_min_gap_s; "
        "0: off"
    )
    straggler_min_gap_s: float = doc(
        0.05, "the straggler report's second bar: the slow rank's own time per step must exceed the others' "
        "median by more than this many seconds too, so that milliseconds of noise on short steps name no one"
    )

    @property
    def validation_sequences(self) -> int:
        """Windows in the validation set (data.bundle.ValSource), whatever the layout."""
        return self.eval_sequences or self.eval_steps * self.micro_batch_size

    def validate(self) -> None:
        for key in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_interval", "profile_active"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("profile_wait", "profile_warmup"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0 (got {getattr(self, key)})")
        if self.eval_interval < 0 or self.eval_steps < 1:
            raise ConfigError("train.eval_interval must be >= 0 and train.eval_steps >= 1")
        if self.eval_sequences < 0:
            raise ConfigError(f"train.eval_sequences must be >= 0 (0: train.eval_steps x train.micro_batch_size), "
                              f"got {self.eval_sequences}")
        for key, default in (("compile_loss", False), ("compile_mode", "default")):
            if getattr(self, key) != default and not self.compile:  # it would be ignored: say so instead
                raise ConfigError(f"train.{key}={getattr(self, key)} has no effect without train.compile=true; "
                                  "set train.compile=true or leave it at its default")
        require_finite("train.data_wait_warn", self.data_wait_warn, ConfigError)
        if self.data_wait_warn < 0:
            raise ConfigError(f"train.data_wait_warn must be >= 0 (got {self.data_wait_warn})")
        for key in ("hang_timeout_s", "hang_grace_s", "straggler_threshold", "straggler_min_gap_s"):
            require_finite(f"train.{key}", getattr(self, key), ConfigError)
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0 (got {getattr(self, key)})")
        if self.hang_timeout_s and self.hang_grace_s < self.hang_timeout_s:
            raise ConfigError(f"train.hang_grace_s={self.hang_grace_s:g} is shorter than train.hang_timeout_s="
                              f"{self.hang_timeout_s:g}; the grace deadline is for the phases slower than a step")
        require_finite("train.peak_tflops", self.peak_tflops, ConfigError)
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"train.peak_tflops must be > 0, or null for the device table (got {self.peak_tflops})")


@dataclass
class CheckpointConfig:
    interval: int = doc(0, "save every N steps (0: only at the end)")
    save_final: bool = doc(True, "save when training finishes")
    keep_last: int = doc(2, "keep this many most recent checkpoints (0 keeps all)")
    resume: str = doc("", "'' (fresh start), 'latest' (newest in the run's checkpoint dir), 'auto' (the newest "
                      "complete checkpoint if there is one, else a fresh start: for torchrun --max-restarts) "
                      "or a path")
    dir: str = doc("", "checkpoint directory; default: <run_dir>/checkpoints")
    reshard: bool = doc(
        False, "resume a checkpoint saved with another parallel layout or rank count: model and optimizer "
        "state are resharded (sharded/DCP checkpoints), the LR schedule continues at the saved step, and the data "
        "stream restarts at its first batch (its position is per data-parallel rank and cannot be mapped)"
    )
    async_save: bool = doc(
        False, "write interval checkpoints in the background: the step pays only for copying the state to "
        "host memory, the checkpoint is published at a later log line once every rank's write is done; at most one "
        "in flight (the next save waits for it); the final save and a save on SIGTERM/Ctrl-C stay synchronous"
    )
    allow_schedule_change: bool = doc(
        False, "resume even if the LR schedule (optim.lr, min_lr, warmup_steps, resolved decay_steps) differs "
        "from the checkpoint's; default: refuse, naming the keys"
    )

    def validate(self) -> None:
        for key in ("interval", "keep_last"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key} must be >= 0 (got {getattr(self, key)})")


@dataclass
class LoggingConfig:
    run_dir: str = doc("runs/{name}", "output directory; {name} is replaced by the config name")
    progress: Literal["auto", "bar", "plain"] = doc(
        "auto", "auto: a progress bar on an interactive terminal, plain log lines otherwise"
    )
    jsonl: bool = doc(True, "write metrics.jsonl in the run directory")
    wandb: bool = doc(False, "log to Weights & Biases")
    wandb_project: str = doc("perfgpt", "wandb project")
    wandb_mode: Literal["offline", "online", "disabled"] = doc(
        "offline", "wandb mode; offline never touches the network"
    )
    tensorboard: bool = doc(False, "write TensorBoard event files in the run directory")


@dataclass
class HarnessConfig:
    """Benchmark tasks of lm-evaluation-harness run during training (training/task_eval.py)."""

    tasks: list[str] = doc([], "lm-evaluation-harness tasks (names or task YAML paths) run every harness.interval "
                           "steps and logged as harness/<task>/<metric>; empty: off (needs pip install -e '.[eval]')")
    interval: int = doc(1000, "run harness.tasks every N steps and after the last one")
    limit: int | None = doc(None, "at most this many examples per task (null: all of them)")
    num_fewshot: int | None = doc(None, "few-shot examples per prompt (null: each task's own default, else 0)")
    task_dir: str = doc("", "a directory of task YAML files searched before the harness's own (e.g. "
                        "tests/harness_tasks); a task's '!function' runs Python from it: use folders you trust")
    batch_size: int = doc(8, "harness requests per forward pass on each rank")

    def validate(self) -> None:
        for key in ("interval", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"harness.{key} must be >= 1 (got {getattr(self, key)})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"harness.limit must be >= 1, or null for every example (got {self.limit})")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"harness.num_fewshot must be >= 0, or null for the tasks' defaults (got {self.num_fewshot})")
        if any(not name.strip() for name in self.tasks):
            raise ConfigError(f"harness.tasks holds an empty name: {self.tasks}")
        if self.task_dir and not Path(self.task_dir).is_dir():
            raise ConfigError(f"harness.task_dir={self.task_dir!r} is not a directory")


@dataclass
class JobConfig:
    name: str = doc("run", "run name (default: the config file's stem)")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        self.validate_layout()

    def validate_layout(self) -> None:
        """The checks a parallel layout must pass against the model, batch and precision of this job:
        the layout's rules (parallel/layout.py: the section's keys, and the layout against the model and
        the sequence) and every cross-section rule of this trainer (tensor and pipeline parallelism, FP8,
        Transformer Engine). ``validate`` runs them, and so does the
        layout planner (analysis/estimator/) on every layout it proposes, so it proposes only what
        the trainer accepts."""
        m, p, t = self.model, self.parallel, self.train
        check_section(p)
        check_model(p, m, seq_len=self.seq_len, micro_batches=t.grad_accum_steps, seq_key=self.seq_key)
        self._validate_cross_sections()

    def lr_schedule(self) -> dict[str, Any]:
        """The learning-rate schedule of this run (``OptimConfig.schedule``): ``lr_at``'s keyword
        arguments, and what a checkpoint records so a resumed run can be checked against it."""
        return self.optim.schedule(self.train.max_steps)

    @property
    def seq_key(self) -> str:
        """The key that sets the sequence length, for errors that name it."""
        return "data.seq_len" if self.data.seq_len else "model.max_seq_len"

    def _validate_parallel_support(self) -> None:
        """What this trainer's tensor, pipeline and context parallelism do not support with the other
        sections (the layout's own rules against the model are parallel/layout.py ``check_model``)."""
        m, p, t = self.model, self.parallel, self.train
        if p.tp > 1 and m.qk_norm:
            raise ConfigError(f"model.qk_norm with parallel.tp={p.tp} is not supported; use parallel.tp=1")
        chunks = self.kernels.loss_chunk_tokens
        if chunks < 0:
            raise ConfigError(f"kernels.loss_chunk_tokens must be >= 0 (got {chunks}; 0 computes the whole logits)")
        if chunks and p.tp > 1:
            raise ConfigError(f"kernels.loss_chunk_tokens={chunks} with parallel.tp={p.tp}: the head is split over "
                              "the vocabulary there; parallel.loss_parallel=true (the default) already never "
                              "gathers the logits whole: set kernels.loss_chunk_tokens=0")
        if chunks and p.pp > 1:
            raise ConfigError(f"kernels.loss_chunk_tokens={chunks} with parallel.pp={p.pp}: the pipeline's last "
                              "stage computes the loss from the whole logits; set kernels.loss_chunk_tokens=0")
        if p.tp > 1:
            if t.compile:
                # torch 2.13's compiled blocks hand DTensor's redistribute a plain gradient in backward
                # ("'Tensor' object has no attribute '_local_tensor'") with every recompute policy, with
                # and without sequence parallelism; under full, selective and every_k the checkpointed
                # region saves the DeviceMesh among its tensors and fails earlier. op_selective seemed to
                # run in test_layout_seams.py only because the test's own forward hook was traced with it.
                raise ConfigError("train.compile=true under parallel.tp > 1 fails in torch's compiler (a compiled "
                                  "block's backward hands DTensor a plain gradient); set train.compile=false")
        if p.pp > 1 and m.moe.experts is not None and m.moe.bias_update_rate:
            # torch's pipeline stages run an extra forward on their first step to infer shapes, whose
            # routing would count in the load the bias moves by (and differ from one process).
            raise ConfigError(f"model.moe.bias_update_rate={m.moe.bias_update_rate} with parallel.pp={p.pp} is not "
                              "supported; balance with model.moe.aux_loss under pipeline parallelism")
        if p.pp > 1:
            if p.pp_schedule == "zero_bubble" and m.mtp_depth:
                raise ConfigError(f"model.mtp_depth={m.mtp_depth} with parallel.pp_schedule=zero_bubble is not supported: "
                                  "the last stage's copy of the token embedding (which the MTP modules read) gets no "
                                  "gradient from torch's split backward; use parallel.pp_schedule=interleaved_1f1b")
            if p.pp_schedule == "zero_bubble" and t.compile:
                raise ConfigError("parallel.pp_schedule=zero_bubble splits each backward in two, which "
                                  "torch.compile'd blocks do not support; set train.compile=false or another schedule")
            if p.pp_schedule == "zero_bubble" and m.recompute == "op_selective":
                raise ConfigError("parallel.pp_schedule=zero_bubble with model.recompute=op_selective: the schedule "
                                  "runs each backward in two passes and torch's selective checkpoint allows one; use "
                                  "model.recompute=selective, full, every_k or offload, or another schedule")
        if p.cp > 1:
            self._validate_context_parallel()
        if p.tp > 1 or p.pp > 1:
            if m.layers == "te":
                raise ConfigError("model.layers=te with parallel.tp or parallel.pp: Transformer Engine layers "
                                  "bring their own parallelism; use model.layers=torch")
            if p.init_on_meta:
                raise ConfigError("parallel.init_on_meta=true with parallel.tp or parallel.pp is not supported: "
                                  "build the model whole (parallel.init_on_meta=false)")
            if self.precision.mode == "fp16":
                raise ConfigError("precision.mode=fp16 with parallel.tp or parallel.pp: the loss scaler does not "
                                  "reach into pipeline schedules and DTensor gradients; use bf16 (or bf16_master)")
            if self.precision.mode == "bf16_master" and p.strategy != "fsdp":
                raise ConfigError("precision.mode=bf16_master with parallel.tp or parallel.pp needs "
                                  "parallel.strategy=fsdp (its fp32 shards are the masters); or use precision.mode=bf16")

    def _validate_muon(self) -> None:
        """What optim.name=muon (and its QK-clip) needs from the layout, the precision and the model."""
        o, p, m = self.optim, self.parallel, self.model
        if o.name != "muon":
            return
        if p.strategy.startswith("zero"):
            raise ConfigError(f"optim.name=muon with parallel.strategy={p.strategy} is not supported: DeepSpeed's ZeRO "
                              "hands a client optimizer flat 1-D partitions, never whole matrices, so Newton-Schulz "
                              "cannot run on them (DeepSpeed's own Muon works inside its partitioning code, by its own "
                              "rules); use parallel.strategy=fsdp")
        if p.etp > 1:
            raise ConfigError(f"optim.name=muon with parallel.etp={p.etp} is not supported: Newton-Schulz needs each "
                              "expert's matrix whole on one rank, and expert tensor parallelism splits it; set "
                              "parallel.etp=1 (experts replicated over tp) or optim.name=adamw")
        if m.layers == "te" or self.precision.mode == "fp8":
            raise ConfigError("optim.name=muon with model.layers=te or precision.mode=fp8 is not supported: Muon is not "
                              "verified on FP8 weight wrappers; use model.layers=torch and another precision.mode")
        if o.muon.qk_clip_tau is None:
            return
        clip = f"optim.muon.qk_clip_tau={o.muon.qk_clip_tau:g}"
        off = "or turn QK-clip off (optim.muon.qk_clip_tau=null)"
        if p.tp > 1 or p.cp > 1:
            raise ConfigError(f"{clip} with parallel.tp or parallel.cp > 1 is not supported: QK-clip reads each "
                              f"head's logits where one rank holds all heads and whole sequences; {off}")
        if m.is_mla:
            raise ConfigError(f"{clip} with model.attention_kind=mla is not supported yet: QK-clip rescales the fused "
                              f"Q/K/V projection, which latent attention does not have; {off}")
        if m.qk_norm:
            raise ConfigError(f"{clip} with model.qk_norm: the norms rescale queries and keys after the projections, so "
                              f"scaling W_q and W_k cannot lower the logits; set model.qk_norm=false {off}")
        if self.precision.mode == "fp16":
            raise ConfigError(f"{clip} with precision.mode=fp16: the loss scaler skips steps inside its own step, which "
                              f"QK-clip must follow; use precision.mode=bf16 or fp32 {off}")

    def _validate_context_parallel(self) -> None:
        """What this trainer's context parallelism (parallel/cp.py) does not support."""
        if self.model.layers == "te":
            raise ConfigError("parallel.cp > 1 with model.layers=te: Transformer Engine's attention does not take the "
                              "gathered keys; use model.layers=torch")

    def _validate_fp8_torchao(self) -> None:
        """torchao converts the GPT's nn.Linear layers (those whose dims are not multiples of 16 stay
        as they are, and the log says so); what it cannot take is refused here."""
        if self.model.layers != "torch":
            raise ConfigError("precision.fp8_backend=torchao converts the model's nn.Linear layers, and "
                              f"model.layers={self.model.layers} has none; use model.layers=torch (or fp8_backend=te)")
        # The weight-gradient GEMM reduces over the micro-batch's tokens, and torch._scaled_mm needs
        # its inner dimension divisible by 16.
        tokens = self.train.micro_batch_size * self.seq_len
        if tokens % 16:
            raise ConfigError(f"precision.fp8_backend=torchao needs train.micro_batch_size x {self.seq_key} divisible "
                              f"by 16 (torch._scaled_mm's inner dimension in the weight-gradient GEMM); "
                              f"{self.train.micro_batch_size} x {self.seq_len} is not")

    def _validate_cross_sections(self) -> None:
        self._validate_parallel_support()
        self._validate_muon()
        fp8_backend = self.precision.fp8_backend if self.precision.mode == "fp8" else None
        if fp8_backend == "torchao":
            self._validate_fp8_torchao()
        if fp8_backend == "te" and self.model.layers != "te":
            raise ConfigError(
                "precision.mode=fp8 needs model.layers=te (FP8 GEMMs come from Transformer Engine layers), "
                "or precision.fp8_backend=torchao for the model's own Linear layers"
            )
        if fp8_backend == "te":
            bad = [(k, v) for k, v in self.model.gemm_dims().items() if v % 16]
            if bad:
                raise ConfigError(
                    "precision.mode=fp8 needs every GEMM dimension divisible by 16; not: "
                    + ", ".join(f"{k}={v}" for k, v in bad)
                )
            # TE also needs the GEMMs' row count (every token of a micro-batch) divisible by 8.
            if self.train.micro_batch_size * self.seq_len % 8:
                raise ConfigError(
                    f"precision.mode=fp8 needs train.micro_batch_size x {self.seq_key} divisible by 8 (Transformer "
                    f"Engine's FP8 GEMMs); {self.train.micro_batch_size} x {self.seq_len} is not"
                )
        if self.harness.tasks and self.model.layers != "torch":
            raise ConfigError(f"harness.tasks evaluates a plain copy of the model, which model.layers={self.model.layers} "
                              "cannot give; use model.layers=torch, or evaluate the checkpoints with "
                              "python -m tools.evaluate --tasks")
        if self.checkpoint.async_save and self.parallel.strategy.startswith("zero"):
            raise ConfigError(f"checkpoint.async_save=true cannot write parallel.strategy={self.parallel.strategy} "
                              "checkpoints in the background (DeepSpeed writes them itself); set "
                              "checkpoint.async_save=false, or use parallel.strategy=fsdp")
        if self.model.layers == "te" and self.parallel.init_on_meta:
            raise ConfigError("parallel.init_on_meta=true cannot initialize Transformer Engine layers "
                              "(model.layers=te); set parallel.init_on_meta=false")
        if self.model.layers == "te" and self.model.attention not in ("auto", "te"):
            raise ConfigError("model.layers=te uses Transformer Engine's own attention; set model.attention=auto")
        if self.data.seq_len and self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )

    @property
    def seq_len(self) -> int:
        return self.data.seq_len or self.model.max_seq_len


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] = (), *, saved: bool = False) -> JobConfig:
    """YAML file (optional) then ``--section.key=value`` overrides, then validation. ``saved``: the
    file is one a run wrote (its ``config.yaml``), so keys renamed since are read under their new names
    (``upgrade_renamed``) where a user's config is told to rename them."""
    cfg = from_dict(JobConfig, _raw_config(path, overrides, saved), prefix="")
    cfg.validate()
    return cfg


def explicit_keys(path: str | Path | None, overrides: list[str] = ()) -> frozenset[str]:
    """The dotted keys the YAML file and the overrides set, whatever their values: what a run asks
    for explicitly, as against the defaults (a model.init_from source must agree with these)."""
    def dotted(raw: Mapping[str, Any], prefix: str) -> list[str]:
        return [k for key, value in raw.items()
                for k in (dotted(value, f"{prefix}{key}.") if isinstance(value, Mapping) else [f"{prefix}{key}"])]

    return frozenset(dotted(_raw_config(path, overrides, saved=False), ""))


def _raw_config(path: str | Path | None, overrides: list[str], saved: bool) -> dict[str, Any]:
    """The YAML file's mapping with the overrides applied, before types and validation."""
    raw: dict[str, Any] = {}
    name = "run"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path} (see configs/ for the shipped ones)")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = upgrade_renamed(JobConfig, loaded or {}) if saved else (loaded or {})
        name = path.stem
    raw.setdefault("name", name)
    for item in overrides:
        _apply_override(raw, item)
    return raw


def parse_known_overrides(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """A command line's own flags, and the ``--section.key=value`` overrides after them; anything
    else is the parser's one-line usage error."""
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognized argument {bad[0]!r}; config overrides look like --section.key=value")
    return args, rest


def _apply_override(raw: dict[str, Any], item: str) -> None:
    body = item[2:] if item.startswith("--") else item
    if "=" not in body:
        raise ConfigError(f"override {item!r} must look like --section.key=value")
    dotted, text = body.split("=", 1)
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {key} is not a section")
        node = child
    # YAML parses the value so "--train.max_steps=10" gives an int and "--x=null" gives None;
    # strings that YAML would mangle (e.g. "1e-3" stays a float in YAML 1.1 only with a dot)
    # are coerced against the declared type in from_dict.
    try:
        node[keys[-1]] = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        node[keys[-1]] = text


def from_dict(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    renamed = getattr(cls, "renamed_keys", {})  # a section's old key names: old -> (new, why)
    for key in unknown:
        if key in renamed:
            new, why = renamed[key]
            raise ConfigError(f"{prefix}{key} is now called {prefix}{new} ({why}): rename the key in the config "
                              "or the override")
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}; valid keys{' in ' + prefix.rstrip('.') if prefix else ''}: "
            + ", ".join(fields)
        )
    kwargs = {}
    for key, value in raw.items():
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def upgrade_renamed(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A section of ``cls`` as a run saved it (checkpoint metadata, an export, a run's config.yaml),
    with keys renamed since then moved to their new names (``renamed_keys`` of each section, nested
    sections included), so what older runs wrote stays readable."""
    out = dict(raw)
    for old, (new, _why) in getattr(cls, "renamed_keys", {}).items():
        if old not in out:
            continue
        *path, leaf = new.split(".")
        node = out
        for part in path:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node.setdefault(leaf, out.pop(old))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(out.get(f.name), Mapping):
            out[f.name] = upgrade_renamed(hints[f.name], out[f.name])
    return out


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, prefix=f"{key}.")
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for option in non_none:
            try:
                return _coerce(option, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is list:
        if isinstance(value, str) and args[0] is str:  # --section.key=a,b on the command line
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp}")  # a bug in a dataclass, not user input


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe_fields(cls: type = JobConfig, prefix: str = "") -> list[str]:
    """One line per key with its default and help text, for ``train.py --help-config``."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.extend(describe_fields(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"--{prefix}{f.name}={default!r}  {f.metadata.get('help', '')}")
    return lines
