"""Typed run configuration: YAML file < command-line overrides, validated before any work.

Each section is a dataclass owned by the package that uses it (``model/config.py`` for the
model, ``data/config.py`` for data, ...). This module only assembles them into one
``JobConfig``, merges YAML and ``--section.key=value`` overrides with strict type checking,
and runs the cross-section checks. Every error is a ``ConfigError`` whose message is one line
naming the key and, where there is a fixed set, the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from data.config import DataConfig
from kernels.config import KernelsConfig
from model.config import ModelConfig
from parallel.config import ParallelConfig
from training.fields import ConfigError, doc


@dataclass
class OptimConfig:
    lr: float = doc(6e-4, "peak learning rate reached at the end of warmup")
    min_lr: float = doc(6e-5, "learning rate at the end of the cosine decay")
    warmup_steps: int = doc(
        100, "linear warmup length in optimizer steps; at most train.max_steps unless optim.decay_steps is set "
        "(a run that is the first part of a longer schedule)"
    )
    decay_steps: int | None = doc(
        None, "step at which the cosine decay reaches optim.min_lr (counted from step 0, warmup included; "
        ">= optim.warmup_steps); default: train.max_steps. Set it when one schedule spans several runs"
    )
    weight_decay: float = doc(0.1, "decoupled weight decay, applied to matrices only (not norms, biases)")
    beta1: float = doc(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = doc(0.95, "AdamW beta2, in [0, 1)")
    eps: float = doc(1e-8, "AdamW epsilon, > 0")
    grad_clip: float = doc(1.0, "clip the global gradient norm to this value; 0 disables")
    fused: Literal["auto", "on", "off"] = doc(
        "auto", "fused AdamW kernel: auto uses it where PyTorch supports the device"
    )

    def validate(self) -> None:
        # inf and nan pass every comparison-based check below (nan fails none of them), and
        # an infinite lr turns the first update into NaN weights: finiteness comes first.
        for key in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            _require_finite(f"optim.{key}", getattr(self, key))
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0 (got {self.lr})")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr must be between 0 and optim.lr={self.lr} (got {self.min_lr})")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.decay_steps is not None and self.decay_steps < 0:
            raise ConfigError(f"optim.decay_steps must be >= 0, or null for train.max_steps (got {self.decay_steps})")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise ConfigError(
                f"optim.decay_steps={self.decay_steps} ends the decay before optim.warmup_steps={self.warmup_steps} "
                "ends the warmup; set optim.decay_steps >= optim.warmup_steps"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0 (got {self.eps})")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip must be >= 0, 0 disables clipping (got {self.grad_clip})")


_FLOAT32_MAX = 3.4028234663852886e38


def _require_finite(key: str, value: float | None) -> None:
    # Parameters and optimizer states are float32 at least: a value beyond float32's range is
    # inf there (or makes torch raise mid-step), although Python calls it finite.
    if value is not None and not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
        raise ConfigError(f"{key} must be a finite number within float32 range (got {value})")


@dataclass
class TrainConfig:
    max_steps: int = doc(1000, "optimizer steps to train for")
    micro_batch_size: int = doc(8, "sequences per rank per forward/backward")
    grad_accum_steps: int = doc(1, "micro-batches accumulated per optimizer step")
    eval_interval: int = doc(200, "evaluate on the validation split every N steps; 0 disables")
    eval_steps: int = doc(20, "validation batches per evaluation")
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
        None, "per-device dense peak TFLOP/s for MFU; default: the device table in analysis/hardware.py"
    )
    data_wait_warn: float = doc(0.2, "warn when the fraction of step time spent waiting for data exceeds this")

    def validate(self) -> None:
        for key in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_interval", "profile_active"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1 (got {getattr(self, key)})")
        for key in ("profile_wait", "profile_warmup"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0 (got {getattr(self, key)})")
        if self.eval_interval < 0 or self.eval_steps < 1:
            raise ConfigError("train.eval_interval must be >= 0 and train.eval_steps >= 1")
        _require_finite("train.data_wait_warn", self.data_wait_warn)
        if self.data_wait_warn < 0:
            raise ConfigError(f"train.data_wait_warn must be >= 0 (got {self.data_wait_warn})")
        _require_finite("train.peak_tflops", self.peak_tflops)
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"train.peak_tflops must be > 0, or null for the device table (got {self.peak_tflops})")


@dataclass
class PrecisionConfig:
    mode: Literal["fp32", "bf16", "fp16", "bf16_master", "fp8"] = doc(
        "fp32",
        "fp32 | bf16 (autocast) | fp16 (autocast + grad scaler) | bf16_master (bf16 weights, "
        "fp32 norms and fp32 master weights) | fp8 (Transformer Engine, delayed scaling)",
    )
    nonfinite: Literal["skip", "stop"] = doc(
        "skip", "on a non-finite loss or grad norm: skip the optimizer step, or stop the run"
    )
    fp16_init_scale: float = doc(2.0**16, "initial loss scale for fp16")
    fp8_format: Literal["hybrid", "e4m3"] = doc("hybrid", "fp8: hybrid = E4M3 forward, E5M2 backward")
    fp8_amax_history_len: int = doc(16, "fp8 delayed scaling: amax history length")
    fp8_amax_compute_algo: Literal["max", "most_recent"] = doc("max", "fp8 delayed scaling: amax reduction")
    fp8_margin: int = doc(0, "fp8 delayed scaling: margin (power-of-two headroom)")
    max_skipped_steps: int = doc(
        10, "with nonfinite=skip, stop after this many consecutive skipped steps"
    )

    def validate(self) -> None:
        _require_finite("precision.fp16_init_scale", self.fp16_init_scale)
        if self.fp16_init_scale <= 0:
            raise ConfigError(f"precision.fp16_init_scale must be > 0 (got {self.fp16_init_scale})")
        if self.fp8_amax_history_len < 1:
            raise ConfigError(f"precision.fp8_amax_history_len must be >= 1 (got {self.fp8_amax_history_len})")
        for key in ("fp8_margin", "max_skipped_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"precision.{key} must be >= 0 (got {getattr(self, key)})")


@dataclass
class CheckpointConfig:
    interval: int = doc(0, "save every N steps (0: only at the end)")
    save_final: bool = doc(True, "save when training finishes")
    keep_last: int = doc(2, "keep this many most recent checkpoints (0 keeps all)")
    resume: str = doc("", "'' (fresh start), 'latest' (newest in the run's checkpoint dir) or a path")
    dir: str = doc("", "checkpoint directory; default: <run_dir>/checkpoints")
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

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        self._validate_schedule()
        self._validate_cross_sections()

    def _validate_schedule(self) -> None:
        # Without an explicit decay_steps the schedule ends with this run, and a warmup longer
        # than the run never reaches optim.lr; with one, the run may be the first slice of a
        # longer schedule (e.g. a job split by a time limit), so a long warmup is intended.
        if self.optim.decay_steps is None and self.optim.warmup_steps > self.train.max_steps:
            raise ConfigError(
                f"optim.warmup_steps={self.optim.warmup_steps} is longer than train.max_steps={self.train.max_steps}, "
                "so the learning rate never reaches optim.lr; lower optim.warmup_steps, or set optim.decay_steps "
                "to the full schedule if this run is part of a longer one"
            )

    def lr_schedule(self) -> dict[str, Any]:
        """The learning-rate schedule with decay_steps resolved: ``lr_at``'s keyword arguments,
        and what a checkpoint records so a resumed run can be checked against it."""
        o = self.optim
        decay_steps = self.train.max_steps if o.decay_steps is None else o.decay_steps
        return {"lr": o.lr, "min_lr": o.min_lr, "warmup_steps": o.warmup_steps, "decay_steps": decay_steps}

    def _validate_cross_sections(self) -> None:
        if self.precision.mode == "fp8" and self.model.layers != "te":
            raise ConfigError(
                "precision.mode=fp8 needs model.layers=te (FP8 GEMMs come from Transformer Engine layers)"
            )
        if self.precision.mode == "fp8":
            bad = [(k, v) for k, v in self.model.gemm_dims().items() if v % 16]
            if bad:
                raise ConfigError(
                    "precision.mode=fp8 needs every GEMM dimension divisible by 16; not: "
                    + ", ".join(f"{k}={v}" for k, v in bad)
                )
            # TE also needs the GEMMs' row count (every token of a micro-batch) divisible by 8.
            seq_key = "data.seq_len" if self.data.seq_len else "model.max_seq_len"
            if self.train.micro_batch_size * self.seq_len % 8:
                raise ConfigError(
                    f"precision.mode=fp8 needs train.micro_batch_size x {seq_key} divisible by 8 (Transformer "
                    f"Engine's FP8 GEMMs); {self.train.micro_batch_size} x {self.seq_len} is not"
                )
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


def load_config(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """YAML file (optional) then ``--section.key=value`` overrides, then validation."""
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
        raw = loaded or {}
        name = path.stem
    raw.setdefault("name", name)
    for item in overrides:
        _apply_override(raw, item)
    cfg = from_dict(JobConfig, raw, prefix="")
    cfg.validate()
    return cfg


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
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}; valid keys{' in ' + prefix.rstrip('.') if prefix else ''}: "
            + ", ".join(fields)
        )
    kwargs = {}
    for key, value in raw.items():
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, prefix=f"{key}.")
    if origin is Literal:
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
