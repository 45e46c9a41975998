"""A memory snapshot of a few training steps of a config: who allocated what, and when.

    python -m tools.memory_snapshot --config configs/tiny.yaml --out runs/tiny/profile
    python -m tools.memory_snapshot --config configs/gpt2-124m.yaml --model.recompute=full

It builds the model and engine exactly as ``train.py`` does in one process (the one build path,
``training/build.py``: same kernels, attention backend, precision mode and recompute policy), runs ``--steps`` steps on random tokens of the configured shape, then:

- on CUDA records the caching allocator's history (``torch.cuda.memory._record_memory_history``)
  and dumps ``memory_snapshot.pickle``: drag it into https://pytorch.org/memory_viz (the page
  runs locally in the browser), or render it offline with
  ``python -m torch.cuda._memory_viz trace_plot memory_snapshot.pickle -o memory.html``;
- on CPU, where the allocator keeps no history, profiles the steps with ``profile_memory=True``,
  prints the ops that allocated most and writes ``memory_trace_cpu.json`` (a chrome trace whose
  memory events ``tools/trace_summary.py`` and Perfetto read).

Data parallelism, data loading and multi-GPU sharding are not part of this picture; profile
``train.py`` itself for those (docs/profiling.md).
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

import torch

from common.errors import USER_FACING_ERRORS
from parallel.distributed import DistContext, pick_device
from training.build import build_from_config
from training.config import load_config, parse_known_overrides
from training.loop import train_step

MIB = 2**20
HISTORY_ENTRIES = 100_000  # alloc/free events kept; several KB each, so the pickle stays ~100s of MB at most


class SnapshotError(ValueError):
    """The config cannot be snapshotted in one process; the message says which key to change."""


def build_training_step(cfg, device: torch.device):
    """(one_step, describe) for the trainer's model and engine on ``device``, in one process."""
    if cfg.parallel.strategy != "none":
        raise SnapshotError(
            f"parallel.strategy={cfg.parallel.strategy} needs several processes; snapshot one process with "
            "--parallel.strategy=none, or profile train.py under torchrun (docs/profiling.md)"
        )
    if cfg.train.compile:
        raise SnapshotError("train.compile=true: snapshot the eager model (--train.compile=false); compiled "
                            "graphs allocate differently, profile train.py for them")
    if cfg.parallel.init_on_meta:
        raise SnapshotError("parallel.init_on_meta=true leaves the model unallocated; pass --parallel.init_on_meta=false")
    built = build_from_config(cfg, DistContext.single(device))
    engine = built.engine
    engine.train(True)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.seq_len + 1), generator=gen)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))

    def one_step() -> None:
        train_step(engine, iter([batch] * cfg.train.grad_accum_steps), cfg.train.grad_accum_steps, cfg.optim.lr)

    return one_step, built.notes[:2]


def snapshot_cuda(one_step, steps: int, out: Path, device: torch.device) -> Path:
    """Run ``steps`` steps with the allocator's history on and dump it; returns the pickle's path."""
    path = out / "memory_snapshot.pickle"
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    try:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize(device)
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    print(f"peak allocated {torch.cuda.max_memory_allocated(device) / MIB:.1f} MiB, "
          f"peak reserved {torch.cuda.max_memory_reserved(device) / MIB:.1f} MiB")
    print(f"wrote {path}: open it at https://pytorch.org/memory_viz, or "
          f"python -m torch.cuda._memory_viz trace_plot {path} -o {out / 'memory.html'}")
    return path


def snapshot_cpu(one_step, steps: int, out: Path, top: int) -> Path:
    """Profile ``steps`` steps with memory events; print the top allocators; returns the trace's path."""
    from torch.profiler import ProfilerActivity, profile

    path = out / "memory_trace_cpu.json"
    one_step()  # first step allocates the optimizer state: keep it out of the per-step picture
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        for _ in range(steps):
            one_step()
    print(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=top))
    prof.export_chrome_trace(str(path))
    print(f"wrote {path}: python -m tools.trace_summary {path}, or open it in https://ui.perfetto.dev")
    return path


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Memory snapshot of a few training steps of a config (CUDA: allocator history for "
        "pytorch.org/memory_viz; CPU: profiler memory events). Config keys can be overridden as "
        "--section.key=value, as with train.py.",
    )
    parser.add_argument("--config", required=True, help="YAML job config, e.g. configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=3, help="training steps recorded")
    parser.add_argument("--out", type=Path, help="output folder (default: <run_dir>/profile)")
    parser.add_argument("--top", type=int, default=15, help="CPU: rows of the top-allocating ops table")
    return parse_known_overrides(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if args.steps < 1:
            raise SnapshotError("--steps must be >= 1")
        device = pick_device(cfg.train.device, 0)
        one_step, notes = build_training_step(cfg, device)
    except (SnapshotError, *USER_FACING_ERRORS) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(cfg.logging.run_dir.format(name=cfg.name)) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    print(f"{cfg.name}: {', '.join(notes)}; recompute={cfg.model.recompute}, precision={cfg.precision.mode}, "
          f"micro_batch={cfg.train.micro_batch_size}, seq_len={cfg.seq_len}, {device}")
    if device.type == "cuda":
        snapshot_cuda(one_step, args.steps, out, device)
    else:
        snapshot_cpu(one_step, args.steps, out, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
