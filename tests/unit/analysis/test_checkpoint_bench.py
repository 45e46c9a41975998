"""analysis/checkpoint_bench.py: one rank's measurement in this process on a one-block model, and
the table built from it (no timing is asserted, only that each figure is the thing it names)."""

from __future__ import annotations

import json

from analysis.checkpoint_bench import Row, table
from analysis.checkpoint_bench import run_rank as measure_rank
from training import checkpoint as ckpt

SMALL = ["--train.device=cpu", "--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=32",
         "--train.micro_batch_size=2"]


def test_one_rank_measures_both_variants_per_round_and_the_checksum_covers_every_file(tmp_path, corpus_cache):
    measure_rank("configs/tiny.yaml", [*SMALL, f"--data.cache_dir={corpus_cache}", "--data.default_corpus_max_mb=2",
                                       f"--logging.run_dir={tmp_path / 'run'}"],
                 rounds=2, max_steps_during=1, out=tmp_path)
    result = json.loads((tmp_path / "rank0.json").read_text())
    rounds = result["rounds"]
    assert len(rounds) == 2
    latest = ckpt.find_latest(tmp_path / "ckpt")  # keep_last=1: the last save of the last round
    assert ckpt.verify_contents(latest) is None
    hashed = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file() and f.name != ckpt.META)
    for r in rounds:
        assert r["checksum_bytes"] == hashed  # one process wrote, and hashed, every file
        assert 0 < r["checksum_s"] < r["sync_write_s"] < r["sync_s"]
        assert r["async_s"] == r["stage_s"] + r["publish_s"] and r["steps_during"] == 1
        assert r["background_write_s"] > 0 and r["step_s_during"] > 0 and r["step_s_without"] > 0
    assert result["bytes"] == hashed + (latest / ckpt.META).stat().st_size

    row = Row("small", 1, "none", result["n_params"], result["bytes"], rounds)
    text = table([row], markdown=True)
    assert text.count("\n") == 2 and "| small (" in text and "x (" in text
