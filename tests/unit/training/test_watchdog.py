"""The hang watchdog: deadlines per phase, the stack file, the line; and the test-only faults."""

from __future__ import annotations

import threading
import time

import pytest

from training.faults import Fault, FaultInjector, parse_faults
from training.watchdog import HANG_EXIT_CODE, HangWatchdog, Phases


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watchdog(phases, tmp_path, **kw):
    return HangWatchdog(phases, timeout_s=10, grace_s=100, dump_dir=tmp_path, rank=3, **kw)


def test_the_deadline_counts_from_the_last_finished_step_and_grace_covers_first_step_and_saves(tmp_path):
    clock = FakeClock()
    phases = Phases(clock=clock, timed=False)
    dog = _watchdog(phases, tmp_path)
    phases.start(0)
    clock.now += 50  # the first step (compile, warm-up) may take longer than a step
    assert dog.overdue() is None
    clock.now += 51
    assert dog.overdue() == pytest.approx(101)
    phases.step_done(1)
    clock.now += 9
    assert dog.overdue() is None
    clock.now += 2
    assert dog.overdue() == pytest.approx(11)
    phases.step_done(2)
    with phases.slow("save"):  # a save longer than a step is not a hang ...
        clock.now += 60
        assert dog.overdue() is None and phases.name == "save"
        clock.now += 41
        assert dog.overdue() == pytest.approx(101)  # ... up to the grace deadline
    clock.now += 9  # after it, the step deadline counts from its end
    assert dog.overdue() is None
    clock.now += 2
    assert dog.overdue() is not None


def _stuck_in_a_collective(release: threading.Event) -> None:
    release.wait(30)


def test_a_stuck_rank_writes_every_threads_stack_and_one_line_then_exits(tmp_path, capfd):
    phases = Phases(timed=False)
    fired = threading.Event()
    dog = HangWatchdog(phases, timeout_s=0.3, grace_s=0.3, dump_dir=tmp_path / "hang", rank=3, tag="[rank 3] ",
                       on_hang=fired.set, poll_s=0.02)
    release = threading.Event()
    stuck = threading.Thread(target=_stuck_in_a_collective, args=(release,), name="main-loop")
    phases.start(6)
    phases.step_done(7)
    phases.mark("collective")
    t0 = time.monotonic()
    with dog:
        stuck.start()
        assert fired.wait(20)
    elapsed = time.monotonic() - t0
    release.set()
    stuck.join()
    text = (tmp_path / "hang" / "rank3.txt").read_text()
    header = text.splitlines()[0]
    assert "rank 3" in header and "last completed step 7" in header and "phase collective" in header
    assert "_stuck_in_a_collective" in text  # the stuck thread's own frame, not just the watchdog's
    assert "train.hang_timeout_s=0.3" in header and f"exiting with code {HANG_EXIT_CODE}" in header
    err = capfd.readouterr().err
    assert err.count("hang: rank 3") == 1 and err.startswith("[rank 3] hang:")
    assert 0.3 <= elapsed < 15


def test_phase_times_add_up_per_phase_and_restart_at_each_window():
    phases = Phases()
    phases.start(0)
    phases.mark("forward")
    time.sleep(0.05)
    phases.mark("backward")
    phases.step_done(1)
    first = phases.take_window()
    assert first["forward"] >= 0.05 and set(first) >= {"forward", "backward"}
    assert phases.take_window().get("forward", 0.0) == 0.0


def test_faults_parse_and_fire_only_on_their_rank_step_and_phase_in_the_first_attempt():
    faults = parse_faults("slow:rank=1:phase=forward:seconds=0.2; kill:rank=0:step=3:phase=optimizer")
    assert faults == [Fault("slow", 1, None, "forward", 0.2), Fault("kill", 0, 3, "optimizer", 0.0)]
    assert faults[1].matches(3, "optimizer") and not faults[1].matches(4, "optimizer")
    assert faults[0].matches(9, "forward") and not faults[0].matches(9, "backward")
    spec = {"PERFGPT_FAULTS": "slow:rank=1:phase=forward:seconds=0.01"}
    assert FaultInjector.from_env(1, spec).faults == [Fault("slow", 1, None, "forward", 0.01)]
    assert FaultInjector.from_env(0, spec) is None  # another rank's fault
    assert FaultInjector.from_env(1, {**spec, "TORCHELASTIC_RESTART_COUNT": "1"}) is None  # a restarted job runs clean
    assert FaultInjector.from_env(1, {}) is None
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        parse_faults("explode:rank=0")


class HostClockEvent:
    """torch.cuda.Event's timing interface on the host clock, to check on a CPU how the CUDA path
    attributes the time between events to phases."""

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA events report


def test_on_cuda_each_phase_gets_the_time_between_its_mark_and_the_next(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "Event", HostClockEvent)
    phases = Phases(torch.device("cuda"))
    phases.start(0)
    phases.mark("data")
    phases.mark("forward")
    time.sleep(0.2)
    phases.mark("backward")
    time.sleep(0.1)
    phases.mark("optimizer")
    phases.step_done(1)
    first = phases.take_window()
    # Each sleep counts in the phase it ran in (shifted by one mark, forward would get 0.1 s, backward none).
    assert first["forward"] >= 0.2 and first["backward"] >= 0.1 and set(first) >= {"data", "optimizer"}
    time.sleep(0.05)  # the phase current at take_window is counted up to it, then in the next window
    assert phases.take_window()["between steps"] >= 0.05


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_phase_times_on_cuda_are_the_device_time_between_marks():
    import torch

    phases = Phases(torch.device("cuda"))
    phases.start(0)
    a = torch.randn(4096, 4096, device="cuda")
    phases.mark("forward")
    for _ in range(20):
        a = a @ a / 64  # seconds of device work the host only queues
    phases.mark("optimizer")
    phases.step_done(1)
    host_queued = phases.take_window()
    torch.cuda.synchronize()
    assert host_queued["forward"] > 10 * host_queued.get("optimizer", 0.0)
    assert host_queued["forward"] > 1e-3
