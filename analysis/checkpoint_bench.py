"""How long a checkpoint save blocks the training loop, synchronous against background
(``checkpoint.async_save``), what a background write costs the steps that run beside it, and what
the content checksums cost per save: the library behind ``tools/bench_checkpoint.py``.

Every row launches the tool again (under torchrun for several ranks) in its hidden worker mode,
``run_rank`` in each rank, which builds the model and engine as train.py does
(training/build.py), takes one training step (so the optimizer state exists, as in any real
checkpoint) and then runs ``rounds`` rounds, alternating which variant goes first (A B, B A, ...)
so that drift on a shared machine hits both alike:

- synchronous: the whole ``SaveJob`` (finite check, temporary directory, every rank's write and
  checksums, agreement, publication): the loop is blocked for all of it;
- background: ``BackgroundSave.start`` (finite check, temporary directory, copy into host memory)
  plus the ``finish`` call that publishes (agreement, meta.json, rename): the loop's share. Training
  steps run while the write is in flight, each followed by the poll train.py makes at a log line,
  until the write is done everywhere (at most ``max_steps_during``, then the loop waits, and the
  wait is reported);
- as many steps again with no write in flight: the step time a background write is compared with.

The figures of a round are the slowest rank's (a save ends when every rank is done). Checkpoint
files go to the page cache first, as they do for train.py: on this machine the "write" is
mostly a copy into memory, which the disk absorbs later.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.measure import machine_load, provenance, ratio_summary, summarize
from common.report import human_bytes, markdown_table, new_figure, save_figure, text_table, write_results
from parallel.distributed import init_distributed, shutdown_distributed
from training import checkpoint as ckpt
from training.build import build_from_config, resolve_job
from training.config import load_config
from training.loop import train_step

ROOT = Path(__file__).resolve().parents[1]
# Shapes on top of configs/tiny.yaml. "100m": 14 blocks of d_model 768 (99M parameters), sequences of 64.
MODELS = {
    "tiny": [],
    "100m": ["--model.n_layer=14", "--model.d_model=768", "--model.n_head=12", "--model.max_seq_len=64",
             "--train.micro_batch_size=1"],
}
LR = 1e-4  # any small rate: the weights move a little each step, as in training


# --------------------------------------------------------------------------- one rank


def run_rank(config: str, overrides: list[str], rounds: int, max_steps_during: int, out: Path) -> None:
    """Measure on this rank (or the single process) and write ``rank<R>.json`` into ``out``."""
    cfg = load_config(config, overrides)
    ctx = init_distributed(cfg.train.device, cfg.parallel)
    try:
        job = resolve_job(cfg, ctx)  # as train.py resolves it
        cfg, batches = job.cfg, job.batches
        engine = build_from_config(cfg, ctx, job.initial_state).engine
        engine.train(True)

        def step() -> float:
            t0 = time.perf_counter()
            train_step(engine, batches, cfg.train.grad_accum_steps, LR).loss.item()
            return time.perf_counter() - t0

        step()
        background, numbers = ckpt.BackgroundSave(), itertools.count(1)

        def job() -> ckpt.SaveJob:
            return ckpt.SaveJob(out / "ckpt", next(numbers), ctx.rank, ctx.world_size, cfg.parallel.strategy,
                                ctx.barrier, keep_last=1, device=ctx.device)

        def rank_state() -> dict:
            return {"rng": ckpt.capture_rng_state(), "data": batches.state_dict()}

        def synchronous() -> dict:
            ctx.barrier()
            t0 = time.perf_counter()
            j = job()
            j.begin(engine.local_weights())
            j.finish(j.write(lambda d: engine.save(d, ctx.rank), rank_state()))
            return {"sync_s": time.perf_counter() - t0, "checksum_s": j.checksum_s, "checksum_bytes": j.checksum_bytes,
                    "sync_write_s": j.write_s}

        def in_background() -> dict:
            ctx.barrier()
            t0 = time.perf_counter()
            j = job()
            background.start(j, lambda d, staging: engine.stage_save(d, ctx.rank, staging), rank_state(),
                             engine.local_weights())
            stage_s, during, publish_s, waited = time.perf_counter() - t0, [], 0.0, 0.0
            while True:
                during.append(step())
                t1 = time.perf_counter()
                done = background.finish(wait=len(during) >= max_steps_during)
                if done is not None:
                    publish_s, waited = time.perf_counter() - t1 - (done[1] or 0.0), done[1] or 0.0
                    break
            without = [step() for _ in range(max(len(during), 3))]
            return {"stage_s": stage_s, "publish_s": publish_s, "async_s": stage_s + publish_s, "waited_s": waited,
                    "background_write_s": j.write_s, "steps_during": len(during),
                    "step_s_during": statistics.mean(during), "step_s_without": statistics.mean(without)}

        synchronous(), in_background()  # warm-up: DCP's first plan, the writer's process group, page cache
        results = []
        for r in range(rounds):
            variants = (synchronous, in_background) if r % 2 == 0 else (in_background, synchronous)
            row: dict = {}
            for variant in variants:
                row.update(variant())
            results.append(row)
        latest = ckpt.find_latest(out / "ckpt")
        size = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
        n_params = sum(p.numel() for p in engine.module().parameters())
        (out / f"rank{ctx.rank}.json").write_text(json.dumps({"rank": ctx.rank, "rounds": results,
                                                              "n_params": n_params, "bytes": size}))
    finally:
        shutdown_distributed(ctx)


# --------------------------------------------------------------------------- the parent


@dataclass
class Row:
    model: str
    ranks: int
    strategy: str
    n_params: int
    checkpoint_bytes: int  # one checkpoint, all ranks' files
    rounds: list[dict]  # per round, the slowest rank's figures

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.rounds]


def launch(worker_module: str, model: str, ranks: int, rounds: int, max_steps_during: int, work: Path,
           timeout: float, extra: list[str]) -> Row:
    out = work / f"{model}-{ranks}"
    out.mkdir(parents=True, exist_ok=True)
    strategy = "fsdp" if ranks > 1 else "none"
    args = ["-m", worker_module, "--worker", str(out), "--rounds", str(rounds), "--max-steps-during",
            str(max_steps_during), "--", "--train.device=cpu", "--parallel.strategy=" + strategy,
            f"--logging.run_dir={out / 'run'}", *MODELS[model], *extra]
    cmd = ([sys.executable, *args] if ranks == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *args])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, 2 // ranks))),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{model} on {ranks} rank(s): exit {proc.returncode}: " + " | ".join(tail))
    per_rank = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    slowest = [{key: max(r["rounds"][i][key] for r in per_rank) for key in per_rank[0]["rounds"][i]}
               for i in range(rounds)]
    return Row(model, ranks, strategy, per_rank[0]["n_params"], max(r["bytes"] for r in per_rank), slowest)


def _s(values: list[float]) -> str:
    s = summarize(values)
    return f"{s.median:.3f} ({s.min:.3f}-{s.max:.3f})"


def table(rows: list[Row], markdown: bool) -> str:
    headers = ["model", "ranks", "checkpoint", "sync: blocked s", "background: blocked s", "background / sync",
               "write in background s", "step s during write / without", "checksum s per save (share of sync)"]
    body = []
    for r in rows:
        checksum = summarize(r.series("checksum_s")).median
        share = checksum / summarize(r.series("sync_s")).median
        rate = summarize(r.series("checksum_bytes")).median / max(checksum, 1e-9)
        body.append([f"{r.model} ({r.n_params / 1e6:.1f}M)", f"{r.ranks} ({r.strategy})", human_bytes(r.checkpoint_bytes),
                     _s(r.series("sync_s")), _s(r.series("async_s")),
                     ratio_summary(r.series("async_s"), r.series("sync_s")).text(3),
                     _s(r.series("background_write_s")),
                     ratio_summary(r.series("step_s_during"), r.series("step_s_without")).text(2),
                     f"{checksum:.3f} ({share:.0%}; {rate / 2**30:.2f} GiB/s)"])
    return markdown_table(headers, body) if markdown else text_table(headers, body)


def plot(rows: list[Row], path: Path) -> None:
    fig, ax = new_figure(width=7.0, height=3.8)
    labels = [f"{r.model}\n{r.ranks} rank(s)" for r in rows]
    xs = range(len(rows))
    for offset, key, name in ((-0.2, "sync_s", "synchronous"), (0.2, "async_s", "background (checkpoint.async_save)")):
        med = [summarize(r.series(key)).median for r in rows]
        low = [m - summarize(r.series(key)).min for m, r in zip(med, rows)]
        high = [summarize(r.series(key)).max - m for m, r in zip(med, rows)]
        ax.bar([x + offset for x in xs], med, width=0.4, yerr=[low, high], capsize=3, label=name)
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("log")
    ax.set_ylabel("training loop blocked per save (s)")
    ax.legend()
    save_figure(fig, path)


def write_markdown(rows: list[Row], command: str, rounds: int, path: Path, load: str | None = None) -> list[Path]:
    where = provenance(torch.device("cpu"))
    title = (f"Checkpoint save: time the training loop is blocked, synchronous vs background ({where['date']}, "
             f"torch {where['torch']}, {load or machine_load()})")
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             f"{rounds} interleaved rounds per row; median (min-max); ratios per round. CPU, torch float32 "
             "AdamW, one training step before the first save; files go to the page cache first.", "",
             table(rows, markdown=True), "",
             "- **blocked**: synchronous = the whole save; background = staging into host memory (with the "
             "finite check and the temporary directory) + the publication at a later log line.",
             "- **step s during write / without**: mean step time while the write runs on its thread against "
             "the same number of steps with none in flight (above 1: the write slows the steps).",
             "- **checksum**: SHA-256 of the files a rank wrote, inside every save (synchronous or not).",
             "- On a shared machine (its load is in the title) a round's timings can vary several-fold; the ratios, "
             "taken round by round, are the figures to read. A background save pays where writing the checkpoint "
             "costs more than copying it into memory and handing it to a thread: not for a 10 MB checkpoint in one "
             "process, where both are a few memory copies.", "",
             f"![blocked per save]({path.with_suffix('.png').name})", ""]
    written = write_results(path, "\n".join(lines), title, rows, command=command)
    plot(rows, path.with_suffix(".png"))
    return written + [path.with_suffix(".png")]
