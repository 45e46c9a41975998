"""Variants of one job compared by training them: the machinery behind the benchmarks that put
configurations side by side (``analysis/optimizer_bench.py``, ``analysis/deepseek_bench.py``).

- loss: real training runs (train.py in a subprocess, each in its own directory under an output
  folder), several at once, resumable: a run whose ``done.json`` exists is read back, not run
  again. A run's curve is train.py's own log (metrics.jsonl): the training loss every log
  interval, the validation loss every eval interval and at the end, and the multi-token-prediction
  loss where the model has one;
- time: a whole training step (forward, backward, optimizer) of each variant, in one process, in
  interleaved rounds (A B, A B, ...) so that a busy spell of a shared machine slows them alike.

A run is anything with a ``name`` (its directory), its ``steps`` and ``overrides(log_interval,
eval_interval)`` (the --section.key=value arguments train.py gets); ``Run`` is the plain one.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import ConfigError
from common.measure import interleaved, machine_load, summarize
from parallel.distributed import DistContext
from training.build import build_from_config
from training.config import JobConfig
from training.loop import train_step

ROOT = Path(__file__).resolve().parents[1]


def standard_overrides(name: str, seed: int, steps: int, log_interval: int, eval_interval: int) -> list[str]:
    """What every compared run sets alike: seed, length, logging, no checkpoints, its name."""
    return [f"--train.seed={seed}", f"--train.max_steps={steps}", f"--train.log_interval={log_interval}",
            f"--train.eval_interval={eval_interval}", "--checkpoint.interval=0", "--checkpoint.save_final=false",
            "--logging.progress=plain", f"--name={name}"]


@dataclass(frozen=True)
class Run:
    """One variant (its --section.key=value ``settings`` on top of the job) at one seed and length."""

    variant: str
    seed: int
    steps: int
    settings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.variant}_seed{self.seed}_steps{self.steps}"

    def overrides(self, log_interval: int, eval_interval: int) -> list[str]:
        return [*self.settings, *standard_overrides(self.name, self.seed, self.steps, log_interval, eval_interval)]


@dataclass
class Curve:
    """What a finished run logged: training loss, validation loss (and multi-token-prediction loss,
    where the model has it) by step, and its wall time."""

    run: object
    train: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0
    mtp: dict[int, float] = field(default_factory=dict)

    @property
    def final_val(self) -> float:
        return self.val[max(self.val)]


def read_curve(run, run_dir: Path, wall_s: float) -> Curve:
    curve = Curve(run, wall_s=wall_s)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("loss") is not None:
            curve.train[row["step"]] = row["loss"]
        if "val_loss" in row:
            curve.val[row["step"]] = row["val_loss"]
        if row.get("mtp_loss") is not None:
            curve.mtp[row["step"]] = row["mtp_loss"]
    if run.steps not in curve.val:
        raise RuntimeError(f"{run_dir}: no validation loss at step {run.steps}; the run did not finish")
    return curve


def train_run(run, config: str, extra: list[str], out_dir: Path, threads: int, log_interval: int,
              eval_interval: int) -> Curve:
    """``run`` through train.py, or its earlier result when ``out_dir/<name>/done.json`` says it finished."""
    run_dir = out_dir / run.name
    done = run_dir / "done.json"
    if done.exists():
        return read_curve(run, run_dir, json.loads(done.read_text())["wall_s"])
    command = [sys.executable, str(ROOT / "train.py"), "--config", config, *extra,
               *run.overrides(log_interval, eval_interval), f"--logging.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{run.name} failed (exit {result.returncode}): {tail[0]}")
    wall = time.perf_counter() - start
    curve = read_curve(run, run_dir, wall)
    done.write_text(json.dumps({"wall_s": wall, "final_val_loss": curve.final_val}) + "\n")
    return curve


def run_all(runs: list, workers: int, progress, **kwargs) -> dict:
    """Every run, ``workers`` at a time; ``progress(line)`` hears each one start and end."""
    curves = {}
    started = time.perf_counter()

    def one(index_run):
        index, run = index_run
        progress(f"[{index + 1}/{len(runs)}] {run.name} ...")
        curve = train_run(run, **kwargs)
        elapsed = time.perf_counter() - started
        progress(f"[{index + 1}/{len(runs)}] {run.name}: final val_loss {curve.final_val:.4f} "
                 f"({curve.wall_s:.0f}s; {elapsed / 60:.0f} min into this batch)")
        return run, curve

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for run, curve in pool.map(one, enumerate(runs)):
            curves[run] = curve
    return curves


def final_summary(curves: list[Curve]) -> dict:
    s = summarize([c.final_val for c in curves])
    return {"median": s.median, "min": s.min, "max": s.max, "n": s.n}


def band(curves: list[Curve], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps logged by every curve, with the median, min and max over the curves at each."""
    steps = sorted(set.intersection(*(set(getattr(c, key)) for c in curves)))
    values = [[getattr(c, key)[s] for c in curves] for s in steps]
    return steps, [statistics.median(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def time_train_steps(jobs: dict[str, JobConfig], rounds: int, warmup: int = 2,
                     progress: str | None = None) -> dict[str, list[float]]:
    """Seconds of a whole training step (train.py's ``train_step``: forward, backward, optimizer) of
    each job, one sample per interleaved round, on CPU; every job steps on the same random tokens,
    shaped by the first job's micro-batch, sequence length and accumulation."""
    device = torch.device("cpu")
    first = next(iter(jobs.values()))
    torch.manual_seed(first.train.seed)
    tokens = torch.randint(0, first.model.vocab_size, (first.train.micro_batch_size, first.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    accum = first.train.grad_accum_steps
    engines = {name: build_from_config(job, DistContext.single(device)).engine for name, job in jobs.items()}

    def train(engine, lr):
        return lambda: train_step(engine, iter([(x, y)] * accum), accum, lr)

    return interleaved({name: train(engine, jobs[name].optim.lr) for name, engine in engines.items()}, rounds, warmup,
                       device, progress=progress)


# --------------------------------------------------------------------------- what the command lines share


def add_run_arguments(parser, out: str, rounds: int, eval_interval: int) -> None:
    """The options of a tool over this module: seeds, parallel runs, threads, timing rounds, logging
    intervals, the resumable output folder, where the Markdown and the PNG go."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=1, help="training runs at once")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run and for the timing")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=eval_interval)
    parser.add_argument("--out", type=Path, default=Path(out), help="where the runs and timing go")
    parser.add_argument("--retime", action="store_true", help="time again even if --out holds a timing")
    parser.add_argument("--markdown", type=Path, help="write the tables here (rows as JSON next to them)")
    parser.add_argument("--plot", type=Path, help="write the loss curves here (PNG)")


def check_run_arguments(args, *positive: str) -> None:
    """One line for an option out of range: the counts below 1, a seed listed twice."""
    for key in ("workers", "threads", "rounds", "log_interval", "eval_interval", *positive):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 1 (got {getattr(args, key)})")
    if len(set(args.seeds)) != len(args.seeds):
        raise ConfigError(f"--seeds lists a seed twice: {args.seeds}")


def saved_timing(args, measure) -> dict:
    """``measure()`` (a dict), with the machine load beside it, kept in ``args.out/timing.json`` and
    read back from there on a later call unless ``args.retime``."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "timing.json"
    if path.exists() and not args.retime:
        return json.loads(path.read_text())
    print(f"timing {args.rounds} interleaved rounds ({machine_load()}) ...", file=sys.stderr)
    timing = measure() | {"load": machine_load()}
    path.write_text(json.dumps(timing) + "\n")
    return timing


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
