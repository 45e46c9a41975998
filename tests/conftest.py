"""Shared test set-up: the two tiers, launch helpers, and a small cached default corpus for runs.

The repository root is importable through pytest's ``pythonpath`` setting (pyproject.toml).

Tiers. A test that starts another process (train.py or a tool in a subprocess, torchrun, the gloo
worker launcher in tests/gloo.py, a shell script) costs seconds of interpreter start-up per process,
so it belongs to the ``slow`` tier, and ``python -m pytest -m "not slow"`` is the inner loop. The
mark is found, not written by hand: ``pytest_collection_modifyitems`` reads the code a test runs
(its function, its fixtures, and the helpers of tests/ they call) for the names that launch a
process. So that nothing slips through, a test left in the fast tier that does launch one fails
with a line saying so (``_launch_guard``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

if not torch.cuda.is_available():
    # Triton reads this when triton.language is first imported, and `import torch._dynamo` already
    # does that, so it is set once for the session: on CPU the kernels run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ----------------------------------------------------------------------------- the slow tier

# Names whose use means a process is launched: the helpers below and tests/gloo.py's, and the
# standard-library and torch entry points they are built on.
LAUNCH_NAMES = frozenset({"run_train", "run_torchrun", "run_workers", "subprocess", "start_processes"})
PROJECT_PACKAGES = frozenset({"tests", "common", "kernels", "model", "data", "parallel", "training", "analysis",
                              "tools", "train"})
_LAUNCHES: dict = {}  # code object -> whether it launches; a cache over the whole collection


def _launches(code, namespace: dict) -> bool:
    """Whether ``code`` launches a process: it names a launcher, or a nested function or a function
    of this project that it refers to does (so a test calling a tool's ``main`` that launches counts)."""
    if code in _LAUNCHES:
        return _LAUNCHES[code]
    _LAUNCHES[code] = False  # a cycle ends here
    found = bool(LAUNCH_NAMES & set(code.co_names)) or any(
        _launches(const, namespace) for const in code.co_consts if hasattr(const, "co_names"))
    for name in code.co_names:
        if found:
            break
        target = namespace.get(name)
        func = getattr(target, "__func__", target)  # methods and static methods
        module = getattr(func, "__module__", None) or ""
        if callable(func) and hasattr(func, "__code__") and module.split(".")[0] in PROJECT_PACKAGES:
            found = _launches(func.__code__, func.__globals__)
        elif isinstance(target, type(os)) and target.__name__.split(".")[0] in PROJECT_PACKAGES:
            # a module used as a namespace (``bench_parallel.main``): its functions that this code names
            found = any(_launches(f.__code__, f.__globals__) for f in
                        (getattr(target, n, None) for n in code.co_names) if hasattr(f, "__code__"))
    _LAUNCHES[code] = found
    return found


def pytest_collection_modifyitems(config, items):
    for item in items:
        funcs = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        for name in item.fixturenames:
            if name == "_launch_guard":  # the guard itself refers to subprocess
                continue
            defs = info.name2fixturedefs.get(name) if info is not None else None
            if defs:
                funcs.append(defs[-1].func)
        if any(f is not None and hasattr(f, "__code__") and _launches(f.__code__, f.__globals__)
               for f in (getattr(f, "__wrapped__", f) for f in funcs)):
            item.add_marker(pytest.mark.slow)


def _is_launch(args) -> bool:
    """A command that starts a Python interpreter or a shell script (not a compiler Inductor calls)."""
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else list(args))]
    if not argv:
        return False
    program = Path(argv[0].split()[0]).name
    if program in ("bash", "sh") or program.endswith(".sh"):
        return True
    # Python running a script or a module (Inductor's own ``python -c`` probes and compile workers are not launches)
    runs_code = any(a == "-m" or a.endswith(".py") for a in argv[1:])
    return program.startswith("python") and runs_code and not any("torch._inductor" in a for a in argv)


@pytest.fixture(autouse=True)
def _launch_guard(request, monkeypatch):
    """In the fast tier, starting a process is a classification error: say so instead of running slowly."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        if _is_launch(args):
            raise AssertionError(f"{request.node.nodeid} launches {args!r} but is not in the slow tier: call the "
                                 "launch through run_train / run_torchrun / run_workers / subprocess in tests/ so "
                                 "tests/conftest.py marks it slow")
        original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield


@pytest.fixture(autouse=True)
def _run_logging_reset():
    """train.main or a tool run in-process (also by a module-scoped fixture) configures the project's
    loggers for that run: a rank-tagged handler and no propagation to Python's root logger. Each test
    starts from the unconfigured state, so caplog sees the project's records whatever ran before."""
    for name in ("perfgpt", "perfgpt.every_rank"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    yield


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def one_thread():
    """For in-process measurements: one thread is faster and steadier on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """A 2 MB default corpus shared by every test run of train.py in this session."""
    from data.default_corpus import ensure_default_corpus

    cache = tmp_path_factory.mktemp("corpus-cache")
    ensure_default_corpus(str(cache), max_mb=2.0, val_fraction=0.05)
    return str(cache)


def tiny_overrides(run_dir: Path, corpus_cache: str, **extra: object) -> list[str]:
    """Overrides that make configs/tiny.yaml run in seconds inside a test."""
    base = {
        "logging.run_dir": str(run_dir),
        "logging.progress": "plain",
        "data.cache_dir": corpus_cache,
        "data.default_corpus_max_mb": 2.0,
        "model.n_layer": 2,
        "model.d_model": 64,
        "model.max_seq_len": 64,
        "train.micro_batch_size": 4,
        "train.max_steps": 6,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "optim.warmup_steps": 2,
    }
    base.update(extra)
    return [f"--{k}={v}" for k, v in base.items()]


def run_train(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run train.py in a fresh interpreter, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env,
    )


def run_torchrun(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run train.py under torchrun with ``nproc`` CPU processes (gloo), one thread each."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         str(ROOT / "train.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


def can_mount_tmpfs() -> bool:
    """Whether ``unshare -rm`` may mount a private tmpfs here (user namespaces): the tests that fill
    a real disk run inside one."""
    import shutil

    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def val_loss(run_dir: Path) -> float:
    return next(m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m)


def torchrun_matches_one_process(tmp_path: Path, corpus_cache: str, config: str, overrides: dict, *,
                                 one_batch: int, rank_batch: int, layout: list[str], expect: list[str]) -> None:
    """A short run of ``config`` under 4-rank torchrun with the ``layout`` flags equals one process
    reading the same windows (micro-batch ``one_batch`` there, ``rank_batch`` on each rank): every
    step's loss and the validation loss within 1e-5; the start-up log holds each of ``expect``."""
    one, many = tmp_path / "one", tmp_path / "many"
    proc = run_train(["--config", config, *tiny_overrides(one, corpus_cache, **overrides,
                                                         **{"train.micro_batch_size": one_batch})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_torchrun(4, ["--config", config, *tiny_overrides(many, corpus_cache, **overrides,
                                                                **{"train.micro_batch_size": rank_batch}), *layout],
                        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in expect:
        assert line in proc.stdout, line
    ref, got = step_losses(one), step_losses(many)
    assert sorted(got) == sorted(ref) and ref
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step
    assert val_loss(many) == pytest.approx(val_loss(one), abs=1e-5)


def pytest_sessionfinish(session, exitstatus):
    """A child process a test left running (a DataLoader worker, a spawned rank) would keep this
    interpreter from exiting, as multiprocessing joins its children at exit: stop and name them,
    and fail the run, so a leak shows as a failure instead of a hang."""
    import multiprocessing

    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join(timeout=10)
    if left:
        print(f"\nstopped {len(left)} child process(es) left running by tests: {', '.join(c.name for c in left)}")
        session.exitstatus = 1
