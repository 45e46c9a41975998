"""DeepSpeed's 2021 ZeRO-3 in the estimator (``zero3_collectives=per_parameter_sync``): one collective per
parameter tensor, gathered again for a recomputed forward, each paying NCCL's ring latency, none hidden
behind compute. Checked against hand counts and against the model's own parameter tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from analysis import estimator as est
from common.hardware import DEVICES
from model.config import ModelConfig
from model.flops import count_parameters
from model.gpt import GPT

A100 = DEVICES["A100"]


def gpt(**changes) -> ModelConfig:
    fields = dict(vocab_size=512, max_seq_len=256, n_layer=3, n_head=4, d_model=128, mlp="gelu", norm="layernorm",
                  position="learned", bias=True, tie_embeddings=True, dropout=0.1, attention="reference")
    fields.update(changes)
    return ModelConfig(**fields)


def zero3(cfg: ModelConfig, gpus: int, recompute: str, grad_accum: int, collectives: str) -> est.JobSpec:
    return est.JobSpec(cfg, 256, 2, est.Layout(gpus, strategy="zero3"), recompute, "bf16_master", A100, grad_accum,
                       zero3_collectives=collectives)


@pytest.mark.parametrize("changes", [
    {},  # Megatron-LM's 2021 GPT: LayerNorm with biases, biased linears, learned positions, tied head
    dict(mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tie_embeddings=False),
    dict(norm="rmsnorm", qk_norm=True, n_kv_head=2),
    dict(attention_sinks=True, bias=False, dropout=0.0),
])
def test_parameter_tensors_are_the_models_own(changes):
    cfg = gpt(**changes)
    cfg.validate()
    with torch.device("meta"):
        model = GPT(cfg)
    assert est.parameter_tensors(cfg) == len(list(model.parameters()))


def test_ring_latency_is_nccls_ring_model_counted_by_hand():
    # N - 1 steps after an 8.4 us base: those inside a node 5.7 us, the nodes - 1 that cross the network 6.6 us
    assert est.ring_latency_seconds(1536, 8) == pytest.approx(1e-6 * (8.4 + 1344 * 5.7 + 191 * 6.6))
    assert est.ring_latency_seconds(8, 8) == pytest.approx(1e-6 * (8.4 + 7 * 5.7))
    assert est.ring_latency_seconds(16, 1) == pytest.approx(1e-6 * (8.4 + 15 * 6.6))  # one rank per node
    assert est.ring_latency_seconds(1, 8) == 0.0


def test_deepspeed_2021_gathers_each_tensor_again_for_a_recomputed_forward():
    cfg = gpt(n_layer=4, recompute_every_k=2)
    assert est.zero3_collective_count(zero3(cfg, 16, "full", 3, "per_parameter_sync")) == (9, 3)
    assert est.zero3_collective_count(zero3(cfg, 16, "none", 3, "per_parameter_sync")) == (6, 3)
    # every_k=2 recomputes 2 of the 4 layers: half a gather more per micro-batch
    assert est.zero3_collective_count(zero3(cfg, 16, "every_k", 3, "per_parameter_sync")) == (7.5, 3)
    # the bucketed (FSDP) count of the same job: forward and backward, whatever is recomputed
    assert est.fsdp_collectives(zero3(cfg, 16, "full", 3, "bucketed")) == (6, 3)


def test_per_parameter_collectives_cost_their_bytes_and_a_ring_latency_each_none_hidden():
    cfg, m, gpus = gpt(), 2, 16  # two DGX A100 nodes
    job = zero3(cfg, gpus, "full", m, "per_parameter_sync")
    n = count_parameters(cfg)  # one stage, no tensor parallelism: every parameter is this GPU's to gather
    volume = est.dp_volume(job, n)
    assert volume.all_gather == pytest.approx(3 * m * n * 2)  # 2-byte weights, 3 gathers per micro-batch
    assert volume.reduce_scatter == pytest.approx(m * n * 2)

    def two_level(nbytes: float) -> float:  # 7/8 over NVLink (300 GB/s one way), 1/8 of it over the NIC (25 GB/s)
        return 7 / 8 * nbytes / (300e9 * 0.8) + 1 / 2 * nbytes / 8 / (25e9 * 0.8)

    tensors = 3 * 12 + 2 + 2  # per block 12, the token and position tables, the final LayerNorm
    latency = 1e-6 * (8.4 + 14 * 5.7 + 1 * 6.6)
    expected = two_level(3 * m * n * 2) + two_level(m * n * 2) + (3 * m + m) * tensors * latency
    time = est.estimate(job).time
    assert time.comm_s == pytest.approx(expected)
    assert time.exposed_comm_s == pytest.approx(time.comm_s)  # synchronous: nothing hides behind compute
    bucketed = est.estimate(dataclasses.replace(job, zero3_collectives="bucketed")).time
    assert bucketed.exposed_comm_s < bucketed.comm_s < time.comm_s


def test_per_parameter_sync_refuses_what_it_does_not_count():
    with pytest.raises(est.EstimatorError, match="per_parameter_sync counts the parameter tensors of dense blocks"):
        est.JobSpec(gpt(n_layer=4), 256, 1, est.Layout(16, strategy="zero3", pp=2), "full", "bf16_master", A100, 2,
                    zero3_collectives="per_parameter_sync")
    with pytest.raises(est.EstimatorError, match="zero3_collectives"):
        dataclasses.replace(zero3(gpt(), 16, "full", 1, "bucketed"), zero3_collectives="per_tensor")
