"""Activation checkpointing policies: same numbers as no checkpointing, stable names, clear errors."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from model.config import RECOMPUTE_POLICIES, ModelConfig
from model.gpt import GPT
from model.recompute import (
    RecomputedModule,
    RecomputeError,
    apply_recompute,
    describe_recompute,
    recomputed_modules,
)

POLICIES = [p for p in RECOMPUTE_POLICIES if p != "none"]
B, T = 2, 32

# Two shapes of block: learned positions + LayerNorm + GELU on the reference attention (which
# stores the scores), and RoPE + RMSNorm + SwiGLU on SDPA (rope tables travel as a tuple argument).
VARIANTS = {
    "reference-gelu": (dict(), "reference"),
    "sdpa-rope-swiglu": (dict(position="rope", norm="rmsnorm", mlp="swiglu"), "sdpa"),
}


def tiny_config(**overrides) -> ModelConfig:
    settings = dict(vocab_size=256, max_seq_len=T, d_model=64, n_head=4, n_layer=4) | overrides
    cfg = ModelConfig(**settings)
    cfg.validate()
    return cfg


def batch(vocab: int = 256):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: GPT, seed: int = 7):
    """One forward/backward; the seed fixes the dropout masks of the forward."""
    idx, targets = batch()
    torch.manual_seed(seed)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def with_policy(base: GPT, policy: str, every_k: int = 2) -> GPT:
    model = copy.deepcopy(base)
    apply_recompute(model, policy, every_k)
    return model


def assert_same_step(expected, actual) -> None:
    # Recompute runs the same kernels on the same inputs, so on CPU the results are bit-identical.
    (loss0, grads0), (loss1, grads1) = expected, actual
    assert torch.equal(loss0, loss1), (loss0.item(), loss1.item())
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), f"{name}: max diff {(grads0[name] - grads1[name]).abs().max()}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_gives_the_same_loss_and_gradients_as_none(policy, variant):
    overrides, backend = VARIANTS[variant]
    torch.manual_seed(0)
    base = GPT(tiny_config(**overrides), attention_backend=backend)
    expected = loss_and_grads(with_policy(base, "none"))
    assert_same_step(expected, loss_and_grads(with_policy(base, policy)))


@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_replays_the_forward_dropout_masks(policy):
    torch.manual_seed(0)
    base = GPT(tiny_config(dropout=0.2), attention_backend="reference")
    expected = loss_and_grads(with_policy(base, "none"))
    assert_same_step(expected, loss_and_grads(with_policy(base, policy)))


@dataclass(frozen=True)
class RecomputeWithFreshRng:
    """Full recompute that does not restore the RNG state: a broken policy the check above must catch."""

    label: str = "fresh-rng"

    def __call__(self, forward, *args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def test_dropout_check_detects_a_recompute_that_draws_new_masks():
    torch.manual_seed(0)
    base = GPT(tiny_config(dropout=0.2), attention_backend="reference")
    expected = loss_and_grads(with_policy(base, "none"))
    broken = with_policy(base, "full")
    for block in broken.blocks.values():
        block.recompute_runner = RecomputeWithFreshRng()
    loss, grads = loss_and_grads(broken)
    assert torch.equal(loss, expected[0])  # the forward itself is unchanged...
    assert not torch.equal(grads["blocks.0.mlp.fc.weight"], expected[1]["blocks.0.mlp.fc.weight"])  # ...backward is not


def test_state_dict_keys_are_identical_and_load_across_policies():
    torch.manual_seed(0)
    base = GPT(tiny_config(), attention_backend="reference")
    keys = list(base.state_dict())
    names = [n for n, _ in base.named_parameters()]
    for policy in POLICIES:
        model = with_policy(base, policy)
        assert list(model.state_dict()) == keys, policy
        assert [n for n, _ in model.named_parameters()] == names, policy
    # A checkpoint written without checkpointing loads strictly into a fully checkpointed model, and back.
    full = with_policy(GPT(tiny_config(), attention_backend="reference"), "full")
    full.load_state_dict(base.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), base.state_dict().values()))
    plain = GPT(tiny_config(), attention_backend="reference")
    plain.load_state_dict(full.state_dict(), strict=True)


def test_each_policy_wraps_the_modules_it_names():
    base = GPT(tiny_config(), attention_backend="reference")
    assert recomputed_modules(with_policy(base, "none")) == {}
    assert recomputed_modules(with_policy(base, "full")) == {f"blocks.{i}": "full" for i in range(4)}
    assert recomputed_modules(with_policy(base, "selective")) == {f"blocks.{i}.attn.core": "selective" for i in range(4)}
    # every_k counts blocks from 1: the k-th, 2k-th, ... block is recomputed; k=1 is full.
    assert list(recomputed_modules(with_policy(base, "every_k", every_k=2))) == ["blocks.1", "blocks.3"]
    assert list(recomputed_modules(with_policy(base, "every_k", every_k=3))) == ["blocks.2"]
    assert len(recomputed_modules(with_policy(base, "every_k", every_k=1))) == 4
    assert set(recomputed_modules(with_policy(base, "op_selective")).values()) == {"op_selective"}
    offloaded = with_policy(base, "offload")
    assert set(recomputed_modules(offloaded).values()) == {"offload"}
    # The wrapped module keeps its type for isinstance checks, and the log line names what was done.
    assert isinstance(offloaded.blocks["0"], type(base.blocks["0"]))
    assert "offload on 4 modules" in describe_recompute(offloaded)
    assert describe_recompute(base) == "recompute: none (model.recompute)"


def test_bad_requests_fail_with_a_message_that_says_what_to_do():
    base = GPT(tiny_config(), attention_backend="reference")
    with pytest.raises(RecomputeError, match="choose one of none, selective"):
        apply_recompute(copy.deepcopy(base), "sometimes")
    with pytest.raises(RecomputeError, match="every_k must be >= 1"):
        apply_recompute(copy.deepcopy(base), "every_k", every_k=0)
    twice = with_policy(base, "full")
    with pytest.raises(RecomputeError, match="already applied"):
        apply_recompute(twice, "full")

    class BlocksWithoutAttentionCore(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])

    with pytest.raises(RecomputeError, match="use recompute=full"):
        apply_recompute(BlocksWithoutAttentionCore(), "selective")
    with pytest.raises(RecomputeError, match="before wrapping it"):
        apply_recompute(nn.Sequential(nn.Linear(4, 4)), "full")


def test_checkpointed_modules_deepcopy_and_share_one_generated_class():
    model = with_policy(GPT(tiny_config(), attention_backend="reference"), "full")
    clone = copy.deepcopy(model)
    assert type(clone.blocks["0"]) is type(model.blocks["0"]) is type(model.blocks["3"])
    assert isinstance(clone.blocks["0"], RecomputedModule)
    assert_same_step(loss_and_grads(model), loss_and_grads(clone))


@pytest.mark.parametrize("policy, attention, warned", [
    ("selective", "sdpa", True), ("selective", "reference", False), ("op_selective", "sdpa", False),
    ("none", "sdpa", False),
])
def test_selective_recompute_over_fused_attention_is_warned_at_build(policy, attention, warned):
    """The build path names the no-gain combination (SDPA keeps no s x s scores to drop) and the switch."""
    from parallel.distributed import DistContext
    from parallel.parallelize import build_training
    from training.config import load_config

    cfg = load_config("configs/tiny.yaml", ["--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=16",
                                            f"--model.recompute={policy}", f"--model.attention={attention}",
                                            "--train.device=cpu"])
    built = build_training(model_cfg=cfg.model, kernels_cfg=cfg.kernels, precision_cfg=cfg.precision,
                           parallel_cfg=cfg.parallel, optim_cfg=cfg.optim, ctx=DistContext.single(torch.device("cpu")), seed=0,
                           micro_batch_size=1, grad_accum_steps=1)
    lines = [w for w in built.warnings if "model.recompute=selective" in w]
    assert bool(lines) == warned, built.warnings
    if warned:
        assert "saves no memory" in lines[0] and "model.recompute=none" in lines[0]
