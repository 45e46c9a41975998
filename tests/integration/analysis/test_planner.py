"""The planner's whole search for every config in configs/ (minutes in all, in this process): every
layout it proposes passes the trainer's validation, and the scaling curves run."""

from __future__ import annotations

import pytest

from analysis import estimator as est
from tests.conftest import ROOT
from tests.unit.analysis.test_planner import H100, _run_estimate
from training.config import load_config


# the planner's search for every config: ~1 minute in all
@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_layout_the_planner_prints_for_a_config_passes_the_trainers_validation(path):
    """Every layout the planner proposes passes the trainer's whole JobConfig.validate, and the ones it
    prints (--top, 10), written as the trainer's own --section.key=value overrides, load through
    training/config.py without a ConfigError."""
    cfg = load_config(path)
    per_gpu = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    planned = 0
    for gpus in (8, 64, 512):
        if gpus == 512 and planned:
            break  # 512 GPUs only for a model no layout fits on 64 (deepseek-v3)
        plans = est.plan_layouts(cfg.model, cfg.seq_len, gpus, H100, cfg.precision.mode, global_batch=per_gpu * gpus,
                                 top=None, config=cfg)
        for plan in plans:
            est.trainer_config(plan.job, cfg).validate()
        for plan in plans[:10]:
            load_config(path, est.job_overrides(plan.job))
        planned += len(plans)
    assert planned


# the planner's full search at two GPU counts for every config: ~2 minutes in all
@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_scaling_curves_run_for_every_config(path):
    text = _run_estimate("--config", str(path), "--scaling", "8,64")
    lines = text.splitlines()
    rows = [line for line in lines if line.split() and line.split()[0] in ("8", "64")]
    assert len(rows) == 2 and "weak scaling, exposed" in text and "strong scaling, exposed" in text
