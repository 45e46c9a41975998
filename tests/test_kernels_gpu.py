"""The compiled Triton kernels on CUDA at LLM-like shapes, against the fp32 reference.

tests/test_kernels.py runs the same checks at small shapes (interpreted on CPU, compiled on a
GPU); these add the shapes only a GPU can afford: rows of a real model's width, a row wider than
one block at the default block size, real vocabularies, and offsets beyond 2**31 elements.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.registry import resolve_kernel_ops
from tests.test_kernels import (  # noqa: F401 (tk is a fixture)
    assert_matches_reference,
    randn,
    reference_rope_qk,
    targets_with_ignored,
    tk,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2048, 4096), (300, 10000)])  # 10000 > MAX_BLOCK_N: the blocked path
def test_layer_norm_and_rms_norm_at_model_widths(tk, dtype, shape):
    x = randn(*shape, dtype=dtype, scale=2.0, shift=3.0)
    w, b = randn(shape[-1], dtype=dtype, shift=1.0, seed=1), randn(shape[-1], dtype=dtype, seed=2)
    assert_matches_reference(tk["layer_norm"].layer_norm, reference.layer_norm, [x, w, b, 1e-5], [0, 1, 2])
    assert_matches_reference(tk["rms_norm"].rms_norm, reference.rms_norm, [x, w, 1e-6], [0, 1])


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_layer_norm_gelu_and_bias_gelu(tk, approximate):
    x = randn(1024, 3072, dtype=torch.bfloat16, scale=2.0)
    w, b = randn(3072, dtype=torch.bfloat16, shift=1.0, seed=1), randn(3072, dtype=torch.bfloat16, seed=2)

    def ln_gelu(x, w, b):
        return tk["layer_norm"].layer_norm_gelu(x, w, b, 1e-5, approximate)

    def ln_gelu_ref(x, w, b):
        return reference.layer_norm_gelu(x, w, b, 1e-5, approximate)

    assert_matches_reference(ln_gelu, ln_gelu_ref, [x, w, b], [0, 1, 2])
    h, bias = randn(2, 512, 12288, dtype=torch.bfloat16), randn(12288, dtype=torch.bfloat16, seed=3)
    assert_matches_reference(tk["bias_gelu"].bias_gelu, reference.bias_gelu, [h, bias, approximate], [0, 1])


def test_swiglu_on_chunks_of_a_fused_projection(tk):
    def kernel(h):
        return tk["swiglu"].swiglu(*h.chunk(2, dim=-1))

    def ref(h):
        return reference.swiglu(*h.chunk(2, dim=-1))

    assert_matches_reference(kernel, ref, [randn(2, 512, 2 * 5504, dtype=torch.bfloat16, scale=2.0)], [0])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n_rows,vocab", [(1024, 50304), (256, 128256)])
def test_cross_entropy_at_real_vocabularies(tk, reduction, n_rows, vocab):
    logits = randn(n_rows, vocab, dtype=torch.bfloat16, scale=3.0)
    targets = targets_with_ignored(n_rows, vocab, ignored_rows=range(0, n_rows, 7))

    def kernel(logits):
        return tk["cross_entropy"].cross_entropy(logits, targets, -100, reduction)

    def ref(logits):
        return reference.cross_entropy(logits, targets, -100, reduction)

    assert_matches_reference(kernel, ref, [logits], [0])


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
def test_rope_on_q_and_k_with_fewer_kv_heads(tk, inplace):
    cos, sin = reference.rope_tables(1024, 128, 10000.0, device="cuda")

    def attention_inputs(q, k, rope):
        q, k = q * 1.0, k * 1.0  # non-leaves, so they may be rotated in place
        q, k = rope(q, k)
        return torch.cat([q.flatten(2), k.flatten(2)], dim=-1)

    def kernel(q, k):
        return attention_inputs(q, k, lambda q, k: tk["rope"].apply_rope_qk(q, k, cos, sin, inplace=inplace))

    def ref(q, k):
        return attention_inputs(q, k, lambda q, k: reference_rope_qk(q, k, cos, sin))

    q, k = randn(2, 512, 16, 128, dtype=torch.bfloat16), randn(2, 512, 4, 128, dtype=torch.bfloat16, seed=1)
    assert_matches_reference(kernel, ref, [q, k], [0, 1])


def test_auto_backend_picks_triton_on_cuda(tk):
    ops, reason = resolve_kernel_ops("auto", torch.device("cuda"))
    assert ops.backend == "triton" and "auto" in reason
    x, w = randn(64, 4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16, seed=1)
    assert ops.layer_norm.unsupported_reason(x, w, None, 1e-5) is None
    assert "cpu" in ops.layer_norm.unsupported_reason(x.cpu(), w.cpu(), None, 1e-5)
