"""tools/bench_deepseek.py end to end on a 3-step setting: four train.py runs (the DeepSeek-shaped
model and its dense twin, each with and without MTP) and the interleaved timing, then the table, the
Markdown, the JSON rows and the plot; run again, it reads the finished runs back."""

from __future__ import annotations

import math

from common.report import read_results, rows_path
from tools import bench_deepseek

VARIANTS = ["moe", "moe-mtp", "dense-twin", "dense-twin-mtp"]


def test_bench_deepseek_trains_times_and_reports_every_variant(tmp_path, corpus_cache, capsys):
    out, md, png = tmp_path / "runs", tmp_path / "ds.md", tmp_path / "ds.png"
    argv = ["--seeds", "0", "--workers", "2", "--rounds", "1", "--log-interval", "1", "--eval-interval", "3",
            "--out", str(out), "--markdown", str(md), "--plot", str(png), "--model.d_ff=320", "--model.n_layer=2",
            "--model.max_seq_len=32", "--train.micro_batch_size=2", "--train.max_steps=3", "--train.eval_steps=1",
            "--optim.warmup_steps=1", f"--data.cache_dir={corpus_cache}", "--data.default_corpus_max_mb=2.0"]
    assert bench_deepseek.main(argv) == 0
    printed = capsys.readouterr().out
    rows = {r["variant"]: r for r in read_results(rows_path(md))["rows"]}
    assert list(rows) == VARIANTS
    text = md.read_text()
    assert "python -m tools.bench_deepseek --seeds 0" in text.splitlines()[2]  # the command, first in the list
    for name in VARIANTS:
        assert f"\n| {name} |" in text and f"\n{name} " in printed
        assert rows[name]["final_val_loss"]["n"] == 1 and math.isfinite(rows[name]["final_val_loss"]["median"])
        assert rows[name]["tokens_per_s"] > 0
    # equal active parameters but the routers: 1 MoE block (the first is dense) and the MTP module's
    routers = 16 * 128
    assert rows["moe"]["active_params"] - rows["dense-twin"]["active_params"] == routers
    assert rows["moe-mtp"]["active_params"] - rows["dense-twin-mtp"]["active_params"] == 2 * routers
    # the MTP variants log their extra loss every step; the others have none
    assert rows["moe-mtp"]["last_mtp_loss"] > 0 and rows["dense-twin-mtp"]["last_mtp_loss"] > 0
    assert rows["moe"]["last_mtp_loss"] is None and rows["dense-twin"]["last_mtp_loss"] is None
    assert rows["dense-twin"]["speed_vs_dense_twin"]["median"] == 1.0
    assert png.read_bytes()[:4] == b"\x89PNG"

    done = sorted(out.glob("*/done.json"))
    assert [p.parent.name for p in done] == sorted(f"{v}_seed0_steps3" for v in VARIANTS)
    stamps = [p.stat().st_mtime_ns for p in done]
    assert bench_deepseek.main(argv) == 0  # finished runs and the timing are read back, not redone
    assert [p.stat().st_mtime_ns for p in done] == stamps
    assert read_results(rows_path(md))["rows"] == list(rows.values())
