"""Tensor, sequence and pipeline parallelism in the estimator, and the layout planner: pure arithmetic.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") give the
per-layer activation memory with tensor parallelism t, with and without sequence parallelism; their
table 3 trains 22B, 175B, 530B and 1T GPTs at s=2048, t=8. Narayanan et al. 2021 give the pipeline
bubble. The pipeline figures are checked against an independent count: a small event simulation of
each schedule's per-GPU order of forwards and backwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

from analysis import estimator as est
from common.errors import ConfigError
from common.hardware import DEVICES
from model.config import ModelConfig
from model.flops import count_parameters
from parallel.config import ParallelConfig
from tests.conftest import ROOT
from training.config import load_config

GIB = 2**30
H100 = DEVICES["H100"]

# Korthikanti et al. 2022, table 3: (name, heads a, hidden h, layers L, micro-batch b); s=2048, t=8.
PAPER_ROWS = [
    ("22B", 64, 6144, 48, 4),
    ("175B", 96, 12288, 96, 1),
    ("530B", 128, 20480, 105, 1),
    ("1T", 160, 25600, 128, 1),
]


def spec(cfg: ModelConfig, gpus: int, recompute: str, *, strategy: str = "fsdp", micro_batch: int = 1,
         grad_accum: int = 1, **layout) -> est.JobSpec:
    """``cfg`` at 2048 tokens on ``gpus`` H100s in bf16_master, with the ``layout`` keys given."""
    return est.JobSpec(cfg, 2048, micro_batch, est.Layout(gpus, strategy=strategy, **layout), recompute,
                       "bf16_master", H100, grad_accum)


def relaid(job: est.JobSpec, grad_accum: int | None = None, **changes) -> est.JobSpec:
    """``job`` on its layout with ``changes`` (dp_shard what they leave), and ``grad_accum`` micro-batches."""
    layout = dataclasses.replace(job.layout, dp_shard=-1, **changes)
    return dataclasses.replace(job, layout=layout, grad_accum=grad_accum or job.grad_accum)


def paper_model(heads: int, hidden: int, layers: int, **changes) -> ModelConfig:
    """The paper's setting: 4h GELU MLP, dropout, attention scores stored (reference attention)."""
    fields = dict(vocab_size=51200, max_seq_len=2048, n_layer=layers, n_head=heads, d_model=hidden, mlp="gelu",
                  dropout=0.1, attention="reference")
    fields.update(changes)
    return ModelConfig(**fields)


# --------------------------------------------------------------------------- activations with t and SP


@pytest.mark.parametrize("name,heads,hidden,layers,micro_batch", PAPER_ROWS)
def test_tp_and_sp_activations_equal_korthikanti_at_the_papers_rows(name, heads, hidden, layers, micro_batch):
    cfg = paper_model(heads, hidden, layers)
    for sp in (False, True):
        for policy in ("none", "selective", "full"):
            general = est.activation_bytes_per_layer(cfg, 2048, micro_batch, policy, tp=8, sequence_parallel=sp)
            paper = est.korthikanti_bytes_per_layer(2048, micro_batch, hidden, heads, policy, tp=8, sequence_parallel=sp)
            assert general == paper, (name, policy, sp)


def test_tp_and_sp_activations_by_hand_at_175b():
    # s=2048, b=1, h=12288, a=96, t=8: 5*a*s/h = 5*96*2048/12288 = 80
    cfg = paper_model(96, 12288, 96)
    sbh = 2048 * 1 * 12288

    def per_layer(policy: str, sp: bool) -> float:
        return est.activation_bytes_per_layer(cfg, 2048, 1, policy, tp=8, sequence_parallel=sp)

    assert per_layer("none", False) == sbh * (10 + 24 / 8 + 80 / 8)  # 23 sbh: only the TP region is split
    assert per_layer("none", True) == sbh * (34 + 80) / 8  # 14.25 sbh: everything split
    assert per_layer("selective", False) == sbh * 13
    assert per_layer("selective", True) == sbh * 34 / 8
    assert per_layer("full", False) == sbh * 2  # the layer input, whole on every rank
    assert per_layer("full", True) == sbh * 2 / 8  # the sequence-split input
    # at t=1 the flag changes nothing: the paper's 34 + 5as/h
    for sp in (False, True):
        assert est.activation_bytes_per_layer(cfg, 2048, 1, "none", tp=1, sequence_parallel=sp) == sbh * 114


def test_tp_splits_gqa_kv_and_swiglu_inside_the_region():
    # h=64, 4 query heads of 16, 2 KV heads (kv width 32), SwiGLU f=128, no dropout, flash attention.
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, mlp="swiglu", max_seq_len=32,
                      dropout=0.0, attention="sdpa")
    s, b, h, kv, f, a = 32, 2, 64, 32, 128, 4
    tokens = s * b
    outside = 2 * tokens * (2 * h + h + h)  # norm inputs, QKV input, MLP input; 2-byte activations
    inside = 2 * tokens * ((h + 2 * kv) + h + 4 * f) + 4 * a * s * b  # Q, K, V; projection input; SwiGLU; lse
    assert est.activation_bytes_per_layer(cfg, s, b, "none", attention="flash") == outside + inside
    assert est.activation_bytes_per_layer(cfg, s, b, "none", attention="flash", tp=2) == outside + inside / 2
    assert est.activation_bytes_per_layer(cfg, s, b, "none", attention="flash", tp=2, sequence_parallel=True) == (
        (outside + inside) / 2
    )


# --------------------------------------------------------------------------- pipeline: a schedule simulator


def _nth_op(kind: str, k: int, gpu: int, p: int, v: int) -> tuple[str, int, int]:
    """GPU ``gpu``'s k-th forward or backward as (kind, micro-batch, stage).

    Interleaved (v > 1, Megatron-LM's order): chunk c of the GPU is stage c*p + gpu; forwards go
    round-robin over the chunks in groups of p micro-batches, backwards the same with the chunks reversed.
    """
    if v == 1:
        return kind, k, gpu
    chunk = (k // p) % v
    if kind == "B":
        chunk = v - 1 - chunk
    return kind, k // (p * v) * p + k % p, chunk * p + gpu


def _schedule_order(schedule: str, p: int, m: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per GPU, its forwards and backwards in execution order: GPipe all forwards first; 1F1B and
    interleaved a warm-up of forwards (p-1-gpu, and 2*(p-1-gpu) + (v-1)*p), then one forward and one
    backward in turn, then the remaining backwards. Interleaved needs m to be a multiple of p."""
    orders = {}
    for gpu in range(p):
        total = m * v
        if schedule == "gpipe":
            warm = total
        elif schedule == "1f1b":
            warm = min(p - 1 - gpu, total)
        else:
            warm = min(2 * (p - 1 - gpu) + (v - 1) * p, total)
        ops = [_nth_op("F", k, gpu, p, v) for k in range(warm)]
        for k in range(warm, total):
            ops += [_nth_op("F", k, gpu, p, v), _nth_op("B", k - warm, gpu, p, v)]
        ops += [_nth_op("B", k, gpu, p, v) for k in range(total - warm, total)]
        orders[gpu] = ops
    return orders


def simulate_pipeline(schedule: str, p: int, m: int, v: int = 1) -> tuple[float, list[float]]:
    """(idle time / ideal compute time, peak micro-batches' worth of activations per GPU).

    A chunk's forward takes 1/v, its backward 2/v; a forward waits for the previous stage's
    forward of the same micro-batch, a backward for the next stage's backward; communication is free.
    """
    orders, done = _schedule_order(schedule, p, m, v), {}
    clock, position, live, peak = [0.0] * p, [0] * p, [0] * p, [0] * p
    last = p * v - 1
    while any(position[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, mb, stage = orders[r][position[r]]
                if kind == "F":
                    ready, length = (done.get(("F", mb, stage - 1)) if stage else 0.0), 1 / v
                else:
                    ready, length = done.get(("B", mb, stage + 1) if stage < last else ("F", mb, stage)), 2 / v
                if ready is None:
                    break
                clock[r] = done[(kind, mb, stage)] = max(clock[r], ready) + length
                live[r] += 1 if kind == "F" else -1
                peak[r] = max(peak[r], live[r])
                position[r] += 1
                moved = True
        assert moved, "the schedule deadlocked"
    ideal = 3.0 * m
    return (max(clock) - ideal) / ideal, [held / v for held in peak]


PIPELINES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 4, 1), ("1f1b", 3, 7, 1),
             ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 4),
             ("interleaved_1f1b", 3, 6, 2)]


@pytest.mark.parametrize("schedule,p,m,v", PIPELINES)
def test_bubble_and_in_flight_micro_batches_equal_a_simulated_schedule(schedule, p, m, v):
    idle, peaks = simulate_pipeline(schedule, p, m, v)
    assert est.bubble_overhead(schedule, p, m, v) == pytest.approx(idle, abs=1e-12)
    assert [est.pipeline_in_flight(schedule, p, m, v, i) for i in range(p)] == pytest.approx(peaks)
    fraction = est.bubble_fraction(schedule, p, m, v)
    assert fraction == pytest.approx(idle / (1 + idle))  # idle share of the whole step


def test_bubble_formulas_by_hand():
    assert est.bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert est.bubble_fraction("1f1b", 8, 64) == pytest.approx(7 / 71)
    assert est.bubble_fraction("interleaved_1f1b", 8, 64, 4) == pytest.approx(7 / (4 * 64 + 7))  # (p-1)/(v*m+p-1)
    assert est.bubble_fraction("zero_bubble", 8, 64, 1) == pytest.approx(7 / (3 * 64 + 7))
    assert est.bubble_fraction("1f1b", 1, 64) == 0.0
    # Narayanan / Korthikanti: the interleaved first stage holds p*(1 + (p-1)/(p*v)) micro-batches' worth
    assert est.pipeline_in_flight("interleaved_1f1b", 8, 64, 4, 0) == 8 * (1 + 7 / 32)
    assert est.pipeline_in_flight("zero_bubble", 8, 64, 1, 0) == 8  # the 1F1B peak


# --------------------------------------------------------------------------- stages: parameters and memory


def test_stage_parameters_split_the_model():
    untied = paper_model(8, 256, 8, vocab_size=1000, tie_embeddings=False, position="learned")
    assert sum(est.stage_parameters(untied, 1, 4, i) for i in range(4)) == count_parameters(untied)
    assert est.stage_parameters(untied, 1, 1, 0) == count_parameters(untied)
    tied = dataclasses.replace(untied, tie_embeddings=True)
    # with pp > 1 the last stage keeps its own copy of the tied table for the LM head
    assert sum(est.stage_parameters(tied, 1, 4, i) for i in range(4)) == count_parameters(tied) + 1000 * 256
    # tp=4: a block's matmul weights and column biases split, norms (2 x 2d) and the two output biases (2d) whole
    d = 256
    block = 12 * d * d + 13 * d
    whole = 4 * d + 2 * d
    assert est.block_parameters_per_gpu(untied, 4) == (block - whole) / 4 + whole
    middle = est.stage_parameters(untied, 4, 4, 1)
    assert middle == 2 * ((block - whole) / 4 + whole)
    # first: + vocab-parallel table + whole positions; last: + final norm + vocab-parallel head
    assert est.stage_parameters(untied, 4, 4, 0) == middle + 1000 * d / 4 + 2048 * d
    assert est.stage_parameters(untied, 4, 4, 3) == middle + 2 * d + 1000 * d / 4


def test_overlapped_pipeline_sends_hide_behind_the_stages_compute_as_other_collectives_do():
    """pp_overlap (Megatron-Core's overlap_p2p_comm): a micro-batch's sends leave on the critical path
    what overlap_efficiency of the stage's compute does not hide, the bubble shrinking with them;
    without an interleaved schedule Megatron-Core has no such overlap, so the estimator refuses it."""
    cfg = paper_model(16, 2048, 16, vocab_size=32000)
    job = spec(cfg, 32, "none", grad_accum=16, tp=2, pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    overlapped = dataclasses.replace(job, pp_overlap=True)
    sends, _ = est.pp_comm_seconds(job)
    plain, hidden = est.estimate_time(job, 0.0), est.estimate_time(overlapped, 0.0)
    assert plain.pp_comm_s == pytest.approx(16 * sends)
    compute_per_microbatch = hidden.compute_s / 16
    a = est.Assumptions()
    assert hidden.pp_comm_s == pytest.approx(16 * (sends - a.overlap_efficiency * min(sends, compute_per_microbatch)))
    assert 0 < hidden.pp_comm_s < plain.pp_comm_s and hidden.bubble_s < plain.bubble_s
    assert hidden.compute_s == plain.compute_s and hidden.memory_bound_s == plain.memory_bound_s
    one_f_one_b = spec(cfg, 32, "none", grad_accum=16, tp=2, pp=4)
    with pytest.raises(est.EstimatorError, match="pp_overlap=True is Megatron-Core's overlap_p2p_comm, which runs only "
                                                  "with an interleaved schedule"):
        dataclasses.replace(one_f_one_b, pp_overlap=True)


def test_the_estimate_tool_takes_pipeline_overlap():
    from tools import estimate

    base = ["--config", "configs/llama3.1-8b.yaml", "--gpus", "8", "--seq-len", "1024", "--micro-batch", "1",
            "--grad-accum", "8", "--pp", "2", "--pp-schedule", "interleaved_1f1b", "--pp-virtual-stages", "2",
            "--allow-refused"]
    jobs = [estimate.build_job(*estimate.parse_args(base + extra)) for extra in ([], ["--pp-overlap"])]
    assert [j.pp_overlap for j in jobs] == [False, True]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)])
def test_memory_per_gpu_is_the_fullest_stage(schedule, v):
    cfg = paper_model(16, 2048, 16, vocab_size=32000, tie_embeddings=False)
    job = spec(cfg, 16, "selective", grad_accum=8, tp=2, pp=4, pp_schedule=schedule, pp_virtual_stages=v)
    stages = [est.stage_memory(job, i) for i in range(4)]
    fullest = max(stages, key=lambda m: m.total)
    assert est.estimate_memory(job) == fullest
    # the first stage holds its in-flight micro-batches' layers plus the embedding output
    per_layer = est.activation_bytes_per_layer(cfg, 2048, 1, "selective", tp=2, sequence_parallel=True)
    none = est.activation_bytes_per_layer(cfg, 2048, 1, "none", tp=2, sequence_parallel=True)
    held = est.pipeline_in_flight(schedule, 4, 8, v, 0)
    embedding = 2 * 2048 * 2048 / 2
    assert stages[0].activations == pytest.approx(held * 4 * per_layer + (none - per_layer) + held * embedding)
    # only the last stage keeps logits: vocab-parallel fp32 log-probs, of every micro-batch in flight
    # under GPipe and of one under the 1F1B schedules (each backward through the last chunk follows its
    # forward), and what loss_parallel's backward allocates beside them (three fp32 tensors)
    last_held = 8 if schedule == "gpipe" else 1
    assert stages[3].logits == pytest.approx(2048 * 32000 / 2 * (4 * last_held + 4 + 4 + 4))
    assert stages[0].logits == stages[1].logits == 0
    # a huge vocabulary makes the last stage the fullest
    wide = dataclasses.replace(job, model=dataclasses.replace(cfg, vocab_size=1_000_000))
    assert est.estimate_memory(wide).stage == 3


def test_fsdp_under_pipelining_keeps_the_stage_gathered():
    # torch.distributed.pipelining defers FSDP2's reshard and gradient reduction to the last micro-batch
    cfg = paper_model(16, 2048, 16)
    job = spec(cfg, 16, "selective", grad_accum=8, tp=2, pp=2)
    stage = est.stage_memory(job, 0)
    # bf16 weights, and gradients accumulated in fp32 (FSDP2's reduce dtype) until the last micro-batch
    assert stage.unsharded_params == est.stage_parameters(cfg, 2, 2, 0) * (2 + 4)
    assert stage.states == est.stage_parameters(cfg, 2, 2, 0) * 16 / 4  # sharded over dp_shard=4
    flat = est.stage_memory(relaid(job, grad_accum=1, pp=1, world_size=8), 0)
    # two layers, as before, and the root's weights, gathered: the vocab-parallel table (tied: the head),
    # the learned positions (2048 x 2048, whole) and the final layernorm's gain and bias
    root = 51200 * 2048 / 2 + 2048 * 2048 + 2 * 2048
    assert flat.unsharded_params == 2 * est.block_parameters_per_gpu(cfg, 2) * (2 + 2) + root * 2


# --------------------------------------------------------------------------- communication and time


def test_tensor_parallel_and_pipeline_communication_by_hand():
    cfg = paper_model(16, 2048, 16)
    job = spec(cfg, 16, "selective", grad_accum=8, tp=8, pp=2)
    activation = 2 * 2048 * 1 * 2048  # s*b*h 16-bit
    one = 7 / 8 * activation / (450e9 * 0.8)  # one all-gather or reduce-scatter over 8 GPUs on NVLink
    # 8 per layer (4 forward, 4 backward) x 8 layers, + 2 for the embedding on stage 0 / the LM head on stage 1
    assert est.tp_comm_seconds(job, 0)[0] == pytest.approx((8 * 8 + 2) * one)
    full = dataclasses.replace(job, recompute="full")
    assert est.tp_comm_seconds(full, 1)[0] == pytest.approx((12 * 8 + 2) * one)  # the recomputed forward's 4 more
    # stages sit on different nodes (16 GPUs > 8 per node): the sequence-split activation and its gradient over the NIC
    assert est.pp_comm_seconds(job) == pytest.approx((2 * activation / 8 / (50e9 * 0.8), 2 * activation / 8))
    assert est.tp_comm_seconds(relaid(job, tp=1, world_size=2), 0) == (0.0, 0.0)


def test_data_parallel_groups_strided_by_tp_cross_nodes():
    # 8 FSDP ranks that sit 8 apart (tp=8 inside each node) share no node: all traffic crosses the NICs
    one_per_node = est.collective_seconds(1e9, 8, H100, 0.8, ranks_per_node=1)
    assert one_per_node == pytest.approx(7 / 8 * 1e9 / 40e9)
    assert est.collective_seconds(1e9, 8, H100, 0.8) == pytest.approx(7 / 8 * 1e9 / 360e9)  # packed: NVLink


def test_step_time_adds_the_bubble_to_the_slowest_stage():
    cfg = paper_model(16, 2048, 16)
    job = spec(cfg, 8, "selective", strategy="none", grad_accum=8, tp=2, pp=4)
    t = est.estimate(job).time
    # one micro-batch through the slowest stage: its compute, memory-bound work (less the optimizer step,
    # which reads and writes the model states once per step) and exposed communication
    optimizer = 2 * est.estimate(job).memory.states / (3.35e12 * est.Assumptions().hbm_fraction)
    assert t.microbatch_s == pytest.approx((t.compute_s + t.memory_bound_s - optimizer + t.tp_comm_s + t.pp_comm_s) / 8)
    assert t.bubble_s == pytest.approx(3 / 8 * 8 * t.microbatch_s)  # (p-1)/m of m micro-batches
    assert t.tokens_per_step == 2048 * 8 * 1  # dp = 1
    # the slowest stage is the last: 4 of the 16 blocks, plus the whole (vocab-parallel) LM head
    flat = est.estimate(relaid(job, pp=1, world_size=2)).time
    head = 3 * est.gemm_seconds(job, 2048, 2048, cfg.vocab_size / 2)
    assert t.compute_s / 8 == pytest.approx((flat.compute_s / 8 - head) / 16 * 4 + head)


# --------------------------------------------------------------------------- layouts: validation and planning


def test_invalid_layouts_are_one_line_errors():
    """The layout's own rules (parallel/layout.py), in the trainer's words."""
    cfg = paper_model(12, 768, 10, n_kv_head=4)
    cases = [
        (dict(world_size=16, tp=8), 1, "parallel.tp=8 must divide model.n_head=12"),
        (dict(world_size=6, tp=3), 1, "parallel.tp=3 must divide model.n_kv_head=4"),
        (dict(world_size=12, pp=4), 4, "model.n_layer=10 must divide into parallel.pp x pp_virtual_stages = 4"),
        (dict(world_size=10, tp=4), 1, "parallel.tp=4 = 4 does not divide the 10 ranks"),
        (dict(world_size=4, pp=2), 1, "train.grad_accum_steps=1 is the number of pipeline micro-batches: it must be >= "
                                      "parallel.pp=2"),
        (dict(world_size=4, pp=2, pp_virtual_stages=5), 4, "parallel.pp_schedule=1f1b runs one stage per rank"),
        (dict(world_size=4, pp=2, pp_schedule="interleaved_1f1b"), 4, "needs parallel.pp_virtual_stages >= 2"),
        (dict(world_size=4, pp=2, pp_schedule="zero_bubble"), 5, "divisible by parallel.pp=2"),
        (dict(world_size=8, dp_replicate=2, strategy="ddp"), 1, "parallel.dp_replicate=2 is HSDP's replicate dimension"),
        (dict(world_size=4, pp=2, pp_schedule="dualpipe"), 2, "pp_schedule='dualpipe'.*choose one of"),
    ]
    for layout, grad_accum, message in cases:
        with pytest.raises(est.EstimatorError, match=message) as info:
            est.JobSpec(cfg, 2048, 1, est.layout_of(**{"strategy": "fsdp", **layout}), device=H100,
                        grad_accum=grad_accum)
        assert "\n" not in str(info.value)


def _plan_70b(**changes) -> list[est.Estimate]:
    p = est.preset("70b")
    model = dataclasses.replace(p.model, **changes)
    return est.plan_layouts(model, p.seq_len, p.world_size, H100, global_batch=p.micro_batch * p.world_size, top=None)


def test_planner_keeps_activations_for_a_70b_without_dropout_on_64_h100s_with_tp_and_sp():
    # Without dropout, tensor + sequence parallelism keeps the activations full recompute would drop: since
    # the stage's fp32 gradients under pp are counted, tp=8 x pp=2 keeping them all is cheapest (tp=2 x pp=8
    # with selective recompute was, at 78.9 GiB of 80)
    plans = _plan_70b(dropout=0.0)
    best = plans[0].job
    assert best.layout.tp > 1 and best.layout.sp and best.recompute in ("none", "selective")
    assert plans[0].fits and plans[0].memory.total <= 80 * GIB
    assert best.micro_batch * best.grad_accum * best.layout.dp == 256
    costs = [plan.time.seconds_per_token for plan in plans]
    assert costs == sorted(costs)
    # data parallelism alone keeps nothing but full recompute (tests/unit/analysis/test_estimator.py), and neither does
    # any layout without tensor or pipeline parallelism here
    assert all(plan.job.recompute in ("full", "offload") for plan in plans
               if plan.job.layout.tp == 1 and plan.job.layout.pp == 1)
    assert {plan.job.recompute for plan in plans if plan.job.layout.tp > 1} >= {"selective"}
    # With the preset's dropout (Korthikanti's setting) the cheapest layouts use tensor parallelism too.
    assert _plan_70b()[0].job.layout.tp > 1


def test_planner_searches_non_power_of_two_gpu_counts():
    # Korthikanti's 22B, untied (what the trainer's pp accepts) and without dropout
    cfg = paper_model(64, 6144, 48, tie_embeddings=False, dropout=0.0)
    for gpus in (48, 96):
        plans = est.plan_layouts(cfg, 2048, gpus, H100, global_batch=192, recomputes=("selective", "full"),
                                 schedules=("1f1b",), top=None)
        layouts = {(plan.job.layout.tp, plan.job.layout.pp, plan.job.layout.dp) for plan in plans}
        assert plans and all(tp * pp * dp == gpus for tp, pp, dp in layouts)
        assert any(pp % 3 == 0 for _, pp, _ in layouts) and any(dp % 3 == 0 for _, _, dp in layouts)
        assert all(192 % dp == 0 for _, _, dp in layouts)


def test_planner_proposes_only_valid_layouts():
    # 12 heads, 4 KV heads, 10 layers: tp in {1, 2, 4} (not 3, 6 or 12: KV heads; not 8: heads), pp | 10
    cfg = paper_model(12, 1536, 10, n_kv_head=4, vocab_size=32000, tie_embeddings=False, dropout=0.0)
    sizes = est.model_parallel_sizes(cfg, 48, 8)
    assert {tp for tp, _ in sizes} == {1, 2, 4}
    assert {pp for _, pp in sizes} == {1, 2}  # divisors of 48 that divide 10
    plans = est.plan_layouts(cfg, 2048, 48, H100, global_batch=96, recomputes=("selective",), top=None)
    assert plans
    for plan in plans:
        job, lay = plan.job, plan.job.layout
        assert cfg.n_head % lay.tp == 0 and cfg.kv_heads % lay.tp == 0 and lay.tp <= 8
        assert cfg.n_layer % (lay.pp * lay.pp_virtual_stages) == 0
        assert job.micro_batch * job.grad_accum * lay.dp == 96
        assert lay.pp == 1 or job.grad_accum >= lay.pp
    small_nodes = dataclasses.replace(H100, gpus_per_node=2)
    assert {tp for tp, _ in est.model_parallel_sizes(cfg, 48, small_nodes.gpus_per_node)} == {1, 2}


def test_job_words_are_the_configs():
    cfg = paper_model(16, 2048, 16)
    job = spec(cfg, 64, "selective", grad_accum=8, tp=8, pp=2, dp_replicate=2, pp_schedule="interleaved_1f1b",
               pp_virtual_stages=2)
    assert est.job_words(job) == (
        "strategy=fsdp dp_replicate=2 dp_shard=2 tp=8 pp=2 pp_schedule=interleaved_1f1b pp_virtual_stages=2 "
        "sequence_parallel=true recompute=selective micro_batch=1 grad_accum=8"
    )
    plain = spec(cfg, 8, "none", strategy="ddp", micro_batch=2)
    assert est.job_words(plain) == "strategy=ddp dp_shard=8 tp=1 pp=1 recompute=none micro_batch=2 grad_accum=1"


# --------------------------------------------------------------------------- the command line


def _run_estimate(*argv: str) -> str:
    from tools import estimate

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert estimate.main(list(argv)) == 0
    return out.getvalue()


def test_estimate_plan_prints_one_layout_per_line_for_70b():
    text = _run_estimate("--preset", "70b", "--plan", "--top", "3")
    assert "global batch 256 sequences" in text
    lines = [line for line in text.splitlines() if line.startswith("strategy=")]
    assert len(lines) == 3
    words = dict(word.split("=") for word in lines[0].split(":")[0].split())
    assert int(words["tp"]) > 1  # tensor parallelism trains with the preset's dropout
    assert "GiB/GPU" in lines[0] and "s/step" in lines[0] and "MFU" in lines[0]


def test_estimate_plan_still_serves_data_parallel_configs_and_takes_layouts():
    text = _run_estimate("--config", "configs/tiny.yaml", "--gpus", "4", "--device", "A100", "--plan", "--top", "2")
    lines = [line for line in text.splitlines() if line.startswith("strategy=")]
    assert len(lines) == 2 and all("recompute=" in line for line in lines)
    # a layout with tp and pp
    one = _run_estimate("--config", "configs/llama-7b.yaml", "--gpus", "32", "--tp", "8", "--pp", "2", "--grad-accum",
                        "8", "--micro-batch", "1", "--recompute", "selective", "--strategy", "fsdp")
    assert "tp=8 + SP" in one and "Pipeline: 2 stages of 16 layers, 1f1b" in one and "fit: yes" in one


# --------------------------------------------------------------------------- the planner proposes what the trainer runs


def _launched_layout(parallel: ParallelConfig, world: int, ranks_per_node: int, monkeypatch) -> est.Layout:
    """The layout train.py builds for ``parallel`` on ``world`` ranks, ``ranks_per_node`` to a node: its
    own launch step (``layout_from_env``, reading torchrun's variables), in this process."""
    from parallel.distributed import layout_from_env

    env = {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": ranks_per_node, "RANK": 0, "LOCAL_RANK": 0}
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, str(value))
        return layout_from_env(parallel).layout


# Configs, GPU counts and GPUs per node whose plans between them use every dimension: tp, pp (interleaved
# too) and HSDP with 6 GPUs to a node (where tp=4 divides the GPUs and the heads, but not a node), ep (an
# MoE model) and cp (128k sequences).
PLANNED = [("gpt2-124m", 12, 6, {"tp", "pp", "dp_replicate"}), ("tiny-moe", 8, 8, {"tp", "pp", "ep", "dp_replicate"}),
           ("llama3-8b-128k", 16, 8, {"tp", "pp", "cp", "dp_replicate"})]


@pytest.mark.parametrize("name, gpus, per_node, dimensions", PLANNED, ids=[row[0] for row in PLANNED])
def test_every_planned_layout_is_the_one_train_py_builds_from_its_overrides(name, gpus, per_node, dimensions,
                                                                              monkeypatch):
    """Each layout the planner proposes, written as the trainer's overrides, loads (the config's checks),
    is the layout train.py's launch step builds on those GPUs (``Layout.of``: tensor-parallel groups
    inside a node among its rules), and keeps its strategy when train.py resolves the job."""
    path = ROOT / "configs" / f"{name}.yaml"
    cfg = load_config(path)
    device = dataclasses.replace(H100, gpus_per_node=per_node)
    per_gpu = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    # every layout, at two micro-batch sizes and one recompute policy (the others meet the same layout rules)
    plans = est.plan_layouts(cfg.model, cfg.seq_len, gpus, device, cfg.precision.mode, global_batch=per_gpu * gpus,
                             recomputes=("full",), micro_batches=(1, 2), top=None, config=cfg)
    distinct = {(plan.job.layout, plan.job.grad_accum): plan for plan in plans}.values()
    for plan in distinct:
        run = load_config(path, est.job_overrides(plan.job))
        launched = _launched_layout(run.parallel, gpus, per_node, monkeypatch)
        assert launched == dataclasses.replace(plan.job.layout, ranks_per_node=per_node), est.describe_plan(plan)
        resolved, note = run.parallel.resolved(launched)
        assert (resolved.strategy, note) == (plan.job.layout.strategy, None)
    used = {key for plan in plans for key in ("tp", "pp", "cp", "ep", "dp_replicate") if getattr(plan.job.layout, key) > 1}
    assert used == dimensions


def test_the_planner_no_longer_proposes_what_the_trainer_refuses():
    # GPT-3 175B on 64 H100s: tied embeddings (pp refuses them) and, before its vocabulary was padded to
    # 50304, a vocabulary no tp divides; the 70B preset trains with dropout, under tp too.
    for name, gpus in (("gpt3-175b", 64), ("70b", 64)):
        p = est.preset(name)
        plans = est.plan_layouts(p.model, p.seq_len, gpus, H100, global_batch=p.micro_batch * gpus, top=None)
        assert plans
        for plan in plans:
            assert est.trainer_refusal(plan.job) is None
            est.trainer_config(plan.job).validate()
        if name == "70b":
            assert {plan.job.layout.tp for plan in plans} > {1}
    # Whether GPT-3's tied embeddings may be pipelined is the trainer's rule, whatever it says today: the
    # planner proposes pp for it exactly when the trainer accepts such a layout.
    gpt3 = est.preset("gpt3-175b")
    piped = spec(gpt3.model, 64, "full", grad_accum=8, tp=4, pp=8)
    plans = est.plan_layouts(gpt3.model, 2048, 64, H100, global_batch=64, top=None)
    assert any(plan.job.layout.pp > 1 for plan in plans) == (est.trainer_refusal(piped) is None)
    # a vocabulary no tp divides: refused by the layout's own rules (parallel/layout.py check_model)
    unpadded = dataclasses.replace(gpt3.model, vocab_size=50257)
    with pytest.raises(est.EstimatorError, match="parallel.tp=4 must divide model.vocab_size=50257"):
        spec(unpadded, 64, "full", grad_accum=8, tp=4)


def test_zero_bubble_with_op_level_recompute_is_refused_by_the_trainer_and_never_planned():
    # torch's selective activation checkpoint allows one backward per region; the zero-bubble
    # schedule runs two (input gradients, then weight gradients): it failed at step 1 on gloo ranks.
    zero_bubble = ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--parallel.pp_virtual_stages=2",
                   "--train.grad_accum_steps=2"]
    with pytest.raises(ConfigError, match="parallel.pp_schedule=zero_bubble with model.recompute=op_selective"):
        load_config("configs/llama-7b.yaml", zero_bubble + ["--model.recompute=op_selective"])
    load_config("configs/llama-7b.yaml", zero_bubble + ["--model.recompute=full"])  # checkpointing recomputes once
    cfg = load_config("configs/llama-7b.yaml")
    plans = est.plan_layouts(cfg.model, cfg.seq_len, 8, H100, cfg.precision.mode, global_batch=8 * 8, top=None,
                             config=cfg)
    assert any(p.job.layout.pp_schedule == "zero_bubble" for p in plans)
    assert not any(p.job.layout.pp_schedule == "zero_bubble" and p.job.recompute == "op_selective" for p in plans)


def test_fp8_plans_run_the_models_own_layers_through_torchao_with_tensor_parallelism():
    # FP8 on torch layers is torchao's, which trains under tensor parallelism: the planner proposes
    # tp layouts for it, and each proposal's overrides name the backend so train.py takes them.
    p = est.preset("70b")
    plans = est.plan_layouts(p.model, p.seq_len, 64, H100, "fp8", global_batch=p.micro_batch * 64, top=None)
    assert any(plan.job.layout.tp > 1 for plan in plans)
    for plan in plans[:3]:
        assert "--precision.fp8_backend=torchao" in est.job_overrides(plan.job)
        assert est.trainer_config(plan.job).precision.fp8_backend == "torchao"
        assert est.trainer_refusal(plan.job) is None


def test_estimate_refuses_a_layout_the_trainer_refuses(capsys):
    from tools import estimate

    assert estimate.main(["--config", "configs/tiny.yaml", "--gpus", "4", "--tp", "2", "--strategy", "ddp"]) == 2
    assert "parallel.strategy=ddp cannot wrap tensor- or pipeline-parallel models" in capsys.readouterr().err
    # a rule train.py applies when it launches (Layout.of), not when it loads the config
    assert estimate.main(["--config", "configs/llama-7b.yaml", "--gpus", "16", "--tp", "8", "--pp", "2",
                          "--grad-accum", "8", "--strategy", "fsdp"]) == 2
    assert "parallel.strategy=fsdp, but the layout leaves one data-parallel rank" in capsys.readouterr().err


def test_scaling_curves_run_for_a_preset():
    text = _run_estimate("--preset", "llama2-7b", "--scaling", "8,16")
    rows = [line for line in text.splitlines() if line.split() and line.split()[0] in ("8", "16")]
    assert len(rows) == 2 and "preset llama2-7b" in text


def test_fsdp_collectives_per_step_follow_the_trainers_resharding():
    cfg = paper_model(16, 2048, 16, tie_embeddings=False, dropout=0.0)
    flat = spec(cfg, 16, "none", grad_accum=4)
    assert est.fsdp_collectives(flat) == (8, 4)  # each micro-batch gathers forward and backward, reduces once
    assert est.fsdp_collectives(dataclasses.replace(flat, fsdp_reshard_after_forward=False)) == (4, 4)
    piped = relaid(flat, pp=2)
    assert est.fsdp_collectives(piped) == (5, 1)  # m forwards + 1 backward, as bench_parallel measured
    assert est.fsdp_collectives(dataclasses.replace(piped, fsdp_reshard_after_forward=False)) == (1, 1)
    # zero_bubble keeps the blocks gathered for its weight pass whatever the setting, as the trainer does
    zero_bubble = relaid(piped, pp_schedule="zero_bubble", pp_virtual_stages=2)
    assert est.fsdp_collectives(zero_bubble) == (1, 1)
    assert not ParallelConfig(pp=2, pp_schedule="zero_bubble", pp_virtual_stages=2).reshard_blocks_after_forward
    assert ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2).reshard_blocks_after_forward
    # what each GPU sends per step over its 8 data-parallel ranks: 7/8 of (5 gathers of 2-byte weights +
    # 1 reduce-scatter of 2-byte gradients) of its stage, plus its pipeline sends
    n = max(est.stage_parameters(cfg, 1, 2, stage) for stage in (0, 1))
    comm = est.estimate(piped).comm
    assert comm.sent_per_gpu == pytest.approx(7 / 8 * n * (5 * 2 + 1 * 2) + comm.pipeline)


def test_without_reshard_after_forward_every_block_stays_gathered_until_its_backward():
    cfg = paper_model(16, 2048, 16, tie_embeddings=False, dropout=0.0)
    kept = spec(cfg, 16, "none", grad_accum=4)
    held = dataclasses.replace(kept, fsdp_reshard_after_forward=False)
    block = est.block_parameters_per_gpu(cfg, 1)
    # 2-byte weights of every block instead of two, the same two blocks' unreduced 2-byte gradients
    extra = (cfg.n_layer - 2) * block * 2
    assert est.estimate_memory(held).unsharded_params - est.estimate_memory(kept).unsharded_params == pytest.approx(extra)
    # and one gather fewer per micro-batch
    assert est.estimate(held).comm.all_gather == pytest.approx(est.estimate(kept).comm.all_gather / 2)


def test_estimate_reads_reshard_after_forward_from_the_config_and_the_flag():
    common = ["--config", "configs/llama3-8b.yaml", "--gpus", "8", "--micro-batch", "2", "--strategy", "fsdp"]

    def total(*extra: str) -> str:
        return next(line for line in _run_estimate(*common, *extra).splitlines() if line.startswith("fit:"))

    default = total()
    assert total("--reshard-after-forward", "false") != default
    assert total("--parallel.fsdp_reshard_after_forward=false") == total("--reshard-after-forward", "false")
    assert total("--parallel.fsdp_reshard_after_forward=false", "--reshard-after-forward", "true") == default


def test_estimate_estimates_a_refused_job_when_asked_and_says_so(capsys):
    from tools import estimate

    assert estimate.main(["--preset", "70b", "--tp", "8", "--strategy", "ddp"]) == 2  # DDP under tp: refused
    text = _run_estimate("--preset", "70b", "--tp", "8", "--strategy", "ddp", "--allow-refused")
    first = text.strip().splitlines()[0]
    assert first.startswith("Estimated beyond the trainer: train.py refuses this job (parallel.strategy=ddp cannot wrap")
    assert "Per GPU on 64x" in text


def test_devices_of_published_runs_are_in_the_table_with_their_figures():
    h100 = DEVICES["H100"]
    titan, h800 = DEVICES["H100-96GB"], DEVICES["H800"]
    assert (titan.hbm_gib, titan.hbm_tb_s) == (96.0, 2.4) and titan.bf16_tflops == h100.bf16_tflops
    assert h800.nvlink_gb_s == 400.0 and (h800.bf16_tflops, h800.hbm_tb_s) == (h100.bf16_tflops, h100.hbm_tb_s)
    from common.hardware import SYSTEMS

    assert SYSTEMS["grand-teton-96gb-500w"].device is titan
    # a slower NVLink makes tensor parallelism's collectives slower, nothing else
    job = spec(paper_model(16, 2048, 16, dropout=0.0), 8, "none", tp=8)
    on_h800 = dataclasses.replace(job, device=h800)
    assert est.estimate(on_h800).time.tp_comm_s == pytest.approx(est.estimate(job).time.tp_comm_s * 900 / 400)
    assert est.estimate(on_h800).time.compute_s == pytest.approx(est.estimate(job).time.compute_s)


def test_estimate_takes_recompute_and_its_old_name():
    from tools import estimate

    assert estimate.parse_args(["--preset", "70b", "--recompute", "full"])[0].recompute == "full"
    assert estimate.parse_args(["--preset", "70b", "--policy", "selective"])[0].recompute == "selective"
