"""Grouped-query attention through train.py: multi-query attention trains the tiny config."""

from __future__ import annotations

import torch

from tests.conftest import run_train, step_losses, tiny_overrides


def test_mqa_trains_the_tiny_config(tmp_path, corpus_cache):
    args = ["--config", "configs/tiny.yaml", *tiny_overrides(tmp_path, corpus_cache, **{
        "model.n_kv_head": 1, "model.position": "rope", "train.max_steps": 12, "optim.warmup_steps": 2,
    })]
    result = run_train(args)
    assert result.returncode == 0, result.stderr[-2000:]
    resolved = (tmp_path / "config.yaml").read_text()
    assert "n_kv_head: 1" in resolved
    losses = step_losses(tmp_path)
    first, last = losses[min(losses)], losses[max(losses)]
    assert max(losses) == 12 and last < first - 0.5, losses
    # the trained model really is multi-query: one 16-wide key head and one value head next to 64 of queries
    saved = torch.load(next(tmp_path.glob("checkpoints/step_*/model_optim.pt")), weights_only=True)["model"]
    assert saved["blocks.0.attn.qkv.weight"].shape == (64 + 2 * 16, 64)
