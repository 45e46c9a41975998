"""The chapter's tables, reproduced: its claim | our analytic figure at its scale | measured here.

Each ``*_table`` function takes the measurements of this run (``Measured``) and returns a
``report.Table``. Analytic figures come from ``analysis/estimator.py`` and ``analysis/hardware.py``;
the chapter's claims are quoted as printed (translated); verdicts say why a claim is wrong where
it is, and docs/chapter_corrections.md lists each correction with the tests that establish it.
A "measured here" cell holds either a measurement of this run or a figure read, at generation
time, from a measured file under docs/results/ (named in the cell); otherwise it says what is
missing. No cell quotes a figure from anywhere else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from analysis import comm_model as cm
from analysis import estimator as est
from common.hardware import DEVICES
from common.measure import NO_DIFFERENCE, speedup
from common.report import GIB, NEEDS_GPU, Table, gib, human_bytes, new_figure, save_figure, sci


@dataclass
class Measured:
    """What this run measured (any device), and GPU-only figures (this run's if on CUDA, else a saved GPU run's)."""

    formats: dict
    precision: dict | None = None
    attention: dict | None = None
    recompute: dict | None = None
    gpu: dict = field(default_factory=dict)  # {"precision": ..., "attention": ..., "recompute": ...}
    data_bench: dict | None = None  # tools/bench_data.py's rows document (common.report.write_results), if found
    # Other measured files of docs/results/ by file name (MEASURED_FILES): the rows documents their
    # tools wrote next to them (same stem, .json), read when the tables are built.
    documents: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# Measured files other tools write into docs/results/, which the summary table quotes by name; their
# numbers are read from the rows each tool writes next to them (same stem, .json), never from the Markdown.
BENCH_TRAIN_CPU = "bench_train_cpu.md"  # tools/bench_train.py on configs/tiny.yaml
PARALLEL_CPU = "parallel_strategies_cpu.md"  # tools/bench_parallel.py on 2 gloo processes
MEASURED_FILES = (BENCH_TRAIN_CPU, PARALLEL_CPU)
NOT_MEASURED = "not measured"


def _where(result: dict) -> str:
    return f"{result['hardware']}, {result['date']}"


# --------------------------------------------------------------------------- 8.1 numeric formats

# As printed: (bits, sign, exponent, mantissa, range, GPU support)
CHAPTER_FORMATS = {
    "FP32": (32, 1, 8, 23, "~10⁻³⁸ ~ 10³⁸", "all"),
    "FP16": (16, 1, 5, 10, "~10⁻⁵ ~ 65504", "Volta+"),
    "BF16": (16, 1, 8, 7, "~10⁻³⁸ ~ 10³⁸", "Ampere+"),
    "FP8 (E4M3)": (8, 1, 4, 3, "~10⁻⁶ ~ 448", "Hopper+"),
    "FP8 (E5M2)": (8, 1, 5, 2, "~10⁻¹⁴ ~ 57344", "Hopper+"),
}


def format_from_layout(exponent_bits: int, mantissa_bits: int, finite_only: bool) -> dict:
    """Largest value, smallest normal and subnormal of a binary float with this bit layout.

    IEEE 754 style (FP32, FP16, BF16, OCP E5M2): bias 2^(e-1)-1, the all-ones exponent holds inf
    and NaN, so the largest value is (2 - 2^-m) * 2^bias. OCP E4M3 ("fn", finite): no inf; only
    the all-ones pattern is NaN, so the all-ones exponent carries normal values up to mantissa
    110: (1 + (2^m - 2)/2^m) * 2^(bias + 1) = 448.
    """
    bias = 2 ** (exponent_bits - 1) - 1
    if finite_only:
        largest = (1 + (2**mantissa_bits - 2) / 2**mantissa_bits) * 2.0 ** (bias + 1)
    else:
        largest = (2 - 2.0**-mantissa_bits) * 2.0**bias
    return {
        "max": largest,
        "min_normal": 2.0 ** (1 - bias),
        "min_subnormal": 2.0 ** (1 - bias - mantissa_bits),
        "has_inf": not finite_only,
    }


def formats_table(measured: Measured) -> Table:
    rows, analytic_all = [], {}
    for label, (bits, _, e, m, claimed_range, gpus) in CHAPTER_FORMATS.items():
        analytic = format_from_layout(e, m, finite_only=label == "FP8 (E4M3)")
        analytic_all[label] = analytic
        got = measured.formats.get(label, {})
        if got.get("missing"):
            measured_cell = f"torch has no {got['dtype']}"
        else:
            inf = "inf" if math.isinf(got["inf_casts_to"]) else f"{sci(got['inf_casts_to'])} (no inf)"
            measured_cell = (
                f"e{got['exponent_bits']}m{got['mantissa_bits']}: max {sci(got['max'])}, "
                f"min normal {sci(got['min_normal'])}, min subnormal {sci(got['min_subnormal'])}, "
                f"eps {sci(got['eps'])}; +inf casts to {inf}"
            )
        rows.append([
            label,
            f"{bits} bits (1/{e}/{m}); range {claimed_range}; {gpus}",
            f"max {sci(analytic['max'])}, min normal 2^{round(math.log2(analytic['min_normal']))} = "
            f"{sci(analytic['min_normal'])}, min subnormal 2^{round(math.log2(analytic['min_subnormal']))} = "
            f"{sci(analytic['min_subnormal'])}" + ("" if analytic["has_inf"] else ", no inf"),
            measured_cell,
            _format_verdict(label),
        ])
    notes = [
        "The bit layouts and maxima in the chapter are right. Its lower range ends are not: FP8 E4M3 reaches 2⁻⁶ "
        "(normal) and 2⁻⁹ ≈ 2e-3 (subnormal), not ~1e-6; E5M2 reaches 2⁻¹⁴ and 2⁻¹⁶ ≈ 1.5e-5, not 1e-14; FP16's "
        "smallest normal is 6.1e-5 and smallest subnormal 6e-8, so '~1e-5' is neither.",
        "E4M3 (the 'fn' variant PyTorch and the OCP spec use) has no infinity: torch saturates +inf to its max on a "
        "cast, which is why FP8 recipes keep amax histories and scales.",
        "FP8 tensor cores are on Hopper (sm_90) and Ada (sm_89), not 'Hopper+' only. FP16 tensor cores arrived with "
        "Volta; BF16 ones with Ampere.",
        "Measured = torch.finfo on this machine; analytic = the formula from the bit layout. They must agree "
        "(tests/unit/analysis/test_chapter_tables.py checks it).",
    ]
    return Table(
        name="numeric_formats",
        title="8.1 Numeric formats",
        setup=[
            "chapter: the 8.1 format table, as printed",
            "analytic: IEEE-754-style formulas from (exponent, mantissa) bits; OCP FP8 rules for E4M3",
            f"measured here: torch.finfo and a cast of +inf, torch {_torch_version()}",
        ],
        columns=["format", "chapter's claim", "analytic (bit layout)", "measured here (torch.finfo)", "verdict"],
        rows=rows,
        notes=notes,
        plot=lambda path: _plot_formats(analytic_all, path),
    )


def _format_verdict(label: str) -> str:
    return {
        "FP32": "correct",
        "FP16": "max correct; lower end ~1e-5 matches neither 6.1e-5 nor 6e-8",
        "BF16": "correct",
        "FP8 (E4M3)": "max correct; min is 2⁻⁹ ≈ 2e-3, not 1e-6; no inf; Hopper and Ada",
        "FP8 (E5M2)": "max correct; min is 2⁻¹⁶ ≈ 1.5e-5, not 1e-14; Hopper and Ada",
    }[label]


def _plot_formats(analytic: dict, path: Path) -> None:
    fig, ax = new_figure(width=7, height=3.5)
    labels = list(analytic)
    for i, label in enumerate(labels):
        a = analytic[label]
        low, normal, high = (math.log10(a[k]) for k in ("min_subnormal", "min_normal", "max"))
        ax.plot([low, normal], [i, i], color="tab:orange", linewidth=6, solid_capstyle="butt")
        ax.plot([normal, high], [i, i], color="tab:blue", linewidth=6, solid_capstyle="butt")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("log10 |value|  (orange: subnormal, blue: normal range)")
    ax.set_title("Representable magnitudes (from the bit layout; equal to torch.finfo)")
    save_figure(fig, path)


def _torch_version() -> str:
    import torch

    return torch.__version__


# --------------------------------------------------------------------------- 8.1 precision modes

# mode label -> (our precision mode, chapter TFLOPS, chapter relative throughput, chapter memory)
CHAPTER_PRECISION = {
    "FP32": ("fp32", "~500", "1.0×", "100%"),
    "FP16 (AMP)": ("fp16", "~1000", "2.0×", "~60%"),
    "BF16 (AMP)": ("bf16", "~1000", "2.0×", "~60%"),
    "BF16 (whole model)": ("bf16_master", "~1000", "2.1×", "~50%"),
    "FP8 (TE)": ("fp8", "~1800", "3.6×", "~35%"),
}
PRECISION_MEASURED_VARIANT = {"fp32": "fp32", "fp16": "fp16_autocast", "bf16": "bf16_autocast", "bf16_master": "bf16_model"}


def _mode_peak(mode: str) -> tuple[float, str]:
    h100 = DEVICES["H100"]
    if mode == "fp32":
        return h100.tf32_tflops, "TF32"
    if mode == "fp8":
        return h100.fp8_tflops, "FP8"
    return h100.bf16_tflops, "FP16" if mode == "fp16" else "BF16"


def precision_table(measured: Measured) -> Table:
    gpt3 = est.preset("gpt3-175b")
    h100 = DEVICES["H100"]
    n_params = est.count_parameters(gpt3.model)
    results = {}
    for label, (mode, *_rest) in CHAPTER_PRECISION.items():
        job = est.JobSpec(gpt3.model, gpt3.seq_len, 1, 8, "fsdp", "none", mode, h100)
        results[label] = est.estimate(job)
    fp32_memory = results["FP32"].memory.total
    fp32_speed = results["FP32"].time.seconds_per_token  # predicted as if memory were no limit
    min_gpus = est.min_gpus_to_fit(gpt3.model, gpt3.seq_len, h100, "bf16_master")
    rows = []
    for label, (mode, tflops, rel, mem) in CHAPTER_PRECISION.items():
        result = results[label]
        peak, kind = _mode_peak(mode)
        analytic = (
            f"peak {peak:g} TFLOP/s dense {kind} ({peak / h100.tf32_tflops:.1f}× TF32); "
            f"predicted {fp32_speed / result.time.seconds_per_token:.1f}× fp32 if it fit; "
            f"{gib(result.memory.total)}/GPU = {result.memory.total / fp32_memory:.0%} of fp32 "
            f"(states {gib(result.memory.states)}): does not fit in 80 GiB"
        )
        rows.append([label, f"{tflops} TFLOPS, {rel}, memory {mem}", analytic, _precision_measured(mode, measured)])
    notes = [
        f"Physically impossible as stated: GPT-3 175B has {n_params / 1e9:.1f}B parameters; mixed-precision AdamW "
        f"keeps 16 bytes per parameter ({16 * n_params / 1e12:.2f} TB) against 8 × 80 GB = 640 GB, before any "
        f"activation. Even fully sharded (FSDP/ZeRO-3) each GPU needs {gib(16 * n_params / 8)} of model states. "
        f"Our planner finds the smallest H100 count that fits (FSDP, full recompute, micro-batch 1): "
        f"{_gpu_count(min_gpus)}.",
        "The 'TFLOPS' column is the H100 SXM datasheet's dense peaks (TF32 495, FP16/BF16 989, FP8 1979), not "
        "measurements. 'FP32 ~500' is TF32 on tensor cores; plain FP32 (PyTorch's default for matmuls, TF32 off) "
        f"peaks at {h100.fp32_tflops:g}.",
        "AMP does not shrink model states: autocast keeps fp32 weights, gradients and Adam moments (16 B/param); "
        "only activations become 16-bit. 'Memory 60%/50%/35%' cannot come from precision alone; at this scale "
        "the states dominate, so the analytic memory barely moves between modes.",
        f"FP8 end to end is not the ratio of peaks: only the GEMMs run in FP8 (fitted at "
        f"{_fraction_pct('fp8_gemm_fraction')} of the FP8 peak where BF16 GEMMs reach "
        f"{_fraction_pct('gemm_fraction_hopper')} of their own on H100, both times the GEMM-shape factor), while "
        "attention, element-wise work and communication stay as they are (analysis/estimator.py, Assumptions, "
        "fitted on published measurements: docs/results/published_vs_estimator.md); FP8 is not measured here "
        "(it needs Transformer Engine on a Hopper or Ada GPU).",
    ]
    cpu = measured.precision
    if cpu is not None:
        notes.append(
            "Measured here is a small model on this machine: CPU throughput ratios say nothing about tensor "
            "cores (CPUs without AMX run bf16 slower); the saved-bytes ratio shows what autocast really "
            "halves (only matmul outputs; norms, residual stream and loss stay fp32)."
        )
    return Table(
        name="precision_modes",
        title="8.1 Precision modes (chapter: GPT-3 175B on 8× H100 80GB SXM5)",
        setup=[
            "chapter: the 8.1 'performance comparison' table (GPT-3 175B, 8× H100 80GB SXM5)",
            f"analytic: analysis/estimator.py at the chapter's scale: GPT-3 175B, s={gpt3.seq_len}, micro-batch 1, "
            "8× H100, FSDP (fully sharded), no recompute; throughput ratio from the step-time model",
            "measured here: " + (f"{cpu['setup']} on {_where(cpu)}" if cpu else "not run"),
        ],
        columns=["mode", "chapter's claim", "analytic at the chapter's scale", "measured here"],
        rows=rows,
        notes=notes,
        plot=lambda path: _plot_precision(results, path),
    )


def _gpu_count(n: int | None) -> str:
    if n is None:
        return "none up to the planner's limit"
    power = est.smallest_power_of_two(n)
    return f"{n}" + ("" if power == n else f" (the smallest power of two that fits: {power})")


def _fraction_pct(name: str) -> str:
    return f"{getattr(est.Assumptions(), name):.0%}"


def _precision_measured(mode: str, measured: Measured) -> str:
    gpu = measured.gpu.get("precision")
    cpu = measured.precision
    if mode == "fp8":
        return f"{NEEDS_GPU} (Transformer Engine on Hopper/Ada)"
    variant = PRECISION_MEASURED_VARIANT[mode]
    cells = []
    for result in (cpu, gpu):
        if result is None or variant not in result["speed_vs_fp32"]:
            continue
        cells.append(
            f"{result['speed_vs_fp32'][variant]:.2f}× fp32 speed, saved activations "
            f"{result['saved_vs_fp32'][variant]:.2f}× fp32 ({result['hardware']})"
        )
    if gpu is None:
        cells.append(f"GPU: {NEEDS_GPU}")
    return "; ".join(cells)


def _plot_precision(results: dict, path: Path) -> None:
    fig, (ax_peak, ax_mem) = new_figure(ncols=2, width=5.5)
    labels = list(results)
    chapter = [float(CHAPTER_PRECISION[label][1].strip("~")) for label in labels]
    peaks = [_mode_peak(CHAPTER_PRECISION[label][0])[0] for label in labels]
    xs = range(len(labels))
    ax_peak.bar([x - 0.2 for x in xs], chapter, 0.4, label="chapter 'TFLOPS'")
    ax_peak.bar([x + 0.2 for x in xs], peaks, 0.4, label="H100 dense datasheet peak")
    ax_peak.set_xticks(list(xs), labels, rotation=25, ha="right")
    ax_peak.set_ylabel("TFLOP/s per GPU")
    ax_peak.legend()
    ax_mem.bar(list(xs), [results[label].memory.total / GIB for label in labels], color="tab:red")
    ax_mem.axhline(80, color="black", linestyle="--", label="80 GiB HBM")
    ax_mem.set_xticks(list(xs), labels, rotation=25, ha="right")
    ax_mem.set_ylabel("GiB per GPU (FSDP over 8, analytic)")
    ax_mem.set_title("GPT-3 175B on 8× H100: does not fit")
    ax_mem.legend()
    save_figure(fig, path)


# --------------------------------------------------------------------------- 8.2 activation recompute

CHAPTER_RECOMPUTE = {
    "none": ("~80 GB", "0%"),
    "selective": ("~40 GB", "~5%"),
    "full": ("~15 GB", "~33%"),
    "offload": ("~10 GB GPU", "0% + PCIe"),
    "op_selective": ("—", "—"),
    "every_k": ("—", "—"),
}


def recompute_table(measured: Measured) -> Table:
    p70 = est.preset("70b")
    cfg, s, b = p70.model, p70.seq_len, p70.micro_batch
    h100 = DEVICES["H100"]
    L = cfg.n_layer
    model_flops = est.flops_per_token(cfg, s)
    analytic, with_tp = {}, {}
    rows = []
    for policy, (claim_mem, claim_cost) in CHAPTER_RECOMPUTE.items():
        per_layer = est.activation_bytes_per_layer(cfg, s, b, policy, attention="materialized")
        flash = est.activation_bytes_per_layer(cfg, s, b, policy, attention="flash")
        with_tp[policy] = L * per_layer_tp_sp(cfg, s, b, policy)
        overhead = est.recompute_flops_per_token(cfg, s, policy) / model_flops
        analytic[policy] = L * per_layer
        if policy == "offload":
            host = L * est.activation_bytes_per_layer(cfg, s, b, "none", attention="materialized")
            job = est.JobSpec(cfg, s, b, 64, "fsdp", "offload", "bf16_master", h100)
            result = est.estimate(job)
            cost = (
                f"0 FLOPs; {gib(host)} to host and back over PCIe ≈ {result.time.offload_s:.0f} s/step vs "
                f"{result.time.compute_s:.0f} s compute; host has ~{h100.host_mem_gib:g} GiB per GPU"
            )
            mem = f"~0 saved on GPU (+1 layer in flight, {gib(per_layer_none(cfg, s, b))}); {gib(host)} on host"
        else:
            cost = f"{overhead:.1%} extra FLOPs" + (" (element-wise only; memory-bound)" if policy == "op_selective" else "")
            mem = f"{gib(L * per_layer)} ({gib(per_layer)}/layer); flash/SDPA: {gib(L * flash)}"
        rows.append([policy, f"{claim_mem}, {claim_cost}", mem, _tp_sp_cell(cfg, s, b, policy), cost,
                     _recompute_measured(policy, measured)])
    share_chapter = 2 * 4096 / (2 * 4096 + 4 * 4096)
    attn_term = 5 * cfg.n_head * s / cfg.d_model
    notes = [
        f"Korthikanti et al. 2022 per-layer formulas (16-bit activations, 1-byte dropout masks): none = "
        f"s·b·h·(34 + 5·a·s/h), selective = 34·s·b·h, full = 2·s·b·h. At h={cfg.d_model}, a={cfg.n_head}, "
        f"s={s}, b={b}, {L} layers: {gib(analytic['none'])} / {gib(analytic['selective'])} / "
        f"{gib(analytic['full'])}, not 80 / 40 / 15 GB. The chapter's figures are off by 24× for no recompute.",
        f"The chapter's attention-share formula 2s/(2s+4h) gives {share_chapter:.0%} at s=h=4096, not 50%, and "
        f"ignores the head count the s² term scales with. Korthikanti's share is (5as/h)/(34+5as/h) = "
        f"{attn_term / (34 + attn_term):.0%} at this config, which is why selective recompute saves so much when "
        "the scores are stored; with FlashAttention/SDPA they never are, and selective ≈ none "
        "(compare the flash/SDPA figures and the measured sdpa rows).",
        "Selective recompute costs one extra attention-core forward (QKᵀ and ·V), a few percent; full recompute "
        "one extra forward of every layer, ~33% of model FLOPs, in line with the chapter. The √n memory claim "
        "belongs to segment checkpointing (Chen et al. 2016), not per-layer recompute.",
        _tp_sp_note(cfg, s, b),
        _planner_note(p70),
        "Offloading is not '0% + PCIe': hundreds of GiB per GPU per step cross PCIe on the compute stream "
        "(torch.autograd.graph.save_on_cpu does not overlap), and a node lacks the host memory to hold them.",
        "Measured here: bytes autograd saves per block (tools/bench_memory.py, counted once per storage) next to "
        "analysis.estimator.saved_bytes_per_layer, our model's exact analytic count; time is forward+backward "
        "relative to none in the same run (CPU timings are noisy on a shared machine). On a CPU, offload "
        "copies host memory to host memory, so its time says nothing about PCIe.",
    ]
    rec = measured.recompute
    return Table(
        name="activation_recompute",
        title="8.2 Activation recompute (chapter: 70B, seq_len 4096, batch 4)",
        setup=[
            "chapter: the 8.2 'memory savings estimate' table (70B model, s=4096, b=4)",
            f"analytic: Korthikanti et al. 2022 at h={cfg.d_model}, a={cfg.n_head}, L={L}, s={s}, b={b}, "
            "16-bit activations, dropout (materialized scores, as in the paper), and the same with flash/SDPA; "
            f"per GPU with tensor parallelism t={TP_COLUMN} + sequence parallelism (section 4.2.2)",
            "measured here: " + (f"{rec['setup']} on {_where(rec)}" if rec else "tools/bench_memory.py not available"),
        ],
        columns=["policy", "chapter's claim", "analytic at the chapter's scale",
                 f"analytic per GPU, t={TP_COLUMN} + SP", "recompute cost (analytic)", "measured here"],
        rows=rows,
        notes=notes,
        plot=lambda path: _plot_recompute(analytic, with_tp, path),
    )


TP_COLUMN = 8  # one node of tensor parallelism, the paper's t


def per_layer_tp_sp(cfg, s, b, policy: str, tp: int = TP_COLUMN) -> float:
    return est.activation_bytes_per_layer(cfg, s, b, policy, attention="materialized", tp=tp, sequence_parallel=True)


def _tp_sp_cell(cfg, s, b, policy: str) -> str:
    L = cfg.n_layer
    if policy == "offload":
        host = L * per_layer_tp_sp(cfg, s, b, "none")
        return f"~0 on GPU (+1 layer in flight, {gib(host / L)}); {gib(host)} on host"
    per_layer = per_layer_tp_sp(cfg, s, b, policy)
    return f"{gib(L * per_layer)} ({gib(per_layer)}/layer)"


def _tp_sp_note(cfg, s, b) -> str:
    L, t = cfg.n_layer, TP_COLUMN
    tp_only = {p: L * est.activation_bytes_per_layer(cfg, s, b, p, attention="materialized", tp=t)
               for p in ("none", "selective")}
    return (
        f"With tensor parallelism over t={t} GPUs (Korthikanti et al. 2022, 4.2.1) only the attention and MLP "
        f"internals are split: s·b·h·(10 + 24/t + 5·a·s/(h·t)) per layer, {gib(tp_only['none'])} per GPU without "
        f"recompute and {gib(tp_only['selective'])} with selective; the 10·s·b·h of norm inputs, matmul inputs and "
        f"dropout masks stays whole on every GPU. Sequence parallelism (4.2.2) splits those along the sequence, "
        f"so everything is divided by t: s·b·h·(34 + 5·a·s/h)/t, and 34·s·b·h/t = "
        f"{gib(L * per_layer_tp_sp(cfg, s, b, 'selective'))} with selective recompute (the column above)."
    )


def _planner_note(p70) -> str:
    h100 = DEVICES["H100"]
    global_batch = p70.micro_batch * p70.world_size
    plans = est.plan_layouts(p70.model, p70.seq_len, p70.world_size, h100, global_batch=global_batch, top=1)
    data_parallel = sorted({plan.job.policy for plan in est.plan_fits(p70.model, p70.seq_len, p70.world_size, h100, top=None)})
    if not plans:
        return f"The planner finds no layout that fits on {p70.world_size}× H100 at {global_batch} sequences per step."
    # The preset keeps Korthikanti's dropout; the trainer's tensor parallelism trains without it.
    no_dropout = dataclasses.replace(p70.model, dropout=0.0)
    tp_plans = est.plan_layouts(no_dropout, p70.seq_len, p70.world_size, h100, global_batch=global_batch, top=1)
    tp_note = (f" The preset trains with dropout, which the trainer's tensor parallelism refuses, so no tp layout "
               f"is proposed for it; without dropout the cheapest is {est.describe_plan(tp_plans[0])}."
               if tp_plans else "")
    return (
        f"On {p70.world_size}× H100 at the chapter's {p70.micro_batch} sequences per GPU ({global_batch} per step), "
        f"data parallelism alone fits only with recompute={' or '.join(data_parallel) or 'nothing'}; the planner "
        f"(tools/estimate.py --preset 70b --plan) searches tensor, sequence and pipeline parallelism too, and its "
        f"cheapest layout is {est.describe_plan(plans[0])}.{tp_note}"
    )


def per_layer_none(cfg, s, b) -> float:
    return est.activation_bytes_per_layer(cfg, s, b, "none", attention="materialized")


def _recompute_measured(policy: str, measured: Measured) -> str:
    rec = measured.recompute
    if rec is None:
        return "run tools/bench_memory.py (not available)"
    cfg = rec.get("model_cfg")  # the measured model, for the exact analytic count
    cells = []
    gpu = measured.gpu.get("recompute")
    if gpu is not None and gpu["rows"] is not rec["rows"]:  # GPU figures from an earlier GPU run
        for row in gpu["rows"]:
            if row["policy"] == policy and row.get("device_peak_bytes") is not None:
                cells.append(
                    f"GPU {row['attention']}: peak {human_bytes(row['device_peak_bytes'])}, time "
                    f"{row['overhead']:.2f}× none ({_where(gpu)})"
                )
    for row in rec["rows"]:
        if row["policy"] != policy:
            continue
        saved = row["offloaded_bytes"] / row["n_layer"] if policy == "offload" else row["per_layer_bytes"]
        what = "offloaded" if policy == "offload" else "saved"
        exact = ""
        if cfg is not None:
            analytic = est.saved_bytes_per_layer(
                cfg, row["seq_len"], row["micro_batch"], policy, 2 if row["dtype"] == "bfloat16" else 4,
                attention=row["attention"], device=rec.get("device", "cpu"),
            )
            exact = f" (analytic {human_bytes(analytic)})"
        cells.append(f"{row['attention']}: {human_bytes(saved)}/block {what}{exact}, time {row['overhead']:.2f}× none")
    return "; ".join(cells)


def _plot_recompute(analytic: dict, with_tp: dict, path: Path) -> None:
    fig, ax = new_figure(width=7)
    chapter = {"none": 80, "selective": 40, "full": 15, "offload": 10}
    labels = ["none", "selective", "full", "offload"]
    xs = range(len(labels))
    ax.bar([x - 0.27 for x in xs], [chapter[k] for k in labels], 0.27, label="chapter (GB)")
    ours = [max(analytic[k] / GIB, 1e-1) for k in labels]
    ax.bar(list(xs), ours, 0.27, label="Korthikanti 2022 (GiB, offload: on GPU ~0)")
    split = [max(with_tp[k] / GIB, 1e-1) for k in labels]
    ax.bar([x + 0.27 for x in xs], split, 0.27, label=f"per GPU with t={TP_COLUMN} + SP (GiB)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("activation memory, 70B, s=4096, b=4")
    ax.legend()
    save_figure(fig, path)


# --------------------------------------------------------------------------- 8.5 attention


CHAPTER_ATTENTION = {"seq_len": 8192, "batch": 4, "head_dim": 128, "device": "A100", "standard_gb": 12.4,
                     "flash_gb": 0.8, "standard_ms": 42.0, "flash_ms": 11.0}


def attention_memory(seq_len: int, batch: int, head_dim: int, heads: int, dtype_bytes: int = 2) -> dict[str, float]:
    """One s x s score matrix vs what flash attention keeps (q, k, v, output and a fp32 log-sum-exp)."""
    return {
        "standard": dtype_bytes * seq_len * seq_len * batch * heads,
        "flash": (4 * dtype_bytes * seq_len * head_dim + 4 * seq_len) * batch * heads,
    }


def attention_table(measured: Measured) -> Table:
    c = CHAPTER_ATTENTION
    s, b, d = c["seq_len"], c["batch"], c["head_dim"]
    a100 = DEVICES["A100"]
    per_head = attention_memory(s, b, d, 1)
    implied_heads = c["standard_gb"] * 1e9 / per_head["standard"]
    heads = round(implied_heads)
    at_heads = attention_memory(s, b, d, heads)
    forward_flops = 4 * s * s * d * b * heads  # QK^T and @V, no causal skipping
    causal_train_flops = 3.5 * forward_flops / 2  # causal flash skips half; backward ~2.5x forward
    peak = a100.bf16_tflops * 1e12
    att = measured.attention
    gpu = measured.gpu.get("attention")
    rows = [
        [
            "memory, standard",
            f"{c['standard_gb']} GB",
            f"{human_bytes(per_head['standard'])} per head per s×s bf16 matrix; {c['standard_gb']} GB implies "
            f"{implied_heads:.1f} heads (head count unstated)",
            _attention_measured(att, "reference"),
        ],
        [
            "memory, flash",
            f"{c['flash_gb']} GB",
            f"{human_bytes(per_head['flash'])} per head (q, k, v, out, fp32 lse); {human_bytes(at_heads['flash'])} "
            f"at {heads} heads",
            _attention_measured(att, "sdpa"),
        ],
        [
            "memory ratio",
            "15.5×",
            f"s/(4·d) = {s / (4 * d):g}× (exactly {per_head['standard'] / per_head['flash']:.1f}× with the lse)",
            f"{att['saved_ratio']:.1f}× saved for backward ({att['setup']}; {att['hardware']})" if att else "not run",
        ],
        [
            "time, standard / flash",
            f"{c['standard_ms']:g} ms / {c['flash_ms']:g} ms (3.8×)",
            f"at {heads} heads: forward alone is {forward_flops / 1e12:.2f} TFLOP = {forward_flops / peak * 1e3:.1f} ms "
            f"at 100% of A100's {a100.bf16_tflops:g} TFLOP/s; causal forward+backward ≥ "
            f"{causal_train_flops / peak * 1e3:.1f} ms",
            _attention_time(gpu),
        ],
    ]
    notes = [
        "The chapter's example states neither the head count nor whether it times forward only or forward + "
        "backward; the 15.5× memory ratio is just s/(4d) for one s×s matrix vs q, k, v and the output, "
        "whatever the head count. Report it as unsourced.",
        f"11 ms is only possible forward-only: at the {heads} heads the 12.4 GB implies, even causal forward + "
        f"backward needs ≥ {causal_train_flops / peak * 1e3:.0f} ms at 100% of the A100's dense BF16 peak.",
        "FlashAttention's memory is O(s) per head instead of O(s²); its FLOPs are the same (more in backward, which "
        "recomputes the scores); the speed-up comes from not writing the s×s matrix to HBM and is a GPU "
        "measurement. FlashAttention-2 is by Tri Dao alone (2023), not 'Dao & Guo'.",
    ]
    return Table(
        name="attention",
        title="8.5 Standard vs flash attention (chapter: seq_len 8192, batch 4, d_head 128, A100 80GB)",
        setup=[
            "chapter: the 8.5 comment under its FlashAttention example",
            "analytic: bytes of one bf16 s×s score matrix vs flash's q, k, v, output and log-sum-exp; "
            "attention FLOPs 4·s²·d per head and sequence (forward, no causal skipping)",
            "measured here: " + (f"bytes saved for backward by model.attention's reference and sdpa cores, "
                                 f"{att['setup']} on {_where(att)}" if att else "not run"),
        ],
        columns=["quantity", "chapter's claim", "analytic at the chapter's scale", "measured here"],
        rows=rows,
        notes=notes,
        plot=lambda path: _plot_attention(s, b, d, path),
    )


def _attention_measured(att: dict | None, backend: str) -> str:
    if att is None:
        return "not run"
    return f"{human_bytes(att['saved_bytes'][backend])} saved ({backend}, {att['setup']})"


def _attention_time(gpu: dict | None) -> str:
    if gpu is None or "seconds" not in gpu:
        return NEEDS_GPU
    sec = gpu["seconds"]
    return (
        f"{sec['reference'] * 1e3:.2f} ms / {sec['sdpa'] * 1e3:.2f} ms ({gpu['speedup']:.1f}×), forward+backward, "
        f"{gpu['setup']} on {_where(gpu)}"
    )


def _plot_attention(s_max: int, b: int, d: int, path: Path) -> None:
    fig, ax = new_figure(width=6)
    lengths = [2**k for k in range(9, int(math.log2(s_max)) + 3)]
    standard = [attention_memory(s, b, d, 1)["standard"] / 2**20 for s in lengths]
    flash = [attention_memory(s, b, d, 1)["flash"] / 2**20 for s in lengths]
    ax.loglog(lengths, standard, marker="o", label="standard: s×s scores (bf16)")
    ax.loglog(lengths, flash, marker="o", label="flash: q, k, v, out, lse")
    ax.set_xlabel("sequence length")
    ax.set_ylabel(f"MiB per head (batch {b}, d_head {d})")
    ax.legend()
    save_figure(fig, path)


# --------------------------------------------------------------------------- 8.4 data formats

CHAPTER_DATA = [
    ("CSV/JSON", "sequential parsing", "small data, prototypes", "✅",
     "only with a separate line-offset index; every read parses text (4-6 bytes per token id as text)", "naive"),
    ("TFRecord", "sequential read", "TensorFlow ecosystem", "❌",
     "correct without an index file; length-prefixed, CRC'd records", None),
    ("HDF5", "mmap", "scientific computing", "✅",
     "random access yes, but reads go through libhdf5's chunk cache; only contiguous uncompressed datasets "
     "can be mmapped", None),
    ("Parquet", "columnar read", "structured data", "✅",
     "at row-group granularity: a read decodes (decompresses) a whole page/row group", None),
    ("WebDataset (TAR)", "sequential streaming", "⭐ large-scale training", "❌ (but shardable)",
     "correct: 512-byte tar headers per member; shuffle = shard order + buffer; needs node and worker "
     "splitting", "webdataset"),
    ("MMAP Binary", "memory mapping", "⭐ low-latency random access", "✅",
     "correct: a window is a slice, 2 bytes/token (uint16), no parsing; perfgpt's default format", "mmap"),
]
NOT_BENCHMARKED = {
    "TFRecord": "not a perfgpt format (no reader)",
    "HDF5": "not a perfgpt format (no reader)",
    "Parquet": "input only: tools/prepare_data.py reads it into token shards",
}


def bench_data_rows(document: dict) -> dict[str, list[str]]:
    """{format: ['tokens/s ... (workers w, batch b)', ...]} from tools/bench_data.py's loader rows."""
    found: dict[str, list[str]] = {}
    for row in document["rows"]:
        found.setdefault(row["format"], []).append(
            f"{row['tokens_per_s']:,.0f} tokens/s (workers {row['workers']}, batch {row['batch']})"
        )
    return found


def data_formats_table(measured: Measured) -> Table:
    bench = bench_data_rows(measured.data_bench) if measured.data_bench else {}
    rows = []
    for fmt, mode, use, ra, analysis, bench_name in CHAPTER_DATA:
        if fmt in NOT_BENCHMARKED:
            cell = NOT_BENCHMARKED[fmt]
        elif bench_name in bench:
            label = "raw text tokenized on the fly: " if bench_name == "naive" else ""
            cell = label + "; ".join(bench[bench_name])
        else:
            cell = "run tools/bench_data.py"
        rows.append([fmt, f"{mode}; {use}; random access {ra}", analysis, cell])
    notes = [
        "'CSV/JSON: random access ✅' is wrong: text records have variable length, so random access needs an offset "
        "index built by a full scan, and each read parses text. HDF5's access path is its chunked I/O library, "
        "not mmap.",
        "For GPT pre-training the data should be tokenized once, offline, into integer shards: the mmap format "
        "then costs 2 bytes/token and a slice per sample; tar shards suit streaming from object storage.",
        "Loader throughput only matters relative to what the model consumes; tools/bench_data.py reports both "
        f"(see {DATA_FORMATS_MEASURED_NAME}). With the byte tokenizer, tokenizing raw text on the fly costs "
        "almost nothing; a BPE tokenizer (bench_data's default) is the realistic case for the naive path.",
    ]
    return Table(
        name="data_formats",
        title="8.4 Data formats",
        setup=[
            "chapter: the 8.4 'efficient data formats' table",
            "analytic: what each format's layout implies for random access of token windows",
            "measured here: " + (f"tools/bench_data.py on this machine: {_bench_data_setup(measured.data_bench)} "
                                 f"(full table in {DATA_FORMATS_MEASURED_NAME})"
                                 if bench else "not run (python -m tools.reproduce runs it)"),
        ],
        columns=["format", "chapter's claim", "analysis", "measured here"],
        rows=rows,
        notes=notes,
    )


DATA_FORMATS_MEASURED_NAME = "data_formats_measured.md"


def _bench_data_setup(document: dict) -> str:
    return f"Loader throughput ({document.get('setting', 'settings not recorded')})"


# --------------------------------------------------------------------------- 8.3 communication

# analysis/comm_model.py's stated latency assumptions (the chapter gives none).
NVLINK_STEP_US, NETWORK_STEP_US = 1.0, 5.0
BUCKET_BYTES = 25e6  # one DDP bucket (PyTorch's default bucket_cap_mb=25)


def _topology(nodes: int, gpus_per_node: int = 8):
    h100, eff = DEVICES["H100"], est.Assumptions().link_fraction
    return cm.Topology(
        gpus_per_node, nodes, h100.nvlink_one_way_gb_s * eff, h100.network_gb_s * eff, NVLINK_STEP_US, NETWORK_STEP_US
    )


def communication_table(measured: Measured) -> Table:
    h100 = DEVICES["H100"]
    top = _topology(nodes=8)
    grads = 2 * est.count_parameters(est.preset("llama2-7b").model)  # bf16 gradients
    bucket = {c.algorithm: c for c in cm.all_algorithms(top, BUCKET_BYTES)}
    rows = []
    claims = {
        "flat ring": "'63 steps to go round the ring'",
        "leader-based (chapter)": "intra-node NVLink 900 GB/s, inter-node IB 100 GB/s, leaders only",
    }
    for cost in cm.all_algorithms(top, grads):
        small = bucket[cost.algorithm]
        rows.append([
            cost.algorithm,
            claims.get(cost.algorithm, "—"),
            f"{cost.steps} steps; {human_bytes(cost.inter_bytes_per_gpu)} per busy NIC ({cost.nics_per_node} of "
            f"{top.gpus_per_node} per node); 7B grads {cost.total_s * 1e3:.0f} ms; 25 MB bucket "
            f"{small.total_s * 1e3:.2f} ms (latency {small.latency_s * 1e3:.2f} ms)",
            "checked equal to a flat all-reduce on gloo, 2 nodes × 2 ranks (tests/unit/parallel/test_hierarchical_comm.py); time needs a multi-node "
            "GPU cluster" if cost.algorithm.startswith("two-level") else "needs a multi-node GPU cluster",
        ])
    notes = [
        f"Setup: all-reduce of Llama-2-7B bf16 gradients ({human_bytes(grads)}) and of one 25 MB DDP bucket over "
        f"8 nodes × 8 H100: NVLink {h100.nvlink_one_way_gb_s:g} GB/s one way (the '900 GB/s' is the bidirectional "
        f"total), one {h100.network_gb_s:g} GB/s NDR NIC per GPU (the chapter draws 100 GB/s), both at 80% of peak; "
        f"{NVLINK_STEP_US:g} µs per NVLink step and {NETWORK_STEP_US:g} µs per network step (assumed). Model: "
        "analysis/comm_model.py (alpha-beta), also as tools/comm_model.py.",
        "A flat ring over 64 GPUs takes 2·63 = 126 steps (reduce-scatter then all-gather), not 63; its bandwidth "
        "term barely grows with the GPU count, only its latency term does.",
        "The chapter's leader-only scheme pushes the whole tensor through one NIC per node while seven sit idle; "
        "the correct two-level algorithm (parallel/comm.py) keeps all eight busy. NCCL is already topology-aware "
        "(its rings use every NIC, the 'xL' row), and the NCCL_*_CONNECTIVITY variables the chapter sets do not exist.",
    ]
    return Table(
        name="communication",
        title="8.3 Communication: flat vs hierarchical all-reduce (64 GPUs = 8 nodes × 8)",
        setup=[
            "chapter: the 8.3 diagram and hierarchical_all_reduce code",
            "analytic: alpha-beta model of one all-reduce on 8× DGX H100 (analysis/comm_model.py)",
            "measured here: correctness on gloo (CPU); bandwidth needs a multi-node GPU cluster",
        ],
        columns=["scheme", "chapter's claim", "analytic at the chapter's scale", "measured here"],
        rows=rows,
        notes=notes,
        plot=lambda path: _plot_comm(grads, path),
    )


def _plot_comm(nbytes: float, path: Path) -> None:
    fig, ax = new_figure(width=6.5)
    nodes = [2, 4, 8, 16, 32, 64]
    series: dict[str, list[float]] = {}
    for n in nodes:
        for cost in cm.all_algorithms(_topology(n), nbytes):
            series.setdefault(cost.algorithm, []).append(cost.total_s * 1e3)
    for name, times in series.items():
        ax.plot([8 * n for n in nodes], times, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (8 per node)")
    ax.set_ylabel("ms per all-reduce of 7B bf16 gradients")
    ax.legend(fontsize=8)
    save_figure(fig, path)


# --------------------------------------------------------------------------- summary: the priority table


def priority_table(measured: Measured) -> Table:
    h100 = DEVICES["H100"]
    llama = est.preset("llama2-7b")
    p70 = est.preset("70b")
    cfg70, s70, b70 = p70.model, p70.seq_len, p70.micro_batch

    def job(**kw):
        base = dict(model=llama.model, seq_len=llama.seq_len, micro_batch=1, world_size=64, strategy="fsdp",
                    policy="none", precision="bf16_master", device=h100)
        base.update(kw)
        return est.estimate(est.JobSpec(**base))

    fp32, bf16 = job(precision="fp32"), job(precision="bf16_master")
    fp8 = job(precision="fp8")
    ddp = job(strategy="ddp", world_size=8)
    zero3 = job(strategy="fsdp", world_size=8)
    none70 = est.activation_bytes_per_layer(cfg70, s70, b70, "none")
    sel70 = est.activation_bytes_per_layer(cfg70, s70, b70, "selective")
    full70 = est.activation_bytes_per_layer(cfg70, s70, b70, "full")
    zero2_64 = job(strategy="zero2", world_size=64)  # DDP's 2Ψ traffic; DDP itself does not fit (16Ψ)
    t = zero2_64.time
    serial_step = t.compute_s + t.comm_s + t.offload_s + t.memory_bound_s
    att, rec = measured.attention, measured.recompute
    rows = [
        ["1", "BF16 mixed precision", "2× throughput, 50% memory",
         f"{h100.bf16_tflops / h100.tf32_tflops:.1f}× peak vs TF32, {h100.bf16_tflops / h100.fp32_tflops:.0f}× vs plain "
         f"FP32; predicted {fp32.time.step_s / bf16.time.step_s:.1f}× (7B, 64× H100); memory "
         f"{bf16.memory.total / fp32.memory.total:.0%} of fp32 (states unchanged at 16 B/param)",
         _precision_measured("bf16", measured)],
        ["2", "FlashAttention", "3-4× attention speed",
         "memory s/(4d) less per head (16× at s=8192, d=128); same FLOPs; speed is an HBM-traffic effect",
         (f"{att['saved_ratio']:.1f}× fewer bytes saved ({att['hardware']}); time: "
          f"{_attention_time(measured.gpu.get('attention'))}" if att else NEEDS_GPU)],
        ["3", "FSDP / ZeRO", "large memory reduction",
         f"7B on 8 GPUs: model states {gib(ddp.memory.states)} (DDP) → {gib(zero3.memory.states)} (FSDP) per GPU; "
         f"comm 2Ψ → 3Ψ per step",
         _sharding_measured(measured.documents.get(PARALLEL_CPU))],
        ["4", "activation recompute", "50%+ activation memory",
         f"70B: selective −{1 - sel70 / none70:.0%} (stored scores), full −{1 - full70 / none70:.0%}; "
         "with flash/SDPA selective ≈ 0%",
         _recompute_summary(rec)],
        ["5", "DataLoader tuning", "removes the data bottleneck",
         "workload-dependent: the trainer logs the fraction of step time spent waiting for data",
         "run tools/bench_data.py" if not measured.data_bench else f"see {DATA_FORMATS_MEASURED_NAME}"],
        ["6", "communication overlap", "10-20% throughput",
         f"7B, ZeRO-2 on 64 GPUs (DDP's 2Ψ traffic), micro-batch 1: {t.comm_s * 1e3:.0f} ms of gradient "
         "reduce-scatter + all-gather hidden behind "
         f"{t.compute_s * 1e3:.0f} ms of compute: step {serial_step:.2f} s → {t.step_s:.2f} s "
         f"(+{serial_step / t.step_s - 1:.0%} throughput); the gain is whatever comm was exposed",
         NEEDS_GPU],
        ["7", "torch.compile", "10-30% compute", "workload-dependent expectation; no analytic figure",
         _compile_measured(measured.documents.get(BENCH_TRAIN_CPU))],
        ["8", "FP8 training", "another 2× throughput",
         f"2.0× peak ({h100.fp8_tflops:g} vs {h100.bf16_tflops:g}); predicted "
         f"{bf16.time.step_s / fp8.time.step_s:.2f}× end to end at the estimator's fitted GEMM rates "
         f"({_fraction_pct('fp8_gemm_fraction')} of the FP8 peak, {_fraction_pct('gemm_fraction_hopper')} of the "
         "BF16 one, times the shape factor)",
         f"{NEEDS_GPU} (Transformer Engine)"],
        ["9", "custom Triton kernels", "5-20% compute", "workload-dependent expectation; no analytic figure",
         NEEDS_GPU],
    ]
    notes = [
        f"'BF16 2×' holds against TF32, not against plain FP32 ({h100.bf16_tflops / h100.fp32_tflops:.1f}× by "
        "peak); AMP does not halve model states.",
        "'FP8 another 2×' is the ratio of peaks, not an end-to-end gain.",
        "Compile and overlap percentages are expectations that depend on the workload, not results"
        + (f"; the compile figure measured here is a tiny model on a CPU ({BENCH_TRAIN_CPU}) and says nothing "
           "about a GPU." if BENCH_TRAIN_CPU in measured.documents else "."),
        "Every 'measured here' cell is this run's measurement or a figure read from the named file in "
        "docs/results/ when this table was generated.",
    ]
    return Table(
        name="priority",
        title="Summary: the chapter's optimization priority table",
        setup=[
            "chapter: the closing priority table",
            "analytic: analysis/estimator.py for Llama-2-7B on 64× H100 (FSDP, micro-batch 1, s=4096) unless stated",
            f"measured here: this run's small-model measurements (the other tables) and the measured files "
            f"{', '.join(MEASURED_FILES)} of docs/results/, named in each cell",
        ],
        columns=["#", "technique", "chapter's claim", "analytic", "measured here"],
        rows=rows,
        notes=notes,
    )


def _compile_measured(bench_train: dict | None) -> str:
    """torch.compile's speed-up from tools/bench_train.py's rows: each compiled variant against the
    same variant without compile, from the same run."""
    if not bench_train:
        return f"{NOT_MEASURED} ({BENCH_TRAIN_CPU} not found); GPU: {NEEDS_GPU}"
    rows = {row["variant"]: row for row in bench_train["rows"]}
    cells = []
    for variant, row in rows.items():
        words = variant.split()
        if "train.compile=true" not in words:
            continue
        eager = rows.get(" ".join(w for w in words if w != "train.compile=true"))
        if eager is None or row.get("status") != "ok" or eager.get("status") != "ok":
            continue
        if row.get("rounds_s") and eager.get("rounds_s"):  # interleaved rounds: the ratio per round, and its spread
            r = speedup(row["rounds_s"], eager["rounds_s"])
            verdict = "" if r.measured_difference else f": {NO_DIFFERENCE}"
            cells.append(f"{r.median:.2f}× ({r.min:.2f}-{r.max:.2f}) tokens/s for {variant} vs without compile{verdict}")
            continue
        ratio = row["tokens_per_s"] / eager["tokens_per_s"]
        cells.append(f"{ratio:.2f}× tokens/s for {variant} vs without compile")
    if not cells:
        return f"{NOT_MEASURED} (no compiled variant with an eager twin in {BENCH_TRAIN_CPU}); GPU: {NEEDS_GPU}"
    return "; ".join(cells) + f" ({BENCH_TRAIN_CPU}: {bench_train['title']}); GPU: {NEEDS_GPU}"


def _state_bytes(row: dict) -> float:
    return sum(row["measured"][k] for k in ("params", "grads", "optimizer"))


def _sharding_measured(parallel: dict | None) -> str:
    """Per-rank model-state bytes of FSDP vs DDP from tools/bench_parallel.py's rows."""
    if not parallel:
        return f"{NOT_MEASURED} ({PARALLEL_CPU} not found); GPU memory: {NEEDS_GPU}"
    rows = {row["strategy"]: row for row in parallel["rows"] if row["status"] == "ok"}
    ddp, fsdp = rows.get("ddp"), rows.get("fsdp")
    if ddp is None or fsdp is None:
        return f"{NOT_MEASURED} (no ddp and fsdp rows in {PARALLEL_CPU}); GPU memory: {NEEDS_GPU}"
    return (
        f"model states per rank {_state_bytes(fsdp) / 1024:,.0f} KiB (fsdp) vs {_state_bytes(ddp) / 1024:,.0f} KiB "
        f"(ddp), {_state_bytes(fsdp) / _state_bytes(ddp):.2f}×, loss vs one process {fsdp['delta']:+.1e} "
        f"({PARALLEL_CPU}: {parallel['title']}); GPU memory: {NEEDS_GPU}"
    )


def _recompute_summary(rec: dict | None) -> str:
    if rec is None:
        return "run tools/bench_memory.py"
    parts = []
    for attention in ("reference", "sdpa"):
        by_policy = {r["policy"]: r for r in rec["rows"] if r["attention"] == attention}
        if "none" in by_policy and "full" in by_policy and "selective" in by_policy:
            none = by_policy["none"]["per_layer_bytes"]
            parts.append(
                f"{attention}: selective −{1 - by_policy['selective']['per_layer_bytes'] / none:.0%}, "
                f"full −{1 - by_policy['full']['per_layer_bytes'] / none:.0%} per block"
            )
    return "; ".join(parts) + f" ({rec['hardware']})"


TABLE_BUILDERS = (formats_table, precision_table, recompute_table, attention_table, data_formats_table,
                  communication_table, priority_table)


def build_tables(measured: Measured) -> list[Table]:
    return [builder(measured) for builder in TABLE_BUILDERS]
