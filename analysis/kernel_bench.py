"""Side by side, in one process: each fused op as eager PyTorch, torch.compile of the same
reference function, and the Triton kernel; forward and backward time, achieved GB/s, and that
rate as a fraction of the device's copy bandwidth measured in the same run.

Times are medians of CUDA-event timings after warm-up (common/measure.py's ``repeat``).
Backward time is the median of forward+backward minus the median of forward (the same for all
three implementations, and it needs no retained graph). Bytes are each op's minimal traffic: every input read once, every
output written once (weights and per-row statistics are negligible and left out), so GB/s is
what an ideal fused kernel would need divided by the time taken.

Without CUDA nothing is timed: the kernels run in Triton's interpreter on small shapes and only
their correctness against the fp32 reference is reported, by the project's one tolerance rule
(common/measure.py's ``check_against_fp32``, which the kernel tests use too).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from common.hardware import lookup_device
from common.measure import ToleranceCheck, check_against_fp32, hardware_name, peak_bytes, provenance, repeat
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from kernels import reference
from kernels.registry import TRITON_OPS
from kernels.triton import load_op_modules

IMPLEMENTATIONS = ("eager", "compile", "triton")


@dataclass(frozen=True)
class Case:
    op: str  # a KernelOps field
    shape: tuple[int, ...]  # (rows, width); (N, V) for cross_entropy; (B, T, H, D) for apply_rope

    @property
    def label(self) -> str:
        return "x".join(str(n) for n in self.shape)


# LLM-sized: 8k tokens at d_model 4096 (Llama-2-7B-like), a wider-than-one-block row (12288 = GPT-3
# 175B), the MLP hidden widths of GPT-2 style (4x) and Llama style (11008) models, GPT-2 and
# Llama-3 vocabularies, and 32 heads of 128 at 2k context.
GPU_CASES = [
    Case("layer_norm", (8192, 4096)),
    Case("layer_norm", (4096, 12288)),
    Case("layer_norm_gelu", (8192, 4096)),
    Case("rms_norm", (8192, 4096)),
    Case("rms_norm", (4096, 12288)),
    Case("bias_gelu", (8192, 16384)),
    Case("swiglu", (8192, 11008)),
    Case("cross_entropy", (8192, 50304)),
    Case("cross_entropy", (4096, 128256)),
    Case("apply_rope", (8, 2048, 32, 128)),
]
QUICK_GPU_CASES = [c for i, c in enumerate(GPU_CASES) if i in (0, 2, 3, 5, 6, 7, 9)]
# Interpreter-sized: one row, widths that are not powers of two.
CPU_CASES = [
    Case("layer_norm", (1, 7)),
    Case("layer_norm", (6, 300)),
    Case("layer_norm_gelu", (6, 300)),
    Case("rms_norm", (6, 300)),
    Case("bias_gelu", (6, 300)),
    Case("swiglu", (6, 300)),
    Case("cross_entropy", (6, 1000)),
    Case("apply_rope", (2, 5, 3, 24)),
]


def case_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> tuple[Callable, list, list[int]]:
    """(reference function, its arguments, positions of the arguments that get gradients)."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=generator) * scale + shift).to(device=device, dtype=dtype)

    width = case.shape[-1]
    if case.op in ("layer_norm", "layer_norm_gelu"):
        fn = reference.layer_norm if case.op == "layer_norm" else reference.layer_norm_gelu
        return fn, [randn(*case.shape, scale=2.0, shift=1.0), randn(width, shift=1.0), randn(width), 1e-5], [0, 1, 2]
    if case.op == "rms_norm":
        return reference.rms_norm, [randn(*case.shape, scale=2.0), randn(width, shift=1.0), 1e-6], [0, 1]
    if case.op == "bias_gelu":
        return reference.bias_gelu, [randn(*case.shape, scale=2.0), randn(width), "tanh"], [0, 1]
    if case.op == "swiglu":
        return reference.swiglu, [randn(*case.shape, scale=2.0), randn(*case.shape)], [0, 1]
    if case.op == "cross_entropy":
        rows, vocab = case.shape
        targets = torch.randint(0, vocab, (rows,), generator=generator)
        targets[::8] = -100  # one row in eight is padding, as in a packed batch
        return reference.cross_entropy, [randn(rows, vocab, scale=3.0), targets.to(device)], [0]
    if case.op == "apply_rope":
        batch, seq, heads, head_dim = case.shape
        cos, sin = reference.rope_tables(seq, head_dim, 10000.0, device=device)
        return reference.apply_rope, [randn(*case.shape), cos, sin], [0]
    raise ValueError(f"no benchmark inputs for op {case.op!r}")


def case_bytes(case: Case, dtype: torch.dtype) -> tuple[int, int]:
    """Minimal (forward, backward) bytes moved: full-size tensors read or written once each."""
    elements = math.prod(case.shape) * torch.finfo(dtype).bits // 8
    if case.op == "swiglu":  # fwd: gate, up -> y; bwd: gate, up, dy -> dgate, dup
        return 3 * elements, 5 * elements
    if case.op == "cross_entropy":  # fwd: logits -> per-row loss; bwd: logits -> dlogits
        return elements, 2 * elements
    if case.op == "apply_rope":  # fwd: x -> y; bwd: dy -> dx
        return 2 * elements, 2 * elements
    return 2 * elements, 3 * elements  # norms and bias+GELU: fwd x -> y; bwd x, dy -> dx


# ------------------------------------------------------------------------------------ timing


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median CUDA-event time of fn() in milliseconds, after warm-up."""
    return statistics.median(repeat(fn, device, reps, warmup, events=True)) * 1e3


def copy_bandwidth_gb_s(device: torch.device, warmup: int, reps: int, nbytes: int = 2**30) -> float:
    """Device-to-device copy rate (read + write bytes per second), the ceiling for these ops."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup, reps)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def with_grads(args: list, grad_positions: list[int]) -> list:
    return [
        a.detach().requires_grad_(i in grad_positions) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]


@dataclass
class Timing:
    fwd_ms: float
    bwd_ms: float
    peak_mib: float  # allocator peak above the inputs during one forward+backward


def time_op(fn: Callable, args: list, grad_positions: list[int], warmup: int, reps: int) -> Timing:
    args = with_grads(args, grad_positions)
    leaves = [args[i] for i in grad_positions]
    out = fn(*args)  # also triggers torch.compile's compilation, outside the timed region
    dy = torch.randn(out.shape, device=out.device).to(out.dtype)
    del out

    def forward():
        return fn(*args)

    def forward_backward():
        torch.autograd.grad(fn(*args), leaves, dy)

    fwd = median_ms(forward, dy.device, warmup, reps)
    both = median_ms(forward_backward, dy.device, warmup, reps)
    peak = peak_bytes(forward_backward, dy.device) / 2**20
    return Timing(fwd, max(both - fwd, 0.0), peak)


# ------------------------------------------------------------------------------- correctness


def check_op(kernel: Callable, ref: Callable, args: list, grad_positions: list[int],
             interpreted: bool) -> ToleranceCheck:
    """The kernel's forward and gradients against the fp32 reference, by the project's tolerance rule."""
    return check_against_fp32(kernel, ref, args, grad_positions, interpreted, seed=1)


# -------------------------------------------------------------------------------------- runs


@dataclass
class Row:
    case: Case
    dtype: torch.dtype
    impl: str
    timing: Timing | None = None
    check: ToleranceCheck | None = None
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    error: str = ""  # why this implementation produced no timing (e.g. compile failed)


@dataclass
class Results:
    device: torch.device
    dtype: torch.dtype
    hardware: str
    copy_gb_s: float | None
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def timed(self) -> bool:
        return self.copy_gb_s is not None


def triton_ops(device: torch.device) -> dict:
    """Triton functions by op name; on CPU, in the interpreter (set before triton is imported)."""
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    modules = load_op_modules()
    return {op: getattr(modules[module], function) for op, (module, function) in TRITON_OPS.items()}


def run_benchmark(
    cases: list[Case], dtype: torch.dtype, device: torch.device, warmup: int, reps: int, use_compile: bool,
    log: Callable[[str], None] = print,
) -> Results:
    kernels = triton_ops(device)
    timed = device.type == "cuda"
    copy = copy_bandwidth_gb_s(device, warmup, reps) if timed else None
    results = Results(device, dtype, hardware_name(device), copy)
    if not timed:
        results.notes.append("no CUDA device: correctness only (Triton interpreter, small shapes); nothing timed")
    for case in cases:
        ref, args, positions = case_inputs(case, dtype, device)
        fwd_bytes, bwd_bytes = case_bytes(case, dtype)
        log(f"{case.op} {case.label} {str(dtype).removeprefix('torch.')}")
        check = check_op(kernels[case.op], ref, args, positions, interpreted=not timed)
        impls = {"eager": ref, "triton": kernels[case.op]}
        if use_compile and timed:
            impls["compile"] = torch.compile(ref, dynamic=False)
        for impl in IMPLEMENTATIONS:
            if impl not in impls:
                continue
            row = Row(case, dtype, impl, check=check if impl == "triton" else None,
                      fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes)
            if timed:
                try:
                    row.timing = time_op(impls[impl], args, positions, warmup, reps)
                except Exception as exc:  # a failed compile is a result to report, not a crash
                    row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            results.rows.append(row)
        if timed:
            torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------------- reports


def gb_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def table(results: Results) -> tuple[list[str], list[list[str]]]:
    if not results.timed:
        head = ["op", "shape", "dtype", "outputs checked", "max error vs fp32", "tolerance", "ok"]
        body = []
        for r in results.rows:
            if r.impl != "triton":
                continue
            body.append([
                r.case.op, r.case.label, str(r.dtype).removeprefix("torch."),
                f"fwd + {len(r.check.errors) - 1} grads",
                " / ".join(f"{e:.2g}" for e in r.check.errors),
                " / ".join(f"{t:.2g}" for t in r.check.tolerances),
                "yes" if r.check.ok else "NO",
            ])
        return head, body
    copy = results.copy_gb_s
    head = ["op", "shape", "impl", "fwd ms", "bwd ms", "fwd GB/s (% copy)", "bwd GB/s (% copy)",
            "peak MiB", "fwd+bwd vs eager", "correct"]
    eager_total = {
        r.case: r.timing.fwd_ms + r.timing.bwd_ms for r in results.rows if r.impl == "eager" and r.timing
    }
    body = []
    for r in results.rows:
        if r.timing is None:
            body.append([r.case.op, r.case.label, r.impl, "-", "-", "-", "-", "-", "-", r.error or "-"])
            continue
        t = r.timing
        fwd_rate, bwd_rate = gb_s(r.fwd_bytes, t.fwd_ms), gb_s(r.bwd_bytes, t.bwd_ms)
        speedup = eager_total.get(r.case, float("nan")) / (t.fwd_ms + t.bwd_ms)
        correct = "-" if r.check is None else ("yes" if r.check.ok else f"NO ({r.check.worst_ratio:.1f}x tol)")
        body.append([
            r.case.op, r.case.label, r.impl, f"{t.fwd_ms:.3f}", f"{t.bwd_ms:.3f}",
            f"{fwd_rate:,.0f} ({100 * fwd_rate / copy:.0f}%)", f"{bwd_rate:,.0f} ({100 * bwd_rate / copy:.0f}%)",
            f"{t.peak_mib:,.0f}", f"{speedup:.2f}x", correct,
        ])
    return head, body


def header_lines(results: Results, warmup: int, reps: int) -> list[str]:
    where = provenance(results.device)
    lines = [
        f"date: {where['date']}",
        f"hardware: {results.hardware}; torch {where['torch']}; triton {_triton_version()}",
        f"dtype: {str(results.dtype).removeprefix('torch.')}",
    ]
    if results.timed:
        spec = lookup_device(results.hardware)
        datasheet = f" (datasheet HBM {spec.hbm_tb_s * 1000:,.0f} GB/s)" if spec else ""
        lines.append(f"measured copy bandwidth: {results.copy_gb_s:,.0f} GB/s read+write{datasheet}")
        lines.append(f"timing: CUDA events, median of {reps} after {warmup} warm-up; bwd = (fwd+bwd) - fwd")
        lines.append("GB/s: minimal bytes (inputs read once, outputs written once) / time")
    return lines + results.notes


def _triton_version() -> str:
    try:
        import triton  # optional: the report says when it is missing
    except ImportError:
        return "not installed"
    return triton.__version__


def format_text(head: list[str], body: list[list[str]]) -> str:
    return text_table(head, body, numeric=False)


TITLE = "Fused kernels: eager vs torch.compile vs Triton"


def format_markdown(results: Results, warmup: int, reps: int) -> str:
    head, body = table(results)
    lines = [f"# {TITLE}", ""]
    lines += [f"- {line}" for line in header_lines(results, warmup, reps)]
    lines += ["", markdown_table(head, body, left=3)]
    return "\n".join(lines) + "\n"


def result_rows(results: Results) -> list[dict]:
    """The table's rows as numbers: one per (case, implementation)."""
    rows = []
    for r in results.rows:
        row = {"op": r.case.op, "shape": list(r.case.shape), "dtype": str(r.dtype).removeprefix("torch."),
               "impl": r.impl, "fwd_bytes": r.fwd_bytes, "bwd_bytes": r.bwd_bytes, "error": r.error or None}
        if r.timing is not None:
            row |= {"fwd_ms": r.timing.fwd_ms, "bwd_ms": r.timing.bwd_ms, "peak_mib": r.timing.peak_mib}
        if r.check is not None:
            row |= {"check": {"outputs": r.check.names, "errors": r.check.errors,
                              "eager_errors": r.check.eager_errors, "tolerances": r.check.tolerances,
                              "ok": r.check.ok}}
        rows.append(row)
    return rows


def write_markdown(all_results: list[Results], warmup: int, reps: int, path: Path) -> list[Path]:
    """One Markdown file for every dtype run, and the rows of all of them as JSON next to it."""
    text = "\n".join(format_markdown(results, warmup, reps) for results in all_results)
    first = all_results[0]
    dtypes = ", ".join(str(r.dtype).removeprefix("torch.") for r in all_results)
    title = f"{TITLE}: {first.hardware}, {dtypes}, {provenance(first.device)['date']}"
    rows = [row for results in all_results for row in result_rows(results)]
    return write_results(path, text, title, rows, provenance=provenance(first.device),
                         copy_gb_s=first.copy_gb_s, warmup=warmup, reps=reps)


def write_plot(results: Results, path: str) -> bool:
    """Bars of fwd+bwd achieved bandwidth as a share of copy bandwidth; False when nothing was timed."""
    if not results.timed:
        return False
    cases = list(dict.fromkeys(r.case for r in results.rows))
    fig, ax = new_figure(width=max(7.0, 1.1 * len(cases)), height=4.5)
    width = 0.8 / len(IMPLEMENTATIONS)
    for k, impl in enumerate(IMPLEMENTATIONS):
        shares = []
        for case in cases:
            row = next((r for r in results.rows if r.case == case and r.impl == impl and r.timing), None)
            total_ms = row.timing.fwd_ms + row.timing.bwd_ms if row else 0.0
            rate = gb_s(row.fwd_bytes + row.bwd_bytes, total_ms) if row else 0.0
            shares.append(100 * rate / results.copy_gb_s)
        ax.bar([i + (k - 1) * width for i in range(len(cases))], shares, width, label=impl)
    ax.set_xticks(range(len(cases)), [f"{c.op}\n{c.label}" for c in cases], fontsize=7)
    ax.set_ylabel("fwd+bwd GB/s, % of measured copy")
    ax.set_title(f"{results.hardware}, {str(results.dtype).removeprefix('torch.')}")
    ax.legend()
    save_figure(fig, Path(path))
    return True
