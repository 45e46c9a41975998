"""train.py on a two-source mixture (the built-in corpus and a prepared dataset): per-source validation
and read counts in the metrics, exact resume on 2 ranks, resume of a 2-rank checkpoint in one
process (``checkpoint.reshard=true``: the data stream continues, the same samples), and refusals of
an unreachable source and of data with another tokenizer than the checkpoint's, in one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.prepare import PrepareOptions, prepare
from tests.conftest import ROOT, read_metrics, run_torchrun, run_train, step_losses, tiny_overrides

COMMON = {"train.max_steps": 4, "checkpoint.interval": 2, "checkpoint.keep_last": 0, "checkpoint.save_final": "true",
          "train.eval_interval": 4, "train.eval_sequences": 8, "optim.warmup_steps": 1}


@pytest.fixture(scope="module")
def docs_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "mmap"
    prepare(PrepareOptions(inputs=[str(ROOT / "docs")], out_dir=str(out), glob="*.md", text_split="paragraph",
                           val_fraction=0.1, workers=1, progress=False))
    return out


def mixture(docs: Path) -> str:
    return f"--data.sources=[{{name: code, format: default, weight: 3}}, {{name: docs, path: '{docs}', weight: 1}}]"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, corpus_cache, docs_data):
    """The uninterrupted 2-rank run (micro-batch 2 each), which saves at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("mix") / "two"
    proc = run_torchrun(2, ["--config", "configs/tiny.yaml", *tiny_overrides(run_dir, corpus_cache, **COMMON,
                                                                          **{"train.micro_batch_size": 2}),
                            mixture(docs_data)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc.stdout


def trained(stdout: str, run_dir: Path) -> bool:
    """Whether a run logged a step or saved a checkpoint."""
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    return bool(steps) or any((run_dir / "checkpoints").glob("step_*"))


def last(rows: list[dict], key: str):
    return [r[key] for r in rows if key in r][-1]


def test_a_mixture_logs_per_source_validation_and_reads(two_ranks):
    run_dir, out = two_ranks
    rows = read_metrics(run_dir)
    val = last(rows, "val_loss")
    code, docs = last(rows, "val_loss/code"), last(rows, "val_loss/docs")
    assert val == pytest.approx(0.75 * code + 0.25 * docs, rel=1e-9)  # weighted by the configured weights
    assert "data: mixture of 2 source(s), 4 samples/step" in out and "(code " in out
    # tools/evaluate.py on the final checkpoint gives the same figures, source by source
    from tools.evaluate import main as evaluate

    assert evaluate([str(run_dir), "--json", str(run_dir / "evaluate.json")]) == 0
    result = json.loads((run_dir / "evaluate.json").read_text())
    assert result["loss"] == pytest.approx(val, abs=1e-5)
    assert result["sources"]["docs"]["loss"] == pytest.approx(docs, abs=1e-5)
    samples = last(rows, "data/code/samples") + last(rows, "data/docs/samples")
    assert samples == 4 * 4  # every sample of every rank and step, counted once
    assert last(rows, "data/docs/tokens") == last(rows, "data/docs/samples") * 64


def test_two_ranks_resume_exactly_and_one_process_continues_the_same_stream(two_ranks, tmp_path, corpus_cache,
                                                                            docs_data):
    run_dir, _ = two_ranks
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    reference, rows = step_losses(run_dir), read_metrics(run_dir)
    again = tmp_path / "again"
    proc = run_torchrun(2, ["--config", "configs/tiny.yaml", *tiny_overrides(again, corpus_cache, **COMMON,
                                                                          **{"train.micro_batch_size": 2}),
                            mixture(docs_data), "--resume", str(checkpoint)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = step_losses(again)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step
    assert last(read_metrics(again), "data/docs/samples") == last(rows, "data/docs/samples")

    one = tmp_path / "one"
    proc = run_train(["--config", "configs/tiny.yaml", *tiny_overrides(one, corpus_cache, **COMMON, **{
        "train.micro_batch_size": 4, "checkpoint.reshard": "true"}), mixture(docs_data), "--resume", str(checkpoint)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the data stream continues where it stopped" in proc.stdout
    got = step_losses(one)
    for step in (3, 4):  # the same samples: one process of 4 equals two ranks of 2 to fp32 rounding
        assert got[step] == pytest.approx(reference[step], abs=1e-5), step
    assert last(read_metrics(one), "val_loss/docs") == pytest.approx(last(rows, "val_loss/docs"), abs=1e-5)
    assert last(read_metrics(one), "data/code/samples") == last(rows, "data/code/samples")


def test_an_unreachable_source_and_another_tokenizer_are_one_line_and_train_nothing(two_ranks, tmp_path,
                                                                                   corpus_cache, docs_data):
    run_dir, _ = two_ranks
    bad = tmp_path / "bad"
    proc = run_train(["--config", "configs/tiny.yaml", *tiny_overrides(bad, corpus_cache, **COMMON),
                      "--data.sources=[{name: web, path: 'http://127.0.0.1:9/web'}]", "--data.retries=0"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: http://127.0.0.1:9/web/meta.json: unreachable or dropped after 1 attempt(s) (URLError: [Errno 111] "
        "Connection refused); check the server or raise data.retries / data.request_timeout"]
    assert not trained(proc.stdout, bad)

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for item in docs_data.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    meta = json.loads((other / "meta.json").read_text())
    meta.update(tokenizer="hf:/elsewhere/tokenizer.json", tokenizer_sha256="0" * 64)
    (other / "meta.json").write_text(json.dumps(meta))
    proc = run_train(["--config", "configs/tiny.yaml", *tiny_overrides(tmp_path / "r", corpus_cache, **COMMON, **{
        "checkpoint.reshard": "true"}), f"--data.sources=[{{name: docs, path: '{other}'}}]",
        "--resume", str(run_dir / "checkpoints" / "step_00000002")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "was trained with tokenizer byte and this run's data uses " \
        "hf:/elsewhere/tokenizer.json" in line
    assert not trained(proc.stdout, tmp_path / "r")
