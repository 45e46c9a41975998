"""Progress of long tool loops (common/progress.py): a line every few seconds off a terminal, a bar
on one, nothing for a loop too short to need it; the durations and ETA they print."""

from __future__ import annotations

import io

from common.progress import Progress, elapsed_and_eta, format_duration, track


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_durations_read_at_a_glance():
    assert [format_duration(s) for s in (0, 42.4, 185, 3600 * 2 + 7 * 60 + 30, 86400 * 3 + 3600 * 4)] == \
        ["0s", "42s", "3m05s", "2h07m", "3d04h"]


def test_the_eta_is_the_rest_at_the_average_rate_so_far():
    assert elapsed_and_eta(60, 3, 10) == "elapsed 1m00s | eta 2m20s"  # 20 s each, 7 to go
    assert elapsed_and_eta(5, 0, 10) == "elapsed 5s | eta ?"
    assert elapsed_and_eta(90, 12, 10) == "elapsed 1m30s | eta 0s"


def test_off_a_terminal_a_line_every_interval_and_one_at_the_end():
    clock, out = Clock(), io.StringIO()
    with Progress(10, "estimate --scaling", "point", every_s=30, stream=out, clock=clock) as progress:
        for _ in range(10):
            clock.now += 12  # 12 s per point: a line once 30 s have passed since the last one
            progress.update()
    assert out.getvalue().splitlines() == [
        "estimate --scaling: 3/10 points | elapsed 36s | eta 1m24s",
        "estimate --scaling: 6/10 points | elapsed 1m12s | eta 48s",
        "estimate --scaling: 9/10 points | elapsed 1m48s | eta 12s",
        "estimate --scaling: 10/10 points in 2m00s",
    ]


def test_a_short_loop_prints_nothing():
    clock, out = Clock(), io.StringIO()
    for _ in track(range(5), 5, "evaluate", "batch", stream=out, clock=clock):
        clock.now += 1
    assert out.getvalue() == ""


def test_on_a_terminal_it_is_a_bar():
    out = Terminal()
    assert list(track(range(4), 4, "evaluate", "batch", stream=out)) == [0, 1, 2, 3]
    assert "\revaluate:" in out.getvalue() and "\n" not in out.getvalue()  # redrawn in place, no lines
