"""analysis/parallel_bench.py: its report (the Markdown tables and the same rows as JSON, which the
chapter's priority table reads: no Markdown parsing between tools) and its per-rank formulas. The
rows themselves are measured by launching ranks: tests/integration/test_bench_parallel.py runs one."""

from __future__ import annotations

import math

import pytest

from analysis import parallel_bench
from analysis.chapter_tables import PARALLEL_CPU, Measured, priority_table
from analysis.estimator import stage_parameters
from common.report import read_results, rows_path
from training.config import load_config


def _states(kib: float) -> dict[str, float]:
    return {"params": kib * 256, "grads": kib * 256, "optimizer": kib * 512}


def test_rows_written_as_json_are_what_the_priority_table_quotes(tmp_path):
    rows = [
        parallel_bench.Row("single process", 3.72, 0.0, {**_states(800), "buffers": 0}, _states(800)),
        parallel_bench.Row("ddp", 3.72, -1e-7, {**_states(800), "buffers": 0}, _states(800), ranks=2),
        parallel_bench.Row("fsdp", 3.72, -2e-7, {**_states(400), "buffers": 0}, _states(400), ranks=2),
        parallel_bench.Row("zero3", math.nan, math.nan, {}, {}, status="zero3: exit 1: boom", ranks=2),
    ]
    md = tmp_path / PARALLEL_CPU
    written = parallel_bench.write_markdown(rows, "2 ranks, 3 steps", 2, "python -m tools.bench_parallel", md)
    assert written == [md, rows_path(md)]
    text = md.read_text()
    assert "| fsdp | 2 | 3.720000 | -2.0e-07 | 100 | 100 |" in text and "failed: zero3: exit 1: boom" in text
    document = read_results(rows_path(md))
    assert document["title"] in text and "gloo, 2 processes" in document["title"]
    assert document["rows"][3]["loss"] is None and document["rows"][2]["measured"]["optimizer"] == 400 * 512
    cell = next(r for r in priority_table(Measured(formats={}, documents={PARALLEL_CPU: document})).rows
                if r[1] == "FSDP / ZeRO")[-1]
    assert "model states per rank 400 KiB (fsdp) vs 800 KiB (ddp), 0.50×, loss vs one process -2.0e-07" in cell
    assert document["title"] in cell


def test_layout_rows_keep_the_global_batch_and_split_the_model_as_the_estimator_does():
    for layout in parallel_bench.LAYOUTS.values():
        words = dict(o.lstrip("-").split("=") for o in layout.overrides(8))
        sequences = int(words["train.micro_batch_size"]) * int(words["train.grad_accum_steps"]) * layout.dp_shard
        assert sequences == 8, layout
        assert int(words["train.grad_accum_steps"]) >= layout.pp  # a pipeline's micro-batches
    # Two pipeline ranks hold the whole untied model between them; the estimator's stage split agrees.
    cfg = load_config("configs/tiny.yaml", [parallel_bench.UNTIED, "--parallel.pp=2", "--train.grad_accum_steps=2"])
    whole = stage_parameters(cfg.model)
    assert parallel_bench.rank_parameters(cfg, 0) + parallel_bench.rank_parameters(cfg, 1) == whole
    # Each pipeline rank sends one b x s x h fp32 activation (or its gradient) per micro-batch.
    sent = parallel_bench.formula_comm(cfg, 0, 1)
    b, s, h = cfg.train.micro_batch_size, cfg.seq_len, cfg.model.d_model
    assert sent == {"tp": 0.0, "dp": 0.0, "pp": 2 * b * s * h * 4, "other": 0.0}
    # Under the pipeline FSDP2 gathers a stage in each of the m=2 micro-batches' forwards and once in
    # backward (as measured in docs/results/parallel_strategies_cpu.md), and reduce-scatters once: fp32.
    fsdp = load_config("configs/tiny.yaml", [parallel_bench.UNTIED, "--parallel.pp=2", "--parallel.strategy=fsdp",
                                             "--train.grad_accum_steps=2"])
    n = parallel_bench.rank_parameters(fsdp, 0)
    assert parallel_bench.formula_comm(fsdp, 0, 2)["dp"] == 1 / 2 * n * (3 * 4 + 1 * 4)


def test_context_parallel_rows_count_the_kv_gathers_and_fold_cp_into_fsdp():
    """cp2 (dp_shard=2 x cp=2): per step each rank sends (cp-1)/cp of the whole sequence's K and V in a
    forward all-gather and a backward reduce-scatter per layer; FSDP2 shards over dp_shard x cp."""
    layout = parallel_bench.LAYOUTS["cp2"]
    assert layout.ranks == 4 and layout.strategy == "fsdp"
    cfg = load_config("configs/tiny.yaml", [parallel_bench.UNTIED, *layout.overrides(8)])
    b, s, kv, layers = cfg.train.micro_batch_size, cfg.seq_len, cfg.model.kv_dim, cfg.model.n_layer
    assert parallel_bench.formula_kv_bytes(cfg, 2) == layers * 2 * (1 / 2) * (2 * b * s * kv * 4)
    n = parallel_bench.rank_parameters(cfg, 0)
    assert parallel_bench.formula_comm(cfg, 0, 2)["dp"] == pytest.approx(3 / 4 * n * (2 * 4 + 4))  # over 4 ranks
    assert parallel_bench.formula_states(cfg, 0, 4)["params"] == pytest.approx(n * 4 / 4)
