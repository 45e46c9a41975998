"""Muon against AdamW on one config: the library behind ``tools/bench_muon.py``.

Two measurements, each side by side:

- time: the optimizer step alone and the whole training step (forward, backward, optimizer) of
  each optimizer, in one process, in interleaved rounds (A B, A B, ...) so that a busy spell of a
  shared machine slows both alike; ratios are taken round by round (common/measure.py). The
  optimizer state each keeps is counted from the tensors it holds after a step;
- loss: real training runs (train.py in a subprocess, the default corpus, its validation set),
  one per (optimizer, peak learning rate, seed, steps), resumable: a finished run is read back,
  not run again. Each optimizer's learning rate is tuned over its grid at seed 0; the best
  (lowest final validation loss) is run with the other seeds. Equal steps compares the two at the
  config's steps. Equal wall time gives AdamW the steps it runs in Muon's time, steps x the
  measured whole-step ratio, at its tuned learning rate (its schedule stretched to the longer run).

Loss curves are train.py's own logs (metrics.jsonl): the training loss every log interval and the
validation loss every eval interval and at the end.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from common.measure import interleaved, ratio_summary, summarize
from model.gpt import GPT
from parallel.distributed import DistContext
from parallel.optim import build_optimizer
from training.build import build_from_config
from training.config import JobConfig
from training.loop import train_step

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon")


# --------------------------------------------------------------------------- time, side by side


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (moments, momentum buffers; step counts too)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def optimizer_variants(cfg: JobConfig) -> dict[str, JobConfig]:
    """The job with each optimizer (everything else as configured)."""
    return {name: replace(cfg, optim=replace(cfg.optim, name=name)) for name in OPTIMIZERS}


def time_steps(cfg: JobConfig, rounds: int, warmup: int = 2) -> dict:
    """Seconds of the optimizer step alone and of a whole training step, per optimizer, one sample per
    interleaved round; and each optimizer's state bytes. One process, random tokens."""
    device = torch.device("cpu")
    variants = optimizer_variants(cfg)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.seq_len + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()  # one set of gradients, stepped again and again
    optimizers = {}
    for name, job in variants.items():
        copy = GPT(cfg.model)
        copy.load_state_dict(model.state_dict())
        for p, q in zip(copy.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        optimizers[name] = build_optimizer(list(copy.named_parameters()), job.optim, device)
    optimizer_s = interleaved({name: opt.step for name, opt in optimizers.items()}, rounds, warmup, device)
    engines = {name: build_from_config(job, DistContext.single(device)).engine for name, job in variants.items()}
    x, y = tokens[:, :-1], tokens[:, 1:]
    accum = cfg.train.grad_accum_steps

    def train(engine):
        return lambda: train_step(engine, iter([(x, y)] * accum), accum, cfg.optim.lr)

    step_s = interleaved({name: train(engine) for name, engine in engines.items()}, rounds, warmup, device)
    return {"optimizer_step_s": optimizer_s, "train_step_s": step_s,
            "state_bytes": {name: state_bytes(opt) for name, opt in optimizers.items()},
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def step_ratio(timing: dict, key: str = "train_step_s") -> dict:
    """Muon's time over AdamW's, round by round: median, min, max."""
    r = ratio_summary(timing[key]["muon"], timing[key]["adamw"])
    return {"median": r.median, "min": r.min, "max": r.max, "n": r.n}


# --------------------------------------------------------------------------- loss, from training runs


@dataclass(frozen=True)
class Run:
    optimizer: str
    lr: float
    seed: int
    steps: int

    @property
    def name(self) -> str:
        return f"{self.optimizer}_lr{self.lr:g}_seed{self.seed}_steps{self.steps}"

    def overrides(self, log_interval: int, eval_interval: int) -> list[str]:
        return [f"--optim.name={self.optimizer}", f"--optim.lr={self.lr}", f"--optim.min_lr={self.lr / 10}",
                f"--train.seed={self.seed}", f"--train.max_steps={self.steps}",
                f"--train.log_interval={log_interval}", f"--train.eval_interval={eval_interval}",
                "--checkpoint.interval=0", "--checkpoint.save_final=false", "--logging.progress=plain",
                f"--name={self.name}"]


@dataclass
class Curve:
    """What a finished run logged: training loss and validation loss by step, and its wall time."""

    run: Run
    train: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def final_val(self) -> float:
        return self.val[max(self.val)]


def read_curve(run: Run, run_dir: Path, wall_s: float) -> Curve:
    curve = Curve(run, wall_s=wall_s)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("loss") is not None:
            curve.train[row["step"]] = row["loss"]
        if "val_loss" in row:
            curve.val[row["step"]] = row["val_loss"]
    if run.steps not in curve.val:
        raise RuntimeError(f"{run_dir}: no validation loss at step {run.steps}; the run did not finish")
    return curve


def train_run(run: Run, config: str, extra: list[str], out_dir: Path, threads: int, log_interval: int,
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


def run_all(runs: list[Run], workers: int, progress, **kwargs) -> dict[Run, Curve]:
    """Every run, ``workers`` at a time; ``progress(line)`` hears each one start and end."""
    curves: dict[Run, Curve] = {}
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


def best_lr(curves: dict[Run, Curve], optimizer: str, steps: int, seed: int) -> float:
    """The grid's learning rate with the lowest final validation loss at ``seed``."""
    candidates = {r.lr: c.final_val for r, c in curves.items()
                  if r.optimizer == optimizer and r.steps == steps and r.seed == seed}
    return min(candidates, key=candidates.get)


def over_seeds(curves: dict[Run, Curve], optimizer: str, lr: float, steps: int) -> list[Curve]:
    return [c for r, c in sorted(curves.items(), key=lambda rc: rc[0].seed)
            if (r.optimizer, r.lr, r.steps) == (optimizer, lr, steps)]


def final_summary(curves: list[Curve]) -> dict:
    s = summarize([c.final_val for c in curves])
    return {"median": s.median, "min": s.min, "max": s.max, "n": s.n}


def band(curves: list[Curve], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps logged by every curve, with the median, min and max over the curves at each."""
    steps = sorted(set.intersection(*(set(getattr(c, key)) for c in curves)))
    values = [[getattr(c, key)[s] for c in curves] for s in steps]
    return steps, [statistics.median(v) for v in values], [min(v) for v in values], [max(v) for v in values]
