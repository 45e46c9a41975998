"""FSDP2 on gloo: sharded (DCP) checkpoints reshard 2 -> 1 and 2 -> 4 (and into HSDP 2 x 2),
meta-device init, and the DDP wrapper's options and comm-hook counter.

One 2-process launch trains a tiny GPT under FSDP2, saves model + optimizer with
parallel/checkpoint.py, records the full (all-gathered) state as the reference and the loss
of one more step. One 4-process launch loads that checkpoint into 4-way FSDP2 and into HSDP
(2 nodes x 2), and the pytest process itself loads it into a plain, unsharded module. Every
layout must hold bit-identical weights and optimizer state and take the same next step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gloo import run_workers

N_LAYER, D_MODEL, SEQ, BATCH = 2, 32, 16, 4


# ----------------------------------------------------------------------------- launch helper




# ----------------------------------------------------------------------------- shared pieces


def _model_cfg():
    from model.config import ModelConfig

    return ModelConfig(n_layer=N_LAYER, d_model=D_MODEL, n_head=2, max_seq_len=SEQ, vocab_size=256)


def _build(seed: int, device: str = "cpu"):
    from model.gpt import GPT

    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(_model_cfg())


def _optimizer(model):
    from parallel.optim import OptimConfig, build_adamw, decay_groups

    params = [(n, p) for n, p in model.named_parameters()]
    return build_adamw(decay_groups(params, 0.1), OptimConfig(lr=1e-2), torch.device("cpu"))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank, so any data-parallel layout computes the same gradient."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, optimizer, step: int) -> float:
    x, y = _batch(step)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _ctx(rank: int, world: int, local_world: int | None = None):
    from tests.gloo import gloo_context

    return gloo_context(rank, world, local_world)


def _fsdp(model, rank: int, world: int, **parallel: Any):
    from parallel.config import ParallelConfig
    from tests.gloo import data_parallel_engine, gloo_context

    cfg = ParallelConfig(strategy="fsdp", **parallel)
    local = parallel.get("local_world_size") or world
    ctx = gloo_context(rank, world, local, parallel=cfg)
    return data_parallel_engine(model, cfg, ctx).model


def _full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer state as full tensors, gathered by FSDP itself (independent of DCP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v.detach().clone() for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).detach().clone()
    return flat


# ----------------------------------------------------------------------------- 2-rank worker


def _save_on_two(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    from parallel.checkpoint import save_model_optimizer

    model = _fsdp(_build(seed=0), rank, world)
    optimizer = _optimizer(model)
    for step in range(2):
        _step(model, optimizer, step)
    save_model_optimizer([(model, optimizer)], Path(ckpt_dir))
    reference = _full_state(model, optimizer)
    next_loss = _step(model, optimizer, 2)
    after = _full_state(model, optimizer)
    out = {"reference": reference, "next_loss": next_loss, "after": after}
    out["meta"] = _meta_init_checks(rank, world)
    out["ddp"] = _ddp_checks(rank, world)
    return out


def _meta_init_checks(rank: int, world: int) -> dict[str, Any]:
    from model.gpt import GPT

    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    with torch.device("meta"):
        model = GPT(_model_cfg())
    model = _fsdp(model, rank, world, init_on_meta=True)
    qkv = model.blocks["0"].attn.qkv.weight.full_tensor()
    half = qkv.shape[0] // 2
    return {
        "any_meta": any(p.is_meta for p in model.parameters()),
        "tied": model.lm_head.weight is model.tok_emb.weight,
        "qkv_std": float(qkv.std()),
        "halves_equal": bool(torch.equal(qkv[:half], qkv[half:])),
        "bias_zero": bool((model.blocks["0"].attn.qkv.bias.full_tensor() == 0).all()),
        "rng_restored": bool(torch.equal(rng_before, torch.get_rng_state())),
        "local_first_row": model.blocks["0"].attn.qkv.weight.to_local()[0].detach().clone(),
        "loss_finite": bool(torch.isfinite(model(*_batch(0)))),
    }


def _ddp_checks(rank: int, world: int) -> dict[str, Any]:
    from parallel.config import ParallelConfig
    from tests.gloo import data_parallel_engine

    parallel = ParallelConfig(strategy="ddp", ddp_bucket_cap_mb=0.01, ddp_static_graph=True, ddp_comm_hook="bf16")
    engine = data_parallel_engine(_build(seed=0), parallel, _ctx(rank, world))
    ddp = engine.model
    x, y = _batch(rank)  # different data per rank: the hook must average
    broadcasts = []
    real_broadcast = torch.distributed._broadcast_coalesced  # what DDP calls to sync buffers
    torch.distributed._broadcast_coalesced = lambda *a, **k: (broadcasts.append(1), real_broadcast(*a, **k))[1]
    try:
        engine.forward_backward(x, y, True, 1)
    finally:
        torch.distributed._broadcast_coalesced = real_broadcast
    grad = ddp.module.lm_head.weight.grad.detach().clone()
    stats = engine.comm_stats() or None
    n_bytes = sum(p.numel() * 4 for p in ddp.module.parameters())
    return {
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "static_graph": ddp.static_graph,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "stats": stats,
        "param_bytes": n_bytes,
        "grad": grad,
        "broadcasts_in_step": len(broadcasts),
        "n_buffers": len(list(ddp.module.buffers())),
    }


# ----------------------------------------------------------------------------- 4-rank worker


def _load_on_four(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    from parallel.checkpoint import load_model_optimizer

    out = {}
    for label, parallel in (("fsdp4", {}), ("hsdp2x2", {"fsdp_hybrid": True, "local_world_size": 2})):
        model = _fsdp(_build(seed=1), rank, world, **parallel)  # different init: the load must overwrite it
        optimizer = _optimizer(model)
        load_model_optimizer([(model, optimizer)], Path(ckpt_dir))
        loaded = _full_state(model, optimizer)
        next_loss = _step(model, optimizer, 2)
        local_shape = tuple(model.blocks["0"].mlp.fc.weight.to_local().shape)
        out[label] = {"loaded": loaded, "next_loss": next_loss, "after": _full_state(model, optimizer),
                      "local_shape": local_shape}
    return out


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    ckpt_dir = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    two = run_workers(_save_on_two, 2, ckpt_dir)
    four = run_workers(_load_on_four, 4, ckpt_dir)
    return {"two": two, "four": four, "ckpt_dir": ckpt_dir}


def _assert_same_state(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(reference)
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in reference)
    for key, ref in reference.items():
        assert torch.equal(loaded[key].float(), ref.float()), key


def _assert_close_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    for key in b:
        if key.startswith("model."):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


@pytest.mark.timeout(240)
def test_checkpoint_saved_on_2_ranks_loads_on_4_and_into_hsdp(runs):
    reference = runs["two"][0]["reference"]
    for label in ("fsdp4", "hsdp2x2"):
        for rank_out in runs["four"]:
            _assert_same_state(rank_out[label]["loaded"], reference)
    # 4-way shards vs 2-way shards (HSDP shards within a "node" of 2): the layouts really differ.
    d_ff = 4 * D_MODEL
    assert runs["four"][0]["fsdp4"]["local_shape"] == (d_ff // 4, D_MODEL)
    assert runs["four"][0]["hsdp2x2"]["local_shape"] == (d_ff // 2, D_MODEL)
    # The next step from the loaded state is the step the 2-rank run took (same batch everywhere).
    two_next = runs["two"][0]["next_loss"]
    for label in ("fsdp4", "hsdp2x2"):
        assert runs["four"][0][label]["next_loss"] == pytest.approx(two_next, abs=1e-6)
        _assert_close_state(runs["four"][0][label]["after"], runs["two"][0]["after"], atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP says it loads in 1 process
def test_checkpoint_saved_on_2_ranks_loads_into_a_plain_module_on_1(runs):
    from parallel.checkpoint import load_model_optimizer

    model = _build(seed=1)
    optimizer = _optimizer(model)
    load_model_optimizer([(model, optimizer)], Path(runs["ckpt_dir"]))
    loaded = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            loaded[f"optim.{names[p]}.{key}"] = torch.as_tensor(value)
    _assert_same_state(loaded, runs["two"][0]["reference"])
    assert _step(model, optimizer, 2) == pytest.approx(runs["two"][0]["next_loss"], abs=1e-6)


def test_meta_init_materializes_distinct_shards_with_the_configured_std(runs):
    meta = [r["meta"] for r in runs["two"]]
    for m in meta:
        assert not m["any_meta"] and m["tied"] and m["bias_zero"] and m["rng_restored"] and m["loss_finite"]
        assert not m["halves_equal"]  # rank 0's and rank 1's shards are not copies of each other
        assert 0.017 < m["qkv_std"] < 0.023  # init_std 0.02 over 96 x 32 draws
    assert not torch.equal(meta[0]["local_first_row"], meta[1]["local_first_row"])


def test_ddp_options_and_comm_hook_counter_reach_the_engine(runs):
    r0, r1 = (r["ddp"] for r in runs["two"])
    assert r0["bucket_cap_bytes"] == int(0.01 * 1024 * 1024)
    assert r0["static_graph"] and r0["gradient_as_bucket_view"]
    # bf16 hook: half the bytes of a dense fp32 all-reduce, counted over every bucket.
    stats = r0["stats"]
    assert stats is not None and stats["comm_bytes_uncompressed"] > 0
    assert stats["comm_saving"] == pytest.approx(2.0, rel=0.01)
    # DDP's ring all-reduce of all gradients sends 2(n-1)/n of their bytes: n=2 -> all of them
    # (each parameter once, the tied embedding included once).
    assert stats["comm_bytes_uncompressed"] == pytest.approx(r0["param_bytes"], rel=0.01)
    torch.testing.assert_close(r0["grad"], r1["grad"])  # averaged: the same on both ranks
    # The model's buffers (rotary tables) are computed from the config on every rank, so a step
    # issues no blocking broadcast of them before its forward: gradients are its only collectives.
    assert r0["n_buffers"] > 0 and r0["broadcasts_in_step"] == 0
