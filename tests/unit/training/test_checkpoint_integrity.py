"""Damage inside a checkpoint file that keeps its size is caught by the content checksums.

NaN bytes are written over the token embedding's record inside ``model_optim.pt`` (found by its
bytes, so the file's size and zip structure stay as they were: only the checksum can tell).
Resume, tools/export.py, tools/sample.py, tools/evaluate.py and ``model.init_from`` must name the
file; resume and the tools given the run directory fall back to the intact previous checkpoint
and say so. train.py runs in this process (a few seconds); the sharded (DCP) twin of these checks
runs under torchrun in tests/integration/test_sharded_checkpoints.py.

meta.json itself is as untrusted as the files it lists: a crafted or damaged one may name a file
outside the checkpoint (``..``, an absolute path, a symbolic link out), a FIFO that blocks the
open, a device that never ends, or hold a list where an object belongs. Each must be one line
naming it, and ``--resume latest`` and the tools given the run directory pass over that
checkpoint as over a damaged one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

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


# ----------------------------------------------------------------------------- a meta.json that lies


def _edit_meta(step_dir: Path, change: Callable[[dict], Any]) -> None:
    meta_path = step_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    replaced = change(meta)
    meta_path.write_text(json.dumps(meta if replaced is None else replaced))


def _list(step_dir: Path, rel: str, content: bytes, *, in_manifest: bool = True) -> None:
    """meta.json names ``rel`` with the size and the digest of ``content``: what an attacker writes
    so that the file passes every check the unguarded reader made."""
    def change(meta: dict) -> None:
        if in_manifest:
            meta["files"][rel] = len(content)
        meta["checksums"]["files"][rel] = hashlib.sha256(content).hexdigest()
    _edit_meta(step_dir, change)


def _within(seconds: float, action: Callable[[], Any]) -> Any:
    """``action()``, failing the test if it has not returned in ``seconds`` (a FIFO's open waits for
    a writer, /dev/zero never ends): the daemon thread is left behind, the test is not."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(action()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still reading after {seconds} s: it opened what meta.json named"
    return out[0]


def _plant(step_dir: Path, kind: str) -> str:
    """Make meta.json of ``step_dir`` name a file it must not read; returns a fragment of the refusal."""
    outside = step_dir.parents[2] / "outside.bin"  # beside the run directory
    outside.write_bytes(b"not this checkpoint's")
    if kind == "dot-dot":
        _list(step_dir, "../../../outside.bin", outside.read_bytes())
        return "climbs out of the folder"
    if kind == "absolute":
        _list(step_dir, str(outside), outside.read_bytes())
        return "absolute path"
    if kind == "symlink out":
        (step_dir / "extra.pt").symlink_to(outside)
        _list(step_dir, "extra.pt", outside.read_bytes())
        return "symbolic link"
    if kind == "device by symlink":
        (step_dir / "extra.pt").symlink_to("/dev/zero")
        _list(step_dir, "extra.pt", b"")
        return "symbolic link"
    if kind == "fifo":
        os.mkfifo(step_dir / "extra.pt")
        _list(step_dir, "extra.pt", b"")
        return "is a FIFO, not a regular file"
    if kind == "device in checksums only":
        _list(step_dir, "/dev/zero", b"", in_manifest=False)
        return "'checksums' lists '/dev/zero', which its file manifest"
    if kind == "meta.json links out":
        meta = step_dir / "meta.json"
        outside.write_text(meta.read_text())
        meta.unlink()
        meta.symlink_to(outside)
        return "symbolic link"
    raise AssertionError(kind)


HOSTILE = ["dot-dot", "absolute", "symlink out", "device by symlink", "fifo", "device in checksums only",
           "meta.json links out"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_meta_json_naming_a_file_outside_the_checkpoint_is_refused_without_opening_it(clean_run, tmp_path, kind):
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir, symlinks=True)
    step4 = run_dir / "checkpoints" / "step_00000004"
    fragment = _plant(step4, kind)

    def check() -> str | None:
        return ckpt.incomplete_reason(step4) or ckpt.verify_contents(step4)

    reason = _within(20, check)
    assert reason is not None and fragment in reason and "\n" not in reason, reason
    warnings: list[str] = []
    found = _within(20, lambda: ckpt.find_latest(run_dir / "checkpoints", warnings.append,
                                                 lambda p: ckpt.verify_contents(p)))
    assert found == run_dir / "checkpoints" / "step_00000002"
    assert len(warnings) == 1 and "step_00000004" in warnings[0] and fragment in warnings[0], warnings


@pytest.fixture
def lying_run(clean_run, tmp_path) -> Path:
    """A copy of the clean run whose newest meta.json names a file beside the run, with its true size
    and digest: a checkpoint the unguarded checks accepted."""
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir)
    _plant(run_dir / "checkpoints" / "step_00000004", "dot-dot")
    return run_dir


def test_every_reader_passes_over_or_refuses_a_meta_json_naming_a_file_outside(lying_run, tmp_path, corpus_cache,
                                                                             capsys):
    step4 = lying_run / "checkpoints" / "step_00000004"
    capsys.readouterr()
    assert export_tool.main([str(lying_run), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    out = capsys.readouterr()
    assert "climbs out of the folder" in out.err and "using step_00000002" in out.err and "step 2" in out.out, out
    one_line_error(capsys, export_tool.main([str(step4), "--format", "hf", "--out", str(tmp_path / "hf")]),
                   "outside.bin", "climbs out of the folder")
    one_line_error(capsys, sample_tool.main([str(step4), "--prompt", "x", "--max-new-tokens", "2"]), "climbs out")
    one_line_error(capsys, evaluate_tool.main([str(step4), "--sequences", "2"]), "climbs out")
    one_line_error(capsys, _train(tmp_path / "fresh", corpus_cache, f"--model.init_from={step4}"), "climbs out")
    one_line_error(capsys, _train(lying_run, corpus_cache, "--resume", str(step4)), "climbs out")
    assert _train(lying_run, corpus_cache, "--resume", **{"train.max_steps": 4}) == 0
    out = capsys.readouterr()
    log = out.out + out.err
    assert "climbs out" in log and f"continuing from {step4.parent / 'step_00000002'} at step 2" in log, log[-3000:]


# A meta.json of the wrong shape: one line naming the key, never an AttributeError.
BAD_SHAPES = {
    "a list": (lambda meta: [meta], "holds a JSON array, not an object"),
    "files as a list": (lambda meta: {**meta, "files": list(meta["files"])}, "'files' is a JSON array"),
    "checksums as a list": (lambda meta: {**meta, "checksums": ["model_optim.pt"]}, "'checksums' is a JSON array"),
    "checksum files as a list": (lambda meta: {**meta, "checksums": {"algorithm": "sha256", "files": []}},
                                 "'checksums' holds a JSON array"),
    "a size as text": (lambda meta: {**meta, "files": {k: str(v) for k, v in meta["files"].items()}},
                       "not a byte count"),
    "step as text": (lambda meta: {**meta, "step": "four"}, "'step' is a JSON string, not number"),
    "layout as a list": (lambda meta: {**meta, "layout": [1, 1]}, "'layout' is a JSON array, not object"),
    "a renamed model key's section as a number": (lambda meta: {**meta, "model": {"moe_top_k": 2, "moe": 5}},
                                                  "'model' section does not have the shape of a model config"),
    "nested 100,000 deep": (None, "nests JSON arrays or objects too deeply"),
}


@pytest.mark.parametrize("shape", list(BAD_SHAPES))
def test_a_meta_json_of_the_wrong_shape_is_passed_over_or_refused_in_one_line(clean_run, tmp_path, shape):
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir)
    step4 = run_dir / "checkpoints" / "step_00000004"
    change, fragment = BAD_SHAPES[shape]
    if change is None:
        (step4 / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    else:
        _edit_meta(step4, change)
    reason = ckpt.incomplete_reason(step4) or ckpt.verify_contents(step4)
    assert reason is not None and fragment in reason and "\n" not in reason, reason
    warnings: list[str] = []
    assert ckpt.find_latest(run_dir / "checkpoints", warnings.append, ckpt.verify_contents).name == "step_00000002"
    assert len(warnings) == 1 and fragment in warnings[0], warnings
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_checkpoint_meta(step4, 1, "none")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_resume_latest_passes_over_a_meta_json_holding_a_list(clean_run, tmp_path, corpus_cache, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir)
    step4 = run_dir / "checkpoints" / "step_00000004"
    _edit_meta(step4, lambda meta: [meta])
    capsys.readouterr()
    one_line_error(capsys, sample_tool.main([str(step4), "--prompt", "x", "--max-new-tokens", "2"]),
                   "holds a JSON array")
    assert _train(run_dir, corpus_cache, "--resume", **{"train.max_steps": 4}) == 0  # saves step 4 anew
    out = capsys.readouterr()
    log = out.out + out.err
    assert "holds a JSON array" in log and f"continuing from {step4.parent / 'step_00000002'} at step 2" in log, log
