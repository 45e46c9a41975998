"""Where a run's numbers go: the terminal (progress bar or plain lines), metrics.jsonl, wandb, TensorBoard.

Only rank 0 writes files and summaries; every rank may print warnings through ``RunLogger.warn``
with its rank/node prefix. wandb defaults to offline mode so a run never needs the network.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """Peak memory so far: the CUDA caching allocator's peak, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "gpu_peak_alloc"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20, "host_peak_rss"


class RunLogger:
    def __init__(self, run_dir: Path, logging_cfg, *, is_main: bool, tag: str, max_steps: int, config_dict: dict):
        self.is_main, self.tag = is_main, tag
        self.cfg = logging_cfg
        self._jsonl = None
        self._bar = None
        self._wandb = None
        self._tb = None
        if not is_main:
            return
        if logging_cfg.jsonl:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        interactive = sys.stderr.isatty()
        if logging_cfg.progress == "bar" or (logging_cfg.progress == "auto" and interactive):
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, dynamic_ncols=True, desc="train")
        if logging_cfg.wandb:
            self._wandb = _start_wandb(run_dir, logging_cfg, config_dict)
        if logging_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def info(self, message: str) -> None:
        if self.is_main:
            self._print(message)

    def warn(self, message: str) -> None:
        self._print(f"{self.tag}WARNING: {message}")

    def _print(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, flush=True)

    def set_start(self, step: int) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, metrics: dict[str, Any], line: str | None = None) -> None:
        if not self.is_main:
            return
        record = {"step": step, "time": time.time(), **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if line is not None:
            if self._bar is not None:
                self._bar.set_postfix_str(line, refresh=False)
            else:
                self._print(line)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def _start_wandb(run_dir: Path, logging_cfg, config_dict: dict):
    try:
        import wandb
    except ImportError:
        raise RuntimeError("logging.wandb=true needs the wandb package: pip install 'perfgpt[logging]'") from None
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=logging_cfg.wandb_project,
        mode=logging_cfg.wandb_mode,
        dir=str(run_dir),
        config=config_dict,
        name=run_dir.name,
    )
