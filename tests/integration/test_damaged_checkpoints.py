"""A damaged shard of a sharded (DCP) checkpoint, written by 2 FSDP2 ranks under torchrun.

NaN bytes go over rank 1's rows of the token embedding inside its shard file ``__1_0.distcp``
(found by their bytes; the file keeps its size and DCP's index stays valid, so only the content
checksums can tell). The tools, given the run, pass over it to the intact step-2 checkpoint and
say so; given the damaged checkpoint, they refuse it in one line naming the shard. A 2-rank
``--resume`` (each rank checks its share of the files, collectively) falls back to step 2 and
reproduces steps 3-4 bit for bit. The one-file twin of these checks runs in-process in
tests/unit/training/test_checkpoint_integrity.py.
"""

from __future__ import annotations

import shutil

import pytest

from parallel.checkpoint import read_model_weights
from tests.conftest import run_torchrun, step_losses, tiny_overrides
from tests.unit.training.test_checkpoint_integrity import one_line_error, plant_nan
from tools import evaluate as evaluate_tool
from tools import export as export_tool
from tools import sample as sample_tool

TINY = "configs/tiny.yaml"
FSDP = {"parallel.strategy": "fsdp", "train.max_steps": 4, "checkpoint.interval": 2, "train.log_interval": 1}


@pytest.mark.timeout(600)
def test_a_damaged_fsdp_shard_is_named_and_passed_over_by_resume_and_the_tools(tmp_path, corpus_cache, capsys):
    run_dir = tmp_path / "run"
    proc = run_torchrun(2, ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **FSDP)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    clean = step_losses(run_dir)
    saved = tmp_path / "clean"
    shutil.copytree(run_dir, saved)

    step4 = run_dir / "checkpoints" / "step_00000004"
    shard = step4 / "dcp" / "__1_0.distcp"
    emb = read_model_weights(step4)["tok_emb.weight"]
    plant_nan(shard, emb[emb.shape[0] // 2:])  # FSDP2 shards dim 0: rank 1 holds the second half of the rows

    capsys.readouterr()
    assert export_tool.main([str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    out = capsys.readouterr()
    assert str(shard) in out.err and "using step_00000002" in out.err and "step 2" in out.out, out
    assert sample_tool.main([str(run_dir), "--prompt", "def ", "--greedy", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert str(shard) in out.err and "using step_00000002" in out.err, out
    assert evaluate_tool.main([str(run_dir), "--sequences", "4"]) == 0
    out = capsys.readouterr()
    assert str(shard) in out.err and "step 2" in out.out, out
    one_line_error(capsys, export_tool.main([str(step4), "--format", "hf", "--out", str(tmp_path / "hf")]), str(shard))
    one_line_error(capsys, sample_tool.main([str(step4), "--prompt", "x", "--max-new-tokens", "2"]), str(shard))
    one_line_error(capsys, evaluate_tool.main([str(step4), "--sequences", "2"]), str(shard))

    proc = run_torchrun(2, ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **FSDP), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = proc.stdout + proc.stderr
    assert "skipping incomplete or damaged" in logged and str(shard) in logged, logged[-3000:]
    assert f"continuing from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in logged
    resumed = step_losses(run_dir)
    assert [resumed[s] for s in (3, 4)] == [clean[s] for s in (3, 4)]
