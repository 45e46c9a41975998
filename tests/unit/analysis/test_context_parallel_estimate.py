"""The estimator and planner with context parallelism (analysis/estimator/), against hand counts."""

from __future__ import annotations

import dataclasses

import pytest

import analysis.estimator as est
from analysis.estimator.memory import layer_bytes
from common.hardware import DEVICES
from model.config import ModelConfig
from training.config import load_config

H100 = DEVICES["H100"]
MODEL = ModelConfig(vocab_size=32000, max_seq_len=65536, n_layer=8, n_head=16, n_kv_head=4, d_model=2048,
                    mlp="swiglu", norm="rmsnorm", position="rope", bias=False, attention="sdpa")


def job(world_size: int = 8, cp: int = 1, tp: int = 1, pp: int = 1, **changes) -> est.JobSpec:
    """The model on ``world_size`` H100s under fsdp with ``cp`` (``tp``, ``pp``); ``changes``: JobSpec's other fields."""
    base = dict(model=MODEL, seq_len=65536, micro_batch=1, recompute="none", precision="bf16", device=H100,
                layout=est.layout_of(world_size, strategy="fsdp", cp=cp, tp=tp, pp=pp))
    return est.JobSpec(**{**base, **changes})


@pytest.mark.parametrize("policy", ["none", "op_selective", "selective", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_layer_keeps_its_share_of_the_sequence_plus_the_gathered_keys_and_values(cp, policy):
    s, p = 65536, 2
    local = est.activation_bytes_per_layer(MODEL, s // cp, 1, policy, p, attention="flash")
    # K and V of the other ranks' s - s/cp tokens, kv_dim = 4 heads x 128 wide, stay saved unless
    # the core (gather included) is recomputed in backward.
    gathered = 0 if policy in ("selective", "full") else p * 2 * 512 * (s - s // cp)
    assert est.cp_attention_bytes_per_layer(job(cp=cp), policy) == gathered
    assert layer_bytes(job(cp=cp), policy) == local + gathered
    # tensor parallelism splits the gathered KV heads too
    tp = job(cp=cp, tp=2, world_size=16)
    assert est.cp_attention_bytes_per_layer(tp, policy) == gathered / 2


def test_activation_memory_falls_about_one_over_cp():
    one = est.estimate_memory(job(world_size=4, recompute="selective"))
    for cp in (2, 4):
        split = est.estimate_memory(job(world_size=4, cp=cp, recompute="selective"))
        # Every layer keeps 1/cp (its core is recomputed, gather included); the layer being
        # recomputed holds the gathered K/V once at the peak.
        gathered = est.cp_attention_bytes_per_layer(job(world_size=4, cp=cp), "none")
        assert split.activations == pytest.approx(one.activations / cp + gathered, rel=1e-9)
        assert split.logits == pytest.approx(one.logits / cp)
        assert split.params == pytest.approx(one.params)  # states: sharded over dp_shard x cp = 4 either way


def test_a_materialized_core_keeps_its_queries_scores_against_every_key_it_sees():
    s, cp, c = 8192, 4, 8192 // 8
    ref = dataclasses.replace(MODEL, attention="reference")
    extra = est.cp_attention_bytes_per_layer(job(model=ref, seq_len=s, cp=cp), "none")
    kv = 2 * 2 * 512 * (s - s // cp)
    # rank i: chunk i sees (i+1)c keys, chunk 2cp-1-i sees (2cp-i)c: c^2 (2cp+1) scores per head,
    # where a layer of s/cp tokens has (s/cp)^2 of them
    assert extra == kv + 2 * 16 * (c * c * (2 * cp + 1) - (s // cp) ** 2)


def test_kv_gather_traffic_per_step():
    j = job(cp=4, grad_accum=3)
    seconds, sent = est.cp_comm_seconds(j)
    per_layer = 2 * 65536 * 2 * 512  # bytes of the whole sequence's K and V, bf16
    # a forward all-gather and a backward reduce-scatter per layer, each sending 3/4 of it
    assert sent == 2 * 8 * 3 / 4 * per_layer
    assert est.kv_gather_bytes(MODEL, 65536, 1, 2) == per_layer
    full = est.cp_comm_seconds(dataclasses.replace(j, recompute="full"))[1]
    assert full == pytest.approx(sent * 3 / 2)  # recompute gathers once more
    assert est.estimate(j).time.cp_comm_s == pytest.approx(3 * seconds)
    assert est.cp_comm_seconds(job())[1] == 0


def test_cp_x_pp_sends_each_cp_ranks_tokens_between_stages_and_gathers_its_stages_layers():
    j = job(cp=4, pp=2, world_size=8, grad_accum=2)
    activation = 2 * (65536 // 4) * 2048  # bf16, a cp rank's tokens (b = 1), tp = 1
    # one activation forward and its gradient back, per micro-batch, on NVLink (8 GPUs: one node)
    assert est.pp_comm_seconds(j) == pytest.approx((2 * activation / (450e9 * 0.8), 2 * activation))
    # each GPU's stage has 8 / 2 layers: a K/V all-gather and a reduce-scatter each
    assert est.cp_comm_seconds(j)[1] == 2 * 4 * 3 / 4 * est.kv_gather_bytes(MODEL, 65536, 1, 2)
    # The first stage's activations under 1f1b: pp = 2 micro-batches in flight, each keeping the
    # stage's 4 layers (1/cp of the sequence plus the other ranks' K and V) and the embedding output.
    s, cp = 65536, 4
    layer = est.activation_bytes_per_layer(MODEL, s // cp, 1, "none", 2, attention="flash") + 2 * 2 * 512 * (s - s // cp)
    assert est.activation_bytes_total(j, stage=0) == (2 * (4 * layer + activation), 0.0)


def test_the_planner_proposes_cp_x_pp_where_it_fits():
    plans = est.plan_layouts(MODEL, 65536, 8, H100, "bf16", global_batch=8, top=None, recomputes=("selective",),
                             schedules=("1f1b",), micro_batches=(1,))
    composed = [p for p in plans if p.job.layout.cp > 1 and p.job.layout.pp > 1]
    assert {(p.job.layout.pp, p.job.layout.cp) for p in composed} >= {(2, 2), (2, 4)}
    assert all(p.fits and est.trainer_refusal(p.job) is None for p in composed)  # and the trainer takes them
    assert any("--parallel.pp=2" in " ".join(words) and "--parallel.cp=2" in " ".join(words)
               for words in (est.job_overrides(p.job) for p in composed))


def test_the_planner_places_llama3_8b_at_128k_on_8_gpus_with_cp():
    cfg = load_config("configs/llama3-8b.yaml", ["--model.max_seq_len=131072", "--data.path=unused"])
    plans = est.plan_layouts(cfg.model, 131072, 8, H100, "bf16", global_batch=64, top=None, config=cfg)
    assert plans and plans[0].fits and plans[0].job.layout.cp > 1
    assert plans[0].memory.total <= 80 * est.GIB
    assert all(p.job.layout.strategy == "fsdp" for p in plans if p.job.layout.cp > 1)
    assert "--parallel.cp=" in " ".join(est.job_overrides(plans[0].job))
    assert est.trainer_refusal(plans[0].job, cfg) is None
    # short sequences: no cp searched
    assert all(cp == 1 for cp in est.context_parallel_sizes(8192, 8))
    assert est.context_parallel_sizes(131072, 8) == [1, 2, 4, 8]


def cfg_comment() -> str:
    return "".join(line for line in open("configs/llama3-8b-128k.yaml") if line.startswith("#"))


def test_the_shipped_long_context_config_fits_as_its_comment_says():
    cfg = load_config("configs/llama3-8b-128k.yaml", ["--data.path=unused"])
    assert cfg.parallel.cp == 8 and cfg.model.rope_theta == 500000.0
    j = est.job_of(cfg, est.Layout.of(cfg.parallel, 8), H100)
    assert j.layout.dp_shard == 1 and j.layout.strategy == "fsdp" and est.estimate(j).fits
    assert f"{est.estimate(j).memory.total / est.GIB:.1f} GiB" in cfg_comment()


def test_bad_cp_layouts_are_one_line_errors():
    with pytest.raises(est.EstimatorError, match="parallel.cp=4 splits each sequence into 2 x cp = 8 equal chunks: "
                                                 "seq_len=65532 must divide by 8"):
        job(cp=4, seq_len=65532)
    with pytest.raises(est.EstimatorError, match="parallel.cp=8 x parallel.tp=2 = 16 does not divide the 8 ranks"):
        job(cp=8, tp=2)


def test_the_estimate_tool_takes_cp_and_shards_over_it(capsys):
    from tools import estimate

    args = ["--config", "configs/llama3-8b.yaml", "--model.max_seq_len=131072", "--data.path=unused", "--gpus", "8",
            "--cp", "8", "--recompute", "full"]
    assert estimate.main(args) == 0
    out = capsys.readouterr().out
    assert "cp=8 (16,384 tokens per GPU)" in out
    assert "fit: yes" in out and "strategy=fsdp dp_shard=1 tp=1 pp=1 cp=8, recompute=full" in out  # sharded over the cp ranks
