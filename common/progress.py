"""How far a long loop is, on stderr, for the tools that can run for minutes.

On a terminal it is tqdm's bar (one line, redrawn). Anywhere else (a log file, CI, a pipe) a bar
would write thousands of carriage returns, so it is a plain line every ``every_s`` seconds, and a
last one when the loop ends if any was written: a loop shorter than ``every_s`` prints nothing.
stdout stays the tool's result.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")


def format_duration(seconds: float) -> str:
    """42s, 3m05s, 2h07m, 3d04h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def elapsed_and_eta(elapsed_s: float, done: int, total: int) -> str:
    """'elapsed 1m02s | eta 4m10s': the rest at the average rate so far ('eta ?' before the first item)."""
    eta = format_duration(elapsed_s / done * max(total - done, 0)) if done > 0 else "?"
    return f"elapsed {format_duration(elapsed_s)} | eta {eta}"


class Progress:
    """``total`` items of work named ``desc``; ``update`` after each (see the module docstring).
    ``enabled=False``: silent (e.g. every rank but the first, or a caller that asked for none)."""

    def __init__(self, total: int, desc: str, unit: str = "item", *, every_s: float = 30.0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic, enabled: bool = True):
        self.total, self.desc, self.unit, self.every_s, self.enabled = total, desc, unit, every_s, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.clock, self.done, self.lines = clock, 0, 0
        self.start = self.last = clock()
        self._bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = self.clock()
        if self.enabled and now - self.last >= self.every_s:
            self.last = now
            self._write(now)

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        return f"{self.desc}: {self.done}/{self.total} {self.unit}s | {elapsed_and_eta(now - self.start, self.done, self.total)}"

    def _write(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)
        self.lines += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.lines:  # a loop that reported along the way reports its end too
            now = self.clock()
            print(f"{self.desc}: {self.done}/{self.total} {self.unit}s in {format_duration(now - self.start)}",
                  file=self.stream, flush=True)
            self.lines = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(items: Iterable[T], total: int, desc: str, unit: str = "item", **kwargs) -> Iterator[T]:
    """``items``, with a ``Progress`` of ``total`` updated after each."""
    with Progress(total, desc, unit, **kwargs) as progress:
        for item in items:
            yield item
            progress.update()
