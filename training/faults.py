"""Test-only fault injection: make one rank slow, freeze or die at a chosen step and phase.

The reliability tests need a rank that fails on purpose inside a real ``torchrun`` job. They set
``PERFGPT_FAULTS`` to a ``;``-separated list of ``action:key=value:...`` items, e.g.

    slow:rank=1:phase=forward:seconds=1     sleep 1 s at every forward of rank 1
    freeze:rank=1:step=5:phase=optimizer    rank 1 stops itself (SIGSTOP) in step 5's optimizer phase
    kill:rank=1:step=3:phase=forward        rank 1 SIGKILLs itself at step 3's forward

``step`` defaults to every step, ``phase`` to the first phase of the step (``data``). A fault
fires only in the first attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` unset or 0),
so a restarted job runs clean. Unset, nothing is parsed and the loop gets no hook at all.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

ENV = "PERFGPT_FAULTS"
ACTIONS = ("slow", "freeze", "kill")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int | None = None  # None: every step
    phase: str = "data"
    seconds: float = 0.0

    def matches(self, step: int, phase: str) -> bool:
        return phase == self.phase and (self.step is None or self.step == step)


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        action, *pairs = item.split(":")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {action!r} in {item!r}; choose one of: {', '.join(ACTIONS)}")
        values = dict(pair.split("=", 1) for pair in pairs)
        faults.append(Fault(action, int(values["rank"]), int(values["step"]) if "step" in values else None,
                            values.get("phase", "data"), float(values.get("seconds", 0))))
    return faults


class FaultInjector:
    """Fires this rank's faults from the loop's phase marks (``Phases.on_mark``)."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int, environ=os.environ) -> FaultInjector | None:
        spec = environ.get(ENV, "")
        if not spec or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        injector = cls(parse_faults(spec), rank)
        return injector if injector.faults else None

    def __call__(self, step: int, phase: str) -> None:
        for fault in self.faults:
            if fault.matches(step, phase):
                self._fire(fault, step)

    def _fire(self, fault: Fault, step: int) -> None:
        if fault.action == "slow":
            time.sleep(fault.seconds)
            return
        line = (f"fault: rank {self.rank} pid {os.getpid()} {fault.action} at step {step} phase {fault.phase} "
                f"time {time.time():.3f}\n")
        sys.stderr.flush()
        os.write(2, line.encode())
        os.kill(os.getpid(), signal.SIGSTOP if fault.action == "freeze" else signal.SIGKILL)
