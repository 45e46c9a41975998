"""train.py on configs/tiny-mla.yaml (latent attention, DeepSeek routing) with multi-token prediction:
it trains, logs mtp_loss beside the next-token loss, resumes exactly and samples from its checkpoint."""

from __future__ import annotations

import math

from tests.conftest import read_metrics, run_train, step_losses, tiny_overrides
from tools import sample as sample_tool

TINY_MLA = "configs/tiny-mla.yaml"


def test_tiny_mla_with_mtp_trains_logs_mtp_loss_resumes_exactly_and_samples(tmp_path, corpus_cache, capsys):
    common = {"train.max_steps": 6, "optim.decay_steps": 6, "checkpoint.interval": 3, "model.mtp_depth": 2,
              "model.n_layer": 3}
    full, split = tmp_path / "full", tmp_path / "split"
    # One thread: with two, two identical uninterrupted runs of this model logged step 5's loss 4.8e-7
    # apart (and step 6's equal), so an exact comparison would test the CPU kernels, not the resume.
    env = {"OMP_NUM_THREADS": "1"}
    proc = run_train(["--config", TINY_MLA, *tiny_overrides(full, corpus_cache, **common)], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| mtp loss " in proc.stdout and "attention: sdpa" in proc.stdout
    rows = [m for m in read_metrics(full) if "loss" in m]
    assert len(rows) == 6 and all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]

    resumed = run_train(["--config", TINY_MLA, "--resume", str(full / "checkpoints" / "step_00000003"),
                         *tiny_overrides(split, corpus_cache, **common)], env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert step_losses(split) == {step: loss for step, loss in step_losses(full).items() if step > 3}

    capsys.readouterr()
    assert sample_tool.main([str(full / "checkpoints" / "step_00000006"), "--prompt", "def ", "--greedy",
                             "--max-new-tokens", "8"]) == 0
    header = capsys.readouterr().out.splitlines()[0]  # the prompt, then the count of new tokens
    assert header.startswith("--- 'def ' + ") and " new token" in header
