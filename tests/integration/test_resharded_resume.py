"""train.py ``--resume`` with ``checkpoint.reshard=true`` from an expert-parallel and a context-parallel
checkpoint into one process.

A 2-rank run saves a DCP checkpoint at step 2: under ``parallel.ep=2`` each rank holds half of every
MoE layer's experts (and FSDP2 shards the dense weights over both), under ``parallel.cp=2`` each rank
runs half of every sequence (FSDP2 shards every weight over the cp ranks). One process resumes it
with ``checkpoint.reshard=true``: weights and AdamW state come back whole, the schedule continues at
step 2 and the data stream starts again at its first batch. The reference is the same checkpoint
resumed the same way under the layout that saved it: its steps 3-4 read the same windows (ep: two
data-parallel ranks with B sequences each, the one process 2B; cp: both ranks and the one process B
each), so their losses agree within 1e-5 (fp32); step 4 also depends on the restored Adam moments.
The step-3 loss is checked once more against the checkpoint read by the export path
(training/model_io.load_source, a reader of DCP that builds no engine), evaluated on that first batch.
The Switch auxiliary loss is off for ep: it is computed per micro-batch, so B sequences on each of two
ranks and 2B in one process give different (equally valid) losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_torchrun, run_train, step_losses, tiny_overrides

COMMON = {"train.max_steps": 4, "checkpoint.interval": 2, "checkpoint.keep_last": 0,
          "checkpoint.save_final": "false", "optim.warmup_steps": 1}
TOL = 1e-5


def resume_into_one_process(tmp_path: Path, corpus_cache: str, config: str, overrides: dict, layout: list[str], *,
                            rank_batch: int, one_batch: int) -> None:
    saved, one, same = tmp_path / "saved", tmp_path / "one", tmp_path / "same"
    on_ranks = {**COMMON, **overrides, "train.micro_batch_size": rank_batch}
    proc = run_torchrun(2, ["--config", config, *tiny_overrides(saved, corpus_cache, **on_ranks), *layout])
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = saved / "checkpoints" / "step_00000002"
    assert (checkpoint / "dcp").is_dir()

    resume = ["--resume", str(checkpoint)]
    resharded = {**on_ranks, "checkpoint.reshard": "true", "checkpoint.interval": 0}
    proc = run_train(["--config", config, *tiny_overrides(one, corpus_cache, **{**resharded,
                                                                               "train.micro_batch_size": one_batch}),
                      *resume])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharded" in proc.stdout + proc.stderr and "at step 2" in proc.stdout
    proc = run_torchrun(2, ["--config", config, *tiny_overrides(same, corpus_cache, **resharded), *layout, *resume])
    assert proc.returncode == 0, proc.stderr[-3000:]

    got, reference = step_losses(one), step_losses(same)
    assert sorted(got) == sorted(reference) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(reference[step], abs=TOL), step
    assert got[4] != got[3]  # the resumed step trained

    # The checkpoint's weights, read without the trainer, on the one process's first batch.
    from data.loader import build_data
    from training.config import load_config
    from training.model_io import load_source

    cfg = load_config(one / "config.yaml")
    model = load_source(checkpoint).build().eval()
    data = build_data(cfg.data, seq_len=cfg.seq_len, micro_batch_size=one_batch, seed=cfg.train.seed, rank=0,
                      world_size=1, vocab_size=cfg.model.vocab_size)
    x, y = next(data.train)
    with torch.no_grad():
        assert got[3] == pytest.approx(float(model(x, y)), abs=TOL)
    assert [r["step"] for r in read_metrics(one) if "loss" in r] == [3, 4]


def test_an_ep2_checkpoint_resumes_in_one_process_as_under_ep2(tmp_path, corpus_cache):
    resume_into_one_process(tmp_path, corpus_cache, "configs/tiny-moe.yaml", {"model.moe.aux_loss": 0},
                            ["--parallel.ep=2"], rank_batch=2, one_batch=4)


def test_a_cp2_checkpoint_resumes_in_one_process_as_under_cp2(tmp_path, corpus_cache):
    resume_into_one_process(tmp_path, corpus_cache, "configs/tiny.yaml", {"model.max_seq_len": 128},
                            ["--parallel.cp=2"], rank_batch=2, one_batch=2)
