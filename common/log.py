"""One logging channel for everything a run prints, every line prefixed with the rank tag.

Modules take a logger from ``get_logger``; the run (training/metrics.py's ``RunLogger``) calls
``configure_logging`` once with its rank tag and its way of writing a line (plain print, or
around a progress bar). The main rank shows info and above, the others warnings and above, so
summaries appear once while every rank's problems still reach the terminal, each saying which
rank, local rank and node it came from.
"""

from __future__ import annotations

import logging
from typing import Callable

ROOT = "perfgpt"
EVERY_RANK = f"{ROOT}.every_rank"  # info lines each rank prints (e.g. that it came up), not only rank 0


def get_logger(name: str) -> logging.Logger:
    """The logger for one part of the project (``kernels``, ``data``, ``parallel``, ...)."""
    return logging.getLogger(f"{ROOT}.{name}")


def print_line(line: str) -> None:
    print(line, flush=True)


class _RunHandler(logging.Handler):
    def __init__(self, tag: str, write: Callable[[str], None]):
        super().__init__()
        self.tag, self.write = tag, write

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
            self.write(f"{self.tag}{level}{record.getMessage()}")
        except Exception:  # a logging failure must never end a training run
            self.handleError(record)


def configure_logging(tag: str, *, main: bool, write: Callable[[str], None] = print_line) -> None:
    """Send every ``perfgpt.*`` logger's lines to ``write`` with ``tag`` in front (replacing an
    earlier configuration: a process that runs several jobs, like a test, gets the latest)."""
    root = logging.getLogger(ROOT)
    for handler in [h for h in root.handlers if isinstance(h, _RunHandler)]:
        root.removeHandler(handler)
    root.addHandler(_RunHandler(tag, write))
    root.setLevel(logging.INFO if main else logging.WARNING)
    logging.getLogger(EVERY_RANK).setLevel(logging.INFO)
    root.propagate = False  # the same line must not also reach a handler on Python's root logger
