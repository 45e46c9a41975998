"""The optimizer step the torch engines share (parallel/step.py), in one process: clipping as
torch's ``clip_grad_norm_`` does it, a parameter copy counted once in the norm and stepped like
its original, the host-side skip of a non-finite step; and a one-process checkpoint put under the
names torch's distributed state dict uses (what sharded layouts load it by)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parallel.checkpoint import full_state_by_name
from parallel.distributed import DistContext
from parallel.optim import OptimConfig
from parallel.precision import PrecisionConfig, precision_policy
from parallel.step import OptimizedPart, OptimizerStep, clip_grads_
from training.build import build_from_config
from training.config import load_config

FP32 = precision_policy(PrecisionConfig(mode="fp32"), "none")


def test_clipping_matches_clip_grad_norm_bit_for_bit():
    torch.manual_seed(0)
    grads = [torch.randn(7, 5) * 3, torch.randn(5), torch.randn(2, 3, 4)]
    expected = [g.clone() for g in grads]
    params = [nn.Parameter(torch.zeros_like(g)) for g in expected]
    for p, g in zip(params, expected):
        p.grad = g
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
    ours = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    clip_grads_(grads, 0.5, ours)
    assert torch.equal(ours, norm)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, params))
    assert ours > 0.5  # the clip did scale them


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def test_a_copy_counts_once_in_the_norm_and_steps_bit_equal_to_its_original():
    """Two parts as a pipeline's first and last stage: the same weight in each, both with the
    whole (summed) gradient. The step equals one module holding the weight once."""
    torch.manual_seed(0)
    weight, bias, grad_w, grad_b = torch.randn(4, 3), torch.randn(4), torch.randn(4, 3), torch.randn(4)
    optim = OptimConfig(grad_clip=0.1, lr=1e-2)
    first, last, whole = _linear(weight, bias), _linear(weight), _linear(weight, bias)
    parts = [OptimizedPart.build(m, FP32, optim, torch.device("cpu")) for m in (first, last)]
    pipeline = OptimizerStep(parts, grad_clip=optim.grad_clip, device=torch.device("cpu"),
                             counted_once=(last.weight,))
    single = OptimizerStep([OptimizedPart.build(whole, FP32, optim, torch.device("cpu"))], grad_clip=optim.grad_clip,
                           device=torch.device("cpu"))
    for step in range(3):
        first.weight.grad, first.bias.grad, last.weight.grad = grad_w.clone(), grad_b.clone(), grad_w.clone()
        whole.weight.grad, whole.bias.grad = grad_w.clone(), grad_b.clone()
        ours, reference = pipeline(optim.lr, torch.tensor(1.0)), single(optim.lr, torch.tensor(1.0))
        assert torch.equal(ours.grad_norm, reference.grad_norm)  # the copy is not counted twice
        assert ours.skipped is False
    assert torch.equal(first.weight, last.weight) and torch.equal(first.weight, whole.weight)
    assert torch.equal(first.bias, whole.bias)
    assert not torch.equal(first.weight, weight)


def test_a_non_finite_gradient_skips_the_step_read_on_the_host():
    layer = _linear(torch.ones(2, 2))
    part = OptimizedPart.build(layer, FP32, OptimConfig(), torch.device("cpu"))
    layer.weight.grad = torch.tensor([[1.0, float("nan")], [0.0, 0.0]])
    result = OptimizerStep([part], grad_clip=1.0, device=torch.device("cpu"))(1e-2, torch.tensor(1.0))
    assert result.skipped is True
    assert torch.equal(layer.weight, torch.ones(2, 2)) and not part.optimizer.state
    assert layer.weight.grad is None  # the gradients are cleared for the next step all the same


def _trained_engine(mode: str, *extra: str):
    cfg = load_config(None, ["--model.vocab_size=64", "--model.max_seq_len=8", "--model.n_layer=2",
                             "--model.n_head=2", "--model.d_model=16", f"--precision.mode={mode}",
                             "--optim.warmup_steps=1", "--train.max_steps=2", *extra])
    engine = build_from_config(cfg, DistContext.single()).engine
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = engine.forward_backward(tokens[:, :-1], tokens[:, 1:], True, 1)
    engine.optimizer_step(1e-2, loss)
    return engine


@pytest.mark.parametrize("mup", [[], ["--model.mup=true", "--model.mup_base_width=8"]], ids=["sp", "mup"])
def test_a_one_process_checkpoint_is_named_as_torchs_distributed_state_dict_names_it(mup):
    """With µP too, whose AdamW holds more param groups (one per LR multiplier)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    engine = _trained_engine("fp32", *mup)  # tied embeddings: the head's weight is the embedding's
    ours = full_state_by_name(engine.state_dict())
    [part] = engine.optimized_parts()
    model, optim = get_state_dict(engine.module(), part.optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert set(ours["model"]) == set(model) and set(ours["optimizer"]) == set(optim)
    for key, value in model.items():
        assert torch.equal(ours["model"][key], value), key
    for key, value in optim.items():
        assert (torch.equal(ours["optimizer"][key], value) if isinstance(value, torch.Tensor)
                else ours["optimizer"][key] == value), key


def test_a_one_process_checkpoint_with_fp32_masters_hands_on_the_masters():
    engine = _trained_engine("bf16_master")
    ours = full_state_by_name(engine.state_dict())
    [part] = engine.optimized_parts()
    names = [n for n, _ in engine.module().named_parameters()]
    for name, master in zip(names, part.masters.masters):
        assert ours["model"][name].dtype == torch.float32 and torch.equal(ours["model"][name], master), name
    assert torch.equal(ours["model"]["lm_head.weight"], ours["model"]["tok_emb.weight"])
    # the masters' AdamW state under their parameters' names
    exp_avg = part.optimizer.state[part.masters.masters[0]]["exp_avg"]
    assert torch.equal(ours["optimizer"][f"state.{names[0]}.exp_avg"], exp_avg)


@pytest.mark.parametrize("damage", ["drop_param", "wrong_shape"])
def test_a_one_process_checkpoint_that_does_not_fit_its_model_is_one_line(damage):
    from common.errors import CheckpointError

    state = _trained_engine("fp32").state_dict()
    if damage == "drop_param":
        state["optimizer"]["param_groups"][0]["params"].pop()
    else:
        first = state["optimizer"]["param_groups"][0]["params"][0]
        state["optimizer"]["state"][first]["exp_avg"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as info:
        full_state_by_name(state)
    assert "\n" not in str(info.value)
