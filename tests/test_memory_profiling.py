"""The profiling workflow's own parts: trace summary, memory snapshot, and tools/profile.sh's plumbing.

profile.sh is run against a stub train.py (TRAIN_PY) that writes a small chrome trace where the real
one would, so the script's argument handling, run-dir resolution, NCCL environment and summary step
are checked without a training run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tools import memory_snapshot, trace_summary

ROOT = Path(__file__).resolve().parents[1]


def synthetic_trace() -> dict:
    """Hand-made events whose summary is known: nested CPU ops, overlapping kernels, memory events."""
    def x(name, ts, dur, cat, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": tid}

    def mem(ts, total, dev=1):
        args = {"Total Allocated": total, "Device Type": dev, "Device Id": 0}
        return {"ph": "i", "name": "[memory]", "ts": ts, "cat": "cpu_instant_event", "pid": 1, "tid": 1, "args": args}

    return {"traceEvents": [
        x("ProfilerStep#4", 0, 200, "user_annotation"),
        x("aten::linear", 0, 100, "cpu_op"),        # self = 100 - 30 - 10 = 60
        x("aten::addmm", 10, 30, "cpu_op"),
        x("aten::add", 50, 10, "cpu_op"),
        x("aten::add", 120, 5, "cpu_op", tid=2),    # another thread: not a child of linear
        x("gemm_kernel", 0, 10, "kernel"),
        x("gemm_kernel", 5, 10, "kernel"),          # overlaps the first: busy 0..15
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 10, "kernel"),
        x("Memcpy HtoD (Pageable -> Device)", 40, 4, "gpu_memcpy"),
        mem(1, 100), mem(2, 300), mem(3, 200), mem(4, 50, dev=0),
    ]}


def test_summary_of_a_hand_made_trace():
    s = trace_summary.summarize_trace(synthetic_trace())
    assert s.steps == [("ProfilerStep#4", 200.0)]
    ops = {op.name: op for op in s.cpu_ops}
    assert (ops["aten::linear"].self_us, ops["aten::linear"].total_us) == (60.0, 100.0)
    assert (ops["aten::add"].calls, ops["aten::add"].self_us) == (2, 15.0)
    assert s.cpu_ops[0].name == "aten::linear"
    assert s.gpu_busy_us == 25.0  # 0..15 and 20..30
    assert s.comm_us == 10.0 and s.memcpy_us == 4.0
    assert s.peak_allocated == {"cuda:0": 300, "cpu": 50}
    text = trace_summary.format_summary(s)
    assert "GPU busy 12% of the profiled steps" in text
    assert "communication (GPU kernels): 0.0 ms = 5%" in text


def test_summary_of_a_real_profiler_trace(tmp_path):
    from model.config import ModelConfig
    from model.gpt import GPT

    model = GPT(ModelConfig(max_seq_len=16, d_model=32, n_head=2, n_layer=1))
    idx = torch.randint(0, 256, (2, 16))
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    path = tmp_path / "trace_rank0_step2.json"
    with torch.profiler.profile(schedule=schedule, profile_memory=True,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(2):
            model(idx, idx).backward()
            prof.step()
    s = trace_summary.summarize_trace(trace_summary.load_trace(tmp_path))  # a folder: newest trace in it
    assert s.path == path
    assert [name for name, _ in s.steps] == ["ProfilerStep#1"]
    assert "aten::mm" in [op.name for op in s.cpu_ops[:10]]
    assert s.peak_allocated["cpu"] > 0
    assert all(op.self_us <= op.total_us + 1e-6 for op in s.cpu_ops)


def test_summary_cli_reports_missing_traces(tmp_path, capsys):
    assert trace_summary.main([str(tmp_path)]) == 2
    assert "run train.py with --profile first" in capsys.readouterr().err
    (tmp_path / "x.json").write_text(json.dumps({"not": "a trace"}))
    assert trace_summary.main([str(tmp_path / "x.json")]) == 2


def test_memory_snapshot_on_cpu_writes_a_trace_with_memory_events(tmp_path, capsys):
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--out", str(tmp_path), "--steps", "1",
            "--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=32", "--train.micro_batch_size=2",
            "--model.checkpointing=full", "--train.device=cpu"]
    assert memory_snapshot.main(args) == 0
    out = capsys.readouterr().out
    assert "checkpointing=full" in out and "Self CPU Mem" in out
    summary = trace_summary.summarize_trace(trace_summary.load_trace(tmp_path / "memory_trace_cpu.json"))
    assert summary.peak_allocated["cpu"] > 0


def test_memory_snapshot_refuses_multi_process_strategies(capsys):
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--parallel.strategy=ddp"]
    assert memory_snapshot.main(args) == 2
    assert "--parallel.strategy=none" in capsys.readouterr().err


STUB_TRAIN = textwrap.dedent('''
    """Stands in for train.py: records its argv and environment, writes a trace where train.py would."""
    import json, os, sys
    run_dir = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--logging.run_dir=")][-1]
    os.makedirs(os.path.join(run_dir, "profile"), exist_ok=True)
    with open(os.path.join(run_dir, "stub_call.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "nccl": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}, f)
    if os.environ.get("STUB_WRITES_TRACE", "1") == "1":
        events = [{"ph": "X", "name": "ProfilerStep#6", "ts": 0, "dur": 1000, "cat": "user_annotation", "pid": 1, "tid": 1},
                  {"ph": "X", "name": "aten::mm", "ts": 10, "dur": 500, "cat": "cpu_op", "pid": 1, "tid": 1}]
        with open(os.path.join(run_dir, "profile", "trace_rank0_step6.json"), "w") as f:
            json.dump({"traceEvents": events}, f)
''')


def run_profile_sh(tmp_path: Path, *args: str, writes_trace: bool = True) -> subprocess.CompletedProcess:
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB_TRAIN)
    env = {**os.environ, "PYTHON": sys.executable, "TRAIN_PY": str(stub), "STUB_WRITES_TRACE": "1" if writes_trace else "0"}
    env.pop("NCCL_DEBUG", None)
    cmd = ["bash", str(ROOT / "tools/profile.sh"), *args, "configs/tiny.yaml", f"--logging.run_dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(180)
def test_profile_sh_runs_train_with_profile_then_summarizes_the_new_trace(tmp_path):
    result = run_profile_sh(tmp_path, "--no-snapshot", "--nccl-debug")
    assert result.returncode == 0, result.stderr
    call = json.loads((tmp_path / "run/stub_call.json").read_text())
    argv = call["argv"]
    # tiny.yaml keeps the default profiler schedule: wait 2 + warmup 1 + active 3, plus one step.
    assert argv[:4] == ["--config", "configs/tiny.yaml", "--profile", "--train.max_steps=7"]
    assert argv[-1] == f"--logging.run_dir={tmp_path / 'run'}"  # the user's overrides come last and win
    assert call["nccl"]["NCCL_DEBUG"] == "INFO" and call["nccl"]["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert call["nccl"]["NCCL_DEBUG_FILE"] == f"{tmp_path / 'run/profile'}/nccl.%h.%p.log"
    assert "NCCL_PROFILE" not in call["nccl"]
    summary = (tmp_path / "run/profile/trace_rank0_step6.summary.txt").read_text()
    assert "aten::mm" in summary and "profiled steps (1): 6: 1.0 ms" in summary
    assert "memory snapshot skipped" in result.stdout


@pytest.mark.timeout(180)
def test_profile_sh_fails_clearly_when_no_trace_appears(tmp_path):
    result = run_profile_sh(tmp_path, "--no-snapshot", "--steps", "2", writes_trace=False)
    assert result.returncode == 1
    assert "wrote no trace" in result.stderr
    assert "--train.max_steps=2" in json.loads((tmp_path / "run/stub_call.json").read_text())["argv"]


def test_profile_sh_rejects_bad_usage(tmp_path):
    for args, message in ((["-n", "0", "c.yaml"], "--nproc must be a positive integer"),
                          ([], "no CONFIG given"), (["--bogus", "c.yaml"], "unknown option --bogus")):
        result = subprocess.run(["bash", str(ROOT / "tools/profile.sh"), *args], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
