"""Sharded (DCP) checkpoints of 2 FSDP2 ranks under torchrun: written in the background, then damaged.

A synchronous run and a ``checkpoint.async_save`` run of the same 4 steps must save the same
checkpoints tensor for tensor (model and optimizer state, every shard). Then NaN bytes go over
rank 1's rows of the token embedding inside its shard file ``__1_0.distcp`` of the background
run's newest checkpoint (found by their bytes; the file keeps its size and DCP's index stays
valid, so only the content checksums can tell). The tools, given the run, pass over it to the
intact step-2 checkpoint and say so; given the damaged checkpoint, they refuse it in one line
naming the shard. A 2-rank ``--resume`` (each rank checks the files it wrote, collectively) falls
back to the background-written step 2 and reproduces steps 3-4 of the synchronous run bit for
bit. The one-file twin of these checks runs in-process in
tests/unit/training/test_checkpoint_integrity.py and test_async_checkpoints.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parallel.checkpoint import read_model_weights, read_verified_metadata
from tests.conftest import run_torchrun, step_losses, tiny_overrides
from tests.unit.training.test_checkpoint_integrity import one_line_error, plant_nan
from tools import evaluate as evaluate_tool
from tools import export as export_tool
from tools import sample as sample_tool

TINY = "configs/tiny.yaml"


def every_tensor(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer, all shards joined), read in this process."""
    path = step_dir / "dcp"
    metadata = read_verified_metadata(path)
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP notes that it reads without a process group: intended
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=FileSystemReader(str(path)))
    return state


FSDP = {"parallel.strategy": "fsdp", "train.max_steps": 4, "checkpoint.interval": 2, "train.log_interval": 1}


@pytest.mark.timeout(600)
def test_a_damaged_fsdp_shard_is_named_and_passed_over_by_resume_and_the_tools(tmp_path, corpus_cache, capsys):
    sync_dir, run_dir = tmp_path / "sync", tmp_path / "run"
    proc = run_torchrun(2, ["--config", TINY, *tiny_overrides(sync_dir, corpus_cache, **FSDP)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_torchrun(2, ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **FSDP),
                            "--checkpoint.async_save=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint: step 2 staged in" in proc.stdout and "(written in the background)" in proc.stdout
    clean = step_losses(sync_dir)
    assert step_losses(run_dir) == clean
    for step in ("step_00000002", "step_00000004"):
        written, reference = (every_tensor(d / "checkpoints" / step) for d in (run_dir, sync_dir))
        assert written.keys() == reference.keys() and any(k.startswith("optimizer.") for k in written)
        assert all(torch.equal(written[k], reference[k]) for k in written), step

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

    proc = run_torchrun(2, ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **FSDP), "--resume",
                            "--checkpoint.async_save=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = proc.stdout + proc.stderr
    assert "skipping incomplete or damaged" in logged and str(shard) in logged, logged[-3000:]
    assert f"continuing from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in logged
    resumed = step_losses(run_dir)
    assert [resumed[s] for s in (3, 4)] == [clean[s] for s in (3, 4)]
