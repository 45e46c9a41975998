"""The profiling workflow's own parts: trace summary, memory snapshot, and tools/profile.sh end to end.

profile.sh runs the real train.py on a 2-layer tiny config for 4 steps (profiler: 1 wait, 1 warmup,
1 active) and the real summary and snapshot tools; a PYTHON wrapper only records how each tool was
launched (arguments, NCCL environment) before handing over to this interpreter.
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

ROOT = Path(__file__).resolve().parents[2]


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


def test_communication_on_a_cpu_trace_is_what_the_classifier_names():
    """Without GPU kernels the share is the self time of CPU ops that are communication: sends,
    receives and waits of a pipeline count; aten::broadcast_tensors (no communication) does not."""
    def x(name, ts, dur):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": "cpu_op", "pid": 1, "tid": 1}

    trace = {"traceEvents": [
        x("aten::broadcast_tensors", 0, 40), x("c10d::send", 50, 10), x("c10d::recv_", 70, 20),
        x("_c10d_functional::wait_tensor", 100, 5), x("c10d::alltoall_base_", 110, 7),
    ]}
    assert trace_summary.summarize_trace(trace).comm_us == 10 + 20 + 5 + 7


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
            "--model.recompute=full", "--train.device=cpu"]
    assert memory_snapshot.main(args) == 0
    out = capsys.readouterr().out
    assert "recompute=full" in out and "Self CPU Mem" in out
    summary = trace_summary.summarize_trace(trace_summary.load_trace(tmp_path / "memory_trace_cpu.json"))
    assert summary.peak_allocated["cpu"] > 0


def test_memory_snapshot_refuses_multi_process_strategies(capsys):
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--parallel.strategy=ddp"]
    assert memory_snapshot.main(args) == 2
    assert "--parallel.strategy=none" in capsys.readouterr().err


# Stands in for the python binary: records each launch (argv, NCCL_* environment), then runs the
# real interpreter with the same arguments.
PYTHON_WRAPPER = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    with open({log!r}, "a") as f:
        nccl = {{k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
        f.write(json.dumps({{"argv": sys.argv[1:], "nccl": nccl}}) + "\\n")
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
""")

# profile_wait 1 + warmup 1 + active 1: profile.sh's default is 4 steps, one of them traced.
PROFILE_OVERRIDES = {
    "logging.progress": "plain", "data.default_corpus_max_mb": 2.0, "model.n_layer": 2, "model.d_model": 64,
    "model.max_seq_len": 64, "train.micro_batch_size": 4, "train.log_interval": 1, "optim.warmup_steps": 1,
    "train.profile_wait": 1, "train.profile_warmup": 1, "train.profile_active": 1,
}


def run_profile_sh(tmp_path: Path, corpus_cache: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """tools/profile.sh on the real train.py; returns the result and the launches the wrapper saw."""
    log = tmp_path / "launches.jsonl"
    wrapper = tmp_path / "python"
    wrapper.write_text(PYTHON_WRAPPER.format(python=sys.executable, log=str(log)))
    wrapper.chmod(0o755)
    env = {**os.environ, "PYTHON": str(wrapper), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("NCCL_DEBUG", None)
    env.pop("TRAIN_PY", None)
    overrides = [f"--{k}={v}" for k, v in {**PROFILE_OVERRIDES, "data.cache_dir": corpus_cache}.items()]
    cmd = ["bash", str(ROOT / "tools/profile.sh"), *args, "configs/tiny.yaml", *overrides,
           f"--logging.run_dir={tmp_path / 'run'}"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return result, launches


def _train_launch(launches: list[dict]) -> dict:
    calls = [c for c in launches if c["argv"] and c["argv"][0].endswith("train.py")]
    assert len(calls) == 1, launches
    return calls[0]


@pytest.mark.timeout(420)
def test_profile_sh_trains_profiles_summarizes_and_snapshots(tmp_path, corpus_cache):
    profile_dir = tmp_path / "run" / "profile"
    profile_dir.mkdir(parents=True)
    stale = profile_dir / "trace_rank0_old.json"  # from an earlier run: must not be summarized again
    stale.write_text(json.dumps({"traceEvents": []}))
    os.utime(stale, (1_000_000_000, 1_000_000_000))

    result, launches = run_profile_sh(tmp_path, corpus_cache, "--nccl-debug")
    assert result.returncode == 0, result.stderr[-3000:]
    call = _train_launch(launches)
    argv = call["argv"]
    assert argv[1:3] == ["--config", "configs/tiny.yaml"] and argv[3].startswith("--name=tiny-profile-")
    assert argv[4:6] == ["--profile", "--train.max_steps=4"]
    assert argv[-1] == f"--logging.run_dir={tmp_path / 'run'}"  # the user's overrides come last and win
    assert call["nccl"]["NCCL_DEBUG"] == "INFO" and call["nccl"]["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert call["nccl"]["NCCL_DEBUG_FILE"] == f"{profile_dir}/nccl.%h.%p.log"

    # train.py really ran its 4 steps and wrote one profiler trace
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2, 3, 4]
    traces = sorted(set(profile_dir.glob("trace_rank0_*.json")) - {stale})
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    profiled = sorted(int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert len(profiled) == 1  # train.profile_active=1
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}

    # the summary is of that trace, not of the stale one
    summary = traces[0].with_name(traces[0].name.replace(".json", ".summary.txt")).read_text()
    assert f"profiled steps (1): {profiled[0]}: " in summary
    assert "aten::mm" in ops and "aten::mm" in summary
    assert not stale.with_name("trace_rank0_old.summary.txt").exists()

    # the memory snapshot ran on the same model in one process
    snapshot = [c for c in launches if c["argv"] and c["argv"][:2] == ["-m", "tools.memory_snapshot"]]
    assert len(snapshot) == 1 and "--parallel.strategy=none" in snapshot[0]["argv"]
    memory_events = json.loads((profile_dir / "memory_trace_cpu.json").read_text())["traceEvents"]
    assert any(e.get("name") == "[memory]" for e in memory_events)


@pytest.mark.timeout(420)
def test_profile_sh_fails_clearly_when_no_trace_appears(tmp_path, corpus_cache):
    # 1 step ends inside the profiler's wait + warmup: train.py succeeds but records nothing. (At
    # exactly wait + warmup steps torch's profiler still writes the unfinished active window.)
    result, launches = run_profile_sh(tmp_path, corpus_cache, "--no-snapshot", "--steps", "1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "wrote no trace" in result.stderr
    assert "--train.max_steps=1" in _train_launch(launches)["argv"]
    assert (tmp_path / "run/metrics.jsonl").is_file()  # the training run itself went through


def test_profile_sh_rejects_bad_usage(tmp_path):
    for args, message in ((["-n", "0", "c.yaml"], "--nproc must be a positive integer"),
                          ([], "no CONFIG given"), (["--bogus", "c.yaml"], "unknown option --bogus")):
        result = subprocess.run(["bash", str(ROOT / "tools/profile.sh"), *args], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
