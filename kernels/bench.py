"""Side by side, in one process: each fused op as eager PyTorch, torch.compile of the same
reference function, and the Triton kernel; forward and backward time, achieved GB/s, and that
rate as a fraction of the device's copy bandwidth measured in the same run.

Times are medians of CUDA-event timings after warm-up. Backward time is the median of
forward+backward minus the median of forward (the same for all three implementations, and it
needs no retained graph). Bytes are each op's minimal traffic: every input read once, every
output written once (weights and per-row statistics are negligible and left out), so GB/s is
what an ideal fused kernel would need divided by the time taken.

Without CUDA nothing is timed: the kernels run in Triton's interpreter on small shapes and only
their correctness against the fp32 reference is reported.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kernels import reference

IMPLEMENTATIONS = ("eager", "compile", "triton")
ULP_BITS = {torch.bfloat16: 7, torch.float16: 10}


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


def median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median CUDA-event time of fn() in milliseconds, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gb_s(device: torch.device, warmup: int, reps: int, nbytes: int = 2**30) -> float:
    """Device-to-device copy rate (read + write bytes per second), the ceiling for these ops."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup, reps)
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

    fwd = median_ms(forward, warmup, reps)
    both = median_ms(forward_backward, warmup, reps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward_backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return Timing(fwd, max(both - fwd, 0.0), peak)


# ------------------------------------------------------------------------------- correctness


def outputs_and_grads(fn: Callable, args: list, grad_positions: list[int], dy: torch.Tensor) -> list[torch.Tensor]:
    args = with_grads([a.clone() if isinstance(a, torch.Tensor) else a for a in args], grad_positions)
    out = fn(*args)
    return [out.detach(), *torch.autograd.grad(out, [args[i] for i in grad_positions], dy)]


def error_floor(dtype: torch.dtype, oracle: torch.Tensor, interpreted: bool) -> float:
    scale = oracle.abs().max().item()
    if dtype == torch.float32:
        return 1e-5 * (1.0 + scale)
    ulp = 2.0 ** (math.floor(math.log2(max(scale, 1e-30))) - ULP_BITS[dtype])
    return ulp if interpreted else ulp / 2  # the interpreter truncates fp32 -> bf16 casts


@dataclass
class Check:
    errors: list[float]  # per output (forward, then each gradient): max |kernel - fp32 oracle|
    tolerances: list[float]  # 2 x eager's error in the same dtype + a floor

    @property
    def ok(self) -> bool:
        return all(e <= t for e, t in zip(self.errors, self.tolerances))

    @property
    def worst_ratio(self) -> float:
        return max(e / t for e, t in zip(self.errors, self.tolerances))


def check_op(kernel: Callable, ref: Callable, args: list, grad_positions: list[int], interpreted: bool) -> Check:
    """The kernel's forward and gradients against the fp32 reference, flash-attention style."""
    with torch.no_grad():
        probe = ref(*args)
    dy = torch.randn(probe.shape, generator=torch.Generator().manual_seed(1)).to(probe.device, probe.dtype)
    oracle_args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ours = outputs_and_grads(kernel, args, grad_positions, dy)
    eager = outputs_and_grads(ref, args, grad_positions, dy)
    oracle = outputs_and_grads(ref, oracle_args, grad_positions, dy.float())
    errors, tolerances = [], []
    for o, e, r in zip(ours, eager, oracle):
        errors.append((o.float() - r.float()).abs().max().item())
        eager_err = (e.float() - r.float()).abs().max().item()
        tolerances.append(2 * eager_err + error_floor(o.dtype, r, interpreted))
    return Check(errors, tolerances)


# -------------------------------------------------------------------------------------- runs


@dataclass
class Row:
    case: Case
    dtype: torch.dtype
    impl: str
    timing: Timing | None = None
    check: Check | None = None
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
    from kernels.registry import TRITON_OPS
    from kernels.triton import load_op_modules

    modules = load_op_modules()
    return {op: getattr(modules[module], function) for op, (module, function) in TRITON_OPS.items()}


def run_benchmark(
    cases: list[Case], dtype: torch.dtype, device: torch.device, warmup: int, reps: int, use_compile: bool,
    log: Callable[[str], None] = print,
) -> Results:
    from analysis.measure import hardware_name

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
    import datetime

    lines = [
        f"date: {datetime.date.today().isoformat()}",
        f"hardware: {results.hardware}; torch {torch.__version__}; triton {_triton_version()}",
        f"dtype: {str(results.dtype).removeprefix('torch.')}",
    ]
    if results.timed:
        from analysis.hardware import lookup_device

        spec = lookup_device(results.hardware)
        datasheet = f" (datasheet HBM {spec.hbm_tb_s * 1000:,.0f} GB/s)" if spec else ""
        lines.append(f"measured copy bandwidth: {results.copy_gb_s:,.0f} GB/s read+write{datasheet}")
        lines.append(f"timing: CUDA events, median of {reps} after {warmup} warm-up; bwd = (fwd+bwd) - fwd")
        lines.append("GB/s: minimal bytes (inputs read once, outputs written once) / time")
    return lines + results.notes


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def format_text(head: list[str], body: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def format_markdown(results: Results, warmup: int, reps: int) -> str:
    head, body = table(results)
    lines = ["# Fused kernels: eager vs torch.compile vs Triton", ""]
    lines += [f"- {line}" for line in header_lines(results, warmup, reps)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def write_plot(results: Results, path: str) -> bool:
    """Bars of fwd+bwd achieved bandwidth as a share of copy bandwidth; False when nothing was timed."""
    if not results.timed:
        return False
    from analysis.report import new_figure, save_figure

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
