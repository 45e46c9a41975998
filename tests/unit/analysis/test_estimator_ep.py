"""Expert parallelism in the estimator and the planner: memory, all-to-all bytes and expert-sharding
traffic against hand counts, MoE layers under tensor parallelism (whole, on s/t rows with sequence
parallelism), and the planner proposing ep for Mixtral 8x7B on 64 H100s in words the trainer loads."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math

import pytest

from analysis import estimator as est
from analysis.estimator.activations import _mlp_activation_elements
from analysis.estimator.time import fp8_cast_bytes
from common.hardware import DEVICES
from model.config import ModelConfig, MoEConfig
from parallel.dims import ParallelDims
from training.config import load_config

H100 = DEVICES["H100"]
# 4 layers, every one MoE: 8 SwiGLU experts of width 64, top-2.
MOE = ModelConfig(vocab_size=1024, max_seq_len=256, n_layer=4, n_head=4, d_model=128, mlp="swiglu", norm="rmsnorm",
                  position="rope", bias=False, tie_embeddings=False, dropout=0.0,
                  moe=MoEConfig(experts=8, top_k=2, d_ff=64))
ROUTED = 4 * 8 * 3 * 128 * 64  # layers x experts x matrices x d x f


def job(ep: int, recompute: str = "none", grad_accum: int = 1, model: ModelConfig = MOE, **layout) -> est.JobSpec:
    """The MoE model on 8 H100s under fsdp with ``ep`` (and the other ``layout`` keys)."""
    return est.JobSpec(model, 256, 2, est.Layout(8, strategy="fsdp", ep=ep, **layout), recompute, "bf16_master", H100,
                       grad_accum)


def test_routed_parameters_are_the_expert_weights():
    assert est.stage_routed_parameters(job(1)) == ROUTED
    assert est.stage_routed_parameters(job(1, pp=2, grad_accum=2)) == ROUTED / 2


def test_ep_memory_by_hand():
    """Under fsdp on 8 GPUs the states are sharded 8 ways either way (experts: /ep over ep GPUs, then
    /(8/ep) over the GPUs holding the same experts); what ep saves is the gathered layers: each GPU
    gathers only its 8/ep experts."""
    one, four = est.estimate_memory(job(1)), est.estimate_memory(job(4))
    assert four.states == pytest.approx(one.states)
    per = est.STATE_BYTES["bf16_master"]
    saved = 2 * ROUTED / 4 * (1 - 1 / 4) * (per.param + per.grad)  # two gathered layers of 1/4 of the routed each
    assert one.unsharded_params - four.unsharded_params == pytest.approx(saved)
    # dp_replicate=2: states shard over dp_shard=4 only; experts over dp_shard / ep = 2 GPUs after ep=2.
    hsdp = est.stage_state_bytes(job(2, dp_replicate=2), est.stage_parameters(MOE))
    dense = est.stage_parameters(MOE) - ROUTED
    assert hsdp.optimizer == pytest.approx(per.optimizer * (dense / 4 + ROUTED / 2 / 2))


def test_all_to_all_bytes_by_hand():
    """Four exchanges per MoE layer and micro-batch of s*b*k token copies of d 2-byte values, of which
    (ep-1)/ep leave the GPU; six with full recompute; none without ep."""
    copies_bytes = 256 * 2 * 2 * 128 * 2
    assert est.expert_all_to_all(job(1)) == (0.0, 0.0)
    assert est.expert_all_to_all(job(4))[1] == pytest.approx(4 * 4 * 3 / 4 * copies_bytes)
    full = job(2, "full")
    assert est.expert_all_to_all(full)[1] == pytest.approx(6 * 4 * 1 / 2 * copies_bytes)
    result = est.estimate(job(4, grad_accum=3))
    assert result.comm.expert_all_to_all == pytest.approx(3 * 4 * 4 * 3 / 4 * copies_bytes)
    assert result.time.ep_comm_s > 0 and result.time.step_s > est.estimate(job(1, grad_accum=3)).time.step_s - 1


def test_recomputed_layers_exchange_their_tokens_again():
    """A layer whose forward runs again in backward runs its dispatch and combine again: all four
    MoE layers under full and op_selective (6 exchanges each), every second one under every_k with
    k=2 (layers 2 and 4), none under selective. tests/integration/parallel/test_ep.py counts the trainer's."""
    def exchanges(policy: str, **model) -> float:
        cfg = dataclasses.replace(MOE, **model)
        return est.expert_exchanges(job(2, policy, model=cfg))

    assert exchanges("none") == exchanges("selective") == exchanges("offload") == 4 * 4
    assert exchanges("full") == exchanges("op_selective") == 6 * 4
    assert exchanges("every_k") == 4 * 4 + 2 * 2
    assert exchanges("every_k", recompute_every_k=3) == 4 * 4 + 2 * 1
    assert exchanges("every_k", moe=dataclasses.replace(MOE.moe, every=2)) == 4 * 2 + 2 * 2  # MoE layers 2 and 4, both recomputed
    copies_bytes = 256 * 2 * 2 * 128 * 2
    op = job(2, "op_selective")
    assert est.expert_all_to_all(op)[1] == pytest.approx(6 * 4 * 1 / 2 * copies_bytes)


def test_experts_are_gathered_over_the_gpus_holding_them():
    """fsdp: per micro-batch two all-gathers and one reduce-scatter; with ep=4 on 8 GPUs each GPU's
    2 experts per layer travel over a group of 2: (2-1)/2 of their bytes leave it."""
    per = est.STATE_BYTES["bf16_master"]
    routed = ROUTED / 4
    expected = 1 / 2 * (2 * routed * per.param + routed * per.grad)
    assert est.estimate(job(4)).comm.expert_sharded == pytest.approx(expected)
    assert est.estimate(job(8)).comm.expert_sharded == 0  # one GPU per expert set: nothing to gather


def test_ep_carved_out_of_dp_shard_x_cp_by_hand():
    """With cp=2 on 8 GPUs, ep=4 spans 2 dp_shard GPUs x the cp pair (parallel/layout.py): the states
    still shard 8 ways, the experts over the 8 / 4 = 2 GPUs holding the same ones (edp), and a cp
    rank's all-to-alls carry only its half of each sequence's copies. The trainer's configuration of
    the job builds the same layout."""
    both = job(4, cp=2)
    assert (both.layout.dp_shard, both.layout.dp_shard_cp, both.layout.edp) == (4, 8, 2)
    assert est.estimate_memory(both).states == pytest.approx(est.estimate_memory(job(1, cp=2)).states)
    copies_bytes = 256 * 2 * 2 * 128 * 2 / 2
    assert est.expert_all_to_all(both)[1] == pytest.approx(4 * 4 * 3 / 4 * copies_bytes)
    per = est.STATE_BYTES["bf16_master"]
    routed = ROUTED / 4  # per GPU; gathered twice and reduced once per micro-batch over the 2 GPUs holding them
    assert est.estimate(both).comm.expert_sharded == pytest.approx(1 / 2 * (2 * routed * per.param + routed * per.grad))
    assert est.trainer_refusal(both) is None
    trainer = est.Layout.of(est.trainer_config(both).parallel, 8, 8)
    assert dataclasses.replace(trainer, ranks_per_node=None) == both.layout
    assert ParallelDims(8, 8, 0, 0, layout=trainer).mesh_shape() == {"edp": 2, "ep_shard": 2, "cp": 2}
    assert est.expert_parallel_sizes(MOE, 2, "fsdp", cp=4) == [1, 4, 8]  # multiples of cp dividing dp_shard x cp
    with pytest.raises(est.EstimatorError, match="parallel.ep=2 with parallel.cp=4: .* ep must be a multiple of cp"):
        est.layout_of(8, strategy="fsdp", ep=2, cp=4)


def test_moe_layers_are_not_tensor_split():
    """tp=2: attention weights halve, a MoE layer (router 128 x 8, experts) stays whole on each GPU;
    its GEMMs run on s/2 rows with sequence parallelism and s rows without, and so do its all-to-all
    bytes; ep=2 x tp=2 is a layout the trainer takes."""
    d, norms, attention = 128, 2 * 128, 4 * 128 * 128
    moe = 128 * 8 + ROUTED // 4
    assert est.block_parameters_per_gpu(MOE, 2) == attention / 2 + norms + moe
    tokens = 512

    def flops(gemms):
        return sum(2 * m * k * n for m, k, n in gemms)

    attention_flops = 2 * tokens * attention / 2
    moe_flops = 2 * tokens * (d * 8 + 2 * 3 * d * 64)  # router over E, then k experts' three matrices
    assert flops(est.layer_gemms(MOE, tokens, 2, moe_split=2)) == pytest.approx(attention_flops + moe_flops / 2)
    assert flops(est.layer_gemms(MOE, tokens, 2)) == pytest.approx(attention_flops + moe_flops)
    sp, no_sp = job(2, tp=2), job(2, tp=2, sequence_parallel=False)
    assert est.expert_all_to_all(no_sp)[1] == pytest.approx(2 * est.expert_all_to_all(sp)[1])
    assert est.expert_all_to_all(sp)[1] == pytest.approx(est.expert_all_to_all(job(2))[1] / 2)
    assert est.trainer_refusal(sp) is None and est.trainer_refusal(no_sp) is None
    # activations: the MoE layers' lie outside the tensor-parallel region, split only with sequence parallelism
    act = est.activation_bytes_per_layer
    one, two, two_sp = (act(MOE, 256, 2, "none", tp=t, sequence_parallel=sp) for t, sp in ((1, False), (2, False), (2, True)))
    assert two_sp == pytest.approx(one / 2)
    dense_twin = ModelConfig(vocab_size=1024, max_seq_len=256, n_layer=4, n_head=4, d_model=128, mlp="swiglu",
                             norm="rmsnorm", position="rope", bias=False, dropout=0.0, d_ff=64)
    twin_one, twin_two = act(dense_twin, 256, 2, "none"), act(dense_twin, 256, 2, "none", tp=2)
    # what tp=2 saves without sequence parallelism: the attention share of the tensor-parallel region only
    mlp_inside = 2 * 256 * 2 * _mlp_activation_elements(dense_twin, 2)
    assert one - two == pytest.approx((twin_one - twin_two) - mlp_inside / 2)


def test_invalid_ep_is_one_line():
    dense = ModelConfig(vocab_size=1024, max_seq_len=256, n_layer=4, n_head=4, d_model=128)
    with pytest.raises(est.EstimatorError, match="parallel.ep=2 shards routed experts, but the model has none"):
        job(2, model=dense)
    with pytest.raises(est.EstimatorError, match="parallel.ep=3 must divide model.moe.experts=8"):
        est.JobSpec(MOE, 256, 1, est.Layout(6, strategy="fsdp", ep=3))
    with pytest.raises(est.EstimatorError, match="parallel.ep=4 must divide the dp_shard=2 ranks"):
        est.layout_of(8, strategy="fsdp", ep=4, dp_replicate=4)
    assert "parallel.ep=2 with parallel.strategy=zero2" in est.trainer_refusal(
        est.JobSpec(MOE, 256, 1, est.Layout(8, strategy="zero2", ep=2)))


def test_mixtral_on_64_h100s_plans_expert_parallelism_in_the_trainers_words():
    from tools import estimate

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert estimate.main(["--config", "configs/mixtral-8x7b.yaml", "--gpus", "64", "--plan", "--top", "3"]) == 0
    lines = [line for line in out.getvalue().splitlines() if line.startswith("strategy=")]
    assert len(lines) == 3
    words = dict(word.split("=") for word in lines[0].split(":")[0].split())
    assert int(words["ep"]) > 1
    degrees = [int(words.get(k, 1)) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")]
    assert math.prod(degrees) == 64  # dp_shard counts the ep ranks
    keys = ("strategy", "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "pp_schedule", "pp_virtual_stages",
            "sequence_parallel")
    loaded = load_config("configs/mixtral-8x7b.yaml", [f"--parallel.{k}={words[k]}" for k in keys if k in words])
    assert est.Layout.of(loaded.parallel, 64, 8).describe() == lines[0].split(" recompute=")[0]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_under_ep_a_gpu_runs_its_local_experts_on_every_ranks_copies(ep):
    """parallel/ep.py: each rank runs experts / ep local experts on the rows every rank of its group
    routed to them: E/ep GEMM pairs of ep * T * k / E rows (taller than one rank's share), the same
    FLOPs; FP8 casts the local experts' weights only."""
    tokens, d, f, E, k = 512, 128, 64, 8, 2
    gemms = est.layer_gemms(MOE, tokens, ep=ep)
    experts = gemms[3:]  # after the QKV and output projections and the router
    assert gemms[2] == (tokens, d, E)
    assert [(kk, n) for _, kk, n in experts] == [(d, 2 * f), (f, d)] * (E // ep)
    assert {m for m, _, _ in experts} == {tokens * k / E * ep}
    flops = sum(m * kk * n for m, kk, n in gemms)
    assert flops == pytest.approx(sum(m * kk * n for m, kk, n in est.layer_gemms(MOE, tokens)))
    fp8 = dataclasses.replace(job(ep), precision="fp8")
    one = dataclasses.replace(job(1), precision="fp8")
    (fwd, bwd), (fwd1, bwd1) = fp8_cast_bytes(fp8, tokens), fp8_cast_bytes(one, tokens)
    per_element = 4  # delayed scaling: read 2, write 1 and its transpose 1
    assert fwd1 - fwd == pytest.approx(per_element * (E - E // ep) * 3 * d * f)  # the weights held elsewhere
    assert bwd == pytest.approx(bwd1)


@pytest.mark.parametrize("ep, tp, sp", [(1, 1, True), (2, 1, True), (2, 2, True), (2, 2, False)])
def test_the_router_and_the_permutation_move_these_bytes(ep, tp, sp):
    """Hand count of model/moe.py's route, permute and unpermute and parallel/ep.py's sorts for one
    micro-batch of 2 x 256 tokens (d = 128, bf16 rows of 256 bytes, 8 experts, top-2)."""
    T = 2 * 256 // (tp if sp else 1)  # positions this GPU routes
    A, row, router = 2 * T, 128 * 2, T * 8 * 4  # copies; a row's bytes; fp32 scores over the experts
    forward = [
        ("router softmax reads the logits, writes the scores", 2 * router),
        ("top-k reads the scores", router),
        ("permute: gather the copies (read), write them in expert order", 2 * A * row),
        ("unpermute: read the experts' outputs", A * row),
        ("unpermute: write each token's weighted sum", T * row),
    ]
    backward = [
        ("softmax backward: read the scores and their gradient, write the logits'", 3 * router),
        ("unpermute backward: read the tokens' gradients", T * row),
        ("unpermute backward: write the copies' gradients", A * row),
        ("routing weights' gradient: read the saved outputs", A * row),
        ("permute backward: read the copies' gradients, write the tokens' sums", A * row + T * row),
    ]
    if ep > 1:  # arrived rows sorted by local expert, outputs sorted back: read and write each, both ways
        forward.append(("sorts", 4 * A * row))
        backward.append(("sorts", 4 * A * row))
    layout = dict(tp=tp, sequence_parallel=sp) if tp > 1 else {}
    fwd, bwd = est.moe_permutation_bytes(job(ep, **layout))
    assert fwd == sum(n for _, n in forward)
    assert bwd == sum(n for _, n in backward)
