"""The Triton kernels at LLM-like shapes, and the same checks at small shapes, against the fp32 reference.

Each test runs at two scales. ``model-size`` needs CUDA (marked ``gpu``): rows of a real model's
width, a row wider than one block at the default block size, real vocabularies, q and k with
different head counts at a real head dim. ``small`` runs everywhere, compiled on a GPU and under
Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU),
with the block limits shrunk so that the same code paths (blocked rows, masked tails, several row
tiles) run at sizes the interpreter gets through quickly. Offsets beyond 2**31 elements and the
CUDA-only backend choice have no small form and stay GPU-only.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.registry import resolve_kernel_ops
from tests.unit.kernels.test_triton_kernels import (  # noqa: F401 (tk is a fixture)
    DEVICE,
    assert_matches_reference,
    randn,
    reference_rope_qk,
    targets_with_ignored,
    tk,
)

NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def scales(small, model_size, name: str = "") -> list:
    """The two scales of one case: small everywhere, model-size on CUDA only."""
    prefix = f"{name}-" if name else ""
    return [pytest.param(small, id=f"{prefix}small"),
            pytest.param(model_size, id=f"{prefix}model-size", marks=NEEDS_CUDA)]


def shrink(monkeypatch, module, **limits: int | None) -> None:
    """Lower a kernel module's block limits for a small case (None keeps the default)."""
    for name, value in limits.items():
        if value is not None:
            monkeypatch.setattr(module, name, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    *scales(((4, 40), None), ((2048, 4096), None), "one-block"),
    # rows wider than one block take the blocked loop: 100 > 32 here, 10000 > MAX_BLOCK_N on a GPU
    *scales(((3, 100), 32), ((300, 10000), None), "blocked"),
])
def test_layer_norm_and_rms_norm_at_model_widths(tk, monkeypatch, dtype, case):
    shape, max_block = case
    shrink(monkeypatch, tk["layer_norm"], MAX_BLOCK_N=max_block)
    shrink(monkeypatch, tk["rms_norm"], MAX_BLOCK_N=max_block)
    x = randn(*shape, dtype=dtype, scale=2.0, shift=3.0)
    w, b = randn(shape[-1], dtype=dtype, shift=1.0, seed=1), randn(shape[-1], dtype=dtype, seed=2)
    assert_matches_reference(tk["layer_norm"].layer_norm, reference.layer_norm, [x, w, b, 1e-5], [0, 1, 2])
    assert_matches_reference(tk["rms_norm"].rms_norm, reference.rms_norm, [x, w, 1e-6], [0, 1])


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("case", scales(
    # (x shape, h shape, layer-norm block limit, bias-gelu block limit)
    ((3, 48), (2, 5, 96), 16, 32),
    ((1024, 3072), (2, 512, 12288), None, None),
))
def test_layer_norm_gelu_and_bias_gelu(tk, monkeypatch, approximate, case):
    x_shape, h_shape, ln_block, gelu_block = case
    shrink(monkeypatch, tk["layer_norm"], MAX_BLOCK_N=ln_block)
    shrink(monkeypatch, tk["bias_gelu"], MAX_BLOCK_N=gelu_block, TILE_ELEMENTS=gelu_block and 2 * gelu_block)
    width = x_shape[-1]
    x = randn(*x_shape, dtype=torch.bfloat16, scale=2.0)
    w, b = randn(width, dtype=torch.bfloat16, shift=1.0, seed=1), randn(width, dtype=torch.bfloat16, seed=2)

    def ln_gelu(x, w, b):
        return tk["layer_norm"].layer_norm_gelu(x, w, b, 1e-5, approximate)

    def ln_gelu_ref(x, w, b):
        return reference.layer_norm_gelu(x, w, b, 1e-5, approximate)

    assert_matches_reference(ln_gelu, ln_gelu_ref, [x, w, b], [0, 1, 2])
    h, bias = randn(*h_shape, dtype=torch.bfloat16), randn(h_shape[-1], dtype=torch.bfloat16, seed=3)
    assert_matches_reference(tk["bias_gelu"].bias_gelu, reference.bias_gelu, [h, bias, approximate], [0, 1])


@pytest.mark.parametrize("case", scales(((2, 4, 2 * 40), 16), ((2, 512, 2 * 5504), None)))
def test_swiglu_on_chunks_of_a_fused_projection(tk, monkeypatch, case):
    shape, max_block = case
    shrink(monkeypatch, tk["swiglu"], MAX_BLOCK_N=max_block)

    def kernel(h):
        return tk["swiglu"].swiglu(*h.chunk(2, dim=-1))

    def ref(h):
        return reference.swiglu(*h.chunk(2, dim=-1))

    assert_matches_reference(kernel, ref, [randn(*shape, dtype=torch.bfloat16, scale=2.0)], [0])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", [
    # (rows, vocabulary, vocabulary block limit): the small vocabularies span several blocks with a
    # masked tail, as 50304 and 128256 do at the default block
    *scales((12, 600, 128), (1024, 50304, None), "gpt2"),
    *scales((8, 1100, 256), (256, 128256, None), "llama3"),
])
def test_cross_entropy_at_real_vocabularies(tk, monkeypatch, reduction, case):
    n_rows, vocab, max_block = case
    shrink(monkeypatch, tk["cross_entropy"], MAX_BLOCK_V=max_block)
    logits = randn(n_rows, vocab, dtype=torch.bfloat16, scale=3.0)
    targets = targets_with_ignored(n_rows, vocab, ignored_rows=range(0, n_rows, 7))

    def kernel(logits):
        return tk["cross_entropy"].cross_entropy(logits, targets, -100, reduction)

    def ref(logits):
        return reference.cross_entropy(logits, targets, -100, reduction)

    assert_matches_reference(kernel, ref, [logits], [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cross_entropy_beyond_int32_offsets(tk):
    """17k rows of a 128k vocabulary: element offsets pass 2**31, so row offsets must be 64-bit."""
    n_rows, vocab = 17000, 128256
    if torch.cuda.mem_get_info()[0] < 48 * 2**30:
        pytest.skip("needs a CUDA device with 48 GiB free")
    logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (n_rows,), device="cuda")
    loss = tk["cross_entropy"].cross_entropy(logits, targets, reduction="none")
    loss.sum().backward()
    tail = slice(n_rows - 4, n_rows)  # rows whose offsets are past 2**31
    expected_loss = reference.cross_entropy(logits.detach()[tail], targets[tail], reduction="none")
    expected_grad = torch.softmax(logits.detach()[tail].float(), -1)
    expected_grad[torch.arange(4), targets[tail]] -= 1
    torch.testing.assert_close(loss[tail], expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad[tail].float(), expected_grad, rtol=0, atol=2e-3)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", scales(
    # (batch, seq, q heads, kv heads, head dim, rope table length, head tile limit)
    (2, 6, 4, 2, 16, 8, 16),
    (2, 512, 16, 4, 128, 1024, None),
))
def test_rope_on_q_and_k_with_fewer_kv_heads(tk, monkeypatch, inplace, case):
    batch, seq, q_heads, kv_heads, head_dim, table, head_tile = case
    shrink(monkeypatch, tk["rope"], HEAD_TILE_ELEMENTS=head_tile)
    cos, sin = reference.rope_tables(table, head_dim, 10000.0, device=DEVICE)

    def attention_inputs(q, k, rope):
        q, k = q * 1.0, k * 1.0  # non-leaves, so they may be rotated in place
        q, k = rope(q, k)
        return torch.cat([q.flatten(2), k.flatten(2)], dim=-1)

    def kernel(q, k):
        return attention_inputs(q, k, lambda q, k: tk["rope"].apply_rope_qk(q, k, cos, sin, inplace=inplace))

    def ref(q, k):
        return attention_inputs(q, k, lambda q, k: reference_rope_qk(q, k, cos, sin))

    q = randn(batch, seq, q_heads, head_dim, dtype=torch.bfloat16)
    k = randn(batch, seq, kv_heads, head_dim, dtype=torch.bfloat16, seed=1)
    assert_matches_reference(kernel, ref, [q, k], [0, 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_backend_picks_triton_on_cuda(tk):
    ops, reason = resolve_kernel_ops("auto", torch.device("cuda"))
    assert ops.backend == "triton" and "auto" in reason
    x, w = randn(64, 4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16, seed=1)
    assert ops.layer_norm.unsupported_reason(x, w, None, 1e-5) is None
    assert "cpu" in ops.layer_norm.unsupported_reason(x.cpu(), w.cpu(), None, 1e-5)
