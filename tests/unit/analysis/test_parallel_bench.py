"""analysis/parallel_bench.py: its report (the Markdown tables and the same rows as JSON, which the
chapter's priority table reads: no Markdown parsing between tools) and its per-rank formulas. The
rows themselves are measured by launching ranks: tests/integration/test_bench_parallel.py runs one."""

from __future__ import annotations

import math

import pytest
import torch

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
        sequences = int(words["train.micro_batch_size"]) * int(words["train.grad_accum_steps"]) * layout.data_ranks
        assert sequences == 8, layout
        assert int(words["train.grad_accum_steps"]) >= layout.layout.pp  # a pipeline's micro-batches
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


def test_expert_parallel_all_to_all_formula_is_the_routed_bytes_under_balanced_routing():
    """ep2 on configs/tiny-moe.yaml: 4 ranks' worth of batch over 2 data-parallel ranks (micro-batch 4 of 128
    tokens, top-2: 1,024 copies per layer and rank). Routed evenly over the 8 experts, a rank's dispatch sends
    the half of its copies bound for the other rank and combine returns as many, forward and backward: the
    estimator's formula, plus the per-expert counts each forward exchanges (half of 8 int64s per layer)."""
    layout = parallel_bench.LAYOUTS["ep2"]
    assert layout.ranks == 2 and layout.strategy == "fsdp" and layout.data_ranks == 2
    cfg = load_config("configs/tiny-moe.yaml", [parallel_bench.UNTIED, *layout.overrides(8)])
    layers, experts, row = cfg.model.n_layer, cfg.model.moe.experts, cfg.model.d_model * 4
    copies = cfg.train.micro_batch_size * cfg.seq_len * cfg.model.moe.top_k
    formula = parallel_bench.formula_all_to_all_bytes(cfg, 2)
    assert formula == layers * 4 * copies / 2 * row  # 4 MiB
    even = torch.full((2, layers, experts), copies // experts)
    for rank in (0, 1):
        sent = parallel_bench.routed_all_to_all_bytes(even, rank, forwards=1, backwards=1, row_bytes=row)
        assert sent == formula + layers * experts * 8 / 2


def test_routed_all_to_all_bytes_by_hand():
    """ep=2, one layer, 4 experts (rank 0 holds experts 0-1, rank 1 experts 2-3)."""
    routed = torch.tensor([[[3, 1, 0, 4]], [[6, 2, 5, 1]]])
    # rank 0 dispatches its 4 copies for experts 2-3 and returns the 8 that rank 1 sent to experts 0-1
    # (12 rows forward, 12 backward); rank 1 the same two blocks the other way round. Counts: 2 of 4 int64s.
    for rank in (0, 1):
        assert parallel_bench.routed_all_to_all_bytes(routed, rank, 1, 1, row_bytes=10) == 24 * 10 + 16
    # Recomputed in backward: two forwards' exchanges (counts summed over both), one backward's.
    assert parallel_bench.routed_all_to_all_bytes(2 * routed, 0, 2, 1, row_bytes=10) == 36 * 10 + 32
    # ep=4, 4 experts, one each: rank 2 sends what it routed elsewhere, returns what others routed to expert 2.
    four = torch.tensor([[[1, 2, 3, 4]], [[0, 0, 7, 1]], [[2, 2, 2, 2]], [[5, 0, 0, 0]]])
    assert parallel_bench.routed_all_to_all_bytes(four, 2, 1, 1, row_bytes=1) == 2 * (6 + 10) + 4 * 8 * 3 / 4


def test_expert_parallel_rows_split_the_experts_in_their_states_and_traffic():
    """ep2: dense weights sharded by FSDP2 over both ranks, each rank holding half the experts whole
    (no ranks left to shard them); ep2_fsdp: the experts' halves sharded over the 2 ranks holding them."""
    cfg = load_config("configs/tiny-moe.yaml", [parallel_bench.UNTIED, *parallel_bench.LAYOUTS["ep2"].overrides(8)])
    n = parallel_bench.rank_parameters(cfg, 0)
    routed = cfg.model.n_layer * cfg.model.moe.experts * 3 * cfg.model.d_model * cfg.model.moe.d_ff
    assert parallel_bench.rank_routed_parameters(cfg, 0) == routed
    assert parallel_bench.formula_states(cfg, 0, 2)["params"] == pytest.approx((n - routed) * 4 / 2 + routed / 2 * 4)
    # FSDP2 gathers the dense weights twice and reduce-scatters their gradients; the experts travel not at all
    assert parallel_bench.formula_comm(cfg, 0, 2)["dp"] == pytest.approx(1 / 2 * (n - routed) * (2 * 4 + 4))
    both = load_config("configs/tiny-moe.yaml", [parallel_bench.UNTIED,
                                                 *parallel_bench.LAYOUTS["ep2_fsdp"].overrides(8)])
    assert parallel_bench.formula_states(both, 0, 4)["grads"] == pytest.approx((n - routed) * 4 / 4 + routed / 4 * 4)
    assert parallel_bench.formula_comm(both, 0, 4)["dp"] == pytest.approx(
        3 / 4 * (n - routed) * 12 + 1 / 2 * routed / 2 * 12)


def test_expert_parallel_table_reports_per_step_ratios_to_the_formula():
    """Ratios per step, median (min-max) over the steps: the fullest rank's bytes and the ranks' mean, each
    over the formula; and how far the measured bytes are from the routing's."""
    row = parallel_bench.Row("ep=2", 4.0, 2e-7, {}, {}, ranks=2, a2a_formula=100.0,
                             a2a_by_rank=[[110, 100, 120], [90, 100, 100]],
                             a2a_routed_by_rank=[[110, 100, 120], [90, 100, 99]])
    single = parallel_bench.Row("single process, untied", 4.0, 0.0, {}, {})
    text = parallel_bench.ep_table([single, row], markdown=True)
    assert "| ep=2 | 2 | +2.0e-07 | 0.1 (0.1-0.1) | 0.1 | 1.100 (1.000-1.200) | 1.000 (1.000-1.100) | 1.0e-02 |" in text
    assert parallel_bench.ep_table([single], markdown=True) is None
