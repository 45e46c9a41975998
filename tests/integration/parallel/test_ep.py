"""Expert parallelism (parallel/ep.py) and MoE layers under tensor parallelism, against one process.

A dropless MoE GPT (with the Switch auxiliary loss and the z-loss on) trained for 10 steps by the
build path under ep=2, tp=2 (MoE layers replicated, each tp rank routing its own sequence slice)
and tp=2 without sequence parallelism on 2 ranks; ep=2 of dp_shard=4, ep=2 x pp=2, ep=2 x tp=2 (each
tp rank exchanging its own slice's tokens in its ep group), ep=4 x cp=2 (the ep group spans dp_shard
and cp ranks), ep=2 with cp=2 and dp_shard=2 built on the meta device (init_on_meta; the ep group is the
cp group, experts FSDP-sharded over dp_shard), dp_shard=4 without ep, and ep=2 x pp=2 under the
zero-bubble schedule (4 one-layer stages) on 4 ranks: losses and gradient norms equal one process
stepping on the same micro-batches (within 1e-5), the first step's gradients and the last step's
weights, gathered whole, equal the one-process ones parameter by
parameter (but under pp, where a rank holds one stage and the norm over both stages is checked), and
the router metrics the training log shows after 6 steps (load per layer, auxiliary loss) are one
process's over the same micro-batches. A model whose capacity drops copies trains 6 steps under
ep=2 and ep=4 x cp=2: its losses and router metrics (the dropped fraction too) are one process's. The
init_on_meta run is compared with one process started from its gathered init, and that init with one
process's: the same constants, the same spread per weight, every expert drawn apart. Each layout
resumes bit for bit from its DCP checkpoint; ep=2's checkpoint loads into one process (ep=1) and
dp_shard=4's (ep=1) into ep=2 of dp_shard=4, each then training as the one-process reference does.
The 2-rank launch also counts the token all-to-alls of one step under each recompute policy, against
the estimator's count (analysis/estimator/communication.py ``expert_exchanges``).
One 2-rank and one 4-rank launch run all of it.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from common.values import full_value, local_shard
from parallel.distributed import DistContext
from parallel.layout import Layout
from tests.gloo import gloo_context, run_workers, save_on_every_rank
from training.build import build_from_config
from training.config import load_config
from training.loop import engine_moe_layers, router_window_metrics

SEQ, VOCAB, MICRO, STEPS, SAVE_AFTER = 16, 64, 2, 10, 6
MODEL = {"vocab_size": VOCAB, "max_seq_len": SEQ, "n_layer": 2, "n_head": 4, "d_model": 32, "mlp": "swiglu",
         "moe.experts": 4, "moe.top_k": 2, "moe.d_ff": 16, "moe.aux_loss": 0.01, "moe.z_loss": 0.001,
         "tie_embeddings": False, "bias": False}  # a key bias has no gradient but float noise, which Adam amplifies
LAYOUTS = {2: {"ep2": {"ep": 2}, "tp2": {"tp": 2},
               "tp2_no_sp": {"tp": 2, "sequence_parallel": False, "loss_parallel": False}},
           4: {"ep2_of_dp4": {"ep": 2, "dp_shard": 4}, "dp4": {"dp_shard": 4, "strategy": "fsdp"},
               "ep2_x_pp2": {"ep": 2, "pp": 2}, "ep2_x_tp2": {"ep": 2, "tp": 2}, "ep4_x_cp2": {"ep": 4, "cp": 2},
               # the split backward: its input-gradient pass frees each stage's output in place
               "ep2_x_pp2_zero_bubble": {"ep": 2, "pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2},
               "ep2_x_cp2_x_dp2_meta": {"ep": 2, "cp": 2, "dp_shard": 2, "strategy": "fsdp",
                                        "init_on_meta": "true"}}}
ACCUM = 2  # micro-batches per step: a pipeline needs at least pp of them
# A model whose capacity drops copies, trained SAVE_AFTER steps under these layouts for its losses and
# router metrics: each ep rank keeps what one process keeps of the same micro-batch (ep x cp: of the
# micro-batch's whole sequences, the cp ranks counting together).
MODEL_KEYS = {"capacity": {"moe.capacity": 1.0}, "ep2_x_pp2_zero_bubble": {"n_layer": 4}}  # 4 stages of a layer
CAPACITY_LAYOUTS = {2: {"ep2": {"ep": 2}}, 4: {"ep4_x_cp2": {"ep": 4, "cp": 2}}}
# Muon (optim.name=muon) trained STEPS steps under these layouts: each rank orthogonalises the experts it
# holds (whole, split only over experts) where they are, and the dense matrices through their FSDP2
# shards; Newton-Schulz in fp32, so the layouts agree to rounding.
OPTIM_KEYS = {"muon": {"name": "muon", "muon.ns_dtype": "fp32"}}
MUON_LAYOUTS = {2: {"ep2": {"ep": 2}}, 4: {"ep2_of_dp4": {"ep": 2, "dp_shard": 4}}}


def job(name: str | None = None, **parallel):
    overrides = [f"--model.{k}={v}" for k, v in (MODEL | MODEL_KEYS.get(name, {})).items()]
    overrides += [f"--optim.{k}={v}" for k, v in OPTIM_KEYS.get(name, {}).items()]
    overrides += [f"--train.micro_batch_size={MICRO}", f"--train.grad_accum_steps={ACCUM}",
                  "--optim.warmup_steps=1", "--optim.lr=1e-2", f"--train.max_steps={STEPS}"]
    return load_config(None, overrides + [f"--parallel.{k}={v}" for k, v in parallel.items()])


def micro_batches(step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for m in range(ACCUM):
        g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + m)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


# --------------------------------------------------------------------------- on gloo ranks


def context(rank: int, world: int, cfg):
    return gloo_context(rank, world, parallel=cfg.parallel)


def whole_grads(engine) -> dict[str, torch.Tensor]:
    return {name: full_value(p.grad).detach().clone() for name, p in engine.module().named_parameters()}


def train(engine, ctx, cfg, steps: range, grads: dict | None = None) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in steps:
        loss, _ = engine.forward_backward_step(iter(micro_batches(step, ctx.dims.dp_rank)), ACCUM)
        if grads is not None and not grads:
            grads.update(whole_grads(engine))
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(ctx.all_reduce_mean(loss.detach().clone())))
    return losses, norms


def whole_state(model) -> dict[str, torch.Tensor]:
    """Every weight and buffer, gathered whole (a collective under FSDP2)."""
    return {name: full_value(t.detach()).clone() for name, t in model.state_dict().items()}


def one_process(dp_sizes: list[int], steps: range | None = None, load: Path | None = None,
                grads: dict | None = None, init: dict | None = None, name: str | None = None) -> dict:
    """Step i on the global batch of dp_sizes[i] data-parallel ranks, in one process (ep=1), from
    the seed's init, a checkpoint (``load``) or whole weights (``init``), with MODEL_KEYS[name]'s model;
    ``router``: the router metrics the log shows after SAVE_AFTER steps."""
    cfg = job(name)
    ctx = DistContext.single()
    engine = build_from_config(cfg, ctx).engine
    if load is not None:
        engine.load(load)
    if init is not None:
        engine.module().load_state_dict(init)
    losses, norms, router = [], [], {}
    for step in steps or range(len(dp_sizes)):
        dp_size = dp_sizes[step]
        both = [b for r in range(dp_size) for b in micro_batches(step, r)]
        loss, _ = engine.forward_backward_step(iter(both), dp_size * ACCUM)
        if grads is not None and not grads:
            grads.update(whole_grads(engine))
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(loss))
        if step == SAVE_AFTER - 1:
            router = router_window_metrics(engine_moe_layers(engine), cfg.model, ctx)
    return {"losses": losses, "norms": norms, "weights": whole_state(engine.module()), "router": router}


def train_layout(rank: int, world: int, name: str, layout: dict, root: str) -> dict:
    cfg = job(name, **layout)
    ctx = context(rank, world, cfg)
    engine = build_from_config(cfg, ctx).engine
    whole = ctx.layout.pp == 1  # a pipeline rank holds one stage: its norm is checked, not its weights
    init = whole_state(engine.module()) if cfg.parallel.init_on_meta else None
    grads: dict | None = {} if whole else None
    losses, norms = train(engine, ctx, cfg, range(SAVE_AFTER), grads)
    router = router_window_metrics(engine_moe_layers(engine), cfg.model, ctx)  # what the log shows (collective)
    grad_err = {}
    if grads is not None:
        ref_grads: dict = {}
        one_process([ctx.layout.dp], grads=ref_grads, init=init, name=name)
        grad_err = {k: float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads}
    path = Path(root) / name
    save_on_every_rank(engine, path, rank)
    rest, rest_norms = train(engine, ctx, cfg, range(SAVE_AFTER, STEPS))
    weights = whole_state(engine.module()) if whole else None
    fresh = build_from_config(cfg, ctx).engine
    fresh.load(path)
    resumed, _ = train(fresh, ctx, cfg, range(SAVE_AFTER, STEPS))
    ep_mesh = ctx.submesh("ep")  # ParallelDims.ep_rank names this rank's experts as the mesh does
    ep_rank_ok = ep_mesh is None or ep_mesh.get_local_rank() == ctx.dims.ep_rank
    return {"losses": losses + rest, "norms": norms + rest_norms, "resumed": resumed, "grad_err": grad_err,
            "dp_size": ctx.layout.dp, "init": init, "weights": weights, "ep_rank_ok": ep_rank_ok,
            "router": router}


RECOMPUTE_POLICIES = ("none", "selective", "full", "every_k", "op_selective")


def row_exchanges(rank: int, world: int) -> dict[str, int]:
    """All-to-alls of token rows (not the per-expert counts, which are 1-D) in one step's forward and
    backward under ep=2, per recompute policy: what the estimator's ``expert_exchanges`` counts."""
    calls = []
    original = torch.distributed.all_to_all_single

    def counting(output, input, *args, **kwargs):
        if input.dim() > 1:
            calls.append(input.shape)
        return original(output, input, *args, **kwargs)

    out = {}
    torch.distributed.all_to_all_single = counting
    try:
        for policy in RECOMPUTE_POLICIES:
            cfg = job(ep=2)
            cfg.model = dataclasses.replace(cfg.model, recompute=policy, recompute_every_k=2)
            ctx = context(rank, world, cfg)
            engine = build_from_config(cfg, ctx).engine
            calls.clear()
            engine.forward_backward_step(iter(micro_batches(0, ctx.dims.dp_rank)), ACCUM)
            out[policy] = len(calls)
    finally:
        torch.distributed.all_to_all_single = original
    return out


def train_named(name: str, rank: int, world: int, layout: dict, steps: range):
    """``steps`` steps of job(name) under ``layout``: the config, context, engine and losses."""
    cfg = job(name, **layout)
    ctx = context(rank, world, cfg)
    engine = build_from_config(cfg, ctx).engine
    losses, _ = train(engine, ctx, cfg, steps)
    return cfg, ctx, engine, losses


def train_with_capacity(rank: int, world: int, layout: dict) -> dict:
    """SAVE_AFTER steps of the capacity model: losses, and the router metrics the log would show."""
    cfg, ctx, engine, losses = train_named("capacity", rank, world, layout, range(SAVE_AFTER))
    return {"losses": losses, "router": router_window_metrics(engine_moe_layers(engine), cfg.model, ctx),
            "dp_size": ctx.layout.dp}


def train_with_muon(rank: int, world: int, name: str, layout: dict, root: str) -> dict:
    """STEPS steps with Muon, saved after SAVE_AFTER of them: losses, the whole weights after them, and
    the experts this rank holds."""
    cfg, ctx, engine, losses = train_named("muon", rank, world, layout, range(SAVE_AFTER))
    save_on_every_rank(engine, Path(root) / f"muon_{name}", rank)
    losses += train(engine, ctx, cfg, range(SAVE_AFTER, STEPS))[0]
    experts = {n: tuple(local_shard(p).shape) for n, p in engine.module().named_parameters() if n.endswith("w_up")}
    return {"losses": losses, "weights": whole_state(engine.module()), "dp_size": ctx.layout.dp,
            "local_experts": experts}


def two_rank_worker(rank: int, world: int, root: str) -> dict:
    out = {name: train_layout(rank, world, name, layout, root) for name, layout in LAYOUTS[2].items()}
    out |= {f"capacity_{name}": train_with_capacity(rank, world, layout) for name, layout in CAPACITY_LAYOUTS[2].items()}
    out["row_exchanges"] = row_exchanges(rank, world)
    return out


def four_rank_worker(rank: int, world: int, root: str) -> dict:
    out = {name: train_layout(rank, world, name, layout, root) for name, layout in LAYOUTS[4].items()}
    out |= {f"capacity_{name}": train_with_capacity(rank, world, layout) for name, layout in CAPACITY_LAYOUTS[4].items()}
    # dp_shard=4 without ep (ep=1) saved after SAVE_AFTER steps, loaded into ep=2 of dp_shard=4.
    cfg = job(**LAYOUTS[4]["ep2_of_dp4"])
    ctx = context(rank, world, cfg)
    engine = build_from_config(cfg, ctx).engine
    engine.load(Path(root) / "dp4")
    out["dp4_into_ep2_of_dp4"] = train(engine, ctx, cfg, range(SAVE_AFTER, STEPS))[0]
    return out


@pytest.fixture(scope="module")
def launches():
    with tempfile.TemporaryDirectory() as root:
        ranks = {2: run_workers(two_rank_worker, 2, root), 4: run_workers(four_rank_worker, 4, root)}
        # ep=2's checkpoint into one process (ep=1), which then steps on two ranks' batches.
        ep2_into_one = one_process([2] * STEPS, range(SAVE_AFTER, STEPS), load=Path(root) / "ep2")["losses"]
        yield {"ranks": ranks, "ep2_into_one": ep2_into_one}


def muon_worker(rank: int, world: int, root: str) -> dict:
    return {name: train_with_muon(rank, world, name, layout, root) for name, layout in MUON_LAYOUTS[world].items()}


@pytest.fixture(scope="module")
def muon_launches():
    """Muon's layouts, in launches of their own (the ones above fill theirs on a loaded machine), and
    each layout's checkpoint after SAVE_AFTER steps loaded into one process, which trains on to STEPS."""
    with tempfile.TemporaryDirectory() as root:
        ranks = {world: run_workers(muon_worker, world, root) for world in MUON_LAYOUTS}
        resumed = {name: one_process([ranks[world][0][name]["dp_size"]] * STEPS, range(SAVE_AFTER, STEPS),
                                     load=Path(root) / f"muon_{name}", name="muon")
                   for world, layouts in MUON_LAYOUTS.items() for name in layouts}
        yield {"ranks": ranks, "resumed": resumed}


def assert_trains_as_one_process(got: dict, ref: dict, name: str, *, whole: bool, loss_tol: float = 1e-5,
                                 norm_tol: float = 1e-5, weight_tol: float = 1e-5) -> None:
    """A rank's ``train_layout`` result against ``one_process``'s: losses and gradient norms; where the
    rank holds the whole model (``whole``: not a pipeline stage), the first step's gradients (1e-6) and
    the last weights, gathered whole, parameter by parameter; and the bit-exact resume."""
    assert got["losses"] == pytest.approx(ref["losses"], abs=loss_tol)
    assert got["norms"] == pytest.approx(ref["norms"], rel=norm_tol)
    if whole:
        worst = max(got["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-6, worst
        weight_err = {k: float((got["weights"][k] - w).abs().max()) for k, w in ref["weights"].items()}
        worst = max(weight_err.items(), key=lambda kv: kv[1])
        assert worst[1] < weight_tol, worst
    assert got["resumed"] == got["losses"][SAVE_AFTER:], f"resume under {name} is not bit-exact"


@functools.cache
def reference(dp_size: int, name: str | None = None) -> dict:
    return one_process([dp_size] * STEPS, name=name)


@pytest.mark.parametrize("world,name", [(world, name) for world, layouts in LAYOUTS.items() for name in layouts])
def test_ep_training_equals_one_process(launches, world, name):
    ranks = launches["ranks"][world]
    init = ranks[0][name]["init"]  # init_on_meta: one process starts from the weights the ranks drew
    dp_size = ranks[0][name]["dp_size"]
    ref = reference(dp_size, name) if init is None else one_process([dp_size] * STEPS, init=init, name=name)
    for rank_result in ranks:
        got = rank_result[name]
        assert got["ep_rank_ok"]
        # Adam divides by sqrt(v): float noise in a near-zero gradient moves a weight by up to lr
        # (1e-2) a step, so weights agree less closely than losses; a wrong update is ~lr off.
        assert_trains_as_one_process(got, ref, name, whole="pp" not in LAYOUTS[world][name], weight_tol=1e-4)
        # The router metrics the log shows are the whole batch's, every rank's and stage's layers.
        last_layer = MODEL_KEYS.get(name, {}).get("n_layer", MODEL["n_layer"]) - 1
        assert got["router"].keys() == ref["router"].keys() and f"moe_load_max_mean/{last_layer}" in got["router"]
        for key, value in ref["router"].items():
            assert got["router"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, got["router"])


@pytest.mark.parametrize("world,name", [(world, name) for world, layouts in CAPACITY_LAYOUTS.items()
                                        for name in layouts])
def test_capacity_and_router_metrics_under_ep_equal_one_process(launches, world, name):
    """With copies dropped: the losses, and the router metrics the log shows (dropped fraction,
    load per layer, auxiliary loss), are one process's on the same micro-batches."""
    ranks = launches["ranks"][world]
    ref = one_process([ranks[0][f"capacity_{name}"]["dp_size"]] * SAVE_AFTER, name="capacity")
    assert ref["router"]["moe_dropped_frac"] > 0
    for rank_result in ranks:
        got = rank_result[f"capacity_{name}"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert got["router"].keys() == ref["router"].keys()
        for key, value in ref["router"].items():
            assert got["router"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, got["router"])


@pytest.mark.parametrize("world,name", [(world, name) for world, layouts in MUON_LAYOUTS.items() for name in layouts])
def test_muon_under_ep_equals_one_process_over_ten_steps(muon_launches, world, name):
    ranks = muon_launches["ranks"][world]
    ref = one_process([ranks[0][name]["dp_size"]] * STEPS, name="muon")
    for got in ranks:
        got = got[name]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        for key, want in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], want, rtol=0, atol=1e-5, msg=key)
        # each rank held whole experts, a share of them: orthogonalised where they were
        assert all(shape[0] < MODEL["moe.experts"] for shape in got["local_experts"].values())
    # the layout's checkpoint (experts saved by the ranks holding them, with Muon's momentum) into one process
    resumed = muon_launches["resumed"][name]
    assert resumed["losses"] == pytest.approx(ref["losses"][SAVE_AFTER:], abs=1e-5)
    for key, want in ref["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], want, rtol=0, atol=1e-5, msg=key)


def test_init_on_meta_with_ep_draws_like_one_process(launches):
    """Built on meta, sharded (ep x cp x dp_shard), then initialised shard by shard: the whole weights
    are one process's init in everything but the random draws, which keep its spread, and no two
    experts (held by different ranks) repeat each other's draws."""
    ranks = launches["ranks"][4]
    init = ranks[0]["ep2_x_cp2_x_dp2_meta"]["init"]
    for rank_result in ranks[1:]:
        assert all(torch.equal(rank_result["ep2_x_cp2_x_dp2_meta"]["init"][k], v) for k, v in init.items())
    ref = whole_state(build_from_config(job(), DistContext.single()).model)
    assert init.keys() == ref.keys()
    for name, want in ref.items():
        got = init[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if want.numel() < 2 or float(want.std()) == 0:  # constants: norms, biases
            assert torch.equal(got, want), name
        else:
            assert float(got.std()) == pytest.approx(float(want.std()), rel=0.1), name
        if name.endswith(("w_up", "w_down", "w_gate")):
            experts = got.flatten(1)
            assert all(not torch.equal(experts[i], experts[j]) for i in range(len(experts)) for j in range(i)), name


def test_an_ep2_checkpoint_loads_into_one_process(launches):
    ref = reference(2)
    assert launches["ep2_into_one"] == pytest.approx(ref["losses"][SAVE_AFTER:], abs=1e-5)


def test_an_ep1_checkpoint_loads_into_ep2_of_dp4(launches):
    ref = reference(4)
    for rank_result in launches["ranks"][4]:
        assert rank_result["dp4_into_ep2_of_dp4"] == pytest.approx(ref["losses"][SAVE_AFTER:], abs=1e-5)


@pytest.mark.parametrize("policy", RECOMPUTE_POLICIES)
def test_the_estimator_counts_the_all_to_alls_the_trainer_runs(launches, policy):
    """One step of ACCUM micro-batches: the estimator's exchanges per micro-batch, times ACCUM, equal
    the row all-to-alls each rank ran (recomputed layers run their dispatch and combine again)."""
    from analysis import estimator as est
    from common.hardware import DEVICES

    cfg = dataclasses.replace(job(ep=2).model, recompute=policy, recompute_every_k=2)
    spec = est.JobSpec(cfg, SEQ, MICRO, Layout(2, strategy="fsdp", ep=2), policy, "fp32", DEVICES["H100"],
                       grad_accum=ACCUM)
    for rank_result in launches["ranks"][2]:
        assert rank_result["row_exchanges"][policy] == ACCUM * est.expert_exchanges(spec)
