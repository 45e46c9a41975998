"""The estimator with optim.name=muon: the state Muon saves against AdamW, counted on a built model's
parameters as parallel/optim.py splits them, and the bytes it sends, counted by hand from the shapes."""

from __future__ import annotations

import dataclasses

import pytest

from analysis import estimator as est
from model.config import ModelConfig, MoEConfig
from model.gpt import GPT
from parallel.optim import muon_split

DENSE = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=4, n_head=4, n_kv_head=2, d_model=32, mlp="swiglu",
                    norm="rmsnorm", position="rope", tie_embeddings=False)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(experts=4, top_k=2, d_ff=16, shared_experts=1))


def job(model: ModelConfig, world_size: int = 1, optimizer: str = "adamw", **layout) -> est.JobSpec:
    return est.JobSpec(model, 16, 2, layout=est.layout_of(world_size, **layout), precision="fp32", optimizer=optimizer)


def hidden_matrix_elements(model: ModelConfig) -> int:
    """What Muon steps in the built model (parallel/optim.py's split), element count."""
    matrices, _ = muon_split(list(GPT(model).named_parameters()))
    return sum(p.numel() for _, p in matrices)


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_the_estimators_muon_matrices_are_what_the_optimizer_steps(model):
    m = est.muon_matrices(model)
    assert sum(est.muon_numel(kind) for kind in (m.split, m.whole, m.routed)) == hidden_matrix_elements(model)


@pytest.mark.parametrize("model, layout", [
    (DENSE, dict(world_size=1, strategy="none")),
    (DENSE, dict(world_size=2, strategy="ddp")),
    (DENSE, dict(world_size=4, strategy="fsdp")),
    (DENSE, dict(world_size=4, strategy="fsdp", tp=2)),
    (MOE, dict(world_size=4, strategy="fsdp", ep=2)),
], ids=["one", "ddp2", "fsdp4", "fsdp2_tp2", "moe_fsdp4_ep2"])
def test_muon_keeps_one_fp32_buffer_per_hidden_matrix_element_instead_of_two(model, layout):
    adamw, muon = (est.estimate(job(model, optimizer=name, **layout)).memory for name in ("adamw", "muon"))
    saved = adamw.optimizer - muon.optimizer
    shard = layout["world_size"] if layout["strategy"] == "fsdp" else 1  # every layout here shards matrices evenly
    assert saved == pytest.approx(4 * hidden_matrix_elements(model) / shard)
    assert (muon.params, muon.grads) == (adamw.params, adamw.grads)


def test_muon_bytes_sent_by_hand():
    # DENSE: head_dim 8; per layer QKV (4 + 2 * 2) * 8 x 32, proj 32 x 32, SwiGLU gate, fc, out 3 x 128 x 32
    # (d_ff = 8 d / 3 rounded up to a multiple of 64): 2048 + 1024 + 12288 = 15360 elements, 4 layers
    elements = 4 * 15360
    for world, tp in ((2, 1), (4, 1), (4, 2)):
        n = world  # every matrix sharded over the whole world (FSDP times tp)
        sent, a2a_s, ns_s = est.muon_step(job(DENSE, world_size=world, strategy="fsdp", tp=tp, optimizer="muon"))
        assert sent == pytest.approx(2 * (n - 1) / n**2 * elements * est.MUON_PIECE_BYTES)
        assert a2a_s > 0 and ns_s > 0
    # replicas (DDP) send nothing and each runs all of Newton-Schulz; FSDP over 4 shares it 4 ways
    sent, a2a_s, ns_whole = est.muon_step(job(DENSE, world_size=4, strategy="ddp", optimizer="muon"))
    assert (sent, a2a_s) == (0.0, 0.0)
    _, _, ns_shared = est.muon_step(job(DENSE, world_size=4, strategy="fsdp", optimizer="muon"))
    assert ns_shared == pytest.approx(ns_whole / 4)
    # AdamW: nothing of the kind, and the step time and bytes include Muon's only when it runs
    assert est.muon_step(job(DENSE, world_size=4, strategy="fsdp")) == (0.0, 0.0, 0.0)
    adamw, muon = (est.estimate(job(DENSE, world_size=4, strategy="fsdp", optimizer=o)) for o in ("adamw", "muon"))
    assert muon.comm.sent_per_gpu - adamw.comm.sent_per_gpu == pytest.approx(muon.comm.muon)
    assert muon.time.step_s > adamw.time.step_s


def test_experts_held_whole_under_ep_send_nothing():
    moe_only = dataclasses.replace(MOE, n_layer=1)
    sent, _, _ = est.muon_step(job(moe_only, world_size=2, strategy="ddp", ep=2, optimizer="muon"))
    assert sent == 0.0  # attention and shared experts are replicas, the routed experts whole on their rank


def test_muon_under_zero_and_a_bad_optimizer_are_refused():
    zero = job(DENSE, world_size=2, strategy="zero2", optimizer="muon")
    assert "flat 1-D partitions" in est.trainer_refusal(zero)
    with pytest.raises(est.EstimatorError, match="optimizer"):
        job(DENSE, optimizer="sgd")
