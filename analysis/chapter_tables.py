"""The chapter's tables, reproduced: its claim | our analytic figure at its scale | measured here.

What the tables say lives in ``analysis/chapter_tables.yaml``: each table's title, setup lines,
columns and verdict notes, the chapter's claims quoted as printed (translated), and the templates of
the cells. Each ``*_table`` function here computes the figures those templates name, from
``analysis/estimator/`` and ``common/hardware.py`` (analytic) and from the measurements of this
run (``Measured``), and ``render`` fills them into a ``report.Table``. Verdicts say why a claim is
wrong where it is, and docs/chapter_corrections.md lists each correction with the tests that
establish it. A "measured here" cell holds either a measurement of this run or a figure read, at
generation time, from a measured file under docs/results/ (named in the cell); otherwise it says
what is missing. No cell quotes a figure from anywhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from analysis import comm_model as cm
from analysis import estimator as est
from common.hardware import DEVICES
from common.measure import NO_DIFFERENCE, speedup
from common.report import GIB, NEEDS_GPU, Table, gib, human_bytes, new_figure, save_figure, sci

TEXT = yaml.safe_load(Path(__file__).with_suffix(".yaml").read_text(encoding="utf-8"))


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
DATA_FORMATS_MEASURED_NAME = "data_formats_measured.md"  # tools/bench_data.py, run by tools/reproduce.py
MEASURED_FILES = (BENCH_TRAIN_CPU, PARALLEL_CPU)
NOT_MEASURED = "not measured"


# --------------------------------------------------------------------------- the renderer


def fill(template: str, values: dict) -> str:
    """A template of chapter_tables.yaml with its named figures filled in."""
    return template.format(**values)


def _shown(entries: list, values: dict) -> list[str]:
    """Setup lines or notes: a plain entry always, a {text, when|unless} entry when its figure says so."""
    lines = []
    for entry in entries:
        if isinstance(entry, dict):
            if ("when" in entry and not values[entry["when"]]) or ("unless" in entry and values[entry["unless"]]):
                continue
            entry = entry["text"]
        lines.append(fill(entry, values))
    return lines


def render(name: str, values: dict, rows: list[list[str]] | None = None, plot=None) -> Table:
    """Table ``name`` of chapter_tables.yaml: its title, setup, columns and notes filled with ``values``;
    ``rows`` as given, or the table's own row templates filled."""
    spec = TEXT[name]
    if rows is None:
        rows = [[fill(cell, values) for cell in row.values()] for row in spec["rows"]]
    return Table(
        name=name,
        title=fill(spec["title"], values),
        setup=_shown(spec["setup"], values),
        columns=[fill(column, values) for column in spec["columns"]],
        rows=rows,
        notes=_shown(spec["notes"], values),
        plot=plot,
    )


def _where(result: dict) -> str:
    return f"{result['hardware']}, {result['date']}"


# --------------------------------------------------------------------------- 8.1 numeric formats

# As printed: (bits, sign, exponent, mantissa, range, GPU support)
CHAPTER_FORMATS = {
    row["format"]: (row["bits"], row["sign"], row["exponent"], row["mantissa"], row["range"], row["gpus"])
    for row in TEXT["numeric_formats"]["claims"]
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
    texts = TEXT["numeric_formats"]["texts"]
    rows, analytic_all = [], {}
    for claim in TEXT["numeric_formats"]["claims"]:
        label = claim["format"]
        analytic = format_from_layout(claim["exponent"], claim["mantissa"], claim.get("finite_only", False))
        analytic_all[label] = analytic
        figures = {
            "max": sci(analytic["max"]), "min_normal": sci(analytic["min_normal"]),
            "min_subnormal": sci(analytic["min_subnormal"]),
            "normal_exponent": round(math.log2(analytic["min_normal"])),
            "subnormal_exponent": round(math.log2(analytic["min_subnormal"])),
        }
        rows.append([
            label,
            fill(texts["claim"], claim),
            fill(texts["analytic" if analytic["has_inf"] else "analytic_no_inf"], figures),
            _format_measured(measured.formats.get(label, {})),
            claim["verdict"],
        ])
    return render("numeric_formats", {"torch_version": _torch_version()}, rows,
                  plot=lambda path: _plot_formats(analytic_all, path))


def _format_measured(got: dict) -> str:
    if got.get("missing"):
        return f"torch has no {got['dtype']}"
    inf = "inf" if math.isinf(got["inf_casts_to"]) else f"{sci(got['inf_casts_to'])} (no inf)"
    return (
        f"e{got['exponent_bits']}m{got['mantissa_bits']}: max {sci(got['max'])}, "
        f"min normal {sci(got['min_normal'])}, min subnormal {sci(got['min_subnormal'])}, "
        f"eps {sci(got['eps'])}; +inf casts to {inf}"
    )


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

PRECISION_MEASURED_VARIANT = {"fp32": "fp32", "fp16": "fp16_autocast", "bf16": "bf16_autocast", "bf16_master": "bf16_model"}


def _mode_peak(mode: str) -> tuple[float, str]:
    h100 = DEVICES["H100"]
    if mode == "fp32":
        return h100.tf32_tflops, "TF32"
    if mode == "fp8":
        return h100.fp8_tflops, "FP8"
    return h100.bf16_tflops, "FP16" if mode == "fp16" else "BF16"


def precision_table(measured: Measured) -> Table:
    texts = TEXT["precision_modes"]["texts"]
    claims = TEXT["precision_modes"]["claims"]
    gpt3 = est.preset("gpt3-175b")
    h100 = DEVICES["H100"]
    n_params = est.count_parameters(gpt3.model)
    results = {}
    for claim in claims:
        job = est.JobSpec(gpt3.model, gpt3.seq_len, 1, est.Layout(8, strategy="fsdp"), "none", claim["mode"], h100)
        results[claim["label"]] = est.estimate(job)
    fp32_memory = results["FP32"].memory.total
    fp32_speed = results["FP32"].time.seconds_per_token  # predicted as if memory were no limit
    min_gpus = est.min_gpus_to_fit(gpt3.model, gpt3.seq_len, h100, "bf16_master")
    rows = []
    for claim in claims:
        result = results[claim["label"]]
        peak, kind = _mode_peak(claim["mode"])
        analytic = fill(texts["analytic"], {
            "peak": peak, "kind": kind, "peak_vs_tf32": peak / h100.tf32_tflops,
            "speed_vs_fp32": fp32_speed / result.time.seconds_per_token,
            "memory_per_gpu": gib(result.memory.total), "memory_vs_fp32": result.memory.total / fp32_memory,
            "states_per_gpu": gib(result.memory.states),
        })
        rows.append([claim["label"], fill(texts["claim"], claim), analytic, _precision_measured(claim["mode"], measured)])
    cpu = measured.precision
    values = {
        "gpt3": gpt3, "h100": h100, "assumptions": est.Assumptions(), "cpu": cpu,
        "cpu_where": _where(cpu) if cpu else None,
        "n_params_billion": n_params / 1e9, "states_tb": 16 * n_params / 1e12, "sharded_states": gib(16 * n_params / 8),
        "gpu_count": _gpu_count(min_gpus, texts),
    }
    return render("precision_modes", values, rows, plot=lambda path: _plot_precision(results, claims, path))


def _gpu_count(n: int | None, texts: dict) -> str:
    if n is None:
        return texts["gpus_none"]
    power = est.smallest_power_of_two(n)
    return fill(texts["gpus" if power == n else "gpus_rounded"], {"gpus": n, "power": power})


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


def _plot_precision(results: dict, claims: list[dict], path: Path) -> None:
    fig, (ax_peak, ax_mem) = new_figure(ncols=2, width=5.5)
    labels = [claim["label"] for claim in claims]
    chapter = [float(claim["tflops"].strip("~")) for claim in claims]
    peaks = [_mode_peak(claim["mode"])[0] for claim in claims]
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

TP_COLUMN = 8  # one node of tensor parallelism, the paper's t


def recompute_table(measured: Measured) -> Table:
    texts = TEXT["activation_recompute"]["texts"]
    p70 = est.preset("70b")
    cfg, s, b = p70.model, p70.seq_len, p70.micro_batch
    h100 = DEVICES["H100"]
    L = cfg.n_layer
    model_flops = est.flops_per_token(cfg, s)
    analytic, with_tp = {}, {}
    rows = []
    for claim in TEXT["activation_recompute"]["claims"]:
        policy = claim["policy"]
        per_layer = est.activation_bytes_per_layer(cfg, s, b, policy, attention="materialized")
        flash = est.activation_bytes_per_layer(cfg, s, b, policy, attention="flash")
        with_tp[policy] = L * per_layer_tp_sp(cfg, s, b, policy)
        analytic[policy] = L * per_layer
        figures = {"h100": h100, "overhead": est.recompute_flops_per_token(cfg, s, policy) / model_flops,
                   "total": gib(L * per_layer), "per_layer": gib(per_layer), "flash_total": gib(L * flash)}
        if policy == "offload":
            host = L * est.activation_bytes_per_layer(cfg, s, b, "none", attention="materialized")
            result = est.estimate(est.JobSpec(cfg, s, b, est.Layout(64, strategy="fsdp"), "offload", "bf16_master", h100))
            tp_host = L * per_layer_tp_sp(cfg, s, b, "none")
            figures |= {"host": gib(host), "layer_in_flight": gib(per_layer_none(cfg, s, b)),
                        "offload_s": result.time.offload_s, "compute_s": result.time.compute_s,
                        "tp_sp_host": gib(tp_host), "tp_sp_per_layer": gib(tp_host / L)}
            memory, tp_sp, cost = "memory_offload", "tp_sp_offload", "cost_offload"
        else:
            tp_layer = per_layer_tp_sp(cfg, s, b, policy)
            figures |= {"tp_sp_total": gib(L * tp_layer), "tp_sp_per_layer": gib(tp_layer)}
            memory, tp_sp, cost = "memory", "tp_sp", "cost_op_selective" if policy == "op_selective" else "cost"
        rows.append([policy, fill(texts["claim"], claim), fill(texts[memory], figures), fill(texts[tp_sp], figures),
                     fill(texts[cost], figures), _recompute_measured(policy, measured)])
    attention_term = 5 * cfg.n_head * s / cfg.d_model
    tp_only = {p: L * est.activation_bytes_per_layer(cfg, s, b, p, attention="materialized", tp=TP_COLUMN)
               for p in ("none", "selective")}
    rec = measured.recompute
    values = {
        "cfg": cfg, "s": s, "b": b, "tp": TP_COLUMN, "rec": rec, "rec_where": _where(rec) if rec else None,
        "none_total": gib(analytic["none"]), "selective_total": gib(analytic["selective"]),
        "full_total": gib(analytic["full"]),
        "chapter_share": 2 * 4096 / (2 * 4096 + 4 * 4096), "attention_share": attention_term / (34 + attention_term),
        "tp_only_none": gib(tp_only["none"]), "tp_only_selective": gib(tp_only["selective"]),
        "tp_sp_selective": gib(L * per_layer_tp_sp(cfg, s, b, "selective")),
        **_planner_figures(p70),
    }
    return render("activation_recompute", values, rows, plot=lambda path: _plot_recompute(analytic, with_tp, path))


def per_layer_tp_sp(cfg, s, b, policy: str, tp: int = TP_COLUMN) -> float:
    return est.activation_bytes_per_layer(cfg, s, b, policy, attention="materialized", tp=tp, sequence_parallel=True)


def _planner_figures(p70) -> dict:
    """The 70B preset on its own GPU count: the policies data parallelism alone fits with, and the
    planner's cheapest layout (None when nothing fits)."""
    h100 = DEVICES["H100"]
    global_batch = p70.micro_batch * p70.world_size
    plans = est.plan_layouts(p70.model, p70.seq_len, p70.world_size, h100, global_batch=global_batch, top=1)
    data_parallel = sorted({plan.job.recompute for plan in est.plan_fits(p70.model, p70.seq_len, p70.world_size, h100, top=None)})
    return {"p70": p70, "global_batch": global_batch, "plan": est.describe_plan(plans[0]) if plans else None,
            "data_parallel_policies": " or ".join(data_parallel) or "nothing"}


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


def attention_memory(seq_len: int, batch: int, head_dim: int, heads: int, dtype_bytes: int = 2) -> dict[str, float]:
    """One s x s score matrix vs what flash attention keeps (q, k, v, output and a fp32 log-sum-exp)."""
    return {
        "standard": dtype_bytes * seq_len * seq_len * batch * heads,
        "flash": (4 * dtype_bytes * seq_len * head_dim + 4 * seq_len) * batch * heads,
    }


def attention_table(measured: Measured) -> Table:
    c = TEXT["attention"]["claims"]
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
    values = {
        "claims": c, "a100": a100, "att": att, "att_where": _where(att) if att else None, "heads": heads,
        "implied_heads": implied_heads, "standard_per_head": human_bytes(per_head["standard"]),
        "flash_per_head": human_bytes(per_head["flash"]), "flash_at_heads": human_bytes(at_heads["flash"]),
        "s_over_4d": s / (4 * d), "exact_ratio": per_head["standard"] / per_head["flash"],
        "forward_tflop": forward_flops / 1e12, "forward_ms": forward_flops / peak * 1e3,
        "causal_train_ms": causal_train_flops / peak * 1e3,
        "measured_standard": _attention_measured(att, "reference"), "measured_flash": _attention_measured(att, "sdpa"),
        "measured_ratio": fill(TEXT["attention"]["texts"]["measured_ratio"], {"att": att}) if att else "not run",
        "measured_time": _attention_time(measured.gpu.get("attention")),
    }
    return render("attention", values, plot=lambda path: _plot_attention(s, b, d, path))


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


def bench_data_rows(document: dict) -> dict[str, list[str]]:
    """{format: ['tokens/s ... (workers w, batch b)', ...]} from tools/bench_data.py's loader rows."""
    found: dict[str, list[str]] = {}
    for row in document["rows"]:
        found.setdefault(row["format"], []).append(
            f"{row['tokens_per_s']:,.0f} tokens/s (workers {row['workers']}, batch {row['batch']})"
        )
    return found


def data_formats_table(measured: Measured) -> Table:
    texts = TEXT["data_formats"]["texts"]
    bench = bench_data_rows(measured.data_bench) if measured.data_bench else {}
    rows = []
    for claim in TEXT["data_formats"]["claims"]:
        loader = claim.get("loader")
        if "not_benchmarked" in claim:
            cell = claim["not_benchmarked"]
        elif loader in bench:
            cell = fill(texts["measured_naive" if loader == "naive" else "measured"], {"figures": "; ".join(bench[loader])})
        else:
            cell = texts["not_run"]
        rows.append([claim["format"], fill(texts["claim"], claim), claim["analysis"], cell])
    values = {"bench": bench, "measured_name": DATA_FORMATS_MEASURED_NAME,
              "bench_setting": (measured.data_bench or {}).get("setting", "settings not recorded")}
    return render("data_formats", values, rows)


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
    spec = TEXT["communication"]
    texts = spec["texts"]
    top = _topology(nodes=8)
    grads = 2 * est.count_parameters(est.preset("llama2-7b").model)  # bf16 gradients
    bucket = {c.algorithm: c for c in cm.all_algorithms(top, BUCKET_BYTES)}
    rows = []
    for cost in cm.all_algorithms(top, grads):
        small = bucket[cost.algorithm]
        analytic = fill(texts["analytic"], {
            "cost": cost, "top": top, "busy_nic_bytes": human_bytes(cost.inter_bytes_per_gpu),
            "total_ms": cost.total_s * 1e3, "bucket_ms": small.total_s * 1e3, "bucket_latency_ms": small.latency_s * 1e3,
        })
        measured_cell = texts["measured_two_level" if cost.algorithm.startswith("two-level") else "measured"]
        rows.append([cost.algorithm, spec["claims"].get(cost.algorithm, texts["no_claim"]), analytic, measured_cell])
    values = {"h100": DEVICES["H100"], "gradient_bytes": human_bytes(grads), "nvlink_step_us": NVLINK_STEP_US,
              "network_step_us": NETWORK_STEP_US}
    return render("communication", values, rows, plot=lambda path: _plot_comm(grads, path))


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
    texts = TEXT["priority"]["texts"]
    h100 = DEVICES["H100"]
    llama = est.preset("llama2-7b")
    p70 = est.preset("70b")
    cfg70, s70, b70 = p70.model, p70.seq_len, p70.micro_batch

    def job(precision: str = "bf16_master", strategy: str = "fsdp", gpus: int = 64):
        return est.estimate(est.JobSpec(llama.model, llama.seq_len, 1, est.Layout(gpus, strategy=strategy), "none",
                                        precision, h100))

    fp32, bf16 = job(precision="fp32"), job(precision="bf16_master")
    fp8 = job(precision="fp8")
    ddp = job(strategy="ddp", gpus=8)
    zero3 = job(strategy="fsdp", gpus=8)
    none70 = est.activation_bytes_per_layer(cfg70, s70, b70, "none")
    sel70 = est.activation_bytes_per_layer(cfg70, s70, b70, "selective")
    full70 = est.activation_bytes_per_layer(cfg70, s70, b70, "full")
    zero2_64 = job(strategy="zero2", gpus=64)  # DeepSpeed's all-reduce + all-gather; DDP does not fit (16Ψ)
    t = zero2_64.time
    serial_step = t.compute_s + t.comm_s + t.offload_s + t.memory_bound_s
    att = measured.attention
    values = {
        "h100": h100, "assumptions": est.Assumptions(), "needs_gpu": NEEDS_GPU,
        "measured_files": ", ".join(MEASURED_FILES), "bench_train": BENCH_TRAIN_CPU,
        "compile_measured": BENCH_TRAIN_CPU in measured.documents,
        "bf16_vs_tf32": h100.bf16_tflops / h100.tf32_tflops, "bf16_vs_fp32": h100.bf16_tflops / h100.fp32_tflops,
        "bf16_speedup": fp32.time.step_s / bf16.time.step_s, "bf16_memory": bf16.memory.total / fp32.memory.total,
        "ddp_states": gib(ddp.memory.states), "fsdp_states": gib(zero3.memory.states),
        "selective_saves": 1 - sel70 / none70, "full_saves": 1 - full70 / none70,
        "comm_ms": t.comm_s * 1e3, "compute_ms": t.compute_s * 1e3, "serial_step_s": serial_step,
        "step_s": t.step_s, "overlap_gain": serial_step / t.step_s - 1,
        "fp8_speedup": bf16.time.step_s / fp8.time.step_s,
        "measured_bf16": _precision_measured("bf16", measured),
        "measured_attention": (f"{att['saved_ratio']:.1f}× fewer bytes saved ({att['hardware']}); time: "
                               f"{_attention_time(measured.gpu.get('attention'))}" if att else NEEDS_GPU),
        "measured_sharding": _sharding_measured(measured.documents.get(PARALLEL_CPU)),
        "measured_recompute": _recompute_summary(measured.recompute),
        "measured_data": (fill(texts["data_measured"], {"data_measured_name": DATA_FORMATS_MEASURED_NAME})
                          if measured.data_bench else texts["data_not_run"]),
        "measured_compile": _compile_measured(measured.documents.get(BENCH_TRAIN_CPU)),
    }
    return render("priority", values)


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
