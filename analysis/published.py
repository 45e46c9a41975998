"""Published training measurements and the estimator's prediction for each: the table that says how far
analysis/estimator/ is from real runs.

The measurements are data, one YAML file per source under analysis/published/ (what each file holds is
described at its top: the citation, where the numbers were read, the framework, and every layout detail
that the source does not print but the row needs). This module loads them into ``PublishedRow``s, turns
each into an estimator ``JobSpec`` on the system it ran on (common/hardware.py ``SYSTEMS``), compares,
summarizes the errors per source and quantity, renders the Markdown and the plot, and fits the
estimator's free parameters on the calibration rows (``fit``).

Which rows calibrate is fixed by a rule written before any error was looked at: in a source marked
``calibration: alternate`` every second row in file order (the first, third, ...) calibrates and the
others are held out; a source marked ``calibration: none`` (torchtitan's and Megatron-Bridge's tables) is never
used to fit.
The held-out error is the honest figure.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from analysis import estimator as est
from common.errors import ConfigError
from common.hardware import DEVICES, SYSTEMS
from common.report import new_figure, save_figure
from model.config import ModelConfig, MoEConfig
from model.flops import count_parameters, flops_per_token
from parallel.layout import LAYOUT_KEYS
from training.config import load_config

PUBLISHED_DIR = Path(__file__).resolve().parent / "published"
ROOT = PUBLISHED_DIR.parent.parent
# What a row may publish, and which quantity each is a measure of.
THROUGHPUT_KEYS = ("tokens_per_s_per_gpu", "tflops_per_gpu", "iteration_s")
QUANTITIES = ("throughput", "memory")
FLOPS_CONVENTIONS = ("megatron_eq3", "perfgpt")
ROW_KEYS = {
    "id", "table", "model", "system", "seq_len", "gpus", "tp", "pp", "cp", "micro_batch", "grad_accum",
    "global_batch", "strategy", "recompute", "precision", "ep", "pp_schedule", "pp_virtual_stages", "sequence_parallel",
    "tp_overlap", "dp_overlap", "pp_overlap", "fsdp_reshard_after_forward", "zero_reduction", "zero3_collectives", "op_selective_saves", "fp8_scaling", "fp8_weight_casts", "fp8_cast_kernels", "attention_kernel", "sink_attention", "compile", "num_params", "memory_gib", "reason",
    *THROUGHPUT_KEYS,
}
SOURCE_KEYS = {"source", "citation", "read_from", "framework", "calibration", "flops_convention", "memory_kind",
               "defaults", "model_defaults", "models", "rows", "left_out_reason", "cli_config"}
# An error beyond this needs a written reason in the row (``reason:``).
REASON_THRESHOLD = 0.25
# The median error a source left out of the fit should reach; beyond it the source says why (left_out_reason).
LEFT_OUT_TARGET = 0.10


@dataclass(frozen=True)
class Source:
    name: str
    citation: str
    read_from: str
    framework: str
    calibration: str  # alternate | none
    flops_convention: str | None
    memory_kind: str  # reserved (torch.cuda.max_memory_reserved) | device (nvidia-smi)
    left_out_reason: str = ""  # why the source, left out of the fit, is predicted worse (validation by source)
    cli_config: str = ""  # the configs/*.yaml its rows' tools.estimate commands start from (``cli_command``)


@dataclass(frozen=True, eq=False)  # identity: a row is one line of one file
class PublishedRow:
    """One published measurement: the run's layout as the source gives it, and its figures."""

    source: Source
    id: str
    table: str
    system: str
    model: ModelConfig
    seq_len: int
    gpus: int
    micro_batch: int
    global_batch: int
    layout: dict[str, Any]  # the Layout's keys (strategy, tp, pp, schedule) and JobSpec's (recompute, precision, overlaps)
    published: dict[str, float]  # THROUGHPUT_KEYS and memory_gib, as printed
    role: str  # calibration | held-out | check
    cp: int = 1
    compile: bool = False
    num_params: int | None = None
    reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.source.name}/{self.id}"

    @property
    def grad_accum(self) -> int:
        dp = self.gpus // (self.layout.get("tp", 1) * self.layout.get("pp", 1) * self.cp)
        return self.global_batch // (self.micro_batch * dp)

    def unsupported(self) -> str | None:
        """Why the estimator cannot predict this row, or None (every row it holds today is predicted)."""
        return None

    def job(self, assumptions: est.Assumptions | None = None) -> est.JobSpec:
        keys = {k: v for k, v in self.layout.items() if k in LAYOUT_KEYS}
        rest = {k: v for k, v in self.layout.items() if k not in LAYOUT_KEYS}
        return est.JobSpec(self.model, self.seq_len, self.micro_batch, est.layout_of(self.gpus, cp=self.cp, **keys),
                           device=SYSTEMS[self.system].device, grad_accum=self.grad_accum,
                           assumptions=assumptions or est.Assumptions(), **rest)


def _load_source(path: Path) -> list[PublishedRow]:
    raw = yaml.safe_load(path.read_text())
    where = path.name
    unknown = set(raw) - SOURCE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; valid: {', '.join(sorted(SOURCE_KEYS))}")
    for key in ("source", "citation", "read_from", "framework", "calibration", "rows"):
        if not raw.get(key):
            raise ConfigError(f"{where}: every source names its {key}")
    if raw["calibration"] not in ("alternate", "none"):
        raise ConfigError(f"{where}: calibration must be alternate or none, not {raw['calibration']!r}")
    convention = raw.get("flops_convention")
    if convention is not None and convention not in FLOPS_CONVENTIONS:
        raise ConfigError(f"{where}: flops_convention {convention!r} is not one of {', '.join(FLOPS_CONVENTIONS)}")
    source = Source(raw["source"], raw["citation"], raw["read_from"], raw["framework"], raw["calibration"],
                    convention, raw.get("memory_kind", "device"), raw.get("left_out_reason", ""),
                    raw.get("cli_config", ""))
    models = raw.get("models", {})
    rows = []
    for index, entry in enumerate(raw["rows"]):
        fields = {**raw.get("defaults", {}), **entry}
        unknown = set(fields) - ROW_KEYS
        name = f"{where} row {entry.get('id', index)}"
        if unknown:
            raise ConfigError(f"{name}: unknown key {sorted(unknown)[0]!r}")
        for key in ("id", "table", "system", "seq_len", "gpus", "micro_batch", "global_batch"):
            if key not in fields:
                raise ConfigError(f"{name}: missing {key}")
        if fields["system"] not in SYSTEMS:
            raise ConfigError(f"{name}: unknown system {fields['system']!r}; known: {', '.join(SYSTEMS)}")
        published = {k: float(fields[k]) for k in (*THROUGHPUT_KEYS, "memory_gib") if k in fields}
        if not published:
            raise ConfigError(f"{name}: publishes no figure (one of {', '.join(THROUGHPUT_KEYS)}, memory_gib)")
        if "tflops_per_gpu" in published and convention is None:
            raise ConfigError(f"{name}: tflops_per_gpu needs the source's flops_convention")
        shape = fields.get("model", {})
        shape = models[shape] if isinstance(shape, str) else shape
        fields_of_model = {**raw.get("model_defaults", {}), **shape, "max_seq_len": fields["seq_len"]}
        if isinstance(fields_of_model.get("moe"), dict):
            fields_of_model["moe"] = MoEConfig(**fields_of_model["moe"])
        model = ModelConfig(**fields_of_model)
        model.validate()
        layout = {
            "strategy": fields.get("strategy", "fsdp"), "recompute": fields.get("recompute", "none"),
            "precision": fields.get("precision", "bf16_master"), "tp": fields.get("tp", 1), "pp": fields.get("pp", 1),
            "pp_schedule": fields.get("pp_schedule", "1f1b"), "pp_virtual_stages": fields.get("pp_virtual_stages", 1),
            "tp_overlap": fields.get("tp_overlap", False), "dp_overlap": fields.get("dp_overlap", True),
            "pp_overlap": fields.get("pp_overlap", False),
            "fsdp_reshard_after_forward": fields.get("fsdp_reshard_after_forward", True),
            "zero_reduction": fields.get("zero_reduction", "deepspeed"),
            "zero3_collectives": fields.get("zero3_collectives", "bucketed"),
            "op_selective_saves": fields.get("op_selective_saves", "every_matmul"),
            "fp8_scaling": fields.get("fp8_scaling", "delayed"),
            "fp8_weight_casts": fields.get("fp8_weight_casts", "per_microbatch"),
            "fp8_cast_kernels": fields.get("fp8_cast_kernels", "separate"),
            "sink_attention": fields.get("sink_attention", "materialized"),
            "attention_kernel": fields.get("attention_kernel", "flash_attn2"),
        }
        if "ep" in fields:
            layout["ep"] = fields["ep"]
        if "sequence_parallel" in fields:
            layout["sequence_parallel"] = fields["sequence_parallel"]
        role = "check" if source.calibration == "none" else ("calibration" if index % 2 == 0 else "held-out")
        rows.append(PublishedRow(
            source, str(fields["id"]), str(fields["table"]), fields["system"], model, fields["seq_len"], fields["gpus"],
            fields["micro_batch"], fields["global_batch"], layout, published, role, cp=fields.get("cp", 1),
            compile=fields.get("compile", False), num_params=fields.get("num_params"), reason=fields.get("reason", ""),
        ))
    return rows


def load_rows(directory: Path = PUBLISHED_DIR) -> list[PublishedRow]:
    """Every published row, source by source (file name order), in file order within a source."""
    rows = []
    for path in sorted(directory.glob("*.yaml")):
        rows += _load_source(path)
    keys = [row.key for row in rows]
    duplicate = next((k for k in keys if keys.count(k) > 1), None)
    if duplicate:
        raise ConfigError(f"published row {duplicate} appears twice")
    return rows


# --------------------------------------------------------------------------- units


def flops_per_token_published(row: PublishedRow) -> float:
    """FLOPs per token in the source's own convention, to read its TFLOP/s as tokens per second."""
    cfg, s = row.model, row.seq_len
    if row.source.flops_convention == "megatron_eq3":
        # Narayanan et al. 2021, equation (3): F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per iteration
        layers, h, v = cfg.n_layer, cfg.d_model, cfg.vocab_size
        return 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops_per_token(cfg, s)


def tokens_per_s_per_gpu(row: PublishedRow, key: str, value: float) -> float:
    """A published throughput figure (in the unit ``key``) as tokens per second per GPU."""
    if key == "tokens_per_s_per_gpu":
        return value
    if key == "tflops_per_gpu":
        return value * 1e12 / flops_per_token_published(row)
    tokens = row.global_batch * row.seq_len  # iteration_s: one optimizer step
    return tokens / value / row.gpus


def in_unit(row: PublishedRow, key: str, tokens_per_s: float) -> float:
    """Tokens per second per GPU in the unit the row publishes (the inverse of ``tokens_per_s_per_gpu``)."""
    if key == "tokens_per_s_per_gpu":
        return tokens_per_s
    if key == "tflops_per_gpu":
        return tokens_per_s * flops_per_token_published(row) / 1e12
    return row.global_batch * row.seq_len / (tokens_per_s * row.gpus)


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Comparison:
    """One published figure next to the estimator's prediction for the same run."""

    row: PublishedRow
    quantity: str  # throughput | memory
    key: str  # the published unit
    published: float
    predicted: float | None  # in the same unit; None when the row cannot be predicted
    why_not: str = ""

    @property
    def error(self) -> float | None:
        """Predicted throughput (or memory) over published, minus one."""
        if self.predicted is None:
            return None
        if self.key == "iteration_s":  # a time: the throughput error is the inverse ratio
            return self.published / self.predicted - 1
        return self.predicted / self.published - 1


def compare(rows: list[PublishedRow], assumptions: est.Assumptions | None = None) -> list[Comparison]:
    """Every published figure of ``rows`` with the estimator's prediction (or why there is none)."""
    out = []
    for row in rows:
        why = row.unsupported()
        result = None if why else est.estimate(row.job(assumptions))
        for key, value in row.published.items():
            quantity = "memory" if key == "memory_gib" else "throughput"
            if result is None:
                out.append(Comparison(row, quantity, key, value, None, why))
            elif quantity == "memory":
                memory = result.memory.reserved if row.source.memory_kind == "reserved" else result.memory.total
                out.append(Comparison(row, quantity, key, value, memory / est.GIB))
            else:
                tokens = result.time.tokens_per_step / result.time.step_s / row.gpus
                out.append(Comparison(row, quantity, key, value, in_unit(row, key, tokens)))
    return out


@dataclass(frozen=True)
class Summary:
    source: str  # a source's name, or "all"
    quantity: str
    roles: tuple[str, ...]
    count: int
    median: float | None  # of |error|
    worst: float | None
    worst_row: str

    @property
    def label(self) -> str:
        return "/".join(self.roles)


def summarize(comparisons: list[Comparison]) -> list[Summary]:
    """Median and worst absolute error per source and quantity, calibration and held-out apart, then the
    held-out (held-out and independent-check rows) over all sources."""
    out = []
    sources = list(dict.fromkeys(c.row.source.name for c in comparisons))
    groups = [(s, q, roles) for s in sources for q in QUANTITIES
              for roles in (("calibration",), ("held-out", "check"))]
    groups += [("all", q, ("held-out", "check")) for q in QUANTITIES]
    for source, quantity, roles in groups:
        chosen = [c for c in comparisons if c.quantity == quantity and c.row.role in roles and c.error is not None
                  and source in ("all", c.row.source.name)]
        if not chosen:
            continue
        errors = [abs(c.error) for c in chosen]
        worst = max(chosen, key=lambda c: abs(c.error))
        out.append(Summary(source, quantity, roles, len(chosen), statistics.median(errors), abs(worst.error),
                           worst.row.id))
    return out


def unexplained(comparisons: list[Comparison]) -> list[Comparison]:
    """Figures predicted more than REASON_THRESHOLD off whose row gives no written reason."""
    return [c for c in comparisons if c.error is not None and abs(c.error) > REASON_THRESHOLD and not c.row.reason]


# --------------------------------------------------------------------------- calibration


def throughput_loss(rows: list[PublishedRow], assumptions: est.Assumptions) -> float:
    """Mean absolute log-ratio of predicted to published throughput over every throughput figure of ``rows``
    (absolute, not squared, so that a row the model cannot explain pulls no harder than any other)."""
    errors = [math.log(1 + c.error) for c in compare(rows, assumptions)
              if c.quantity == "throughput" and c.error is not None]
    return sum(abs(e) for e in errors) / len(errors)


def calibration_loss(rows: list[PublishedRow], assumptions: est.Assumptions) -> float:
    """``throughput_loss`` over the calibration rows."""
    return throughput_loss([r for r in rows if r.role == "calibration"], assumptions)


def _is_fraction(name: str) -> bool:
    # gemm_fraction_ampere and gemm_fraction_hopper are fractions too, not only names ending in one
    return "_fraction" in name or name.endswith("_efficiency")


def _to_search(name: str, value: float) -> float:
    # Fractions stay inside (0, 1) (logit); the other parameters are positive scales (log).
    if _is_fraction(name):
        value = min(max(value, 1e-6), 1 - 1e-6)
        return math.log(value / (1 - value))
    return math.log(value)


def _from_search(name: str, x: float) -> float:
    return 1 / (1 + math.exp(-x)) if _is_fraction(name) else math.exp(x)


def fit(rows: list[PublishedRow], start: est.Assumptions | None = None, iterations: int = 600,
        restarts: int = 2) -> est.Assumptions:
    """The estimator's FITTED_PARAMETERS that minimize ``calibration_loss`` over the calibration rows.

    Nelder-Mead on transformed parameters (a fraction's logit keeps it inside (0, 1), a scale's
    logarithm keeps it positive), from ``start`` with a simplex 0.2 wide, restarted from the best point
    ``restarts`` times; deterministic, so the same rows give the same parameters."""
    return fit_on([r for r in rows if r.role == "calibration"], start, iterations, restarts)


def fit_on(rows: list[PublishedRow], start: est.Assumptions | None = None, iterations: int = 600,
           restarts: int = 2) -> est.Assumptions:
    """As ``fit``, minimizing ``throughput_loss`` over every row given (whatever its role)."""
    best = start or est.Assumptions()
    for _ in range(restarts + 1):
        best = _nelder_mead(rows, best, iterations)
    return best


def _nelder_mead(rows: list[PublishedRow], start: est.Assumptions, iterations: int) -> est.Assumptions:
    names = est.FITTED_PARAMETERS

    def assumptions(point: list[float]) -> est.Assumptions:
        return dataclasses.replace(start, **{n: _from_search(n, x) for n, x in zip(names, point)})

    def loss(point: list[float]) -> float:
        return throughput_loss(rows, assumptions(point))

    origin = [_to_search(n, getattr(start, n)) for n in names]
    simplex = [origin] + [[x + (0.2 if i == j else 0.0) for j, x in enumerate(origin)] for i in range(len(names))]
    values = [loss(point) for point in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-6:
            break
        centroid = [sum(point[j] for point in simplex[:-1]) / len(names) for j in range(len(names))]

        def towards(factor: float) -> list[float]:
            return [c + factor * (w - c) for c, w in zip(centroid, simplex[-1])]

        reflected = towards(-1.0)
        r = loss(reflected)
        if r < values[0]:
            expanded = towards(-2.0)
            e = loss(expanded)
            simplex[-1], values[-1] = (expanded, e) if e < r else (reflected, r)
        elif r < values[-2]:
            simplex[-1], values[-1] = reflected, r
        else:
            contracted = towards(0.5)
            c = loss(contracted)
            if c < values[-1]:
                simplex[-1], values[-1] = contracted, c
            else:  # shrink towards the best point
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, point)] for point in simplex[1:]]
                values = [values[0]] + [loss(point) for point in simplex[1:]]
    best = min(range(len(simplex)), key=values.__getitem__)
    return assumptions(simplex[best])


# --------------------------------------------------------------------------- validation by source


@dataclass(frozen=True)
class Fold:
    """One source left out: the parameters fitted on every other source's throughput figures, and the
    left-out source's figures predicted with them."""

    source: str
    assumptions: est.Assumptions
    comparisons: list[Comparison]


def fold(rows: list[PublishedRow], source: str, assumptions: est.Assumptions) -> Fold:
    """``source``'s figures predicted with ``assumptions`` (fitted without it)."""
    return Fold(source, assumptions, compare([r for r in rows if r.source.name == source], assumptions))


def leave_one_source_out(rows: list[PublishedRow], start: est.Assumptions | None = None, iterations: int = 600,
                         restarts: int = 2) -> list[Fold]:
    """For every source in turn, ``fit_on`` every row of the others (from ``start``, default the committed
    parameters, searched as ``fit`` searches: a weaker search left a fold's figure moving with its start),
    then predict the source's figures: how the estimator does on a source it never saw.
    Memory has no fitted parameter, so its figures come out as in ``compare``."""
    folds = []
    for source in dict.fromkeys(r.source.name for r in rows):
        others = [r for r in rows if r.source.name != source]
        folds.append(fold(rows, source, fit_on(others, start, iterations, restarts)))
    return folds


def fold_summaries(folds: list[Fold]) -> list[Summary]:
    """Median and worst absolute error per left-out source and quantity, then over all sources."""
    out = []
    pooled = [c for f in folds for c in f.comparisons if c.error is not None]
    for name, chosen in [(f.source, [c for c in f.comparisons if c.error is not None]) for f in folds] + [("all", pooled)]:
        for quantity in QUANTITIES:
            figures = [c for c in chosen if c.quantity == quantity]
            if figures:
                worst = max(figures, key=lambda c: abs(c.error))
                out.append(Summary(name, quantity, ("left out",), len(figures),
                                   statistics.median(abs(c.error) for c in figures), abs(worst.error), worst.row.id))
    return out


# --------------------------------------------------------------------------- rendering


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _figure(key: str, value: float) -> str:
    if key == "iteration_s":
        return f"{value:.2f} s/iter"
    if key == "tflops_per_gpu":
        return f"{value:.0f} TFLOP/s"
    if key == "memory_gib":
        return f"{value:.1f} GiB"
    return f"{value:,.0f} tok/s"


def layout_text(row: PublishedRow) -> str:
    lay = row.layout
    dp = row.gpus // (lay["tp"] * lay["pp"] * row.cp)
    parts = [f"dp{dp}", f"tp{lay['tp']}", f"pp{lay['pp']}"]
    if row.cp > 1:
        parts.append(f"cp{row.cp}")
    if lay["pp"] > 1:
        v = lay["pp_virtual_stages"]
        parts.append(lay["pp_schedule"] + (f"/v{v}" if v > 1 else ""))
    if lay["tp"] > 1 and lay.get("sequence_parallel", True):
        parts.append("sp")
    parts += [lay["strategy"], f"mb{row.micro_batch}x{row.grad_accum}", f"s{row.seq_len}", lay["recompute"],
              lay["precision"]]
    return " ".join(parts)


# The model fields a row's command states where they differ from its source's cli_config (the rest,
# initialization and rotary details, leave the estimate unchanged; the command test checks that).
CLI_MODEL_FIELDS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "mlp", "norm", "position",
                    "bias", "tie_embeddings", "dropout", "attention", "max_seq_len")


def cli_command(row: PublishedRow) -> str | None:
    """The ``python -m tools.estimate`` command that estimates ``row`` (its source's ``cli_config``
    with the row's model fields, layout and device put in), or None for a source without one.
    ``--allow-refused``: these are other frameworks' runs, some on layouts train.py refuses."""
    if not row.source.cli_config:
        return None
    base = load_config(ROOT / row.source.cli_config).model
    job = row.job()
    device = next(key for key, spec in DEVICES.items() if spec == job.device)
    words = ["python -m tools.estimate", f"--config {row.source.cli_config}"]
    for name in CLI_MODEL_FIELDS:
        value = getattr(row.model, name)
        if value != getattr(base, name) and (name != "max_seq_len" or value > base.max_seq_len):
            words.append(f"--model.{name}={value}")
    lay = job.layout
    words += [f"--device {device}", f"--gpus {row.gpus}", f"--seq-len {job.seq_len}",
              f"--micro-batch {job.micro_batch}", f"--grad-accum {job.grad_accum}", f"--strategy {lay.strategy}",
              f"--recompute {job.recompute}", f"--precision {job.precision}"]
    if job.precision == "fp8":
        words.append(f"--fp8-scaling {job.fp8_scaling}")
        if job.fp8_weight_casts != "per_microbatch":
            words.append(f"--fp8-weight-casts {job.fp8_weight_casts}")
        if job.fp8_cast_kernels != "separate":
            words.append(f"--fp8-cast-kernels {job.fp8_cast_kernels}")
    words += [f"--tp {lay.tp}", f"--pp {lay.pp}", f"--cp {lay.cp}"]
    if lay.pp > 1:
        words += [f"--pp-schedule {lay.pp_schedule}", f"--pp-virtual-stages {lay.pp_virtual_stages}"]
    words += [f"--reshard-after-forward {str(job.fsdp_reshard_after_forward).lower()}",
              f"--op-selective-saves {job.op_selective_saves}"]
    if job.sink_attention != "materialized":
        words.append(f"--sink-attention {job.sink_attention}")
    if job.attention_kernel != "flash_attn2":
        words.append(f"--attention-kernel {job.attention_kernel}")
    if job.tp_overlap:
        words.append("--tp-overlap")
    if job.pp_overlap:
        words.append("--pp-overlap")
    return " ".join(words + ["--allow-refused"])


def summary_lines(summaries: list[Summary]) -> list[str]:
    """The error summary as Markdown table lines (what the test regenerates and compares)."""
    lines = ["| source | quantity | rows | n | median abs error | worst abs error (row) |", "|---|---|---|---:|---:|---|"]
    for s in summaries:
        worst = f"{s.worst:.1%} ({s.worst_row})"
        name = "**all sources**" if s.source == "all" else s.source
        lines.append(f"| {name} | {s.quantity} | {s.label} | {s.count} | {s.median:.1%} | {worst} |")
    return lines


def render_markdown(comparisons: list[Comparison], assumptions: est.Assumptions, command: str) -> str:
    rows = list(dict.fromkeys(c.row for c in comparisons))
    summaries = summarize(comparisons)
    held = {s.quantity: s for s in summaries if s.source == "all"}
    sources = list(dict.fromkeys(r.source for r in rows))
    lines = [
        "# Published measurements against the estimator",
        "",
        f"Generated by `{command}` from analysis/published/*.yaml. Every row is a measurement some source "
        "published (numbers as printed, one row per table row); the prediction is the estimator's (analysis/estimator/) for "
        "that exact model, layout and system (common/hardware.py `SYSTEMS`). Error = predicted / published "
        "− 1 in throughput (for an iteration time, published / predicted − 1) or memory.",
        "",
        "Calibration rows (every second row of a source, in file order, fixed before any error was seen) fit "
        f"the estimator's free parameters ({', '.join(est.FITTED_PARAMETERS)}); held-out rows never did, and "
        "torchtitan's and Megatron-Bridge's tables (`check`) were kept aside as independent checks and never "
        "used to fit or choose anything. The held-out figure is the honest one.",
        "",
    ]
    for quantity in QUANTITIES:
        s = held.get(quantity)
        if s is not None:
            lines.append(f"- **Held-out {quantity}: median absolute error {s.median:.1%} over {s.count} figures, "
                         f"worst {s.worst:.1%} ({s.worst_row}).**")
    lines += ["", "## Error summary", "", *summary_lines(summaries), "",
              "## Parameters", "",
              "| parameter | value | |", "|---|---:|---|"]
    for f in dataclasses.fields(assumptions):
        kind = "fitted" if f.name in est.FITTED_PARAMETERS else "stated"
        lines.append(f"| {f.name} | {getattr(assumptions, f.name):g} | {kind} |")
    lines += ["", "## Rows", ""]
    for source in sources:
        lines += [f"### {source.name}", "", f"- Source: {source.citation}", f"- Read from: {source.read_from}",
                  f"- Framework: {source.framework}",
                  f"- Calibration: {'every second row (the first, third, ...)' if source.calibration == 'alternate' else 'none (independent check)'}",
                  "", "| row | table | model | GPUs | layout | published | predicted | error | role |",
                  "|---|---|---|---:|---|---:|---:|---:|---|"]
        for c in (c for c in comparisons if c.row.source is source):
            r = c.row
            params = count_parameters(r.model) / 1e9
            predicted = _figure(c.key, c.predicted) if c.predicted is not None else f"not predicted: {c.why_not}"
            lines.append(f"| {r.id} | {r.table} | {params:.1f}B | {r.gpus} | {layout_text(r)} | "
                         f"{_figure(c.key, c.published)} | {predicted} | {_pct(c.error)} | {r.role} |")
        commands = [(r.id, cli_command(r)) for r in rows if r.source is source and source.cli_config]
        if commands:
            lines += ["", "Through the command line (each prints the prediction above):", ""]
            lines += [f"- {row_id}: `{command}`" for row_id, command in commands]
        reasons = [r for r in rows if r.source is source and r.reason]
        if reasons:
            lines += ["", "Written reasons:", ""] + [f"- {r.id}: {r.reason}" for r in reasons]
        lines.append("")
    lines.append("![published vs estimator](published_vs_estimator.png)")
    return "\n".join(lines) + "\n"


def render_leave_one_out(folds: list[Fold], alternate: list[Summary], command: str) -> str:
    """The validation by source as Markdown: per left-out source and quantity n, median and worst, the
    parameters each fold fitted, and every figure beyond REASON_THRESHOLD with its row's written reason."""
    summaries = fold_summaries(folds)
    pooled = {s.quantity: s for s in summaries if s.source == "all"}
    alt = {s.quantity: s for s in alternate if s.source == "all"}
    names = est.FITTED_PARAMETERS
    lines = [
        "# Published measurements, validated by source (leave one source out)",
        "",
        f"Generated by `{command}` from analysis/published/*.yaml. For every source in turn, the estimator's "
        f"free parameters ({', '.join(names)}) are fitted on every throughput figure of the other sources "
        "(analysis/published.py `leave_one_source_out`: Nelder-Mead from the committed parameters, restarted "
        "twice from its best point as the committed fit is), and the "
        "left-out source's figures are predicted with them: how the estimator does on a framework, a "
        "hardware generation and a team it never saw. Memory has no fitted parameter, so its errors are those "
        "of [published_vs_estimator.md](published_vs_estimator.md); only torchtitan publishes memory with "
        "full layouts. Error = predicted / published − 1 (for an iteration time, published / predicted − 1).",
        "",
    ]
    for quantity in QUANTITIES:
        s = pooled.get(quantity)
        if s is not None:
            lines.append(f"- **Left-out sources, {quantity}: median absolute error {s.median:.1%} over {s.count} "
                         f"figures of {len([f for f in folds if any(c.quantity == quantity for c in f.comparisons)])} "
                         f"sources, worst {s.worst:.1%} ({s.worst_row}).**")
    for quantity in QUANTITIES:
        s = alt.get(quantity)
        if s is not None:
            lines.append(f"- Secondary (alternate rows of the same sources held out, one fit): {quantity} median "
                         f"{s.median:.1%} over {s.count} figures.")
    lines += ["", "## Error per left-out source", "",
              "| left-out source | quantity | n | median abs error | worst abs error (row) |",
              "|---|---|---:|---:|---|"]
    for s in summaries:
        name = "**all sources**" if s.source == "all" else s.source
        lines.append(f"| {name} | {s.quantity} | {s.count} | {s.median:.1%} | {s.worst:.1%} ({s.worst_row}) |")
    off = [s for s in summaries if s.source != "all" and s.median > LEFT_OUT_TARGET]
    if off:
        lines += ["", f"Why a left-out source's median is beyond {LEFT_OUT_TARGET:.0%} (its file's `left_out_reason`):", ""]
        reasons = {f.source: next((c.row.source.left_out_reason for c in f.comparisons), "") for f in folds}
        lines += [f"- {s.source} ({s.quantity}, {s.median:.1%}): {reasons.get(s.source) or 'no written reason'}"
                  for s in off]
    lines += ["", "## Parameters fitted without each source", "",
              "| left out | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for f in folds:
        lines.append(f"| {f.source} | " + " | ".join(f"{getattr(f.assumptions, n):.3g}" for n in names) + " |")
    beyond = [c for f in folds for c in f.comparisons if c.error is not None and abs(c.error) > REASON_THRESHOLD]
    lines += ["", f"## Figures beyond {REASON_THRESHOLD:.0%} on their left-out source", ""]
    if not beyond:
        lines.append("None.")
    lines += [f"- {c.row.key} ({c.quantity}, {_pct(c.error)}): "
              + (c.row.reason or (f"its source's: {c.row.source.left_out_reason}" if c.row.source.left_out_reason
                                  else "no written reason")) for c in beyond]
    return "\n".join(lines) + "\n"


def fold_parameters(folds: list[Fold]) -> list[dict]:
    """Each fold's source and fitted parameters (what ``render_leave_one_out`` needs to be redrawn)."""
    return [{"source": f.source, "parameters": {n: getattr(f.assumptions, n) for n in est.FITTED_PARAMETERS}}
            for f in folds]


def folds_from(rows: list[PublishedRow], saved: list[dict]) -> list[Fold]:
    """The folds of ``fold_parameters``' record, predicted again with today's estimator."""
    return [fold(rows, entry["source"], dataclasses.replace(est.Assumptions(), **entry["parameters"]))
            for entry in saved]


def plot(comparisons: list[Comparison], path: Path) -> None:
    """Predicted against published (log-log), throughput and memory side by side, one colour per source,
    filled markers for held-out and check rows, hollow for calibration rows."""
    fig, axes = new_figure(ncols=2, width=6.0, height=5.0)
    sources = list(dict.fromkeys(c.row.source.name for c in comparisons))
    colours = {s: f"C{i}" for i, s in enumerate(sources)}
    for ax, quantity in zip(axes, QUANTITIES):
        chosen = [c for c in comparisons if c.quantity == quantity and c.predicted is not None]
        if not chosen:
            ax.set_visible(False)
            continue
        for source in sources:
            for calibrating in (True, False):
                points = [c for c in chosen if c.row.source.name == source and (c.row.role == "calibration") == calibrating]
                if not points:
                    continue
                pub = [tokens_per_s_per_gpu(c.row, c.key, c.published) if quantity == "throughput" else c.published
                       for c in points]
                pred = [tokens_per_s_per_gpu(c.row, c.key, c.predicted) if quantity == "throughput" else c.predicted
                        for c in points]
                ax.scatter(pub, pred, s=22, edgecolors=colours[source],
                           facecolors="none" if calibrating else colours[source],
                           label=f"{source} ({'calibration' if calibrating else 'held-out'})")
        low = min(min(ax.get_xlim()), min(ax.get_ylim()))
        high = max(max(ax.get_xlim()), max(ax.get_ylim()))
        ax.plot([low, high], [low, high], color="0.5", lw=0.8)
        for f in (0.9, 1.1):
            ax.plot([low, high], [low * f, high * f], color="0.8", lw=0.6, ls="--")
        if quantity == "throughput":
            ax.set_xscale("log")
            ax.set_yscale("log")
        unit = "tokens/s per GPU" if quantity == "throughput" else "GiB per GPU"
        ax.set_xlabel(f"published ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(f"{quantity}: dashed lines at ±10%")
        ax.legend(fontsize=6)
    save_figure(fig, path)


def parameter_count_problems(rows: list[PublishedRow], tolerance: float = 0.002) -> list[str]:
    """Rows whose published parameter count differs from the model built from their shape."""
    problems = []
    for row in rows:
        if row.num_params:
            ours = count_parameters(row.model)
            if abs(ours / row.num_params - 1) > tolerance:
                problems.append(f"{row.key}: published {row.num_params:,} parameters, the shape gives {ours:,}")
    return problems

