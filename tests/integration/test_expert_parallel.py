"""train.py under torchrun with expert parallelism against one process.

``torchrun --nproc_per_node=4 train.py --config configs/tiny-moe.yaml --parallel.ep=2
--parallel.dp_shard=2`` (shortened to a few steps): four data-parallel ranks for the dense weights,
each MoE layer's 8 experts split 4 + 4 over the two ranks of each ep group, the experts' weights
sharded over the two ranks holding the same experts. The loader gives the four ranks every fourth
window, so a step reads the windows one process with micro-batch 4B reads. The Switch auxiliary loss
is off here: it is computed over the tokens of one micro-batch, so B tokens on each of four ranks and
4B in one process give different (equally valid) losses; the in-process tests (tests/unit/parallel/
test_ep.py) check it on, against one process stepping on the same micro-batches.
"""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, run_torchrun, run_train, step_losses, tiny_overrides

TINY_MOE = "configs/tiny-moe.yaml"
COMMON = {"train.max_steps": 3, "train.eval_interval": 3, "train.eval_sequences": 4, "model.moe_aux_loss": 0,
          "checkpoint.save_final": "false", "checkpoint.interval": 0}


def val_loss(run_dir) -> float:
    return next(m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m)


def test_ep2_x_dp_shard2_trains_as_one_process(tmp_path, corpus_cache):
    one = tmp_path / "one"
    proc = run_train(["--config", TINY_MOE, *tiny_overrides(one, corpus_cache, **COMMON,
                                                            **{"train.micro_batch_size": 8})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ep = tmp_path / "ep"
    args = ["--config", TINY_MOE, *tiny_overrides(ep, corpus_cache, **COMMON, **{"train.micro_batch_size": 2}),
            "--parallel.ep=2", "--parallel.dp_shard=2"]
    proc = run_torchrun(4, args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "edp=2 x ep=2 (4 ranks)" in proc.stdout and "holds 1/2 of each MoE layer's experts" in proc.stdout
    ref, got = step_losses(one), step_losses(ep)
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), step
    assert val_loss(ep) == pytest.approx(val_loss(one), abs=1e-5)
