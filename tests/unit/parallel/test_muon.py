"""Muon (parallel/muon.py, built from the optim section by parallel/optim.py) in one process: against a
straightforward reference written here and against torch.optim.Muon with torch.optim.AdamW, which
parameters it steps, a peak learning rate of its own, exact resume, and bad keys as one line."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from common.errors import ConfigError
from model.config import ModelConfig, MoEConfig
from model.gpt import GPT
from parallel.distributed import DistContext
from parallel.muon import JORDAN_COEFFICIENTS, newton_schulz
from parallel.optim import MuonConfig, OptimConfig, build_optimizer, describe_split, muon_split
from parallel.step import set_lr
from training.build import build_from_config
from training.config import load_config

DENSE = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    tie_embeddings=False, mlp="swiglu", norm="rmsnorm", position="rope")
# Without biases: the key bias's gradient is zero up to rounding, which AdamW's normalised step turns
# into lr-sized noise once the two models differ in the last bit (the reference's arithmetic).
MOE = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=48, bias=False,
                  moe=MoEConfig(experts=4, top_k=2, shared_experts=1))


# --------------------------------------------------------------------------- the reference


def reference_orthogonalise(u: torch.Tensor, steps: int, abc) -> torch.Tensor:
    """The quintic Newton-Schulz map as written on paper, in fp64: X <- aX + b(XX^T)X + c(XX^T)^2 X."""
    a, b, c = abc
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return (x.T if tall else x).float()


class ReferenceMuonAdamW:
    """Muon on the hidden matrices, AdamW on the rest, one tensor at a time, from the formulas."""

    def __init__(self, named, cfg: OptimConfig):
        self.cfg, self.t = cfg, 0
        self.muon, self.rest = muon_split(named)
        self.state = {id(p): {} for _, p in named}

    @torch.no_grad()
    def step(self, lr: float) -> None:
        cfg, m = self.cfg, self.cfg.muon
        self.t += 1
        for _, p in self.muon:
            buf = self.state[id(p)].setdefault("m", torch.zeros_like(p))
            buf.mul_(m.momentum).add_(p.grad, alpha=1 - m.momentum)
            u = (1 - m.momentum) * p.grad + m.momentum * buf if m.nesterov else buf
            mats = [u] if p.ndim == 2 else list(u)  # an expert stack: each (in, out) expert apart
            fan_out, fan_in = (p.shape[0], p.shape[1]) if p.ndim == 2 else (p.shape[2], p.shape[1])
            scale = {"match_rms_adamw": 0.2 * math.sqrt(max(fan_out, fan_in)),
                     "original": math.sqrt(max(1, fan_out / fan_in)), "none": 1.0}[m.scale]
            o = torch.stack([reference_orthogonalise(x, m.ns_steps, m.ns_coefficients) for x in mats]).view_as(p)
            muon_lr = lr * (cfg.muon_lr / cfg.lr)
            p.mul_(1 - muon_lr * cfg.muon_weight_decay).sub_(muon_lr * scale * o)
        for _, p in self.rest:
            s = self.state[id(p)]
            m1, m2 = s.setdefault("m1", torch.zeros_like(p)), s.setdefault("m2", torch.zeros_like(p))
            m1.mul_(cfg.beta1).add_(p.grad, alpha=1 - cfg.beta1)
            m2.mul_(cfg.beta2).add_(p.grad * p.grad, alpha=1 - cfg.beta2)
            decay = cfg.weight_decay if p.ndim >= 2 else 0.0
            p.mul_(1 - lr * decay)
            denom = (m2 / (1 - cfg.beta2 ** self.t)).sqrt() + cfg.eps
            p.sub_(lr * (m1 / (1 - cfg.beta1 ** self.t)) / denom)


def _train_pair(model_cfg: ModelConfig, optim_cfg: OptimConfig, steps: int = 3, seed: int = 0):
    """The same model stepped by ``build_optimizer`` and by the reference, on the same batches."""
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    twin = copy.deepcopy(model)
    ours = build_optimizer(list(model.named_parameters()), optim_cfg, torch.device("cpu"))
    ref = ReferenceMuonAdamW(list(twin.named_parameters()), optim_cfg)
    for step in range(steps):
        tokens = torch.randint(0, model_cfg.vocab_size, (3, model_cfg.max_seq_len + 1),
                               generator=torch.Generator().manual_seed(step))
        for m in (model, twin):
            m.zero_grad()
            m(tokens[:, :-1], tokens[:, 1:]).backward()
        lr = optim_cfg.lr * (step + 1) / steps  # a changing schedule
        set_lr(ours, lr)
        ours.step()
        ref.step(lr)
    return model, twin


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------------- against the references


def test_newton_schulz_is_the_quintic_iteration_and_lands_the_singular_values_near_one():
    torch.manual_seed(0)
    for shape in ((24, 40), (40, 24)):
        u = torch.randn(shape)
        ours = newton_schulz(u, 5, JORDAN_COEFFICIENTS, torch.float32)
        torch.testing.assert_close(ours, reference_orthogonalise(u, 5, JORDAN_COEFFICIENTS), atol=1e-5, rtol=0)
        singular = torch.linalg.svdvals(ours)
        assert singular.min() > 0.6 and singular.max() < 1.25, singular  # Jordan's band, not exactly 1
    stack = torch.randn(3, 16, 24)  # an expert stack: each matrix on its own
    each = torch.stack([newton_schulz(x, 5, JORDAN_COEFFICIENTS, torch.float32) for x in stack])
    torch.testing.assert_close(newton_schulz(stack, 5, JORDAN_COEFFICIENTS, torch.float32), each, atol=1e-6, rtol=0)


@pytest.mark.parametrize("muon", [
    MuonConfig(ns_dtype="fp32"),
    MuonConfig(ns_dtype="fp32", nesterov=False, scale="original", momentum=0.9),
    MuonConfig(ns_dtype="fp32", scale="none", ns_steps=3, ns_coefficients=[2.0, -1.5, 0.5], lr=0.02,
               weight_decay=0.05),
], ids=["defaults", "plain_momentum_original_scale", "own_lr_and_coefficients"])
def test_muon_matches_the_reference_on_a_dense_model(muon):
    model, twin = _train_pair(DENSE, OptimConfig(name="muon", lr=3e-3, muon=muon))
    assert _max_difference(model, twin) < 1e-6


def test_expert_stacks_are_orthogonalised_per_expert():
    model, twin = _train_pair(MOE, OptimConfig(name="muon", lr=3e-3, muon=MuonConfig(ns_dtype="fp32")))
    assert _max_difference(model, twin) < 1e-6
    assert any(p.ndim == 3 for _, p in muon_split(list(model.named_parameters()))[0])


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
def test_muon_equals_torch_muon_with_torch_adamw_where_they_agree(scale):
    """torch.optim.Muon orthogonalises in bf16 and has no expert stacks or Nesterov-free default;
    with the same settings (bf16, Nesterov, a dense model) the two step bit-equal."""
    torch.manual_seed(0)
    cfg = OptimConfig(name="muon", lr=3e-3, muon=MuonConfig(scale=scale, ns_dtype="bf16"))
    model = GPT(DENSE)
    twin = copy.deepcopy(model)
    ours = build_optimizer(list(model.named_parameters()), cfg, torch.device("cpu"))
    matrices, rest = muon_split(list(twin.named_parameters()))
    torch_muon = torch.optim.Muon([p for _, p in matrices], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=0.95,
                                  nesterov=True, adjust_lr_fn=scale)
    torch_adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                                     {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0}],
                                    lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    for step in range(4):
        tokens = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(step))
        for m in (model, twin):
            m.zero_grad()
            m(tokens[:, :-1], tokens[:, 1:]).backward()
        ours.step()
        torch_muon.step()
        torch_adamw.step()
    assert _max_difference(model, twin) <= 1e-6


# --------------------------------------------------------------------------- what it steps, and how it says so


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw():
    model = GPT(dataclasses.replace(MOE, bias=True))
    matrices, rest = muon_split(list(model.named_parameters()))
    names = {n for n, _ in matrices}
    assert all(n.startswith("blocks.") for n in names)
    assert {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.w_up",
            "blocks.0.mlp.w_down", "blocks.0.mlp.shared.fc.weight"} <= names
    assert {n for n, _ in rest} >= {"tok_emb.weight", "pos_emb.weight", "blocks.0.mlp.router.weight",
                                    "blocks.0.norm1.weight", "norm_f.weight"}
    assert "blocks.0.attn.qkv.bias" in {n for n, _ in rest}
    assert all(p.ndim < 2 or "emb" in n or "router" in n for n, p in rest)
    line = describe_split(list(model.named_parameters()))
    assert f"muon on {len(matrices)} hidden matrices" in line and f"adamw on {len(rest)} tensors" in line
    assert "2 expert stacks" not in line and "expert stacks" in line and "MoE routers" in line
    assert "\n" not in line


def test_per_expert_biases_stay_on_adamw():
    """gpt-oss's expert biases are (E, out): 2-D, but one bias per expert, never a matrix to orthogonalise."""
    model = GPT(dataclasses.replace(MOE, bias=True, moe=dataclasses.replace(MOE.moe, bias=True)))
    matrices, rest = muon_split(list(model.named_parameters()))
    biases = {n for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("b_gate", "b_up", "b_down")}
    assert biases and biases <= {n for n, _ in rest}
    assert {n for n, _ in matrices} >= {"blocks.0.mlp.w_up", "blocks.0.mlp.w_down"}
    assert all(n.endswith(".weight") or n.rsplit(".", 1)[-1].startswith("w_") for n, _ in matrices)
    assert "biases" in describe_split(list(model.named_parameters()))


def test_a_muon_peak_of_its_own_follows_the_schedule_scaled():
    cfg = OptimConfig(name="muon", lr=1e-3, muon=MuonConfig(lr=0.02))
    optimizer = build_optimizer(list(GPT(DENSE).named_parameters()), cfg, torch.device("cpu"))
    set_lr(optimizer, 5e-4)  # half the peak: warm-up or decay
    muon_group, *adamw_groups = optimizer.param_groups
    assert muon_group["muon"] and muon_group["lr"] == pytest.approx(0.01)
    assert all(g["lr"] == 5e-4 for g in adamw_groups)


def test_a_muon_run_resumes_exactly_from_its_checkpoint(tmp_path):
    overrides = [f"--model.{k}={v}" for k, v in {"vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 4,
                                                   "d_model": 32}.items()]
    cfg = load_config(None, overrides + ["--optim.name=muon", "--optim.warmup_steps=1", "--train.micro_batch_size=2"])

    def batches(step):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        return iter([(tokens[:, :-1], tokens[:, 1:])])

    def run(engine, steps):
        losses = []
        for step in steps:
            loss, _ = engine.forward_backward_step(batches(step), 1)
            engine.optimizer_step(1e-3, loss)
            losses.append(float(loss))
        return losses

    engine = build_from_config(cfg, DistContext.single()).engine
    run(engine, range(2))
    engine.save(tmp_path, 0)
    after = run(engine, range(2, 5))
    fresh = build_from_config(cfg, DistContext.single()).engine
    fresh.load(tmp_path)
    assert any("momentum_buffer" in s for s in fresh.optimized_parts()[0].optimizer.state.values())
    assert run(fresh, range(2, 5)) == after


# --------------------------------------------------------------------------- bad keys, one line each


@pytest.mark.parametrize("overrides, message", [
    (["--optim.muon.momentum=0.9"], "optim.muon.momentum=0.9 has no effect with optim.name=adamw"),
    (["--optim.name=muon", "--optim.muon.momentum=1.0"], "optim.muon.momentum must be in [0, 1)"),
    (["--optim.name=muon", "--optim.muon.ns_steps=0"], "optim.muon.ns_steps must be between 1 and 99"),
    (["--optim.name=muon", "--optim.muon.ns_coefficients=[3.4,-4.7]"], "three finite numbers"),
    (["--optim.name=muon", "--optim.muon.scale=rms"], "optim.muon.scale='rms' is not valid"),
    (["--optim.name=muon", "--optim.muon.ns_dtype=fp16"], "optim.muon.ns_dtype='fp16' is not valid"),
    (["--optim.name=muon", "--optim.muon.lr=0"], "optim.muon.lr must be > 0"),
    (["--optim.name=muon", "--optim.muon.lr=10", "--optim.muon.weight_decay=0.5"], "must be < 1"),
    (["--optim.name=muon", "--optim.muon.qk_clip_tau=-1"], "optim.muon.qk_clip_tau must be > 0"),
    (["--optim.name=muon", "--optim.fused=on"], "optim.fused=on is AdamW's fused kernel"),
    (["--optim.name=sgd"], "optim.name='sgd' is not valid"),
    (["--optim.name=muon", "--optim.muon.beta=0.9"], "unknown key optim.muon.beta"),
    (["--optim.name=muon", "--parallel.strategy=zero2"], "flat 1-D partitions"),
    (["--optim.name=muon", "--model.layers=te"], "not verified on FP8 weight wrappers"),
    (["--optim.name=muon", "--model.moe.experts=4", "--parallel.tp=2", "--parallel.etp=2"],
     "Newton-Schulz needs each expert's matrix whole on one rank, and expert tensor parallelism splits it; set "
     "parallel.etp=1"),
    (["--optim.name=muon", "--optim.muon.qk_clip_tau=50", "--model.qk_norm=true"], "cannot lower the logits"),
    (["--optim.name=muon", "--optim.muon.qk_clip_tau=50", "--parallel.tp=2"], "one rank holds all heads"),
    (["--optim.name=muon", "--optim.muon.qk_clip_tau=50", "--precision.mode=fp16"], "skips steps inside"),
])
def test_bad_muon_keys_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert message in str(exc.value) and "\n" not in str(exc.value)
