"""The estimator on sliding windows, attention sinks and heads set apart from d_model: its counts
against the masks the model itself builds (model/attention.py) and the chunks context parallelism
gives each rank (parallel/cp.py), and its times and bytes against hand-written formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from analysis import estimator as est
from common.hardware import DEVICES
from model.attention import causal_mask
from model.config import ModelConfig
from parallel.cp import chunk_ids

H100 = DEVICES["H100"]


def small(**changes) -> ModelConfig:
    base = dict(n_layer=4, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64, position="rope", norm="rmsnorm",
                mlp="swiglu", bias=False)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("window", [1, 7, 32, 64, 100])
def test_causal_pairs_are_the_models_own_mask(window):
    s = 64
    assert est.causal_pairs(s, window) == int(causal_mask(s, s, torch.device("cpu"), window).sum())
    assert est.causal_pairs(s) == int(causal_mask(s, s, torch.device("cpu")).sum())


@pytest.mark.parametrize("cp, window", [(2, 5), (2, 16), (4, 3), (4, 20), (4, None), (2, 1000)])
def test_cp_chunk_keys_are_the_keys_each_ranks_queries_can_see(cp, window):
    s = 64
    c = s // (2 * cp)
    visible = causal_mask(s, s, torch.device("cpu"), window)
    per_rank = []
    for rank in range(cp):
        # the keys parallel/cp.py hands a chunk: from the first key any of its queries sees to its end
        keys = 0
        for g in chunk_ids(cp, rank):
            seen = visible[g * c:(g + 1) * c].any(dim=0).nonzero().flatten()
            keys += int(seen.max() - seen.min() + 1)
        per_rank.append(keys)
    assert est.cp_chunk_keys(s, cp, window) == max(per_rank)


def _flash_seconds(cfg: ModelConfig, seq_len: int = 4096, **job) -> float:
    spec = est.JobSpec(cfg, seq_len, 1, device=H100, **job)
    return est.attention_seconds(spec, 1)[0]


def test_a_windowed_layer_costs_a_flash_kernel_its_band_and_sdpa_the_whole_square():
    s, w = 4096, 512
    plain = _flash_seconds(small(attention="auto"), s)
    band = est.causal_pairs(s, w) / est.causal_pairs(s)
    every = _flash_seconds(small(attention="auto", sliding_window=w), s)
    assert every == pytest.approx(plain * band)
    # gpt-oss's pattern: windows on layers 0 and 2 of 4, the whole context on 1 and 3
    alternate = _flash_seconds(small(attention="flash_attn", sliding_window=w, sliding_window_every=2), s)
    assert alternate == pytest.approx(plain * (band + 1) / 2)
    # SDPA with an explicit mask runs every block: s^2 pairs where the causal kernel runs s(s + 1)/2
    sdpa = _flash_seconds(small(attention="sdpa", sliding_window=w), s)
    assert sdpa == pytest.approx(plain * s * s / est.causal_pairs(s))
    # a window as long as the sequence changes nothing
    assert _flash_seconds(small(attention="auto", sliding_window=s), s) == pytest.approx(plain)


def test_the_reference_core_builds_the_whole_square_with_or_without_a_window():
    plain = est.JobSpec(small(attention="reference"), 1024, 1, device=H100)
    windowed = dataclasses.replace(plain, model=small(attention="reference", sliding_window=64))
    assert est.attention_seconds(windowed, 1) == est.attention_seconds(plain, 1)
    assert est.estimate_memory(windowed).activations == est.estimate_memory(plain).activations


def test_attention_work_and_activations_follow_the_query_width_not_d_model():
    # 4 heads of 32 (query width 128) on d_model 64, against 4 heads of 16 (query width 64)
    wide, narrow = small(attention_head_dim=32, n_kv_head=4), small(n_kv_head=4)
    assert _flash_seconds(wide) == pytest.approx(2 * _flash_seconds(narrow))
    s, b, p = 256, 2, 2
    extra = est.activation_bytes_per_layer(wide, s, b, "none", p, attention="flash") - est.activation_bytes_per_layer(
        narrow, s, b, "none", p, attention="flash")
    # Q, K, V and the core output each 64 wider; the fp32 log-sum-exp and the rest unchanged
    assert extra == p * s * b * 4 * 64


def test_sinks_run_the_reference_core_and_name_the_backends_that_cannot():
    sinks = small(attention_sinks=True)
    job = est.JobSpec(sinks, 512, 1, device=H100)
    assert job.attention == "materialized"
    reference = est.JobSpec(small(attention="reference"), 512, 1, device=H100)
    assert est.estimate_memory(job).activations == est.estimate_memory(reference).activations
    for backend in ("sdpa", "flash_attn"):
        with pytest.raises(est.EstimatorError, match=f"model.attention={backend} cannot run model.attention_sinks"):
            est.JobSpec(small(attention_sinks=True, attention=backend), 512, 1, device=H100)


def test_a_fused_sink_kernel_runs_the_fused_core_and_the_trainers_default_stays_materialized():
    """sink_attention=fused (Megatron-Core's softmax_type=learnable on cuDNN's fused attention): the
    core's time is the flash formula, 3.5 forward passes of the causal half (with the band of a sliding
    window) at attention_fraction of the GEMM rate, no score traffic, and it keeps what a fused core
    keeps; the default is the trainer's materialized reference core."""
    sinks = small(attention_sinks=True, sliding_window=16, sliding_window_every=2)
    fused = est.JobSpec(sinks, 512, 2, device=H100, sink_attention="fused")
    trainer = dataclasses.replace(fused, sink_attention="materialized")
    assert est.JobSpec(sinks, 512, 2, device=H100).sink_attention == "materialized"
    assert (fused.attention, trainer.attention) == ("flash", "materialized")
    a, s, b = est.Assumptions(), 512, 2
    full, band = s * (s + 1) // 2, 16 * 17 // 2 + (s - 16) * 16  # layers 0 and 2 windowed, 1 and 3 whole
    # QK^T and @V over q = v = 64 on half the s x s square, the windowed layers on their band's share of it
    executed = 2 * b * s * s * (2 * 64) / 2 * (1 + band / full) / 2 * 3.5
    rate = H100.bf16_tflops * 1e12 * a.gemm_fraction_hopper * a.attention_fraction
    compute, scores = est.attention_seconds(fused, 1)
    assert compute == pytest.approx(executed / rate)
    assert scores == 0.0 and est.attention_seconds(trainer, 1)[1] > 0
    twin = dataclasses.replace(fused, model=small(sliding_window=16, sliding_window_every=2))  # no sinks, flash-attn
    assert est.estimate_memory(fused).activations == est.estimate_memory(twin).activations
    assert est.estimate_memory(trainer).activations > est.estimate_memory(fused).activations
    with pytest.raises(est.EstimatorError, match="sink_attention='cudnn' is not valid; choose one of: materialized, fused"):
        est.JobSpec(sinks, 512, 2, device=H100, sink_attention="cudnn")


def test_under_cp_a_windowed_materialized_core_keeps_scores_against_the_keys_it_sees():
    s, cp, w, b, p = 4096, 4, 256, 1, 2
    cfg = small(attention="reference", sliding_window=w, sliding_window_every=2, max_seq_len=s)
    job = est.JobSpec(cfg, s, b, est.Layout(cp, strategy="fsdp", cp=cp), device=H100)
    c = s // (2 * cp)
    kv = p * b * 2 * cfg.kv_dim * (s - s // cp)
    windowed = cfg.n_head * b * p * (c * est.cp_chunk_keys(s, cp, w) - (s // cp) ** 2)
    whole = cfg.n_head * b * p * (c * c * (2 * cp + 1) - (s // cp) ** 2)
    assert est.cp_attention_bytes_per_layer(job, "none") == pytest.approx(kv + (windowed + whole) / 2)
    assert est.cp_chunk_keys(s, cp, w) == 2 * (c + w - 1)  # each chunk: its own c and the W - 1 before


def test_the_estimate_tool_takes_the_sink_kernel():
    """tools/estimate.py --sink-attention: gpt-oss's sinks on the trainer's materialized core by default,
    on a fused core when the flag says so."""
    from tools import estimate

    base = ["--config", "configs/gpt-oss-20b.yaml", "--gpus", "8", "--seq-len", "1024", "--micro-batch", "1"]
    jobs = [estimate.build_job(*estimate.parse_args(base + extra)) for extra in ([], ["--sink-attention", "fused"])]
    assert [(j.sink_attention, j.attention) for j in jobs] == [("materialized", "materialized"), ("fused", "flash")]


def test_transformer_engines_kernel_runs_a_fused_core_faster_on_hopper_only():
    """attention_kernel=te: cuDNN's fused attention, what Transformer Engine picks on Hopper, at the
    stated 1.6x of FlashAttention-2's rate; on an A100 TE picks flash-attn 2 (the same time), and a
    materialized core, which runs no fused kernel, is unchanged."""
    cfg, s, b = small(max_seq_len=512), 512, 2
    flash = est.JobSpec(cfg, s, b, device=H100)
    te = dataclasses.replace(flash, attention_kernel="te")
    assert flash.attention_kernel == "flash_attn2"
    a = est.Assumptions()
    executed = 2 * b * s * s * (2 * 64) / 2 * 3.5
    rate = H100.bf16_tflops * 1e12 * a.gemm_fraction_hopper * a.attention_fraction
    assert est.attention_seconds(flash, 1)[0] == pytest.approx(executed / rate)
    assert est.attention_seconds(te, 1)[0] == pytest.approx(executed / (rate * 1.6))
    assert est.estimate(te).time.step_s < est.estimate(flash).time.step_s
    a100 = DEVICES["A100"]
    assert (est.attention_seconds(dataclasses.replace(te, device=a100), 1)
            == est.attention_seconds(dataclasses.replace(flash, device=a100), 1))
    reference = small(max_seq_len=512, attention="reference")
    assert (est.attention_seconds(dataclasses.replace(te, model=reference), 1)
            == est.attention_seconds(dataclasses.replace(flash, model=reference), 1))
    with pytest.raises(est.EstimatorError, match="attention_kernel='fa3' is not valid; choose one of: flash_attn2, te"):
        est.JobSpec(cfg, s, b, device=H100, attention_kernel="fa3")


def test_the_estimate_tool_takes_the_attention_kernel():
    from tools import estimate

    base = ["--config", "configs/llama3.1-8b.yaml", "--gpus", "8", "--seq-len", "1024", "--micro-batch", "1"]
    jobs = [estimate.build_job(*estimate.parse_args(base + extra)) for extra in ([], ["--attention-kernel", "te"])]
    assert [j.attention_kernel for j in jobs] == ["flash_attn2", "te"]
