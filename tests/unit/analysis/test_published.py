"""Published measurements against the estimator (analysis/published.py, tools/published.py): the data
loads with its sources, two rows are predicted exactly as a hand computation, the committed results file
is what the tool writes today, and the calibration is what the documents say it is."""

from __future__ import annotations

import dataclasses

import pytest

from analysis import estimator as est
from analysis import published as pub
from common.errors import ConfigError
from common.report import read_results
from tests.conftest import ROOT
from tools.published import LOSO_COMMAND

GIB = 2**30
RESULTS = ROOT / "docs" / "results" / "published_vs_estimator.md"


@pytest.fixture(scope="module")
def rows() -> list[pub.PublishedRow]:
    return pub.load_rows()


@pytest.fixture(scope="module")
def comparisons(rows) -> list[pub.Comparison]:
    return pub.compare(rows)


def _row(rows, key: str) -> pub.PublishedRow:
    return next(r for r in rows if r.key == key)


def _one(comparisons, key: str, quantity: str) -> pub.Comparison:
    return next(c for c in comparisons if c.row.key == key and c.quantity == quantity)


# --------------------------------------------------------------------------- the data


def test_every_row_loads_with_a_source_and_its_published_parameter_count(rows):
    assert len(rows) >= 20
    sources = {r.source.name for r in rows}
    assert len(sources) >= 3
    for row in rows:
        assert row.source.citation and row.source.read_from and row.table and row.published
    # every row that prints a parameter count agrees with the model built from its recorded shape
    counted = [r for r in rows if r.num_params]
    assert len(counted) > 100 and pub.parameter_count_problems(rows) == []
    assert pub.parameter_count_problems([dataclasses.replace(counted[0], num_params=counted[0].num_params * 2)])


def test_calibration_rows_are_every_second_row_and_the_check_source_never_calibrates(rows):
    for source in {r.source.name for r in rows}:
        own = [r for r in rows if r.source.name == source]
        if own[0].source.calibration == "none":
            assert {r.role for r in own} == {"check"}
        else:
            assert [r.role for r in own] == ["calibration" if i % 2 == 0 else "held-out" for i in range(len(own))]
    assert {r.role for r in rows if r.source.name == "torchtitan"} == {"check"}
    assert sum(r.role == "calibration" for r in rows) <= len(rows) / 2


def test_bad_data_is_a_one_line_error_naming_the_file_and_row(tmp_path):
    good = (pub.PUBLISHED_DIR / "llama3.yaml").read_text()
    cases = [
        (good.replace("gpus: 8192,", "gpus: 8192, flops: 3,"), "llama3.yaml row 405b-8k-8192gpus: unknown key 'flops'"),
        (good.replace("system: grand-teton,", "system: nowhere,"), "unknown system 'nowhere'"),
        (good.replace("calibration: alternate", "calibration: some"), "calibration must be alternate or none"),
        (good.replace("tflops_per_gpu: 430}", "tflops: 430}"), "unknown key 'tflops'"),
    ]
    for text, message in cases:
        (tmp_path / "llama3.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message) as info:
            pub.load_rows(tmp_path)
        assert "\n" not in str(info.value)


def test_units_convert_both_ways(rows):
    for row in rows:
        for key, value in row.published.items():
            if key != "memory_gib":
                tokens = pub.tokens_per_s_per_gpu(row, key, value)
                assert pub.in_unit(row, key, tokens) == pytest.approx(value)
    # Megatron-LM's equation (3) for its 1T row: 96*l*h^2*(1 + s/(6h) + V/(16lh)) FLOPs per token
    row = _row(rows, "narayanan2021/t1-1008b")
    layers, h, s, v = 128, 25600, 2048, 51200
    per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    assert pub.tokens_per_s_per_gpu(row, "tflops_per_gpu", 163) == pytest.approx(163e12 / per_token)


# --------------------------------------------------------------------------- two rows by hand


def test_a_throughput_row_equals_a_hand_computation(rows, comparisons):
    """Korthikanti et al.'s 22B with sequence parallelism and selective recompute, tp=8 on one DGX A100:
    every term of docs/estimator.md written out again for this row."""
    a = est.Assumptions()
    s, b, d, heads, L, V, t = 2048, 4, 6144, 64, 48, 51200, 8
    f, hd, tokens = 4 * d, d // heads, s * b
    peak = 312e12 * a.gemm_fraction_ampere
    hbm = 2.039e12 * a.hbm_fraction

    def gemm(m, k, n):
        shape = m / (m + a.gemm_knee) * n / (n + a.gemm_knee)
        return max(2 * m * k * n / (peak * shape), 2 * (m * k + k * n + m * n) / hbm)

    layer_gemms = gemm(tokens, d, 3 * d / t) + gemm(tokens, d / t, d) + gemm(tokens, d, f / t) + gemm(tokens, f / t, d)
    # materialized attention: both batched matmuls on the whole s x s square, forward twice (selective
    # recompute) and backward once (twice the forward), plus the scores through HBM: with dropout 13 bytes
    # per score forward (6 passes of 2 bytes and a 1-byte mask) and 15 backward
    core = 2 * gemm(s, hd, s) * b * (heads / t) * (2 + 2)
    scores = b * (heads / t) * s * s * (2 * 13 + 15) * a.elementwise_scale / hbm
    # element-wise, sequence-parallel: outside 30 + 34 d-wide bytes per token (norms, residuals, dropout),
    # inside GELU 4 + 6 d_ff bytes per token
    elementwise = tokens * ((30 + 34) * d / t + (4 + 6) * f / t) * a.elementwise_scale / hbm
    compute = L * (3 * layer_gemms + core) + 3 * gemm(tokens, d, V / t)
    memory_bound = L * (elementwise + scores) + tokens * V / t * (3 * 2 + 8) * a.elementwise_scale / hbm
    # tensor parallel: 8 collectives per layer, 2 for the embedding and 2 for the LM head, each 7/8 of the
    # 16-bit s*b*h activation over NVLink (300 GB/s one way) at link_fraction
    activation = 2 * tokens * d
    tp = (8 * L + 4) * 7 / 8 * activation / (300e9 * a.link_fraction)
    whole = 2 * (2 * d) + 2 * d  # two LayerNorms (gain and bias) and the two row-parallel biases stay whole
    per_gpu = L * ((12 * d * d + 13 * d - whole) / t + whole) + V * d / t + s * d + 2 * d
    optimizer = 2 * 16 * per_gpu / hbm  # 2 + 2 + 12 bytes per parameter, read and written once
    step = compute + memory_bound + tp + optimizer
    c = _one(comparisons, "korthikanti2022/22b-sp-selective", "throughput")
    assert c.key == "iteration_s" and c.published == 1.10
    assert c.predicted == pytest.approx(step, rel=1e-9)
    assert c.error == pytest.approx(1.10 / step - 1)


def test_a_memory_row_equals_a_hand_computation(comparisons):
    """torchtitan's Llama 3.1 8B under FSDP on 128 H100s, its per-op recompute (op_selective keeping the
    1st, 3rd, 5th and 7th of wq wk wv wo w1 w3 w2), micro-batch 2 at 8192 tokens: the reserved bytes
    written out again."""
    a = est.Assumptions()
    s, b, h, kv, f, heads, L, V = 8192, 2, 4096, 1024, 14336, 32, 32, 128256
    tokens = s * b
    params = L * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + h + 2 * V * h  # untied, RMSNorm, no bias
    states = 16 * params / 128
    lse = 4 * heads * s * b  # flash attention's fp32 log-sum-exp
    kept = 2 * tokens * (2 * h + (h + kv) + h + f) + lse  # input, w2's output; wq's and wv's, the core's, w1's
    none = 2 * tokens * (4 * h + (h + 2 * kv) + h + 4 * f) + lse
    activations = L * kept + (none - kept) + 2 * tokens * h  # + one layer rebuilt + the embedding output
    logits = tokens * V * (4 + 4 + 4)  # fp32 log-probabilities, their gradient, the fp32 logits' gradient
    unsharded = 2 * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) * (2 + 2)  # two gathered layers and grads
    unsharded += 2 * (2 * V * h + h)  # FSDP2's root (table, head, final norm), gathered through backward
    reserved = states + activations + logits + unsharded + a.fragmentation * (activations + logits + unsharded)
    c = _one(comparisons, "torchtitan/t3-8b-fsdp-128", "memory")
    assert c.published == 67.0
    assert c.predicted == pytest.approx(reserved / GIB, rel=1e-9)


# --------------------------------------------------------------------------- the committed results


def test_committed_results_are_what_the_tool_writes_today(comparisons):
    from tools import published as tool

    text = pub.render_markdown(comparisons, est.Assumptions(), tool.COMMAND)
    committed = RESULTS.read_text()
    summary = "\n".join(pub.summary_lines(pub.summarize(comparisons)))
    assert summary in committed, "the error summary is stale: run python -m tools.published"
    assert text == committed, "docs/results/published_vs_estimator.md is stale: run python -m tools.published"


def test_every_figure_beyond_thirty_percent_has_a_written_reason(comparisons):
    assert [c.row.key for c in pub.unexplained(comparisons)] == []
    assert any(c.error is not None and abs(c.error) > pub.REASON_THRESHOLD for c in comparisons)  # reasons are needed


def test_the_committed_parameters_minimize_the_calibration_loss(rows):
    # The Assumptions defaults are the fit (python -m tools.published --fit): nudging any fitted
    # parameter by 3% either way does not lower the calibration rows' loss by more than rounding.
    base = est.Assumptions()
    loss = pub.calibration_loss(rows, base)
    for name in est.FITTED_PARAMETERS:
        for factor in (0.97, 1.03):
            value = getattr(base, name) * factor
            if name.endswith("_fraction") and value >= 1:
                continue
            nudged = pub.calibration_loss(rows, dataclasses.replace(base, **{name: value}))
            assert nudged > loss - 5e-4, (name, factor, nudged, loss)


def test_the_tool_writes_markdown_json_and_a_plot_for_all_rows(tmp_path, capsys):
    from tools import published as tool

    assert tool.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "**all sources** | throughput | held-out/check" in out
    for suffix in (".md", ".json", ".png"):
        assert (tmp_path / f"published_vs_estimator{suffix}").stat().st_size > 0
    assert (tmp_path / "published_vs_estimator.md").read_text() == RESULTS.read_text()


def test_context_parallel_rows_are_predicted_on_their_layout(rows, comparisons):
    cp = [c for c in comparisons if c.row.cp > 1]
    assert cp and all(c.predicted is not None for c in cp)
    row = _row(rows, "torchtitan/t6-405b-4d-cp8")
    assert row.job().layout.cp == 8 and row.job().local_seq_len == 262144 // 8
    assert row.published["memory_gib"] == 84.9  # torchtitan's Table 6 (commit 31a17bfd)


# --------------------------------------------------------------------------- validation by source

LOSO = ROOT / "docs" / "results" / "published_leave_one_source_out.md"


def test_each_fold_fits_on_every_other_source_and_predicts_only_its_own(rows, monkeypatch):
    seen = []

    def recording_fit(fit_rows, start=None, iterations=0, restarts=0):
        seen.append({r.source.name for r in fit_rows})
        return est.Assumptions(gemm_fraction_hopper=0.5 + 0.01 * len(seen))

    monkeypatch.setattr(pub, "fit_on", recording_fit)
    folds = pub.leave_one_source_out(rows)
    fitting = {r.source.name for r in rows}
    assert [f.source for f in folds] == list(dict.fromkeys(r.source.name for r in rows))
    for f, fitted_on in zip(folds, seen):
        assert fitted_on == fitting - {f.source}
        assert {c.row.source.name for c in f.comparisons} == {f.source}
        # predicted with the fold's own parameters
        assert f.comparisons == pub.compare([r for r in rows if r.source.name == f.source], f.assumptions)


def test_committed_validation_by_source_is_what_its_saved_fits_predict_today(rows):
    # The tool's fits take minutes; their parameters are saved in the JSON, so the page is redrawn here
    # from them with today's estimator and data, and must be the committed page.
    saved = read_results(LOSO.with_suffix(".json"))["folds"]
    folds = pub.folds_from(rows, saved)
    assert {f.source for f in folds} == {r.source.name for r in rows}
    page = pub.render_leave_one_out(folds, pub.summarize(pub.compare(rows)), LOSO_COMMAND)
    assert page == LOSO.read_text()



def test_the_readme_and_the_estimator_doc_state_the_current_held_out_errors(comparisons):
    held = {s.quantity: s for s in pub.summarize(comparisons) if s.source == "all"}
    throughput, memory = f"{held['throughput'].median:.1%}", f"{held['memory'].median:.0%}"
    folds = pub.folds_from(pub.load_rows(), read_results(LOSO.with_suffix(".json"))["folds"])
    by_source = next(s for s in pub.fold_summaries(folds) if s.source == "all" and s.quantity == "throughput")
    for path in ("README.md", "docs/estimator.md"):
        text = (ROOT / path).read_text()
        assert throughput in text and memory in text and f"{len(pub.load_rows())} published" in text, path
        assert f"{by_source.median:.1%}" in text, path  # the validation by source, the headline


def test_every_fitted_fraction_stays_a_fraction_in_the_search():
    # The GEMM fractions are named gemm_fraction_<family>: searched on their logits like the others,
    # however far the search goes they stay below 1 (a rate above the peak is impossible).
    for name in est.FITTED_PARAMETERS:
        if "fraction" in name:
            assert 0 < pub._from_search(name, 50.0) <= 1 and pub._from_search(name, -50.0) >= 0, name
            assert pub._from_search(name, pub._to_search(name, 0.61)) == pytest.approx(0.61)


def test_each_torchtitan_row_through_its_command_line_predicts_what_the_table_does(rows, comparisons):
    """The command published_vs_estimator.md lists beside each torchtitan row, parsed and run by
    tools/estimate.py as a user would, gives the table's predictions (memory and tokens/s/GPU)."""
    import shlex

    from tools import estimate as cli

    checked = 0
    for row in (r for r in rows if r.source.name == "torchtitan"):
        command = pub.cli_command(row)
        assert command is not None and command in (ROOT / "docs/results/published_vs_estimator.md").read_text()
        args, overrides = cli.parse_args(shlex.split(command)[3:])
        job = cli.build_job(args, overrides, cli.load_job_config(args, overrides))
        result = est.estimate(job)
        through_cli = {"memory": result.memory.reserved / est.GIB,
                       "throughput": result.time.tokens_per_step / result.time.step_s / row.gpus}
        for c in (c for c in comparisons if c.row is row):
            assert through_cli[c.quantity] == pytest.approx(c.predicted, rel=1e-9), (row.id, c.quantity)
            checked += 1
    assert checked == 36  # 18 rows, throughput and memory each


def test_a_row_says_its_framework_runs_sinks_in_a_fused_kernel(rows):
    """megatron_bridge.yaml's GPT OSS 120B row (sink_attention: fused) is estimated with a fused core;
    the same row without the key gets the trainer's materialized one."""
    row = next(r for r in rows if r.key == "megatron_bridge/gpt-oss-120b-64gpus")
    fused = row.job()
    assert row.model.attention_sinks and fused.attention == "flash"
    assert dataclasses.replace(fused, sink_attention="materialized").attention == "materialized"


def test_rows_run_the_attention_kernel_and_pipeline_overlap_their_framework_ran(rows):
    """Transformer Engine's attention (cuDNN's on Hopper) for the Megatron-Core sources, FlashAttention-2
    for the others; overlapped pipeline sends where Megatron-Bridge sets overlap_p2p_comm (interleaved
    schedules), nowhere else."""
    for row in rows:
        job = row.job()
        te = row.source.name in ("nemo", "megatron_bridge")
        assert job.attention_kernel == ("te" if te else "flash_attn2"), row.key
        interleaved = job.layout.pp > 1 and job.layout.pp_schedule == "interleaved_1f1b"
        assert job.pp_overlap == (row.source.name == "megatron_bridge" and interleaved), row.key
