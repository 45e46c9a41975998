"""StopRequest's set-up exit, called from two threads at once (the watcher and the Python-level
handler both see the same signal): one line, one exit."""

import signal
import threading

import training.signals as signals


def test_a_set_up_signal_seen_twice_prints_one_line(monkeypatch):
    lines: list[bytes] = []
    release = threading.Event()
    exits: list[int] = []

    def write(fd, data):
        lines.append(data)
        return len(data)

    def fake_exit(code):  # the real one ends the process; here the first caller parks until the test ends
        exits.append(code)
        release.wait(10)

    monkeypatch.setattr(signals.os, "write", write)
    monkeypatch.setattr(signals.os, "_exit", fake_exit)
    stop = signals.StopRequest()
    first = threading.Thread(target=stop._leave_set_up, args=(signal.SIGTERM,))
    first.start()
    while not exits:  # the first caller has written its line and is exiting
        first.join(0.01)
    stop._leave_set_up(signal.SIGTERM)  # the other path, arriving while the first exits
    release.set()
    first.join()
    assert [line.decode() for line in lines] == ["interrupted (SIGTERM) before the first step; nothing to save\n"]
    assert exits == [signals.exit_code(signal.SIGTERM)]
