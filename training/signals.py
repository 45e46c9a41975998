"""SIGTERM and Ctrl-C end a run cleanly: during set-up at once with one line; during training they
finish the step, save and exit non-zero; a second signal exits at once.

Preemptible clusters send SIGTERM some seconds before SIGKILL (Slurm: ``KillWait``, 30 s by
default; torchrun forwards it to every worker and waits 30 s). The handler only records the
signal; the training loop asks ``StopRequest.requested`` after each optimizer step, and under
several ranks ``StopAgreement`` makes every rank stop, and so save, at the same step.

SIGXFSZ is ignored for the run: by default a write past the process's file-size limit (``ulimit
-f``) kills it on the spot; ignored, the write fails with EFBIG, which the checkpoint save and
metrics.jsonl report in one line with nothing lost.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from parallel.distributed import DistContext

HANDLED = (signal.SIGTERM, signal.SIGINT)
# Slurm signals every process of a job step and torchrun forwards the same signal to its workers,
# so one preemption can reach a worker twice within milliseconds: that is still one request.
DUPLICATE_WINDOW_S = 0.5


def exit_code(signum: int) -> int:
    """128 + signal number, what a shell reports for a process ended by that signal (143, 130)."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """Takes SIGTERM/SIGINT away from the default action for the whole run, in two phases.

    During set-up (from ``install`` to ``arm``) a signal ends the process at once with one line
    (``interrupted (SIGINT) before the first step; nothing to save``) and the shell's exit code:
    nothing has been trained, so there is nothing to save. It is not raised as KeyboardInterrupt
    into whatever set-up code is running, because that may be C++ called from Python (torch's and
    Triton's extensions, mid-import), where the exception cannot pass through and the process
    aborts with a C++ traceback instead (seen under load: ``terminate called after throwing an
    instance of 'nanobind::python_error'``, exit -6).

    From ``arm`` (the first training step) on, a signal is only recorded; the loop asks
    ``requested`` after each optimizer step, finishes it, saves and exits; a second signal exits
    at once. Signals are read by a watcher thread from ``signal.set_wakeup_fd``, which the C-level
    handler writes at once, not by the Python-level handler: that one runs only when the main
    thread next executes Python, and a rank blocked in a collective or a long kernel may not for
    minutes. The Python-level handler only replaces the default action and records, as a fallback.
    """

    def __init__(self, tag: str = ""):
        self.tag = tag
        self.signum = 0
        self.armed = False  # False: set-up, a signal exits at once; True: training, a signal is recorded
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._write_fd: int | None = None
        self._leaving = threading.Lock()

    def install(self) -> None:
        """Take the signals over (set-up phase). Signal handlers can only be set from the main
        thread; elsewhere (a test harness, a notebook thread) the process keeps its default behaviour."""
        if threading.current_thread() is not threading.main_thread() or self._write_fd is not None:
            return
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it; a full pipe drops bytes, never blocks
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._on_python_signal)
        if hasattr(signal, "SIGXFSZ"):
            self._previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        threading.Thread(target=self._watch, args=(read_fd,), name="perfgpt-signals", daemon=True).start()

    def arm(self) -> None:
        """From the first training step on: a signal finishes the step and saves."""
        self.install()
        self.armed = True
        if self.signum:  # arrived in the instant between the end of set-up and now
            self._leave_set_up(self.signum)

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._write_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)  # the watcher reads end-of-file and ends
            self._write_fd = None

    @property
    def requested(self) -> int:
        """The signal number received on this rank (0: none)."""
        return self.signum

    def _watch(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                for signum in data:  # the wakeup fd also carries other handled signals (SIGCHLD, ...)
                    if signum in HANDLED:
                        self._on_signal(signum)
        finally:
            os.close(read_fd)

    def _on_signal(self, signum: int) -> None:
        if not self.armed:
            self._leave_set_up(signum)
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at < DUPLICATE_WINDOW_S:
            return
        # The user insists: leave now, from this thread, whatever the main thread is blocked in.
        os.write(2, f"{self.tag}second {signal_name(signum)}: exiting at once without saving\n".encode())
        os._exit(exit_code(signum))

    def _leave_set_up(self, signum: int) -> None:
        # The watcher and the Python-level handler both see a set-up signal and may both get here.
        # Not blocking: a second caller on the main thread (a handler interrupting the first) would
        # otherwise wait forever on a lock its own thread holds; the first caller is about to exit.
        if not self._leaving.acquire(blocking=False):
            return
        os.write(2, f"{self.tag}interrupted ({signal_name(signum)}) before the first step; nothing to save\n".encode())
        os._exit(exit_code(signum))

    def _on_python_signal(self, signum: int, frame) -> None:
        # Normally the watcher has acted on this signal already. Should anything have replaced the
        # wakeup fd since, the stop still happens; only the "second signal" exit would be lost.
        if not self.armed:
            self._leave_set_up(signum)
        if not self.signum:
            self.signum, self._first_at = signum, time.monotonic()


class StopAgreement:
    """Makes every rank stop at the same step when any of them was asked to (SIGTERM, Ctrl-C).

    Ranks receive a signal at different steps, yet must save the same one. Each step every rank
    starts an all-reduce (MAX) of its signal number and reads the result of the previous step's:
    one step of lag, so the read never waits (on CUDA the value comes back through pinned memory
    behind an event, so it adds no host sync to the step). A single process
    needs no agreement and stops after the step in which the signal arrived.
    """

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self._pending: tuple | None = None

    def poll(self, local_signum: int) -> int:
        """The agreed signal number (0: keep going). A collective: every rank calls it once per step."""
        if self.ctx.backend is None:
            return local_signum
        agreed = self._collect()
        value = torch.tensor([local_signum], dtype=torch.int32, device=self.ctx.device)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        if value.is_cuda:
            work.wait()  # orders the copy after the all-reduce on the stream; does not block the host
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (None, host, event)
        else:
            self._pending = (work, value, None)
        return agreed

    def finish(self) -> None:
        """Complete the outstanding all-reduce before the process group goes away."""
        self._collect()

    def _collect(self) -> int:
        if self._pending is None:
            return 0
        work, host, event = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return int(host.item())
