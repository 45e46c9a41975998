"""The estimator under expert tensor parallelism (parallel.etp = tp), against hand counts of what the
trainer runs (parallel/tp.py ``split_moe``) on a small shape."""

from __future__ import annotations

import pytest

import analysis.estimator as est
from common.hardware import DEVICES
from model.config import ModelConfig, MoEConfig

SEQ, MICRO, D = 16, 2, 32
MODEL = ModelConfig(vocab_size=64, max_seq_len=SEQ, n_layer=2, n_head=4, d_model=D, mlp="swiglu", norm="rmsnorm",
                    bias=False, tie_embeddings=False, position="rope", moe=MoEConfig(experts=4, top_k=2, d_ff=16))
SHARED = ModelConfig(**{**MODEL.__dict__, "moe": MoEConfig(experts=4, top_k=2, d_ff=16, shared_experts=1)})
X = 4 * SEQ * MICRO * D  # one layer's fp32 activation (s * b * h), bytes


def job(model=MODEL, world: int = 2, **layout) -> est.JobSpec:
    return est.JobSpec(model, SEQ, MICRO, est.layout_of(world, strategy="fsdp" if world > layout.get("tp", 1) else
                                                         "none", **layout), "none", "fp32", DEVICES["H100"])


def sent(equivalents: int, tp: int = 2) -> float:
    """Bytes one GPU sends in ``equivalents`` all-gathers/reduce-scatters of X over tp (an all-reduce is two)."""
    return equivalents * (tp - 1) / tp * X


@pytest.mark.parametrize("model, sp, per_layer", [
    # attention 4 (all-gather + reduce-scatter each way); the MoE layer: forward the input all-gathered (1),
    # the k = 2 rows per token's partial outputs all-reduced (2k = 4); backward the output's gradient
    # all-gathered (1), the rows' gradients all-reduced (4)
    (MODEL, True, 4 + (1 + 4) + (1 + 4)),
    # without sequence parallelism: no gathers; shared experts: one all-reduce forward, one per
    # column-parallel projection (gate and up) backward
    (SHARED, False, 4 + (4 + 2) + (4 + 2 * 2)),
])
def test_expert_tp_bytes_are_the_trainers_collectives_counted_by_hand(model, sp, per_layer):
    etp = job(model, tp=2, etp=2, sequence_parallel=sp)
    embedding_and_head = 2 + 2
    assert est.tp_comm_seconds(etp)[1] == pytest.approx(sent(2 * per_layer + embedding_and_head))
    # replicated experts (etp = 1): the estimator's dense count, 8 per layer
    assert est.tp_comm_seconds(job(model, tp=2, sequence_parallel=sp))[1] == pytest.approx(sent(2 * 8 + 4))


def test_split_experts_hold_one_tp_share_of_every_expert():
    attention, norms, router, experts = 4 * D * D, 2 * D, D * 4, 4 * 3 * D * 16
    assert est.block_parameters_per_gpu(MODEL) == attention + norms + router + experts
    assert est.block_parameters_per_gpu(MODEL, 2) == attention / 2 + norms + router + experts
    assert est.block_parameters_per_gpu(MODEL, 2, etp=2) == attention / 2 + norms + router + experts / 2
    # the memory estimate's states follow: FSDP over dp_shard=2 on 4 GPUs, fp32 parameters
    full, split = (est.stage_memory(job(world=4, tp=2, etp=etp), 0) for etp in (1, 2))
    assert full.states - split.states == pytest.approx(2 * experts / 2 / 2 * 16)  # 16 B/param (fp32 Adam), / dp 2


def test_under_ep_every_tp_gpu_exchanges_the_whole_micro_batchs_copies():
    """Split experts: each tp GPU routes the whole sequence (not its s/t slice) and sends its copies."""
    exchanges = 4 * MODEL.n_moe_layers  # dispatch and combine, forward and backward
    copies = SEQ * MICRO * 2  # top-2
    nbytes = (2 - 1) / 2 * copies * D * 4
    assert est.expert_all_to_all(job(world=4, tp=2, ep=2, etp=2))[1] == exchanges * nbytes
    assert est.expert_all_to_all(job(world=4, tp=2, ep=2))[1] == exchanges * nbytes / 2


def test_the_planner_tries_split_experts_only_for_moe_models_under_tp():
    """Among every layout that fits 4 GPUs, the MoE model's include etp = tp = 2 and 4 (each accepted by the trainer,
    as every proposal is); a dense model's never do."""
    dense = ModelConfig(**{**MODEL.__dict__, "moe": MoEConfig()})
    for model, want in ((MODEL, {1, 2, 4}), (dense, {1})):
        plans = est.plan_layouts(model, SEQ, 4, DEVICES["H100"], "fp32", global_batch=8, top=None,
                                 recomputes=("none",), micro_batches=(2,), schedules=("1f1b",), virtual_stages=(1,))
        assert {p.job.layout.etp for p in plans} == want
        assert all(p.job.layout.etp in (1, p.job.layout.tp) for p in plans)


@pytest.mark.parametrize("sp", [True, False])
def test_split_experts_activations_are_the_layers_saved_tensors_counted_by_hand(sp):
    """What ``split_moe``'s layer keeps per tp GPU, fp32, no recompute: every tp GPU routes the whole
    sequence (n = s * b tokens), so its all-gathered input (h), the router's fp32 logits and scores (E
    each), the dispatch's int64 slots and expert indices (k each) and each of the k copies' input and
    summed output rows (h each) are whole; of each copy's SwiGLU hidden activations (gate and up, silu(gate),
    their product: 4 f) it holds 1/tp. Replicated experts (etp = 1) keep all of it on the positions the
    GPU holds (s/t of them with sequence parallelism)."""
    n, h, k, f, e, tp = SEQ * MICRO, D, 2, 16, 4, 2
    routed = 4 * k * 2 * h + (4 * 2 * e + 8 * 2 * k)  # copies' rows; router and dispatch, bytes per token
    split = n * (4 * h + routed + 4 * k * 4 * f / tp)
    replicated = n * (4 * h + routed + 4 * k * 4 * f) / (tp if sp else 1)
    kw = dict(attention="flash", tp=tp, sequence_parallel=sp)
    etp, no_etp = (est.activation_bytes_per_layer(MODEL, SEQ, MICRO, "none", 4, **kw, expert_tp=x) for x in (True, False))
    assert MODEL.n_moe_layers == MODEL.n_layer  # every layer is MoE: the per-layer mean is the MoE layer's
    assert etp - no_etp == pytest.approx(split - replicated)
    # op_selective keeps each copy's first matmul outputs (gate and up, 2 f): split by width under etp
    sel = {x: est.activation_bytes_per_layer(MODEL, SEQ, MICRO, "op_selective", 4, **kw, expert_tp=x) for x in (1, 0)}
    assert sel[1] - sel[0] == pytest.approx(4 * n * k * 2 * f / tp - 4 * n * k * 2 * f / (tp if sp else 1))
    # the memory estimate follows the layout's etp (4 GPUs: tp 2 x dp_shard 2)
    mem = {x: est.stage_memory(job(world=4, tp=2, etp=x, sequence_parallel=sp), 0).activations for x in (1, 2)}
    assert mem[2] - mem[1] == pytest.approx(MODEL.n_layer * (split - replicated))
