"""Hang detection: a thread per rank that ends the process when no training step finishes in time.

A rank stuck in a collective (its peer hangs in a kernel, a node drops off the network) waits
until the process group's timeout, which must be long enough for the slowest legitimate pause
(checkpoint writes, the first compile), and then leaves no trace of where it was. The watchdog
knows how long a step takes: when no step has finished for ``train.hang_timeout_s`` it writes
the Python stack of every thread of its rank to ``<run_dir>/hang/rank<R>.txt`` (faulthandler,
which needs no lock the stuck thread could hold), logs one line naming the rank, the last
completed step and the phase the loop was in, and exits with ``HANG_EXIT_CODE``, so torchrun
(``--max-restarts``) restarts the job from its last checkpoint.

Phases that legitimately take longer than a step run under a grace deadline
(``train.hang_grace_s``): the first step (compile, allocator and communicator warm-up), saves,
evaluation and harness tasks. The loop marks phases by assigning a string (``Phases.mark``);
the watchdog thread only reads them, so the step pays no lock and no system call for it.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

# What a rank exits with when its watchdog fires; distinct from config errors (2), a non-finite
# stop (3) and signals (128 + n), so a launcher's log says "hang" by its exit code alone.
HANG_EXIT_CODE = 4


class Phases:
    """Where the training loop is: the last completed step, the phase it is in, and the time each
    phase took since the last ``take_window`` (for the straggler report).

    On CUDA the time of a phase is measured between events recorded on the current stream at the
    marks (read at the next ``take_window``, where the loop syncs anyway); on the CPU by the host
    clock; ``timed=False`` measures nothing. ``on_mark`` (the test-only fault injection) hears
    every mark with the step being run.
    """

    def __init__(self, device: torch.device = torch.device("cpu"), *, timed: bool = True,
                 on_mark: Callable[[int, str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock, self.on_mark, self.timed = clock, on_mark, timed
        self.cuda = device.type == "cuda"
        self.name = "start-up"
        self.completed = 0  # the last step that finished
        self.since = clock()  # the deadline counts from here: the last finished step or the start of a grace phase
        self.grace = True  # until the first step finishes
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event]] = []
        self._t = time.perf_counter()

    def start(self, step: int) -> None:
        """The loop is about to run ``step + 1``, the first step of this process: under the grace deadline."""
        self.completed, self.grace, self.since = step, True, self.clock()
        self.take_window()

    def mark(self, name: str) -> None:
        self._account()
        self.name = name
        if self.on_mark is not None:
            self.on_mark(self.completed + 1, name)

    def step_done(self, step: int) -> None:
        self._account()
        self.completed, self.name, self.grace, self.since = step, "between steps", False, self.clock()

    @contextmanager
    def slow(self, name: str) -> Iterator[None]:
        """A phase that may take longer than a step (save, evaluation): the grace deadline applies,
        counted from its start; the step deadline counts again from its end."""
        self.mark(name)
        self.grace, self.since = True, self.clock()
        try:
            yield
        finally:
            self.mark("between steps")
            self.grace, self.since = False, self.clock()

    def _account(self) -> None:
        if not self.timed:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((self.name, event))
        else:
            now = time.perf_counter()
            self._seconds[self.name] += now - self._t
            self._t = now

    def take_window(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call (CUDA: waits for the device to get here)."""
        self._account()  # the current phase up to now
        if self._events:
            self._events[-1][1].synchronize()
            # Each event closes the phase recorded with it, which began at the event before.
            for (_, start), (name, end) in zip(self._events, self._events[1:]):
                self._seconds[name] += start.elapsed_time(end) / 1e3
            self._events = self._events[-1:]
        seconds, self._seconds = dict(self._seconds), defaultdict(float)
        return seconds


class HangWatchdog:
    """Watches ``phases`` from a daemon thread; see the module docstring. ``on_hang`` (default:
    ``os._exit(HANG_EXIT_CODE)``) runs after the stack file and the line are written; the main
    thread is stuck, so nothing else could end the process."""

    def __init__(self, phases: Phases, *, timeout_s: float, grace_s: float, dump_dir: Path, rank: int,
                 tag: str = "", on_hang: Callable[[], None] | None = None, poll_s: float | None = None):
        self.phases, self.timeout_s, self.grace_s = phases, timeout_s, grace_s
        self.path = Path(dump_dir) / f"rank{rank}.txt"
        self.rank, self.tag = rank, tag
        self.on_hang = on_hang or (lambda: os._exit(HANG_EXIT_CODE))
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HangWatchdog:
        self._thread = threading.Thread(target=self._watch, name="perfgpt-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def overdue(self) -> float | None:
        """Seconds since the deadline started counting, if past the deadline; else None."""
        p = self.phases
        waited = p.clock() - p.since
        return waited if waited > (self.grace_s if p.grace else self.timeout_s) else None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = self.overdue()
            if waited is not None:
                self._fire(waited)
                return

    def _fire(self, waited: float) -> None:
        p = self.phases
        limit = f"train.hang_grace_s={self.grace_s:g}" if p.grace else f"train.hang_timeout_s={self.timeout_s:g}"
        line = (f"hang: rank {self.rank} finished no step for {waited:.0f}s ({limit}); last completed step "
                f"{p.completed}, phase {p.name}; the stack of every thread of this rank is in {self.path}; "
                f"exiting with code {HANG_EXIT_CODE}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(line + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as exc:
            line += f" (writing the stack failed: {exc})"
        os.write(2, f"{self.tag}{line}\n".encode())
        self.on_hang()
