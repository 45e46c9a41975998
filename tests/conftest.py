"""Shared test set-up: launch helpers, and a small cached default corpus for runs.

The repository root is importable through pytest's ``pythonpath`` setting (pyproject.toml)."""

from __future__ import annotations

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
