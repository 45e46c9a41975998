"""The mixture-of-experts layer: routing, capacity, load-balancing losses, the aux-loss-free bias,
the grouped GEMM against the per-expert loop, the parameter counts, and bad keys."""

from __future__ import annotations

import math

import pytest
import torch

from common.errors import CapabilityError, ConfigError
from kernels.registry import REFERENCE_OPS
from model.config import ModelConfig, MoEConfig
from model.flops import count_parameters
from model.gpt import GPT, MLP
from model.moe import (
    MoE,
    expert_capacity,
    expert_mlp,
    grouped_matmul,
    load_balancing_loss,
    moe_layers,
    permute,
    route,
    router_z_loss,
    select_expert_backend,
    take_moe_metrics,
    unpermute,
    update_expert_bias,
)
from training.config import load_config


def moe_cfg(moe: dict | None = None, **kw) -> ModelConfig:
    base = dict(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32, mlp="swiglu")
    cfg = ModelConfig(**(base | kw), moe=MoEConfig(**(dict(experts=4, top_k=2, d_ff=16) | (moe or {}))))
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_every_token_goes_to_exactly_its_top_k_experts(scoring):
    torch.manual_seed(0)
    logits = torch.randn(50, 8)
    r = route(logits, 3, scoring, renormalize=True, routed_scale=1.0)
    assert r.experts.shape == (50, 3)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    for t in range(50):
        chosen = set(r.experts[t].tolist())
        assert len(chosen) == 3  # three different experts
        # every chosen expert scores at least as high as every expert left out
        left_out = [e for e in range(8) if e not in chosen]
        assert min(scores[t, e] for e in chosen) >= max(scores[t, e] for e in left_out)


def test_routing_weights_sum_as_configured():
    torch.manual_seed(0)
    logits = torch.randn(20, 6)
    probs = logits.softmax(-1)
    renorm = route(logits, 2, "softmax", renormalize=True, routed_scale=1.0)
    torch.testing.assert_close(renorm.weights.sum(-1), torch.ones(20))
    raw = route(logits, 2, "softmax", renormalize=False, routed_scale=1.0)
    torch.testing.assert_close(raw.weights.sum(-1), probs.topk(2).values.sum(-1))
    assert (raw.weights.sum(-1) < 1).all()
    scaled = route(logits, 2, "sigmoid", renormalize=True, routed_scale=2.5)  # DeepSeek-V3's recipe
    torch.testing.assert_close(scaled.weights.sum(-1), torch.full((20,), 2.5))
    unnormed = route(logits, 2, "sigmoid", renormalize=False, routed_scale=2.5)
    torch.testing.assert_close(unnormed.weights, 2.5 * logits.sigmoid().gather(-1, unnormed.experts))


def test_the_bias_changes_which_experts_are_chosen_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    r = route(logits, 1, "sigmoid", renormalize=False, routed_scale=1.0, bias=torch.tensor([0.0, 0.0, 5.0]))
    assert r.experts.tolist() == [[2]]
    torch.testing.assert_close(r.weights, torch.sigmoid(torch.tensor([[0.0]])))


def identity_experts(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return rows


def test_dropless_dispatch_keeps_every_token_and_combines_with_the_weights():
    torch.manual_seed(0)
    x = torch.randn(12, 4)
    r = route(torch.randn(12, 5), 2, "softmax", renormalize=False, routed_scale=1.0)
    rows, d = permute(x, r.experts, 5, capacity=None)
    assert rows.shape == (24, 4) and d.counts.sum() == 24 and torch.equal(d.counts, d.routed)
    # rows come grouped by expert
    experts_of_rows = r.experts.flatten()[d.slots]
    assert torch.equal(experts_of_rows, experts_of_rows.sort().values)
    # with identity experts every token gets back x * (sum of its weights)
    torch.testing.assert_close(unpermute(rows, d, r.weights), x * r.weights.sum(-1, keepdim=True))


def test_capacity_drops_exactly_the_overflow_hand_computed():
    # 6 tokens, k=1, 2 experts; tokens 0, 1, 2, 4, 5 pick expert 0, token 3 picks expert 1.
    experts = torch.tensor([[0], [0], [0], [1], [0], [0]])
    capacity = expert_capacity(6, 1, 2, capacity_factor=1.0)
    assert capacity == 3  # ceil(1.0 * 6 * 1 / 2)
    x = torch.arange(6, dtype=torch.float32).unsqueeze(1) + 1  # token t carries t + 1
    rows, d = permute(x, experts, 2, capacity)
    assert d.routed.tolist() == [5, 1] and d.counts.tolist() == [3, 1]
    # expert 0 keeps its first three tokens (0, 1, 2) and drops 4 and 5; expert 1 keeps token 3
    assert rows.flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    out = unpermute(rows, d, torch.ones(6, 1))
    assert out.flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0]
    # factor 1.5: ceil(4.5) = 5 per expert, nothing dropped
    assert permute(x, experts, 2, expert_capacity(6, 1, 2, 1.5))[1].counts.tolist() == [5, 1]


def test_capacity_with_two_slots_per_token():
    # 3 tokens, k=2, 3 experts: copies to expert 0 from tokens 0, 1, 2 (slot 0) overflow capacity 2
    experts = torch.tensor([[0, 1], [0, 2], [0, 1]])
    capacity = expert_capacity(3, 2, 3, 1.0)
    assert capacity == 2
    x = torch.tensor([[1.0], [10.0], [100.0]])
    rows, d = permute(x, experts, 3, capacity)
    assert d.counts.tolist() == [2, 2, 1]
    out = unpermute(rows, d, torch.full((3, 2), 0.5))
    # token 2 lost its expert-0 copy: half of it comes back; tokens 0 and 1 come back whole
    assert out.flatten().tolist() == [1.0, 10.0, 50.0]


def test_load_balancing_loss_equals_the_hand_computed_value():
    probs = torch.tensor([[0.75, 0.25], [0.6, 0.4], [0.3, 0.7]])
    r = route(probs.log(), 1, "softmax", renormalize=False, routed_scale=1.0)
    assert r.experts.flatten().tolist() == [0, 0, 1]
    # f = (2/3, 1/3), P = (0.55, 0.45): 2 * (2/3 * 0.55 + 1/3 * 0.45)
    assert load_balancing_loss(r, 2).item() == pytest.approx(2 * (2 / 3 * 0.55 + 1 / 3 * 0.45), abs=1e-6)
    # uniform scores and load give exactly 1
    flat = route(torch.zeros(4, 4), 1, "softmax", renormalize=False, routed_scale=1.0)
    flat.experts = torch.tensor([[0], [1], [2], [3]])
    assert load_balancing_loss(flat, 4).item() == pytest.approx(1.0)
    z = route(torch.tensor([[0.0, math.log(3.0)]]), 1, "softmax", renormalize=False, routed_scale=1.0)
    assert router_z_loss(z).item() == pytest.approx(math.log(4.0) ** 2, abs=1e-6)


def test_the_layer_adds_its_weighted_losses_to_the_gradient_not_to_the_logged_loss():
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = {}, {}
    for coef in (0.0, 1.0, 2.0):
        torch.manual_seed(1)
        model = GPT(moe_cfg(dict(aux_loss=coef)))
        loss = model(x, x)
        loss.backward()
        losses[coef], grads[coef] = loss.item(), model.blocks["0"].mlp.router.weight.grad.clone()
    assert losses[0.0] == losses[1.0] == losses[2.0]  # the value is the language-model loss
    assert not torch.allclose(grads[0.0], grads[1.0])  # the router's gradient includes the aux loss
    # ... linearly in its coefficient
    torch.testing.assert_close(grads[2.0] - grads[0.0], 2 * (grads[1.0] - grads[0.0]), atol=1e-7, rtol=1e-4)

    # Without targets (a pipeline stage's output) the aux loss's gradient rides on the output.
    torch.manual_seed(1)
    staged = GPT(moe_cfg(dict(aux_loss=1.0)))
    logits = staged(x)
    torch.nn.functional.cross_entropy(logits.view(-1, 64), x.view(-1)).backward()
    torch.testing.assert_close(staged.blocks["0"].mlp.router.weight.grad, grads[1.0])


def test_eval_forwards_set_no_aux_loss_and_count_nothing():
    model = GPT(moe_cfg()).eval()
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 16)))
    assert all(m.aux_loss is None for m in moe_layers([model]))
    assert take_moe_metrics(moe_layers([model])) == {}


def test_aux_free_bias_moves_toward_balance():
    torch.manual_seed(0)
    cfg = moe_cfg(dict(router="sigmoid", top_k=1, aux_loss=0.0, bias_update_rate=0.05), n_layer=1)
    layer = MoE(cfg, REFERENCE_OPS)
    layer.init_weights(0.02, 0.02)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.3)
    x = torch.randn(64, 32).abs()
    layer.train()

    def load() -> torch.Tensor:
        layer(x)
        return layer.stats.since_update.clone()

    first = load()
    update_expert_bias([layer], 0.05)
    # each expert above the mean load moves down by the rate, each below moves up
    expected = 0.05 * torch.sign(first.float().mean() - first.float())
    torch.testing.assert_close(layer.expert_bias, expected)
    imbalance = [first.max().item() / first.float().mean().item()]
    assert imbalance[0] > 3  # nearly every token on one expert to begin with
    for _ in range(20):
        counts = load()
        imbalance.append(counts.max().item() / counts.float().mean().item())
        update_expert_bias([layer], 0.05)
    assert max(imbalance[-4:]) < imbalance[0] / 2, imbalance


def test_bias_update_sums_the_load_over_ranks_first():
    cfg = moe_cfg(dict(bias_update_rate=0.1), n_layer=1)
    layer = MoE(cfg, REFERENCE_OPS)
    layer.init_weights(0.02, 0.02)
    layer.stats.since_update = torch.tensor([3, 1, 0, 0])
    # another rank saw the opposite: summed, the load is even and nothing moves
    update_expert_bias([layer], 0.1, all_reduce_sum=lambda t: t + torch.tensor([[0.0, 2.0, 3.0, 3.0]]))
    assert layer.expert_bias.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert layer.stats.since_update is None


def test_router_metrics_report_load_and_dropped_fraction():
    torch.manual_seed(0)
    cfg = moe_cfg(dict(capacity=0.5, top_k=1), n_layer=1)
    model = GPT(cfg).train()
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    layer = moe_layers([model])[0]
    routed = layer.stats.window["routed"].clone()
    m = take_moe_metrics([layer])
    capacity = expert_capacity(32, 1, 4, 0.5)
    assert m["moe_dropped_frac"] == pytest.approx((routed - routed.clamp(max=capacity)).sum().item() / 32)
    assert m["moe_load_max_mean/0"] == pytest.approx(routed.max().item() / routed.float().mean().item())
    assert m["moe_aux_loss"] > 0
    assert take_moe_metrics([layer]) == {}  # the window was taken


# --------------------------------------------------------------------------- experts


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("gated", [True, False])
def test_grouped_gemm_equals_the_per_expert_loop(dtype, tol, gated):
    torch.manual_seed(0)
    e, d, f = 4, 32, 16
    counts = torch.tensor([5, 0, 9, 2])  # an expert with no tokens too
    x = torch.randn(int(counts.sum()), d, dtype=dtype)
    weights = [torch.randn(e, d, f, dtype=dtype) * 0.2, torch.randn(e, f, d, dtype=dtype) * 0.2,
               torch.randn(e, d, f, dtype=dtype) * 0.2 if gated else None]
    outs, grads = {}, {}
    for backend in ("grouped_mm", "loop"):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in [x] + weights]
        y = expert_mlp(leaves[0], counts, leaves[1], leaves[2], leaves[3], REFERENCE_OPS, "tanh", backend)
        y.backward(torch.ones_like(y) + torch.arange(y.numel(), dtype=dtype).view_as(y) / y.numel())
        outs[backend], grads[backend] = y, [t.grad for t in leaves if t is not None]
    torch.testing.assert_close(outs["grouped_mm"], outs["loop"], atol=tol, rtol=tol)
    for a, b in zip(grads["grouped_mm"], grads["loop"]):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol)


def test_grouped_gemm_runs_under_bf16_autocast_in_bf16():
    w = torch.randn(2, 16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_matmul(torch.randn(5, 16), w, torch.tensor([2, 3]), "grouped_mm")
    assert y.dtype == torch.bfloat16


def test_expert_backend_is_chosen_by_capability_and_says_why():
    cpu = torch.device("cpu")
    assert select_expert_backend("auto", cpu, torch.float32, moe_cfg())[0] == "grouped_mm"
    backend, note = select_expert_backend("auto", cpu, torch.float32, moe_cfg(dict(d_ff=6)))
    assert backend == "loop" and "multiples of 16 bytes" in note
    backend, note = select_expert_backend("auto", cpu, torch.bfloat16, moe_cfg(dict(d_ff=4)))  # 8 bytes
    assert backend == "loop"
    backend, note = select_expert_backend("auto", cpu, torch.float64, moe_cfg())
    assert backend == "loop" and "float64" in note
    with pytest.raises(CapabilityError, match="moe.backend=grouped_mm cannot run"):
        select_expert_backend("grouped_mm", cpu, torch.float64, moe_cfg())
    assert select_expert_backend("loop", cpu, torch.float32, moe_cfg())[0] == "loop"


def test_compiled_experts_in_fp32_take_the_backend_torchs_compiler_traces():
    # torch.compile traces torch._grouped_mm through a shape function that takes bf16 only (the CPU
    # kernel takes fp32): auto picks the loop there, and an explicit grouped_mm is refused in one line.
    cpu = torch.device("cpu")
    backend, note = select_expert_backend("auto", cpu, torch.float32, moe_cfg(), compiled=True)
    assert backend == "loop" and "torch.compile traces torch._grouped_mm in bf16 only" in note
    assert select_expert_backend("auto", cpu, torch.bfloat16, moe_cfg(), compiled=True)[0] == "grouped_mm"
    with pytest.raises(CapabilityError, match="or train.compile=false"):
        select_expert_backend("grouped_mm", cpu, torch.float32, moe_cfg(), compiled=True)
    # the trace alone (backend="eager": no code generated): the loop traces, what auto chose before does not
    x, w, counts = torch.randn(5, 16), torch.randn(2, 16, 8), torch.tensor([2, 3])
    torch.testing.assert_close(torch.compile(grouped_matmul, backend="eager")(x, w, counts, backend),
                               grouped_matmul(x, w, counts, "grouped_mm"))
    with pytest.raises(Exception, match="Expected inputs of BF16 type"):
        torch.compile(grouped_matmul, backend="eager")(x, w, counts, "grouped_mm")


def test_the_gpt_is_the_same_with_either_expert_backend():
    x = torch.randint(0, 64, (2, 16))
    out = {}
    for backend in ("grouped_mm", "loop"):
        torch.manual_seed(0)
        out[backend] = GPT(moe_cfg(dict(shared_experts=1)), expert_backend=backend)(x)
    torch.testing.assert_close(out["grouped_mm"], out["loop"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("experts,top_k,width", [(8, 2, 32), (16, 4, 16)])
def test_routed_scale_top_k_gives_the_dense_twins_output_scale_at_init(experts, top_k, width):
    """Renormalised top-k weights average the k experts' outputs (each ~1/k), so at init a MoE MLP's
    output is ~1/k the size of the dense MLP as wide as the k experts together, and with AdamW its
    output moves ~1/k as fast. moe.routed_scale = top_k (configs/tiny-moe.yaml) sums them instead:
    the dense twin's scale. Measured over three seeds' weights on the same tokens."""
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))

    def output_std(cfg: ModelConfig) -> float:
        stds = []
        for seed in range(3):
            torch.manual_seed(seed)
            stds.append(GPT(cfg).blocks["0"].mlp(x).std().item())
        return sum(stds) / len(stds)

    base = dict(vocab_size=64, max_seq_len=16, n_layer=1, n_head=2, d_model=64, mlp="swiglu")
    dense = output_std(ModelConfig(**base, d_ff=top_k * width))
    averaged = output_std(ModelConfig(**base, moe=MoEConfig(experts=experts, top_k=top_k, d_ff=width)))
    summed = output_std(ModelConfig(**base, moe=MoEConfig(experts=experts, top_k=top_k, d_ff=width,
                                                          routed_scale=float(top_k))))
    assert averaged / dense == pytest.approx(1 / top_k, rel=0.1)
    assert summed / dense == pytest.approx(1.0, rel=0.1)


# --------------------------------------------------------------------------- structure and counts


def test_which_layers_are_moe():
    every = moe_cfg(n_layer=4)
    assert [every.is_moe_layer(i) for i in range(4)] == [True] * 4
    other = moe_cfg(dict(every=2), n_layer=4)
    assert [other.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    first_dense = moe_cfg(dict(first_dense=1), n_layer=4)
    assert [first_dense.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    model = GPT(first_dense)
    assert isinstance(model.blocks["0"].mlp, MLP) and isinstance(model.blocks["1"].mlp, MoE)


@pytest.mark.parametrize("kw", [dict(), dict(mlp="gelu", bias=True, moe=dict(shared_experts=2)),
                                dict(moe=dict(every=2, bias_update_rate=0.01)), dict(moe=dict(first_dense=1, top_k=1))])
def test_parameter_counts_match_the_built_model(kw):
    cfg = moe_cfg(**kw)
    model = GPT(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    # active: per MoE layer, the experts not among the top-k are left out
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.expert_d_ff
    layer = moe_layers([model])[0]
    assert layer.w_up.numel() * (3 if cfg.mlp == "swiglu" else 2) == cfg.moe.experts * per_expert
    assert count_parameters(cfg) - count_parameters(cfg, active=True) == (
        cfg.n_moe_layers * (cfg.moe.experts - cfg.moe.top_k) * per_expert)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw, message", [
    (dict(experts=4, top_k=5), "model.moe.top_k=5 must be between 1 and model.moe.experts=4"),
    (dict(experts=0), "model.moe.experts=0 must be >= 1"),
    (dict(experts=4, capacity=-1.0), "model.moe.capacity must be a finite number >= 0"),
    (dict(experts=4, every=3), "no layer is MoE"),
    (dict(experts=4, routed_scale=0.0), "model.moe.routed_scale must be a finite number > 0"),
    (dict(experts=4, capacity=1e300), "model.moe.capacity=1e+300 is above model.moe.experts / model.moe.top_k = 2"),
    (dict(experts=8, top_k=2, capacity=4.5), "model.moe.capacity=4.5 is above model.moe.experts / model.moe.top_k = 4"),
])
def test_bad_moe_keys_are_one_line_config_errors(kw, message):
    cfg = ModelConfig(n_layer=2, moe=MoEConfig(**kw))
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_moe_key_exits_2_with_one_line(capsys):
    import train

    code = train.main(["--config", "configs/tiny-moe.yaml", "--model.moe.top_k=17"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == "config error: model.moe.top_k=17 must be between 1 and model.moe.experts=16"


def test_from_a_capacity_of_experts_over_top_k_nothing_is_dropped():
    """Why larger factors are refused: at experts / top_k the capacity is already every token (each
    token sends an expert at most one copy), so no larger factor changes anything."""
    for tokens, top_k, experts in [(7, 2, 4), (32, 1, 4), (1000, 3, 7), (5, 8, 8)]:
        assert expert_capacity(tokens, top_k, experts, experts / top_k) >= tokens
    moe_cfg(dict(capacity=2.0)).validate()  # 4 experts, top-2: the bound itself is accepted


@pytest.fixture()
def sixteen_gib(monkeypatch):
    """The memory check against a 16 GiB device, whatever this machine has."""
    from parallel import parallelize

    monkeypatch.setattr(parallelize, "device_memory_bytes", lambda device: 16 * 2**30)


def test_a_model_whose_experts_cannot_fit_is_refused_before_anything_is_written(tmp_path, capsys, sixteen_gib):
    import train

    run_dir = tmp_path / "run"
    code = train.main(["--config", "configs/tiny-moe.yaml", "--model.moe.experts=1000000",
                       f"--logging.run_dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    # 4 MoE layers x 10^6 experts x 3 x 128 x 64 weights, 4 bytes each
    assert err.startswith("config error: the model's 98.8B parameters (98.3B of them in 4 layers x "
                          "model.moe.experts=1000000 experts of width 64) need 368.1 GiB (each rank builds them "
                          "whole in fp32), more than the 16.0 GiB of cpu memory here; lower model.moe.experts"), err
    assert not run_dir.exists()


def test_the_memory_check_counts_a_sharded_share_when_built_on_meta(sixteen_gib):
    from parallel.parallelize import check_parameters_fit

    cpu = torch.device("cpu")
    cfg = load_config("configs/tiny-moe.yaml", ["--model.moe.experts=1000000"]).model  # 98.8B parameters
    with pytest.raises(ConfigError, match=r"need 368\.1 GiB \(each rank builds"):
        check_parameters_fit(cfg, cpu, 64, init_on_meta=False)
    check_parameters_fit(cfg, cpu, 64, init_on_meta=True)  # 2 bytes x 98.8B / 64 ranks: 2.9 GiB each
    with pytest.raises(ConfigError, match=r"need 23\.0 GiB \(a 1/8 share of them in 16-bit floats"):
        check_parameters_fit(cfg, cpu, 8, init_on_meta=True)
    check_parameters_fit(load_config("configs/tiny-moe.yaml").model, cpu, 1, init_on_meta=False)


def test_a_compiled_moe_block_compiles_once_and_trains_as_the_eager_one():
    # torch.compile'd blocks (train.compile): the routing's expert counts have a fixed length (no
    # graph break on their data-dependent shape), the per-expert loop runs eagerly (its row counts
    # come from the host, and a graph traced through them was recompiled for new counts at nearly
    # every step), and so does the router's bookkeeping (Python state that changes between forwards).
    # backend="eager": dynamo's graphs and guards alone, no code generated.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = GPT(moe_cfg(dict(aux_loss=0.01)), expert_backend="loop")
    compiled = GPT(moe_cfg(dict(aux_loss=0.01)), expert_backend="loop")
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.blocks.values():
        block.compile(backend="eager")
    for step in range(4):  # other tokens each step: other expert counts
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            losses = [model(x, x) for model in (eager, compiled)]
        torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=0)
        for loss in losses:
            loss.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-6, msg=name)
    assert not [reason for reason in counters["graph_break"] if "bincount" in reason]
    # The layer's window counted every forward, compiled or not.
    assert take_moe_metrics(moe_layers([compiled])) == take_moe_metrics(moe_layers([eager]))
