"""The plain log lines of a run end with the time since training started (or resumed) and the time
to train.max_steps at the rate so far."""

from __future__ import annotations

from training import metrics
from training.config import LoggingConfig


def test_plain_lines_carry_elapsed_time_and_an_eta_from_the_start_step(tmp_path, monkeypatch, capsys):
    now = [500.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    cfg = LoggingConfig(progress="plain", jsonl=False)
    with metrics.RunLogger(tmp_path, cfg, is_main=True, tag="", max_steps=100, config_dict={}) as log:
        log.set_start(40)  # resumed at step 40: 60 steps to go
        now[0] += 150
        log.log(50, {"loss": 1.0}, "step 50/100 | loss 1.0000")  # 10 steps in 150 s: 15 s each
        log.log(50, {"val_loss": 1.1})  # rows without a line print nothing
    assert capsys.readouterr().out.splitlines() == ["step 50/100 | loss 1.0000 | elapsed 2m30s | eta 12m30s"]
