"""Damage inside a checkpoint file that keeps its size is caught by the content checksums.

NaN bytes are written over the token embedding's record inside ``model_optim.pt`` (found by its
bytes, so the file's size and zip structure stay as they were: only the checksum can tell).
Resume, tools/export.py, tools/sample.py, tools/evaluate.py and ``model.init_from`` must name the
file; resume and the tools given the run directory fall back to the intact previous checkpoint
and say so. train.py runs in this process (a few seconds); the sharded (DCP) twin of these checks
runs under torchrun in tests/integration/test_sharded_checkpoints.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import step_losses, tiny_overrides
from tools import evaluate as evaluate_tool
from tools import export as export_tool
from tools import sample as sample_tool
from training import checkpoint as ckpt

TINY = "configs/tiny.yaml"


def plant_nan(file: Path, tensor: torch.Tensor, rows: int = 4) -> None:
    """Overwrite the stored bytes of ``tensor``'s first ``rows`` rows inside ``file`` with NaN,
    keeping the file's size: the bytes are found by their value, as a damaged disk block would hit
    them (every copy: a tied embedding may be stored under both of its names)."""
    data = bytearray(file.read_bytes())
    original = tensor[:rows].contiguous().numpy().tobytes()
    assert data.find(original) >= 0, f"the tensor's bytes are not in {file}"
    nan = torch.full_like(tensor[:rows], float("nan")).numpy().tobytes()
    while (at := data.find(original)) >= 0:
        data[at:at + len(original)] = nan
    size = file.stat().st_size
    file.write_bytes(bytes(data))
    assert file.stat().st_size == size


def one_line_error(capsys, code: int, *fragments: str) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], err
    return lines[0]


def _train(run_dir: Path, corpus_cache: str, *extra: str, **overrides) -> int:
    args = tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 4, "checkpoint.interval": 2, **overrides})
    return train.main(["--config", TINY, *args, *extra])


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, corpus_cache) -> Path:
    """4 steps of the tiny config in this process, saved at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    assert _train(run_dir, corpus_cache) == 0
    return run_dir


@pytest.fixture
def damaged_run(clean_run, tmp_path) -> Path:
    """A copy of the clean run whose newest checkpoint has NaN inside its token-embedding record."""
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir)
    newest = run_dir / "checkpoints" / "step_00000004" / "model_optim.pt"
    plant_nan(newest, torch.load(newest, weights_only=True)["model"]["tok_emb.weight"])
    assert ckpt.incomplete_reason(newest.parent) is None  # sizes alone see nothing wrong
    return run_dir


def test_every_file_of_a_checkpoint_is_recorded_with_its_sha256(clean_run):
    for step_dir in (clean_run / "checkpoints").glob("step_*"):
        meta = json.loads((step_dir / "meta.json").read_text())
        assert meta["checksums"]["algorithm"] == "sha256"
        assert set(meta["checksums"]["files"]) == set(meta["files"]) == {"model_optim.pt", "rank_00000.pt"}
        for rel, digest in meta["checksums"]["files"].items():
            assert digest == hashlib.sha256((step_dir / rel).read_bytes()).hexdigest()
        assert not list(step_dir.glob(f"{ckpt.DIGESTS_PREFIX}*"))  # merged into meta.json, then removed
        assert ckpt.verify_contents(step_dir) is None


def test_resume_names_the_damaged_file_and_continues_bit_exact_from_the_previous_checkpoint(
        damaged_run, clean_run, corpus_cache, capsys):
    capsys.readouterr()
    assert _train(damaged_run, corpus_cache, "--resume", **{"train.max_steps": 4}) == 0
    out = capsys.readouterr()
    damaged = str(damaged_run / "checkpoints" / "step_00000004" / "model_optim.pt")
    assert any("skipping incomplete or damaged" in line and damaged in line and "checksum" in line
               for line in (out.out + out.err).splitlines()), out.out[-3000:] + out.err[-3000:]
    assert f"continuing from {damaged_run / 'checkpoints' / 'step_00000002'} at step 2" in out.out + out.err
    # steps 3 and 4 again from the intact step-2 state: the same losses as the clean run
    resumed, clean = step_losses(damaged_run), step_losses(clean_run)
    assert [resumed[s] for s in (3, 4)] == [clean[s] for s in (3, 4)]


def test_a_named_damaged_checkpoint_is_refused_by_resume_in_one_line(damaged_run, corpus_cache, capsys):
    step4 = damaged_run / "checkpoints" / "step_00000004"
    code = _train(damaged_run, corpus_cache, "--resume", str(step4), **{"train.max_steps": 6})
    one_line_error(capsys, code, str(step4 / "model_optim.pt"), "checksum")


def test_export_sample_and_evaluate_on_the_run_take_the_intact_checkpoint_and_say_so(damaged_run, tmp_path, capsys):
    damaged = str(damaged_run / "checkpoints" / "step_00000004" / "model_optim.pt")
    capsys.readouterr()
    assert export_tool.main([str(damaged_run), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    out = capsys.readouterr()
    assert damaged in out.err and "using step_00000002" in out.err and "step 2" in out.out, out
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "st" / "model.safetensors"))
    step2 = torch.load(damaged_run / "checkpoints" / "step_00000002" / "model_optim.pt", weights_only=True)["model"]
    assert torch.equal(exported["tok_emb.weight"], step2["tok_emb.weight"])
    assert exported["tok_emb.weight"].isfinite().all()

    assert sample_tool.main([str(damaged_run), "--prompt", "def ", "--greedy", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert damaged in out.err and "using step_00000002" in out.err and out.out.startswith("--- 'def '"), out

    assert evaluate_tool.main([str(damaged_run), "--sequences", "4"]) == 0
    out = capsys.readouterr()
    assert damaged in out.err and "using step_00000002" in out.err and "step 2" in out.out, out


def test_the_tools_and_init_from_refuse_a_named_damaged_checkpoint_in_one_line(damaged_run, corpus_cache, tmp_path,
                                                                              capsys):
    step4 = damaged_run / "checkpoints" / "step_00000004"
    damaged = str(step4 / "model_optim.pt")
    capsys.readouterr()
    one_line_error(capsys, export_tool.main([str(step4), "--format", "hf", "--out", str(tmp_path / "hf")]), damaged)
    assert not (tmp_path / "hf").exists()
    one_line_error(capsys, sample_tool.main([str(step4), "--prompt", "x", "--max-new-tokens", "2"]), damaged)
    one_line_error(capsys, evaluate_tool.main([str(step4), "--sequences", "2"]), damaged)
    code = _train(tmp_path / "fresh", corpus_cache, f"--model.init_from={step4}")
    one_line_error(capsys, code, damaged, "checksum")


def test_a_checkpoint_from_before_checksums_loads_with_one_note(clean_run, tmp_path, corpus_cache, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir)
    for step_dir in (run_dir / "checkpoints").glob("step_*"):
        meta_path = step_dir / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["checksums"]
        meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert export_tool.main([str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    err = capsys.readouterr().err
    assert err.count("records no content checksums") == 1 and "step_00000004" in err, err
    assert _train(run_dir, corpus_cache, "--resume", **{"train.max_steps": 5, "optim.decay_steps": 4}) == 0
    out = capsys.readouterr()
    assert (out.out + out.err).count("records no content checksums") == 1
    assert "at step 4" in out.out + out.err
