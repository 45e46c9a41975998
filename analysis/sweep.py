"""A grid of training runs, each a real ``train.py`` run, and the one table they add up to.

A sweep is a YAML file (configs/sweeps/*.yaml)::

    config: configs/tiny.yaml          # the base job config of every point
    overrides:                         # keys set for every point
      checkpoint.interval: 0
    axes:                              # the grid: the product of the axes, in this order
      width:                           # an axis whose values each set several keys
        - {model.d_model: 64, model.n_head: 4}
        - {model.d_model: 128, model.n_head: 4}
      train.max_steps: [200, 600]      # an axis of one key

Every point is its own ``train.py`` process (one at a time, or ``workers`` at once, each with
``threads`` CPU threads), in its own folder ``<out>/runs/<point>/`` (the run directory: log,
metrics.jsonl, config.yaml). When it ends well the sweep writes ``sweep_point.json`` there, the
point's row; that file is what makes a point finished, so a sweep started again skips finished
points (a point whose keys changed since, or that never finished, runs again from the start).
Every point's config is resolved and validated before the first run starts, so a bad key or value
is one line, not a failure an hour in.

The row: parameters N (the matmul parameters of ``model.flops``, the N of 6ND) and the total count,
tokens D (steps x batch x sequence), FLOPs (the project's convention, ``model.flops``) and 6ND, the
final validation loss (train.py evaluates at the last step), the wall time and the CPU time of the
process. CPU time says what a point costs on a quiet machine where wall time on a shared one
cannot: on a loaded machine wall time grows, CPU time barely does.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, Callable

import yaml

from common.errors import ConfigError, DataError
from common.report import markdown_table, read_results, write_results
from model.flops import count_parameters, flops_per_token, matmul_parameters
from training.config import JobConfig, load_config

ROOT = Path(__file__).resolve().parents[1]  # the repository: where train.py runs
POINT_FILE = "sweep_point.json"
SPEC_KEYS = ("config", "overrides", "axes")
# Keys the sweep sets itself for every point: where the run writes, and how it prints.
OWN_KEYS = ("logging.run_dir", "logging.progress", "name")


@dataclass(frozen=True)
class Point:
    name: str  # also its folder under <out>/runs
    overrides: dict[str, Any]  # dotted key -> value: the sweep's fixed keys, then this point's

    def arguments(self) -> list[str]:
        return [f"--{key}={_yaml_scalar(value)}" for key, value in self.overrides.items()]


@dataclass(frozen=True)
class Sweep:
    spec_path: str
    config: str  # the base job config
    points: list[Point]


@dataclass
class Row:
    point: str
    params: int  # N: matmul parameters (model.flops.matmul_parameters), the N of C = 6ND
    params_total: int  # every parameter, embeddings included
    tokens: int  # D: optimizer steps x tokens per step
    flops: float  # training FLOPs in the project's convention (model.flops.flops_per_token x D)
    flops_6nd: float  # 6 N D
    val_loss: float
    train_loss: float | None
    wall_s: float
    cpu_s: float  # user + system time of the train.py process
    threads: int
    overrides: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the spec


def load_sweep(path: str | Path) -> Sweep:
    """A sweep file, with every point's config resolved and checked (one line on the first bad one)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path} (see configs/sweeps/)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping with keys {', '.join(SPEC_KEYS)}")
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; a sweep file has {', '.join(SPEC_KEYS)}")
    config = raw.get("config")
    found = [c for c in ((Path(config), ROOT / config) if isinstance(config, str) else ()) if c.is_file()]
    if not found:
        raise ConfigError(f"{path}: config must name the base job config file (e.g. configs/tiny.yaml), got {config!r}")
    fixed = _key_values(raw.get("overrides") or {}, f"{path}: overrides")
    axes = raw.get("axes")
    if not isinstance(axes, dict) or not axes:
        raise ConfigError(f"{path}: axes must map each axis name to a list of values (the grid)")
    levels = [_axis_levels(name, values, path) for name, values in axes.items()]
    points = []
    for combination in product(*levels):
        overrides = dict(fixed)
        for level in combination:
            overrides.update(level)
        points.append(Point(point_name(combination), overrides))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: two points share the name {next(n for n in names if names.count(n) > 1)!r}; "
                          "make the axes' values differ")
    sweep = Sweep(str(path), str(found[0].resolve()), points)
    for point in points:
        resolve(sweep, point, Path("."))  # every point's config is valid before anything runs
    return sweep


def _key_values(mapping: Any, where: str) -> dict[str, Any]:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where} must be a mapping of dotted config keys to values, got {mapping!r}")
    for key in mapping:
        if not isinstance(key, str) or "." not in key and key != "name":
            raise ConfigError(f"{where}: {key!r} is not a dotted config key like model.d_model")
        if key in OWN_KEYS:
            raise ConfigError(f"{where}: {key} is set by the sweep for each point (its folder); leave it out")
    return dict(mapping)


def _axis_levels(name: str, values: Any, path: Path) -> list[dict[str, Any]]:
    """An axis's values as override mappings: a list of scalars for an axis named by a config key,
    or a list of mappings (several keys per value) for an axis with a free name."""
    where = f"{path}: axis {name}"
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where} must be a non-empty list of values")
    if all(isinstance(v, dict) for v in values):
        return [_key_values(v, where) for v in values]
    if any(isinstance(v, (dict, list)) for v in values):
        raise ConfigError(f"{where}: the values must be all scalars (an axis named by a config key) or all "
                          "mappings of config keys")
    return [_key_values({name: v}, where) for v in values]


def point_name(levels: tuple[dict[str, Any], ...]) -> str:
    """A readable, filesystem-safe name: each key's last part and value, e.g. d_model64-max_steps300."""
    parts = [f"{key.rsplit('.', 1)[-1]}{value}" for level in levels for key, value in level.items()]
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", "-".join(parts))


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def resolve(sweep: Sweep, point: Point, out: Path) -> tuple[JobConfig, list[str]]:
    """A point's job config as train.py will see it, and the command-line overrides that give it."""
    run_dir = out / "runs" / point.name
    args = point.arguments() + [f"--logging.run_dir={run_dir}", "--logging.progress=plain", f"--name={point.name}"]
    try:
        cfg = load_config(sweep.config, args)
    except ConfigError as exc:
        raise ConfigError(f"{sweep.spec_path}: point {point.name}: {exc}") from None
    if not cfg.train.eval_interval:  # the final validation loss is the row's point
        args.append(f"--train.eval_interval={cfg.train.max_steps}")
        cfg.train.eval_interval = cfg.train.max_steps
    return cfg, args


def describe(cfg: JobConfig) -> dict[str, float]:
    """Parameters, tokens and FLOPs of a resolved point (a single-process run)."""
    t = cfg.train
    tokens = t.max_steps * t.micro_batch_size * t.grad_accum_steps * cfg.seq_len
    n = matmul_parameters(cfg.model)
    return {"params": n, "params_total": count_parameters(cfg.model), "tokens": tokens,
            "flops": flops_per_token(cfg.model, cfg.seq_len) * tokens, "flops_6nd": 6.0 * n * tokens}


# --------------------------------------------------------------------------- running


@dataclass
class Outcome:
    point: str
    row: Row | None  # None: the run failed
    skipped: bool = False  # finished by an earlier start of the sweep
    error: str = ""


def finished_row(run_dir: Path, point: Point) -> Row | None:
    """The row of a point an earlier start of the sweep finished with the same keys, or None."""
    path = run_dir / POINT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        row = Row(**data)
    except (OSError, ValueError, TypeError):
        return None  # a damaged record: the point runs again
    return row if row.overrides == point.overrides else None


def launch_train(args: list[str], config: str, log_path: Path, threads: int) -> tuple[int, float, float]:
    """``python train.py --config C <args>`` with ``threads`` CPU threads, its output into
    ``log_path``; (exit code, wall seconds, CPU seconds of that process)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", config, *args], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # wait4: this child's own CPU time
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def final_losses(run_dir: Path, max_steps: int) -> tuple[float | None, float | None]:
    """(validation loss at the last step, last logged training loss) from the run's metrics.jsonl."""
    val, train = None, None
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None, None
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("step") == max_steps and row.get("val_loss") is not None:
            val = row["val_loss"]
        if row.get("loss") is not None:
            train = row["loss"]
    return val, train


Launcher = Callable[[list[str], str, Path, int], tuple[int, float, float]]


def run_point(sweep: Sweep, point: Point, out: Path, threads: int, launcher: Launcher = launch_train) -> Outcome:
    cfg, args = resolve(sweep, point, out)
    run_dir = out / "runs" / point.name
    row = finished_row(run_dir, point)
    if row is not None:
        return Outcome(point.name, row, skipped=True)
    if run_dir.exists():  # an unfinished or outdated run of this point: start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log_path = run_dir / "train.log"
    code, wall, cpu = launcher(args, sweep.config, log_path, threads)
    val, train = final_losses(run_dir, cfg.train.max_steps)
    if code != 0 or val is None or not math.isfinite(val):
        tail = log_path.read_text().strip().splitlines()[-1:] if log_path.is_file() else []
        why = f"exit {code}" if code != 0 else "no final val_loss in metrics.jsonl"
        return Outcome(point.name, None, error=f"{why}: {' '.join(tail)[:300]} (log: {log_path})")
    row = Row(point=point.name, **describe(cfg), val_loss=val, train_loss=train, wall_s=wall, cpu_s=cpu,
              threads=threads, overrides=point.overrides)
    (run_dir / POINT_FILE).write_text(json.dumps(asdict(row), indent=1) + "\n")
    return Outcome(point.name, row)


class Progress:
    """One line per event: points done / running / failed, elapsed time, and the time left. The time
    left comes from the points run so far: seconds = start-up + FLOPs x rate, fitted by least
    squares (start-up dominates the smallest points), over the points and FLOPs still to run."""

    def __init__(self, sweep: Sweep, out: Path, workers: int, report: Callable[[str], None]):
        self.report, self.total, self.workers = report, len(sweep.points), workers
        self.flops = {p.name: describe(resolve(sweep, p, out)[0])["flops"] for p in sweep.points}
        self.start = time.perf_counter()
        self.done, self.failed, self.running = 0, 0, 0
        self.measured: list[tuple[float, float]] = []  # (FLOPs, wall seconds) of the points run now
        self.left = dict(self.flops)
        self.lock = threading.Lock()

    def started(self, name: str) -> None:
        with self.lock:
            self.running += 1
            self.report(f"sweep: start {name} ({self.flops[name]:.3g} FLOPs)")

    def ended(self, outcome: Outcome) -> None:
        with self.lock:
            self.left.pop(outcome.point)
            if outcome.row is None:
                self.failed += 1
                self.running -= 1
                what = f"FAILED {outcome.error}"
            else:
                self.done += 1
                r = outcome.row
                if not outcome.skipped:
                    self.running -= 1
                    self.measured.append((r.flops, r.wall_s))
                what = (f"{'finished earlier' if outcome.skipped else 'done'}: val_loss {r.val_loss:.4f}, "
                        f"N {r.params / 1e6:.3g}M, D {r.tokens / 1e6:.3g}M tokens, {r.wall_s:.0f} s wall, "
                        f"{r.cpu_s:.0f} s CPU")
            self.report(f"sweep [{self.done}/{self.total} done, {self.running} running, {self.failed} failed | "
                        f"{_clock(time.perf_counter() - self.start)} elapsed{self._time_left()}] {outcome.point} {what}")

    def _time_left(self) -> str:
        if not self.measured or not self.left:
            return ""
        startup, rate = seconds_model(self.measured)
        seconds = (startup * len(self.left) + rate * sum(self.left.values())) / self.workers
        return f", ~{_clock(seconds)} left"


def seconds_model(measured: list[tuple[float, float]]) -> tuple[float, float]:
    """(start-up seconds, seconds per FLOP) fitted to (FLOPs, seconds) pairs: least squares with
    both terms >= 0; with one distinct FLOP count, all of it is rate."""
    xs, ys = [x for x, _ in measured], [y for _, y in measured]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread > 0:
        rate = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
        startup = mean_y - rate * mean_x
        if rate > 0 and startup >= 0:
            return startup, rate
    return 0.0, sum(ys) / max(sum(xs), 1e-30)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_sweep(sweep: Sweep, out: Path, *, workers: int = 1, threads: int = 1,
              report: Callable[[str], None] = print, launcher: Launcher = launch_train) -> list[Outcome]:
    """Every point not finished earlier, ``workers`` at a time; the outcomes in the grid's order.

    ``launcher`` runs one point (``launch_train``: a train.py process; a test may train in-process).
    With several workers the ``workers`` x ``threads`` threads share the cores, and each point's wall
    time is its own process's, run beside the others."""
    if workers < 1 or threads < 1:
        raise ConfigError(f"workers and threads must be >= 1 (got {workers}, {threads})")
    out = out.resolve()  # train.py runs from the repository root
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(sweep, out, workers, report)
    outcomes: dict[str, Outcome] = {}

    def one(point: Point) -> Outcome:
        if finished_row(out / "runs" / point.name, point) is None:
            progress.started(point.name)
        outcome = run_point(sweep, point, out, threads, launcher)
        progress.ended(outcome)
        return outcome

    if workers == 1:  # in the calling thread: a launcher that trains in-process may need the main thread
        return [one(point) for point in sweep.points]
    # The costliest points first, so the last one to finish does not run alone for long.
    by_cost = sorted(sweep.points, key=lambda p: progress.flops[p.name], reverse=True)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, point) for point in by_cost]
        for future in as_completed(futures):
            outcome = future.result()
            outcomes[outcome.point] = outcome
    return [outcomes[p.name] for p in sweep.points]


# --------------------------------------------------------------------------- the table

COLUMNS = ("point", "params", "params_total", "tokens", "flops", "flops_6nd", "val_loss", "train_loss", "wall_s",
           "cpu_s", "threads")


def write_table(rows: list[Row], markdown_path: Path, title: str, setup: list[str], **extra: Any) -> list[Path]:
    """The sweep's table as Markdown, its rows as JSON next to it (the fit reads that) and as CSV."""
    headers = ["point", "N (params)", "total params", "D (tokens)", "FLOPs", "6ND", "val loss", "wall s", "CPU s"]
    cells = [[r.point, f"{r.params:,}", f"{r.params_total:,}", f"{r.tokens:,}", f"{r.flops:.3g}", f"{r.flops_6nd:.3g}",
              f"{r.val_loss:.4f}", f"{r.wall_s:.0f}", f"{r.cpu_s:.0f}"] for r in rows]
    text = "\n".join([f"# {title}", "", *[f"- {line}" for line in setup], "", markdown_table(headers, cells), ""])
    written = write_results(markdown_path, text, title, [asdict(r) for r in rows], setup=setup, **extra)
    csv_path = Path(markdown_path).with_suffix(".csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows([["" if getattr(r, c) is None else getattr(r, c) for c in COLUMNS] for r in rows])
    return written + [csv_path]


def read_points(path: Path) -> list[dict[str, Any]]:
    """(point, params, tokens, val_loss) of each row of a sweep table (its .json, or its .csv)."""
    path = Path(path)
    if path.suffix == ".csv":
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        except (OSError, csv.Error, UnicodeDecodeError) as exc:
            raise DataError(f"{path}: cannot read the sweep table ({exc})") from None
    else:
        rows = read_results(path)["rows"]
    points = []
    for i, row in enumerate(rows):
        try:
            points.append({"point": str(row.get("point", i)), "params": float(row["params"]),
                           "tokens": float(row["tokens"]), "val_loss": float(row["val_loss"])})
        except (AttributeError, KeyError, TypeError, ValueError):
            raise DataError(f"{path}: row {i} lacks a number for params, tokens or val_loss; is this a "
                            "tools.sweep table?") from None
    return points
