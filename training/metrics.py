"""Where a run's numbers go: the terminal (progress bar or plain lines), metrics.jsonl, wandb, TensorBoard.

A plain line ends with the time since training started (or resumed) and the time to
``train.max_steps`` at the rate so far, evaluations and saves included; the bar shows the same.

Only rank 0 writes files and summaries. A metrics.jsonl that cannot be written (a full disk, a
file-size limit) does not end the run: ``JsonlSink`` says so once and keeps the rows until the
file takes them again. Lines go through the project's one logging channel
(``common/log.py``), which ``RunLogger`` points at the terminal with this rank's prefix: info from
rank 0, warnings from every rank. wandb defaults to offline mode so a run never needs the network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from common.files import os_error_words
from common.log import EVERY_RANK, configure_logging, get_logger, print_line
from common.progress import elapsed_and_eta

METRICS_FILE = "metrics.jsonl"  # one JSON row per logged step, in the run directory


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
            self._jsonl = JsonlSink(run_dir / METRICS_FILE, self.warn, self.info)
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
        path = self._jsonl.path
        self._jsonl.close()
        try:
            kept, dropped = rewrite_rows_up_to(path, step)
        except OSError as exc:  # the old rows stay: a log file never stops the run (JsonlSink)
            kept, dropped = 0, 0
            self.warn(f"metrics: cannot drop the rows after step {step} from {path}: {os_error_words(exc)}; "
                      "they stay, and the steps after it are logged again below them")
        self._jsonl = JsonlSink(path, self.warn, self.info)
        if dropped:
            self.info(f"metrics: dropped {dropped} row(s) after step {step} from {path} "
                      f"(logged before the restart; {kept} kept)")

    def log(self, step: int, metrics: dict[str, Any], line: str | None = None) -> None:
        if not self.is_main:
            return
        metrics = finite_or_none(metrics)
        record = {"step": step, "time": time.time(), **metrics}
        if self._jsonl is not None:
            self._jsonl.append(step, json.dumps(record, allow_nan=False))
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


class JsonlSink:
    """metrics.jsonl, appended one whole row at a time; a failed write holds the rows instead of
    ending the run.

    Each row goes out in one ``os.write`` on an O_APPEND descriptor. When a write fails (ENOSPC,
    EFBIG under a file-size limit, EIO) or stops part-way, the file is cut back to where the row
    began, so it never holds a torn row, and the row stays in memory with the ones after it (at
    most MAX_HELD_ROWS, the oldest dropped beyond that). The failure is said once; every later row
    retries the held ones first, so when space returns the file catches up in order and says so.
    Rows still held at the end are counted in one line (the log lines printed them).

    Why the run goes on: a log file is not the run. The terminal line carries the same numbers, the
    checkpoint may live on another disk, and stopping would lose every step since the last save;
    when the checkpoint's disk is full too, its save fails in its own one line, with the previous
    checkpoint kept.
    """

    MAX_HELD_ROWS = 100_000  # ~50 MB of rows

    def __init__(self, path: Path, warn: Callable[[str], None], info: Callable[[str], None]):
        self.path, self.warn, self.info = path, warn, info
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._held: list[tuple[int, bytes]] = []  # (step, the row's bytes), oldest first
        self._dropped = 0
        self._failure: str | None = None  # why the last write failed, while rows are held

    def append(self, step: int, row: str) -> None:
        self._held.append((step, (row + "\n").encode()))
        if len(self._held) > self.MAX_HELD_ROWS:
            self._held.pop(0)
            self._dropped += 1
        self._flush()

    def _flush(self) -> None:
        first = self._held[0][0] if self._held else None
        while self._held:
            error = self._write_whole(self._held[0][1])
            if error is not None:
                if self._failure is None:
                    self._failure = os_error_words(error)
                    self.warn(f"metrics: cannot write step {self._held[0][0]} to {self.path}: {self._failure}; "
                              "training goes on, and the rows are kept in memory (the log lines show them) until "
                              "the file takes them again")
                return
            last = self._held.pop(0)[0]
        if self._failure is not None:
            lost = f" ({self._dropped} older row(s) did not fit in memory)" if self._dropped else ""
            self.info(f"metrics: {self.path} takes rows again; the held rows of steps {first}-{last} are written, "
                      f"in order{lost}")
            self._failure, self._dropped = None, 0

    def _write_whole(self, data: bytes) -> OSError | None:
        start = os.lseek(self._fd, 0, os.SEEK_END)
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            if done:  # the part that got out would be a torn row: cut it off again
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
            return exc
        return None

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._held:
            self._flush()
        if self._held:
            steps = f"steps {self._held[0][0]}-{self._held[-1][0]}"
            self.warn(f"metrics: {len(self._held) + self._dropped} row(s) ({steps}) never reached {self.path}: "
                      f"{self._failure}; their numbers are in the log lines above")
        os.close(self._fd)
        self._fd = -1


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
