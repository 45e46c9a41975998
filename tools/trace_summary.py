"""Summarize a PyTorch profiler chrome trace (what ``train.py --profile`` writes) as tables.

    python -m tools.trace_summary runs/tiny/profile            # newest trace in the folder
    python -m tools.trace_summary runs/tiny/profile/trace_rank0_step6.json --top 20

It prints the profiled steps' wall times, where the time went (top CPU ops by self time; on a
CUDA trace also the top GPU kernels, how busy the GPU was, and the share of communication and
memory-copy kernels) and, when the trace was recorded with ``profile_memory=True``, the peak of
allocated memory per device. The same trace opens interactively in https://ui.perfetto.dev or
chrome://tracing; this is the quick text view, and what docs/profiling.md tells you to look for.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from common.comm_names import is_communication
from common.measure import union_length
from common.report import text_table

MIB = 2**20


class TraceError(ValueError):
    """The path holds no readable chrome trace; the message says what was looked for."""


@dataclass
class OpTime:
    name: str
    calls: int = 0
    total_us: float = 0.0  # inclusive
    self_us: float = 0.0  # minus the ops it called


@dataclass
class TraceSummary:
    path: Path
    steps: list[tuple[str, float]] = field(default_factory=list)  # (ProfilerStep#N, wall us)
    cpu_ops: list[OpTime] = field(default_factory=list)  # by self time, largest first
    kernels: list[OpTime] = field(default_factory=list)  # GPU kernels by total time
    gpu_busy_us: float | None = None  # union of kernel intervals, None without GPU activity
    comm_us: float = 0.0  # communication: GPU kernels if any, else CPU ops' self time
    memcpy_us: float = 0.0
    peak_allocated: dict[str, int] = field(default_factory=dict)  # {device: bytes}

    @property
    def profiled_us(self) -> float:
        return sum(d for _, d in self.steps)


# --------------------------------------------------------------------------- reading


def find_trace(path: Path) -> Path:
    """The file itself, or the newest trace (*.json / *.json.gz) under a folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise TraceError(f"{path} does not exist; pass a trace file or the run's profile/ folder")
    candidates = [p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz")) and p.is_file()]
    if not candidates:
        raise TraceError(f"no *.json or *.json.gz trace under {path}; run train.py with --profile first")
    return max(candidates, key=lambda p: p.stat().st_mtime)


def load_trace(path: Path) -> dict:
    trace_path = find_trace(path)
    opener = gzip.open if trace_path.name.endswith(".gz") else open
    try:
        with opener(trace_path, "rt") as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise TraceError(f"{trace_path} is not a readable JSON trace ({exc})") from None
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise TraceError(f"{trace_path} has no traceEvents: not a PyTorch profiler chrome trace")
    trace["_path"] = trace_path
    return trace


# --------------------------------------------------------------------------- summarizing


def summarize_trace(trace: dict) -> TraceSummary:
    events = [e for e in trace["traceEvents"] if isinstance(e, dict)]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    summary = TraceSummary(path=trace.get("_path", Path("?")))
    summary.steps = [
        (e["name"], float(e["dur"]))
        for e in sorted(complete, key=lambda e: e["ts"])
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")
    ]
    summary.cpu_ops = cpu_ops_by_self_time([e for e in complete if e.get("cat") == "cpu_op"])
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    summary.kernels = _totals(kernels)
    if kernels:
        summary.gpu_busy_us = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        summary.comm_us = sum(e["dur"] for e in kernels if is_communication(e["name"]))
    else:
        summary.comm_us = sum(op.self_us for op in summary.cpu_ops if is_communication(op.name))
    summary.memcpy_us = sum(e["dur"] for e in complete if e.get("cat") in ("gpu_memcpy", "gpu_memset"))
    summary.peak_allocated = peak_allocated(events)
    return summary


def cpu_ops_by_self_time(ops: list[dict]) -> list[OpTime]:
    """Self time = own duration minus that of the ops directly nested in it on the same thread."""
    table: dict[str, OpTime] = {}
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[dict, list[float]]] = []  # (event, [children's time])
        for e in thread_ops:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                _close(stack.pop(), table)
            if stack:
                stack[-1][1][0] += e["dur"]
            stack.append((e, [0.0]))
        while stack:
            _close(stack.pop(), table)
    return sorted(table.values(), key=lambda op: op.self_us, reverse=True)


def _close(entry: tuple[dict, list[float]], table: dict[str, OpTime]) -> None:
    event, children = entry
    op = table.setdefault(event["name"], OpTime(event["name"]))
    op.calls += 1
    op.total_us += event["dur"]
    op.self_us += max(event["dur"] - children[0], 0.0)


def _totals(events: list[dict]) -> list[OpTime]:
    table: dict[str, OpTime] = {}
    for e in events:
        op = table.setdefault(e["name"], OpTime(e["name"]))
        op.calls += 1
        op.total_us += e["dur"]
        op.self_us += e["dur"]
    return sorted(table.values(), key=lambda op: op.total_us, reverse=True)


def peak_allocated(events: list[dict]) -> dict[str, int]:
    """Peak 'Total Allocated' per device from the profiler's [memory] events (profile_memory=True)."""
    peaks: dict[str, int] = {}
    for e in events:
        if e.get("name") != "[memory]":
            continue
        args = e.get("args", {})
        device = "cpu" if args.get("Device Type", 0) == 0 else f"cuda:{args.get('Device Id', 0)}"
        peaks[device] = max(peaks.get(device, 0), int(args.get("Total Allocated", 0)))
    return peaks


# --------------------------------------------------------------------------- printing


def format_summary(summary: TraceSummary, top: int = 15) -> str:
    lines = [f"trace: {summary.path}"]
    if summary.steps:
        walls = ", ".join(f"{name.split('#')[-1]}: {dur / 1e3:.1f} ms" for name, dur in summary.steps)
        lines.append(f"profiled steps ({len(summary.steps)}): {walls}")
    wall = summary.profiled_us
    if summary.gpu_busy_us is not None and wall:
        lines.append(
            f"GPU busy {summary.gpu_busy_us / wall:.0%} of the profiled steps "
            "(idle gaps between kernels: CPU-bound launch, data wait or synchronization)"
        )
    if wall:
        where = "GPU kernels" if summary.kernels else "CPU ops, self time"
        lines.append(f"communication ({where}): {summary.comm_us / 1e3:.1f} ms = {summary.comm_us / wall:.0%} of the steps")
        if summary.memcpy_us:
            lines.append(f"memcpy/memset on the GPU: {summary.memcpy_us / 1e3:.1f} ms = {summary.memcpy_us / wall:.0%}")
    for device, nbytes in sorted(summary.peak_allocated.items()):
        lines.append(f"peak allocated on {device} (profiler memory events): {nbytes / MIB:.1f} MiB")
    if summary.kernels:
        lines += ["", _op_table("top GPU kernels by total time", summary.kernels[:top], wall, self_column=False)]
    lines += ["", _op_table("top CPU ops by self time", summary.cpu_ops[:top], wall, self_column=True)]
    return "\n".join(lines)


def _op_table(title: str, ops: list[OpTime], wall: float, self_column: bool) -> str:
    header = ["op", "calls", "self ms" if self_column else "total ms", "of steps"]
    rows = []
    for op in ops:
        t = op.self_us if self_column else op.total_us
        rows.append([_shorten(op.name), str(op.calls), f"{t / 1e3:.2f}", f"{t / wall:.1%}" if wall else "-"])
    return f"{title}\n{text_table(header, rows)}"


def _shorten(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Summarize a PyTorch profiler chrome trace: step times, top ops/kernels, GPU busy "
        "fraction, communication share, peak memory. Pass a trace file or a run's profile/ folder."
    )
    parser.add_argument("trace", type=Path, help="trace .json/.json.gz, or a folder (newest trace in it)")
    parser.add_argument("--top", type=int, default=15, help="rows in each op table")
    parser.add_argument("--markdown", type=Path, help="also write the summary into this Markdown file")
    args = parser.parse_args(argv)
    try:
        summary = summarize_trace(load_trace(args.trace))
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = format_summary(summary, args.top)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"# Profiler trace summary\n\n```\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
