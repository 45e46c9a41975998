"""Where a run's numbers go: the terminal (progress bar or plain lines), metrics.jsonl, wandb, TensorBoard.

A plain line ends with the time since training started (or resumed) and the time to
``train.max_steps`` at the rate so far, evaluations and saves included; the bar shows the same.

Only rank 0 writes files and summaries. Lines go through the project's one logging channel
(``common/log.py``), which ``RunLogger`` points at the terminal with this rank's prefix: info from
rank 0, warnings from every rank. wandb defaults to offline mode so a run never needs the network.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.log import EVERY_RANK, configure_logging, get_logger, print_line
from common.progress import elapsed_and_eta


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """Peak memory so far: the CUDA caching allocator's peak, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "gpu_peak_alloc"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20, "host_peak_rss"


class RunLogger:
    def __init__(self, run_dir: Path, logging_cfg, *, is_main: bool, tag: str, max_steps: int, config_dict: dict):
        self.is_main, self.tag = is_main, tag
        self.cfg, self.max_steps = logging_cfg, max_steps
        self._started = (time.monotonic(), 0)  # when training started, and at which step (set_start)
        self._jsonl = None
        self._bar = None
        self._wandb = None
        self._tb = None
        self._log = get_logger("run")
        if not is_main:
            configure_logging(tag, main=False, write=self._write)
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
        configure_logging(tag, main=is_main, write=self._write)

    def info(self, message: str) -> None:
        self._log.info(message)

    def warn(self, message: str) -> None:
        self._log.warning(message)

    def info_every_rank(self, message: str) -> None:
        """An info line from this rank whatever its rank (only rank 0 prints plain info)."""
        logging.getLogger(EVERY_RANK).info(message)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print_line(line)

    def set_start(self, step: int) -> None:
        """Training starts (or resumes) now at ``step``: elapsed time and ETA count from here."""
        self._started = (time.monotonic(), step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def keep_rows_up_to(self, step: int) -> None:
        """A resumed run logs steps after ``step`` again: drop the rows the previous run wrote for them.

        Without this a crash between checkpoints leaves two rows for those steps in metrics.jsonl.
        Rows are kept byte for byte; a line cut short by the crash is dropped too.
        """
        if self._jsonl is None:
            return
        path = Path(self._jsonl.name)
        self._jsonl.close()
        kept, dropped = rewrite_rows_up_to(path, step)
        self._jsonl = open(path, "a", buffering=1)
        if dropped:
            self.info(f"metrics: dropped {dropped} row(s) after step {step} from {path} "
                      f"(logged before the restart; {kept} kept)")

    def log(self, step: int, metrics: dict[str, Any], line: str | None = None) -> None:
        if not self.is_main:
            return
        metrics = finite_or_none(metrics)
        record = {"step": step, "time": time.time(), **metrics}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        if line is not None:
            if self._bar is not None:
                self._bar.set_postfix_str(line, refresh=False)
            else:
                start, first = self._started
                self.info(f"{line} | {elapsed_and_eta(time.monotonic() - start, step - first, self.max_steps - first)}")

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

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LearningAlarms:
    """Warns when a run looks alive but cannot learn: all-zero gradients, or a loss scaler that skips
    every step (fp16 with a bad ``precision.fp16_init_scale``), neither of which stops a run by itself.

    Reads only what the loop already holds on the host (the skip flag each step, the grad norm at
    log intervals): no extra device sync. Each warning fires once until its condition clears.
    """

    def __init__(self, log: RunLogger, precision_mode: str, skip_streak: int = 3):
        self.log, self.fp16, self.skip_streak = log, precision_mode == "fp16", skip_streak
        self._zero_warned = self._streak_warned = False

    def on_step(self, step: int, skips_in_a_row: int, loss_scale: float | None) -> None:
        if skips_in_a_row == 0:
            self._streak_warned = False
        elif self.fp16 and skips_in_a_row >= self.skip_streak and not self._streak_warned:
            self._streak_warned = True
            self.log.warn(f"step {step}: the fp16 loss scaler skipped {skips_in_a_row} steps in a row (gradients "
                          f"overflow; scale now {_scale(loss_scale)}); if it goes on, lower precision.fp16_init_scale")

    def on_log(self, step: int, grad_norm: float, loss_scale: float | None) -> None:
        if grad_norm != 0.0:  # NaN (a skipped step) is not "zero gradients" either
            self._zero_warned = False
            return
        if self._zero_warned:
            return
        self._zero_warned = True
        if self.fp16:
            why = (f"the fp16 loss scale {_scale(loss_scale)} underflows them to zero; raise precision.fp16_init_scale "
                   "(default 65536)")
        else:
            why = "nothing is learned; check that the loss depends on the weights"
        self.log.warn(f"step {step}: gradient norm is exactly 0 (all gradients are zero): {why}")


def _scale(loss_scale: float | None) -> str:
    return "unknown" if loss_scale is None else f"{loss_scale:g}"


def finite_or_none(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf become None (JSON null): strict JSON, and no fake number in a dashboard."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def rewrite_rows_up_to(path: Path, step: int) -> tuple[int, int]:
    """Keep the rows of ``path`` with ``"step" <= step``, replacing the file atomically; (kept, dropped)."""
    if not path.is_file():
        return 0, 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            row_step = None  # torn by the crash, or not a row of ours
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return len(kept), dropped


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
