"""Shared test set-up: the two tiers, launch helpers, and a small cached default corpus for runs.

The repository root is importable through pytest's ``pythonpath`` setting (pyproject.toml).

Tiers. The directory is the tier. tests/unit/ holds the fast tier: tests that run in this process.
A test that starts another process (train.py or a tool in a subprocess, torchrun, the gloo workers
of tests/gloo.py, a shell script) costs seconds of interpreter start-up per process, so it lives
under tests/integration/, and everything there is marked ``slow``: ``python -m pytest -m "not slow"``
is the inner loop, ``-m slow`` the rest. A test outside tests/integration/ that starts one fails
with a line saying to move it (``_launch_guard``); one marked ``slow`` by hand is a usage error.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One intra-op thread for what runs in this process: the tests' tensors are tiny, so a second thread
# saves little on a quiet machine, while on a loaded one OpenMP's waiting threads burn the CPU share
# (test_gpt.py's two overfit tests: 16 s of CPU with one thread, 92 s with two, at load 9).
torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton reads this when triton.language is first imported, and `import torch._dynamo` already
    # does that, so it is set once for the session: on CPU the kernels run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ----------------------------------------------------------------------------- the tiers

INTEGRATION = ROOT / "tests" / "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("slow") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked slow: move it under tests/integration/, whose "
                                    "tests are the slow tier, and drop the mark")


def _argv(args) -> list[str]:
    return [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else list(args))]


def _is_launch(argv: list[str]) -> bool:
    """A command that starts a Python interpreter or a shell script, unless torch's compiler starts it
    for itself (Inductor's compile workers and its ``python -c`` probes of the CPU's vector units)."""
    if not argv:
        return False
    program = Path(argv[0].split()[0]).name
    if program in ("bash", "sh") or program.endswith(".sh"):
        return True
    runs_code = any(a in ("-m", "-c") or a.endswith(".py") for a in argv[1:])
    return program.startswith("python") and runs_code and not _called_from("torch._inductor")


def _called_from(package: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(package):
            return True
        frame = frame.f_back
    return False


@pytest.fixture(scope="module", autouse=True)
def _launch_guard(request):
    """Outside tests/integration/, starting a process is a misplaced test: say where it belongs
    instead of running slowly. Module-scoped, so a shared module fixture that launches is caught too."""
    if Path(request.node.path).is_relative_to(INTEGRATION):
        yield
        return
    where = request.node.nodeid

    def refuse(what: str):
        raise AssertionError(f"{where} starts {what}: a test that launches a process belongs under "
                             "tests/integration/ (the directory is the tier)")

    original = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        if _is_launch(_argv(args)):
            refuse(repr(" ".join(_argv(args)).replace("\n", " ")[:100]))
        original(self, args, *a, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", guarded)
        # tests/gloo.py's workers (forkserver) and torch.multiprocessing.spawn start fresh interpreters;
        # forked children (DataLoader workers) do not, and stay allowed.
        for kind in (multiprocessing.context.ForkServerProcess, multiprocessing.context.SpawnProcess):
            patch.setattr(kind, "_Popen", staticmethod(lambda process, name=kind.__name__: refuse(f"a {name}")))
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
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join(timeout=10)
    if left:
        print(f"\nstopped {len(left)} child process(es) left running by tests: {', '.join(c.name for c in left)}")
        session.exitstatus = 1
