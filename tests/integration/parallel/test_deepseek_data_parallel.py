"""The tiny DeepSeek-shaped GPT (latent attention, group-limited sigmoid routing with its moving
score bias, a shared expert, a multi-token-prediction module) under DDP, FSDP2 and expert
parallelism on 2 gloo ranks trains as one process does: the same losses and the same routing biases."""

from __future__ import annotations

import pytest

from parallel.distributed import DistContext, init_distributed
from tests.integration.parallel.test_moe_data_parallel import RATE, train
from training.config import load_config

CONFIG = "configs/tiny-mla.yaml"
OVERRIDES = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.max_seq_len=16",
             "--model.q_lora_rank=16", "--model.kv_lora_rank=8", "--model.qk_nope_head_dim=8",
             "--model.qk_rope_head_dim=4", "--model.v_head_dim=8", "--model.moe.experts=4", "--model.moe.top_k=2",
             "--model.moe.d_ff=16", "--model.moe.groups=2", "--model.moe.groups_kept=1", "--model.moe.aux_loss=0.001",
             f"--model.moe.bias_update_rate={RATE}", "--model.mtp_depth=1", "--train.micro_batch_size=2"]
LAYOUTS = {"ddp": ["--parallel.strategy=ddp"], "fsdp": ["--parallel.strategy=fsdp"], "ep2": ["--parallel.ep=2"]}


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        cfg = load_config(CONFIG, OVERRIDES + layout)
        results[name] = train(cfg, init_distributed("cpu", cfg.parallel), [rank])
    return results


@pytest.fixture(scope="module")
def ranks():
    from tests.gloo import run_workers

    return run_workers(_worker, 2)


def test_latent_attention_routing_and_mtp_under_ddp_fsdp_and_ep_match_one_process(ranks):
    cfg = load_config(CONFIG, OVERRIDES + ["--train.grad_accum_steps=2"])
    losses, biases = train(cfg, DistContext.single(), [0, 1])
    assert len(biases[-1]) == 2 * 4  # block 1 and the MTP module's block route
    # The MTP module's router's bias moved (it may come back to 0 by the last step: it moves by +-rate).
    assert any(b != 0 for step in biases for b in step[4:])
    for rank in ranks:
        for name in LAYOUTS:
            got_losses, got_biases = rank[name]
            assert got_losses == pytest.approx(losses, abs=1e-5), name
            assert got_biases == biases, name
