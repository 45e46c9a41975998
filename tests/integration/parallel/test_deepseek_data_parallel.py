"""The tiny DeepSeek-shaped GPT (latent attention, group-limited sigmoid routing with its moving
score bias, a shared expert, a multi-token-prediction module) under DDP, FSDP2 and expert
parallelism on 2 gloo ranks trains as one process does: over 10 steps the same losses (within
1e-5), the same routing biases and the same final weights, every parameter gathered whole (within
1e-5). The ep=2 run is saved after 5 steps and a fresh engine that loads the checkpoint trains the
last 5 as the uninterrupted run did, bit for bit: losses, biases and weights. One 2-rank launch."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from parallel.distributed import DistContext, init_distributed
from tests.gloo import assert_resumes_exactly, run_workers, train_save_and_resume
from tests.integration.parallel.test_moe_data_parallel import RATE, train
from tests.integration.parallel.test_tp_pp import full_params
from training.build import build_from_config
from training.config import load_config

CONFIG = "configs/tiny-mla.yaml"
OVERRIDES = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.max_seq_len=16",
             "--model.q_lora_rank=16", "--model.kv_lora_rank=8", "--model.qk_nope_head_dim=8",
             "--model.qk_rope_head_dim=4", "--model.v_head_dim=8", "--model.moe.experts=4", "--model.moe.top_k=2",
             "--model.moe.d_ff=16", "--model.moe.groups=2", "--model.moe.groups_kept=1", "--model.moe.aux_loss=0.001",
             f"--model.moe.bias_update_rate={RATE}", "--model.mtp_depth=1", "--train.micro_batch_size=2"]
LAYOUTS = {"ddp": ["--parallel.strategy=ddp"], "fsdp": ["--parallel.strategy=fsdp"], "ep2": ["--parallel.ep=2"]}
STEPS, SAVE_AFTER = 10, 5
RESUMED = "ep2"  # the layout also saved and resumed


def _worker(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        cfg = load_config(CONFIG, OVERRIDES + layout)
        ctx = init_distributed("cpu", cfg.parallel)
        if name != RESUMED:
            engine = build_from_config(cfg, ctx).engine
            losses, biases = train(cfg, ctx, [rank], range(STEPS), engine)
            results[name] = {"losses": losses, "biases": biases, "final": full_params(engine)}
            continue
        engine, fresh, head, tail, resumed = train_save_and_resume(
            lambda: build_from_config(cfg, ctx).engine,
            lambda engine, steps: train(cfg, ctx, [rank], steps, engine),
            Path(root) / name, rank, SAVE_AFTER, STEPS)
        results[name] = {"losses": head[0] + tail[0], "biases": head[1] + tail[1], "final": full_params(engine),
                         "resumed": resumed[0], "resumed_biases": resumed[1], "resumed_final": full_params(fresh)}
    return results


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as root:
        return run_workers(_worker, 2, root)


def test_latent_attention_routing_and_mtp_under_ddp_fsdp_and_ep_match_one_process(ranks):
    cfg = load_config(CONFIG, OVERRIDES + ["--train.grad_accum_steps=2"])
    engine = build_from_config(cfg, DistContext.single()).engine
    losses, biases = train(cfg, DistContext.single(), [0, 1], range(STEPS), engine)
    final = full_params(engine)
    assert len(biases[-1]) == 2 * 4  # block 1 and the MTP module's block route
    # The MTP module's router's bias moved (it may come back to 0 by the last step: it moves by +-rate).
    assert any(b != 0 for step in biases for b in step[4:])
    for rank in ranks:
        for name in LAYOUTS:
            got = rank[name]
            assert got["losses"] == pytest.approx(losses, abs=1e-5), name
            assert got["biases"] == biases, name  # sign steps of the summed load: exactly equal
            assert got["final"].keys() == final.keys(), name
            for key, value in final.items():
                torch.testing.assert_close(got["final"][key], value, rtol=0, atol=1e-5, msg=f"{name}: {key}")


def test_deepseek_ep2_resumes_exactly(ranks):
    for rank in ranks:
        run = rank[RESUMED]
        assert_resumes_exactly(run, SAVE_AFTER)
        assert run["resumed_biases"] == run["biases"][SAVE_AFTER:]
