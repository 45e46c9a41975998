"""train.py on configs/tiny-moe.yaml: router metrics in the log and metrics.jsonl, the aux-loss-free
bias saved with the weights, and a resume that continues the loss sequence bit for bit."""

from __future__ import annotations

import torch

from parallel.checkpoint import safe_torch_load
from tests.conftest import read_metrics, run_train, step_losses, tiny_overrides
from tools import sample as sample_tool
from training.config import load_config

TINY_MOE = "configs/tiny-moe.yaml"
MODEL = load_config(TINY_MOE, []).model
EXPERTS, TOP_K = MODEL.moe.experts, MODEL.moe.top_k


def test_tiny_moe_trains_logs_its_router_resumes_exactly_and_samples(tmp_path, corpus_cache, capsys):
    common = {"train.max_steps": 6, "optim.decay_steps": 6, "checkpoint.interval": 3,
              "model.moe.d_ff": 32, "model.moe.capacity": 1.0, "model.moe.bias_update_rate": 0.01,
              "model.moe.z_loss": 0.001}
    full, split = tmp_path / "full", tmp_path / "split"
    proc = run_train(["--config", TINY_MOE, *tiny_overrides(full, corpus_cache, **common)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "moe: " in proc.stdout and "M active per token" in proc.stdout
    assert "experts: grouped_mm (auto:" in proc.stdout
    assert "| moe aux " in proc.stdout and "load max/mean" in proc.stdout
    rows = [m for m in read_metrics(full) if "loss" in m]
    for row in rows:
        assert row["moe_aux_loss"] > 0
        assert 0.0 <= row["moe_dropped_frac"] < 1.0
        loads = [row[f"moe_load_max_mean/{i}"] for i in range(2)]
        assert all(1.0 <= v <= EXPERTS / TOP_K for v in loads)  # between balanced and all on top-k experts
    state = safe_torch_load(full / "checkpoints" / "step_00000006" / "model_optim.pt")["model"]
    bias = state["blocks.0.mlp.expert_bias"]
    assert bias.shape == (EXPERTS,) and bias.abs().sum() > 0  # it moved, and it is saved

    resumed = run_train(["--config", TINY_MOE, "--resume", str(full / "checkpoints" / "step_00000003"),
                         *tiny_overrides(split, corpus_cache, **common)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = {step: loss for step, loss in step_losses(full).items() if step > 3}
    assert step_losses(split) == expected
    assert torch.equal(safe_torch_load(split / "checkpoints" / "step_00000006" / "model_optim.pt")["model"][
        "blocks.0.mlp.expert_bias"], bias)

    # generation from the MoE checkpoint, with its routing bias
    capsys.readouterr()
    assert sample_tool.main([str(full / "checkpoints" / "step_00000006"), "--prompt", "def ", "--greedy",
                             "--max-new-tokens", "8"]) == 0
    header, continuation = capsys.readouterr().out.split("\n", 1)
    assert header == "--- 'def ' + 8 new tokens:" and continuation.endswith("\n") and len(continuation) > 1
