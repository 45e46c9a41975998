"""analysis/optimizer_bench.py (behind tools/bench_muon.py): the state bytes it reports against a count
from the parameters, the learning-rate choice and the bands over seeds, and a finished run read back
instead of run again."""

from __future__ import annotations

import json

import pytest
import torch

from analysis.optimizer_bench import Run, best_lr, over_seeds, state_bytes
from analysis.training_runs import Curve, band, final_summary, train_run
from model.config import ModelConfig
from model.gpt import GPT
from parallel.optim import MuonConfig, OptimConfig, build_optimizer, muon_split

MODEL = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, d_model=32)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_state_bytes_are_two_moments_or_one_momentum_per_element(name):
    model = GPT(MODEL)
    tokens = torch.randint(0, 64, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, OptimConfig(name=name, muon=MuonConfig()), torch.device("cpu"))
    optimizer.step()
    matrices, rest = muon_split(named) if name == "muon" else ([], named)
    elements = sum(p.numel() for _, p in matrices) + 2 * sum(p.numel() for _, p in rest)
    step_counts = 4 * len(named)  # one fp32 step count per tensor, as torch's AdamW keeps
    assert state_bytes(optimizer) == 4 * elements + step_counts


def curve(optimizer: str, lr: float, seed: int, val: dict[int, float]) -> tuple[Run, Curve]:
    run = Run(optimizer, lr, seed, max(val))
    return run, Curve(run, train={s: v + 0.1 for s, v in val.items()}, val=val)


def test_the_tuned_learning_rate_and_the_band_over_seeds():
    curves = dict([curve("muon", 1e-3, 0, {0: 5.0, 10: 3.0}), curve("muon", 2e-3, 0, {0: 5.0, 10: 2.5}),
                   curve("muon", 2e-3, 1, {0: 5.0, 10: 2.7}), curve("muon", 2e-3, 2, {0: 5.0, 10: 2.6}),
                   curve("adamw", 2e-3, 0, {0: 5.0, 10: 2.0})])
    assert best_lr(curves, "muon", 10, 0) == 2e-3  # the other optimizer's lower loss does not count
    runs = over_seeds(curves, "muon", 2e-3, 10)
    assert [c.run.seed for c in runs] == [0, 1, 2]
    assert final_summary(runs) == {"median": 2.6, "min": 2.5, "max": 2.7, "n": 3}
    steps, median, low, high = band(runs, "val")
    assert (steps, median, low, high) == ([0, 10], [5.0, 2.6], [5.0, 2.5], [5.0, 2.7])


def test_a_finished_run_is_read_back_not_run_again(tmp_path):
    run = Run("adamw", 3e-3, 0, 20)
    run_dir = tmp_path / run.name
    run_dir.mkdir()
    rows = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 20, "val_loss": 2.6}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "done.json").write_text(json.dumps({"wall_s": 12.5, "final_val_loss": 2.6}))
    # a config that does not exist: running train.py would fail, reading back does not need it
    got = train_run(run, "no/such/config.yaml", [], tmp_path, threads=1, log_interval=10, eval_interval=10)
    assert (got.train, got.val, got.wall_s, got.final_val) == ({10: 3.0, 20: 2.5}, {20: 2.6}, 12.5, 2.6)
