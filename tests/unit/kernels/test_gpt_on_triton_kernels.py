"""The GPT with kernels.backend=triton (interpreted on CPU) against the same GPT on the reference ops.

Every fused op the model uses is switched in: LayerNorm or RMSNorm, bias+GELU or SwiGLU, rotary
embeddings and the vocabulary cross-entropy. See tests/unit/kernels/test_triton_kernels.py for why TRITON_INTERPRET
is set at collection time on a machine without CUDA.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="needs the triton package (pip install triton)")

from common.measure import kernel_tolerance  # noqa: E402
from kernels.registry import REFERENCE_OPS, TRITON_OPS, resolve_kernel_ops  # noqa: E402
from model.config import ModelConfig, MoEConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_config(norm: str, mlp: str) -> ModelConfig:
    # 8 positions: the interpreter's cost grows with the rows the kernels run over, and 2 x 8 rows
    # still pass every kernel's row loop and the cross-entropy's ignored targets
    cfg = ModelConfig(
        vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=32, norm=norm, mlp=mlp, position="rope"
    )
    cfg.validate()
    return cfg


def twin_models(cfg: ModelConfig) -> tuple[GPT, GPT]:
    """(reference-ops GPT, triton-ops GPT) with identical weights, norms and biases perturbed so
    that every weight and bias path of the kernels carries a non-trivial value."""
    torch.manual_seed(0)
    reference_model = GPT(cfg, REFERENCE_OPS).to(DEVICE)
    with torch.no_grad():
        for p in reference_model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ops, reason = resolve_kernel_ops("triton", DEVICE)
    assert ops.backend == "triton", reason
    kernel_model = GPT(cfg, ops).to(DEVICE)
    kernel_model.load_state_dict(reference_model.state_dict())
    return reference_model, kernel_model


def batch(cfg: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=generator)
    targets[0, :3] = -100  # padding positions the loss ignores
    return idx.to(DEVICE), targets.to(DEVICE)


def loss_and_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_fp32_loss_and_grads_match(loss, grads: dict, ref_loss, ref_grads: dict) -> None:
    """fp32 throughout: only summation orders differ."""
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        scale = ref_grad.abs().max().item()
        err = (grads[name] - ref_grad).abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, f"{name}: max error {err:.3g} at gradient scale {scale:.3g}"


def assert_no_fallback(model: GPT) -> None:
    """Every op call went to its Triton kernel (a fallback would make the comparison vacuous)."""
    for name in TRITON_OPS:
        op = getattr(model.ops, name)
        assert not op.logged_reasons, f"{name} fell back to the reference: {op.logged_reasons}"


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_loss_and_every_gradient_match_the_reference_model(norm, mlp):
    cfg = tiny_config(norm, mlp)
    reference_model, kernel_model = twin_models(cfg)
    idx, targets = batch(cfg)
    ref_loss, ref_grads = loss_and_grads(reference_model, idx, targets)
    loss, grads = loss_and_grads(kernel_model, idx, targets)
    assert_no_fallback(kernel_model)
    assert_fp32_loss_and_grads_match(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_moe_model_routes_its_tokens_through_the_permute_kernels(capacity):
    """A MoE GPT (4 experts, top-2; dropless, and with capacity 1.0, which drops copies): loss and every
    gradient, the router's included, equal the reference model's, with both routing kernels called."""
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=1, n_head=2, d_model=32, mlp="swiglu", position="rope",
                      moe=MoEConfig(experts=4, top_k=2, d_ff=16, capacity=capacity))
    cfg.validate()
    reference_model, kernel_model = twin_models(cfg)
    calls = []
    for name in ("moe_permute", "moe_unpermute"):
        op = getattr(kernel_model.ops, name)
        op.kernel = (lambda kernel, name: lambda *a: calls.append(name) or kernel(*a))(op.kernel, name)
    idx, targets = batch(cfg)
    ref_loss, ref_grads = loss_and_grads(reference_model, idx, targets)
    loss, grads = loss_and_grads(kernel_model, idx, targets)
    assert calls == ["moe_permute", "moe_unpermute"]
    dropped = kernel_model.blocks["0"].mlp.stats.take_window()["dropped"].item()
    assert (dropped > 0) == (capacity > 0), dropped  # the capacity case drops copies: their rows stay zero
    assert_no_fallback(kernel_model)
    assert_fp32_loss_and_grads_match(loss, grads, ref_loss, ref_grads)


def test_bf16_model_error_is_within_twice_eager_bf16():
    """In bf16 the kernel model's loss may be off the fp32 loss by at most twice eager bf16's error."""
    cfg = tiny_config("rmsnorm", "swiglu")
    reference_model, kernel_model = twin_models(cfg)
    oracle_model = copy.deepcopy(reference_model)
    reference_model, kernel_model = reference_model.to(torch.bfloat16), kernel_model.to(torch.bfloat16)
    idx, targets = batch(cfg)
    with torch.no_grad():
        oracle = oracle_model(idx, targets).item()
        eager = reference_model(idx, targets).item()
        ours = kernel_model(idx, targets).item()
    assert_no_fallback(kernel_model)
    # the project's tolerance rule (common/measure.py), with one bf16 ulp of the loss as the floor
    assert abs(ours - oracle) <= kernel_tolerance(abs(eager - oracle), 2.0 ** -7 * abs(oracle))


def test_tiny_model_trains_with_every_kernel_switched_in():
    """AdamW steps on one batch: the kernel model follows the reference model's losses. Two steps (the
    interpreter takes seconds per step here): the second runs the kernels on weights updated from
    their own gradients."""
    cfg = tiny_config("layernorm", "gelu")
    reference_model, kernel_model = twin_models(cfg)
    idx, targets = batch(cfg)
    curves = []
    for model in (reference_model, kernel_model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            loss = model(idx, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(losses)
    reference_curve, kernel_curve = curves
    assert_no_fallback(kernel_model)
    assert kernel_curve[-1] < kernel_curve[0] - 0.1, kernel_curve
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(kernel_curve, reference_curve)), curves


@pytest.mark.timeout(240)
def test_torch_compile_around_the_triton_ops_matches_eager():
    """Under torch.compile the kernels run as registered custom ops inside the graph, still differentiable."""
    cfg = tiny_config("layernorm", "gelu")
    reference_model, kernel_model = twin_models(cfg)
    block = kernel_model.blocks["0"]
    rope = (kernel_model.rope_cos, kernel_model.rope_sin)
    x = torch.randn(2, cfg.max_seq_len, cfg.d_model, device=DEVICE, requires_grad=True)
    compiled = torch.compile(block)
    out = compiled(x, rope)
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    expected = reference_model.blocks["0"](x_ref, rope)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    assert_no_fallback(kernel_model)
