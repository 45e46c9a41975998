"""train.py under torchrun with context parallelism against one process.

``torchrun --nproc_per_node=4 train.py --config configs/tiny.yaml --parallel.cp=2
--parallel.dp_shard=2 --model.max_seq_len=256`` (shortened to a few steps): two data-parallel ranks
of two cp ranks each. The loader gives the two data-parallel ranks every other window, and both cp
ranks of one data-parallel rank the same windows, so a step reads the same 2 x B windows one process
with micro-batch 2B reads; each cp rank runs half of every sequence. Losses of every step and the
validation loss agree within 1e-5 (fp32). (The document mask under cp is checked in process, in
tests/unit/parallel/test_cp.py.)
"""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, run_torchrun, run_train, step_losses, tiny_overrides

TINY = "configs/tiny.yaml"
COMMON = {"model.max_seq_len": 256, "train.max_steps": 3, "train.eval_interval": 3, "train.eval_sequences": 5,
          "checkpoint.save_final": "false", "checkpoint.interval": 0}


def val_loss(run_dir) -> float:
    return next(m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m)


def test_cp2_x_dp_shard2_trains_as_one_process(tmp_path, corpus_cache):
    extra = COMMON
    one = tmp_path / "one"
    proc = run_train(["--config", TINY, *tiny_overrides(one, corpus_cache, **extra, **{"train.micro_batch_size": 4})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cp = tmp_path / "cp"
    args = ["--config", TINY, *tiny_overrides(cp, corpus_cache, **extra, **{"train.micro_batch_size": 2}),
            "--parallel.cp=2", "--parallel.dp_shard=2"]
    proc = run_torchrun(4, args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cp=2" in proc.stdout and "holds sequence chunks (0, 3)" in proc.stdout
    ref, got = step_losses(one), step_losses(cp)
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step
    assert val_loss(cp) == pytest.approx(val_loss(one), abs=1e-5)
