"""A run resolves its configuration once (training/build.py's ``resolve_job``), then writes and logs
it: the ``config.yaml`` in the run directory is the configuration the training loop ran with, and
what its checkpoints record, including the values taken from elsewhere than the config file."""

from __future__ import annotations

import json

import pytest

import train
from parallel.distributed import DistContext
from tests.conftest import tiny_overrides
from training import checkpoint as ckpt
from training.build import resolve_job
from training.config import load_config, to_dict
from training.loop import TrainingLoop

TINY = "configs/tiny.yaml"
# A document mask takes its end-of-text id from the dataset; a warm-up longer than the run is shortened.
RESOLVED_ELSEWHERE = {"model.attention_mask": "document", "train.max_steps": 2, "optim.warmup_steps": 5,
                      "model.n_layer": 1, "checkpoint.interval": 0}


@pytest.fixture
def used_configs(monkeypatch) -> list:
    """The configurations train.py hands its training loop, as the loop receives them."""
    seen = []

    class RecordingLoop(TrainingLoop):
        def __init__(self, cfg, *args, **kwargs):
            seen.append(cfg)
            super().__init__(cfg, *args, **kwargs)

    monkeypatch.setattr(train, "TrainingLoop", RecordingLoop)
    return seen


def test_config_yaml_is_the_configuration_the_run_used(tmp_path, corpus_cache, used_configs):
    assert train.main(["--config", TINY, *tiny_overrides(tmp_path, corpus_cache, **RESOLVED_ELSEWHERE)]) == 0
    written = load_config(tmp_path / "config.yaml", saved=True)
    [used] = used_configs
    assert to_dict(written) == to_dict(used)
    # the values that were not in the config file: the byte corpus's end-of-text id (0), the warm-up
    assert written.model.eot_id == 0 and written.optim.warmup_steps == 2
    # and what the checkpoint records of the model and its schedule
    meta = json.loads((tmp_path / "checkpoints" / ckpt.step_dir_name(2) / ckpt.META).read_text())
    assert meta["model"] == to_dict(written.model)
    assert meta["schedule"] == written.lr_schedule()


def test_the_start_up_log_is_short_and_names_the_resolved_config(tmp_path, corpus_cache, capsys):
    assert train.main(["--config", TINY, *tiny_overrides(tmp_path, corpus_cache, **RESOLVED_ELSEWHERE)]) == 0
    out = capsys.readouterr().out.splitlines()
    before_first_step = out[:next(i for i, line in enumerate(out) if line.startswith("step 1/"))]
    assert f"resolved config: {tmp_path / 'config.yaml'}" in "\n".join(before_first_step)
    assert len(before_first_step) <= 16, "\n".join(before_first_step)  # a summary, not every key
    assert not any(line.startswith("model:") and line.strip() == "model:" for line in before_first_step)


def test_resolution_leaves_the_loaded_config_as_it_was(corpus_cache):
    cfg = load_config(TINY, [f"--data.cache_dir={corpus_cache}", "--data.default_corpus_max_mb=2.0",
                             "--model.attention_mask=document", "--train.max_steps=3"])
    job = resolve_job(cfg, DistContext.single())
    try:
        assert job.cfg.model.eot_id == 0 and job.cfg.optim.warmup_steps == 3
        assert cfg.model.eot_id is None and cfg.optim.warmup_steps == 50  # a new value, not an edited one
        assert job.warnings and "optim.warmup_steps=50 is longer than train.max_steps=3" in job.warnings[0]
    finally:
        job.data.train.close()


def test_a_document_mask_without_an_end_of_text_id_is_one_line_before_anything_is_written(tmp_path, corpus_cache,
                                                                                          monkeypatch, capsys):
    from data import loader

    real = loader.build_data
    monkeypatch.setattr("training.build.build_data", lambda *a, **k: _without_eot(real(*a, **k)))
    code = train.main(["--config", TINY, *tiny_overrides(tmp_path / "run", corpus_cache, **RESOLVED_ELSEWHERE)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["config error: model.attention_mask=document needs the end-of-text id that ends "
                                 "each document, and the dataset records none: set model.eot_id"]
    assert not (tmp_path / "run").exists()


def _without_eot(bundle):
    bundle.eot_id = None
    return bundle
