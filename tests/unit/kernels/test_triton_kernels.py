"""Every Triton kernel's forward and gradients against kernels/reference.py, and the registry.

On a machine without CUDA the kernels run in Triton's interpreter. Triton reads TRITON_INTERPRET
once, when triton.language is first imported (``import torch._dynamo`` does that too), so it is
set here at collection time, before any test runs, and stays set for the session: on a machine
without CUDA, interpreting is the only way Triton runs at all, and torch.compile's CPU backend
does not use Triton. (tests/conftest.py should set it too, before any module is collected.) With
CUDA the kernels are compiled and the same tests run on the GPU.

Tolerance (flash-attention's idiom): the kernel's error against an fp32 oracle may be at most
twice eager PyTorch's error in the same precision, plus a floor for the output dtype:
- float32 outputs: 1e-5 * (1 + max|oracle|) (only the summation order differs);
- bfloat16 / float16 outputs: half an ulp at max|oracle| compiled; one ulp in the interpreter,
  which truncates fp32 -> bf16 casts where the GPU rounds to nearest (up to one ulp instead of
  half: measured kernel errors reach 0.9999 ulp there).
The oracle is the reference run in fp32 on the same (already rounded) inputs and output gradient.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from analysis import kernel_bench
from common.errors import ConfigError
from common.measure import check_against_fp32
from common.report import read_results, rows_path
from kernels import reference
from kernels.registry import REFERENCE_OPS, KernelWithFallback, resolve_kernel_ops
from tools import bench_kernels

pytest.importorskip("triton", reason="needs the triton package (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOW = torch.bfloat16
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def tk():
    """The Triton op modules by name: interpreted on CPU, compiled on CUDA."""
    from kernels.triton import load_op_modules

    return load_op_modules()


# ---------------------------------------------------------------------------------------------
# The comparison every op test uses (also imported by the GPU and model-level kernel tests): the
# project's one tolerance rule, common/measure.py's check_against_fp32, which tools/bench_kernels.py
# applies too. On CPU the kernels run in Triton's interpreter.


def assert_matches_reference(kernel_fn, reference_fn, args: list, grad_positions: list[int], seed: int = 0):
    """Kernel vs reference in the args' own dtypes, both measured against the fp32 reference."""
    check = check_against_fp32(kernel_fn, reference_fn, args, grad_positions, interpreted=DEVICE.type == "cpu",
                               seed=seed)
    assert check.ok, "; ".join(check.failures())


def randn(*shape, dtype=torch.float32, scale=1.0, shift=0.0, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale + shift).to(device=DEVICE, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Norms. Shapes: one row, a width that is no power of two, N-D; block=32 forces the blocked loop.

NORM_SHAPES = [(1, 7), (5, 100), (2, 3, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("max_block", [None, 32])
@pytest.mark.parametrize("has_bias", [True, False])
def test_layer_norm(tk, monkeypatch, dtype, shape, max_block, has_bias):
    if max_block:
        monkeypatch.setattr(tk["layer_norm"], "MAX_BLOCK_N", max_block)
    width = shape[-1]
    # A mean far from zero is where unmasked padding lanes would corrupt the variance.
    x = randn(*shape, dtype=dtype, scale=2.0, shift=5.0)
    w = randn(width, dtype=dtype, shift=1.0, seed=1)
    b = randn(width, dtype=dtype, seed=2) if has_bias else None
    positions = [0, 1, 2] if has_bias else [0, 1]
    assert_matches_reference(tk["layer_norm"].layer_norm, reference.layer_norm, [x, w, b, 1e-5], positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("max_block", [None, 32])
def test_layer_norm_gelu(tk, monkeypatch, dtype, approximate, max_block):
    if max_block:
        monkeypatch.setattr(tk["layer_norm"], "MAX_BLOCK_N", max_block)
    x = randn(3, 70, dtype=dtype, scale=3.0, shift=-2.0)
    w, b = randn(70, dtype=dtype, shift=1.0, seed=1), randn(70, dtype=dtype, seed=2)

    def kernel(x, w, b):
        return tk["layer_norm"].layer_norm_gelu(x, w, b, 1e-5, approximate)

    def ref(x, w, b):
        return reference.layer_norm_gelu(x, w, b, 1e-5, approximate)

    assert_matches_reference(kernel, ref, [x, w, b], [0, 1, 2])


def test_layer_norm_mixed_dtypes_and_strided_input(tk):
    """bf16 activations with fp32 weights (master weights), read through a transposed view."""
    x = randn(24, 6, dtype=torch.bfloat16, shift=3.0).t()  # (6, 24), not contiguous
    w, b = randn(24, shift=1.0, seed=1), randn(24, seed=2)
    assert_matches_reference(tk["layer_norm"].layer_norm, reference.layer_norm, [x, w, b, 1e-5], [0, 1, 2])


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("max_block", [None, 32])
def test_rms_norm(tk, monkeypatch, dtype, shape, max_block):
    if max_block:
        monkeypatch.setattr(tk["rms_norm"], "MAX_BLOCK_N", max_block)
    x = randn(*shape, dtype=dtype, scale=2.0, shift=1.0)
    w = randn(shape[-1], dtype=dtype, shift=1.0, seed=1)
    assert_matches_reference(tk["rms_norm"].rms_norm, reference.rms_norm, [x, w, 1e-6], [0, 1])


# ---------------------------------------------------------------------------------------------
# Elementwise: bias + GELU and SwiGLU.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (5, 100), (2, 3, 40)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_bias_gelu(tk, dtype, shape, approximate, has_bias):
    x = randn(*shape, dtype=dtype, scale=2.0)
    b = randn(shape[-1], dtype=dtype, seed=1) if has_bias else None

    def kernel(x, b):
        return tk["bias_gelu"].bias_gelu(x, b, approximate)

    def ref(x, b):
        return reference.bias_gelu(x, b, approximate)

    assert_matches_reference(kernel, ref, [x, b], [0, 1] if has_bias else [0])


def test_bias_gelu_wider_than_a_block_with_many_row_groups(tk, monkeypatch):
    monkeypatch.setattr(tk["bias_gelu"], "MAX_BLOCK_N", 32)
    monkeypatch.setattr(tk["bias_gelu"], "TILE_ELEMENTS", 64)  # 2-row tiles: several tiles per group
    x, b = randn(13, 75, scale=2.0), randn(75, seed=1)
    assert_matches_reference(tk["bias_gelu"].bias_gelu, reference.bias_gelu, [x, b, "tanh"], [0, 1])


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("shape", [(1, 7), (5, 100), (2, 3, 40)])
def test_swiglu(tk, dtype, shape):
    gate, up = randn(*shape, dtype=dtype, scale=2.0), randn(*shape, dtype=dtype, seed=1)
    assert_matches_reference(tk["swiglu"].swiglu, reference.swiglu, [gate, up], [0, 1])


def test_swiglu_on_chunks_of_one_projection(tk, monkeypatch):
    """gate and up as the two strided halves of one (B, T, 2C) tensor, the usual fused-MLP layout."""
    monkeypatch.setattr(tk["swiglu"], "MAX_BLOCK_N", 16)

    def kernel(h):
        return tk["swiglu"].swiglu(*h.chunk(2, dim=-1))

    def ref(h):
        return reference.swiglu(*h.chunk(2, dim=-1))

    assert_matches_reference(kernel, ref, [randn(2, 3, 2 * 37, dtype=torch.bfloat16)], [0])


# ---------------------------------------------------------------------------------------------
# Cross-entropy over the vocabulary.


def targets_with_ignored(n_rows: int, vocab: int, ignored_rows=(), ignore_index=-100, seed=3):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    targets = torch.randint(0, vocab, (n_rows,), generator=generator)
    targets[list(ignored_rows)] = ignore_index
    return targets.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows,vocab,ignored", [(1, 7, ()), (9, 100, (2, 5)), (4, 33, (0,))])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("max_block", [None, 16])
def test_cross_entropy(tk, monkeypatch, dtype, n_rows, vocab, ignored, reduction, max_block):
    if max_block:
        monkeypatch.setattr(tk["cross_entropy"], "MAX_BLOCK_V", max_block)
    logits = randn(n_rows, vocab, dtype=dtype, scale=4.0, shift=10.0)  # large logits test the max-shift
    targets = targets_with_ignored(n_rows, vocab, ignored)

    def kernel(logits):
        return tk["cross_entropy"].cross_entropy(logits, targets, -100, reduction)

    def ref(logits):
        return reference.cross_entropy(logits, targets, -100, reduction)

    assert_matches_reference(kernel, ref, [logits], [0])


def test_cross_entropy_gradient_stays_in_logits_dtype_and_ignored_rows_get_zero(tk):
    logits = randn(6, 50, dtype=torch.bfloat16, scale=3.0).requires_grad_()
    targets = targets_with_ignored(6, 50, ignored_rows=(1, 4), ignore_index=7)
    loss = tk["cross_entropy"].cross_entropy(logits, targets, ignore_index=7)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.equal(logits.grad[[1, 4]], torch.zeros_like(logits.grad[[1, 4]]))
    expected = reference.cross_entropy(logits.detach(), targets, ignore_index=7)
    assert abs(loss.item() - expected.item()) < 1e-5 * (1 + abs(expected.item()))


def test_cross_entropy_with_every_row_ignored_matches_torch(tk):
    """torch's mean over zero counted rows is NaN with a zero gradient; so is ours."""
    logits = randn(3, 10).requires_grad_()
    targets = torch.full((3,), -100, device=DEVICE)
    loss = tk["cross_entropy"].cross_entropy(logits, targets)
    loss.backward()
    assert torch.isnan(reference.cross_entropy(logits.detach(), targets)) and torch.isnan(loss)
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_cross_entropy_target_out_of_range_is_nan_not_a_number(tk):
    logits = randn(2, 10)
    loss = tk["cross_entropy"].cross_entropy(logits, torch.tensor([3, 10], device=DEVICE), reduction="none")
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1])


# ---------------------------------------------------------------------------------------------
# Rotary embeddings.


def reference_rope_qk(q, k, cos, sin):
    return reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 8), (1, 4, 5, 12)])
@pytest.mark.parametrize("head_tile", [None, 16])  # 16 elements: 2 heads per program, last block masked
def test_apply_rope(tk, monkeypatch, dtype, shape, head_tile):
    if head_tile:
        monkeypatch.setattr(tk["rope"], "HEAD_TILE_ELEMENTS", head_tile)
    cos, sin = reference.rope_tables(shape[1] + 3, shape[3], 10000.0, device=DEVICE)  # longer table than T

    def kernel(x):
        return tk["rope"].apply_rope(x, cos, sin)

    def ref(x):
        return reference.apply_rope(x, cos, sin)

    assert_matches_reference(kernel, ref, [randn(*shape, dtype=dtype, scale=3.0)], [0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_in_place_on_q_and_k_views_of_a_fused_qkv(tk, dtype):
    """q and k sliced from one (B, T, 3, H, D) projection, rotated in place through their strides."""
    batch, seq, heads, head_dim = 2, 6, 3, 10
    cos, sin = reference.rope_tables(seq, head_dim, 10000.0, device=DEVICE)

    def attention_inputs(qkv, rope):
        qkv = qkv * 1.0  # a non-leaf, as a linear layer's output is
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # select: views autograd lets us modify in place
        q, k = rope(q, k)
        return torch.cat([q, k, v], dim=-1)

    def kernel(qkv):
        return attention_inputs(qkv, lambda q, k: tk["rope"].apply_rope_qk(q, k, cos, sin, inplace=True))

    def ref(qkv):
        return attention_inputs(qkv, lambda q, k: reference_rope_qk(q, k, cos, sin))

    qkv = randn(batch, seq, 3, heads, head_dim, dtype=dtype, scale=2.0)
    assert_matches_reference(kernel, ref, [qkv], [0])


def test_apply_rope_strided_input_out_of_place(tk):
    """x as a transposed (B, H, T, D) -> (B, T, H, D) view is read through its strides, not copied."""
    cos, sin = reference.rope_tables(7, 16, 500.0, device=DEVICE)

    def kernel(x):
        return tk["rope"].apply_rope(x.transpose(1, 2), cos, sin)

    def ref(x):
        return reference.apply_rope(x.transpose(1, 2), cos, sin)

    assert_matches_reference(kernel, ref, [randn(2, 4, 7, 16, dtype=torch.bfloat16)], [0])


# ---------------------------------------------------------------------------------------------
# MoE token routing: 13 tokens (no power of two), top-2 of 4 experts, 40 columns (block=16 forces the
# column loop). "dropped": every fifth kept copy removed, as a capacity limit does, so some tokens
# keep one copy and token 0 none (its output row must be zero, its gradient zero).


def routing_slots(n_tokens: int, top_k: int, n_experts: int, dropped: bool) -> torch.Tensor:
    """Flat (token, choice) slots t*k + j sorted by expert, as model/moe.py's permute keeps them."""
    scores = torch.rand(n_tokens, n_experts, generator=torch.Generator().manual_seed(4))
    slots = torch.argsort(scores.topk(top_k, dim=-1).indices.flatten(), stable=True)
    if dropped:
        keep = (torch.arange(slots.numel()) % 5 != 3) & (slots // top_k != 0)
        slots = slots[keep]
    return slots.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropped", [False, True])
def test_moe_permute(tk, monkeypatch, dtype, dropped):
    monkeypatch.setattr(tk["moe_permute"], "MAX_BLOCK_N", 16)
    slots = routing_slots(13, 2, 4, dropped)
    assert_matches_reference(lambda x: tk["moe_permute"].moe_permute(x, slots, 2),
                             lambda x: reference.moe_permute(x, slots, 2), [randn(13, 40, dtype=dtype)], [0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropped", [False, True])
def test_moe_unpermute(tk, monkeypatch, dtype, dropped):
    """Rows in the model's dtype, routing weights in fp32 (as the router makes them): both gradients."""
    monkeypatch.setattr(tk["moe_permute"], "MAX_BLOCK_N", 16)
    slots = routing_slots(13, 2, 4, dropped)
    weights = torch.rand(13, 2, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert_matches_reference(tk["moe_permute"].moe_unpermute, reference.moe_unpermute,
                             [randn(slots.numel(), 40, dtype=dtype), slots, weights], [0, 2])


def test_moe_permute_then_unpermute_returns_each_kept_token_times_its_weights(tk):
    """The round trip by hand: a token comes back times the sum of its kept copies' weights; its
    gradient is the sum of its copies' weights too (token 0, all copies dropped, gets zero)."""
    slots = routing_slots(13, 2, 4, dropped=True)
    x = randn(13, 40).requires_grad_()
    weights = torch.rand(13, 2, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kept = torch.zeros(26, device=DEVICE).index_fill(0, slots, 1.0).view(13, 2)
    factor = (weights * kept).sum(-1, keepdim=True)
    out = tk["moe_permute"].moe_unpermute(tk["moe_permute"].moe_permute(x, slots, 2), slots, weights)
    torch.testing.assert_close(out, x.detach() * factor, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(x.grad, factor.expand(13, 40), rtol=1e-6, atol=1e-6)
    assert factor[0].item() == 0 and 0 < kept.sum() < 26


# ---------------------------------------------------------------------------------------------
# Registry: the choice per backend and device, and per-call fallbacks.


def test_registry_torch_and_auto_on_cpu_give_the_reference():
    ops, reason = resolve_kernel_ops("torch", torch.device("cpu"))
    assert ops is REFERENCE_OPS and "kernels.backend=torch" in reason
    ops, reason = resolve_kernel_ops("auto", torch.device("cpu"))
    assert ops is REFERENCE_OPS and "cpu" in reason and "TRITON_INTERPRET=1" in reason


def test_registry_rejects_unknown_backend():
    with pytest.raises(ConfigError, match="auto"):
        resolve_kernel_ops("cuda", torch.device("cpu"))


def test_registry_triton_on_cpu_needs_the_interpreter(tk, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        resolve_kernel_ops("triton", torch.device("cpu"))


def test_registry_without_triton(monkeypatch):
    monkeypatch.setattr("kernels.registry.triton_version", lambda: None)
    ops, reason = resolve_kernel_ops("auto", torch.device("cuda"))
    assert ops is REFERENCE_OPS and "does not import" in reason
    with pytest.raises(ConfigError, match="pip install triton"):
        resolve_kernel_ops("triton", torch.device("cuda"))


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_registry_gives_triton_ops(tk, backend):
    if backend == "auto" and DEVICE.type != "cuda":
        pytest.skip("needs a CUDA device (auto picks Triton only on CUDA)")
    ops, reason = resolve_kernel_ops(backend, DEVICE)
    assert ops.backend == "triton" and "triton" in reason
    for name in ("layer_norm", "layer_norm_gelu", "rms_norm", "bias_gelu", "swiglu", "cross_entropy", "apply_rope",
                 "moe_permute", "moe_unpermute"):
        op = getattr(ops, name)
        assert isinstance(op, KernelWithFallback) and op.fallback is getattr(reference, name)
    x, w = randn(4, 16), randn(16, seed=1)
    assert ops.rms_norm.unsupported_reason(x, w, 1e-6) is None
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_fallback_is_logged_once_per_reason_and_gives_the_reference_answer(tk, caplog):
    ops, _ = resolve_kernel_ops("triton", DEVICE)
    x = randn(3, 8).double().requires_grad_()
    w = randn(8, seed=1).double()
    with caplog.at_level(logging.WARNING, logger="kernels.registry"):
        for _ in range(2):
            y = ops.layer_norm(x, w, None, 1e-5)
    assert torch.equal(y, reference.layer_norm(x, w, None, 1e-5))
    messages = [r.getMessage() for r in caplog.records if "layer_norm falls back" in r.getMessage()]
    assert len(messages) == 1 and "torch.float64" in messages[0]
    y.sum().backward()  # the fallback is differentiable like the reference
    assert x.grad is not None


@pytest.mark.parametrize(
    "op,args,reason_part",
    [
        ("apply_rope", lambda: (randn(1, 2, 1, 5), randn(2, 2), randn(2, 2)), "head_dim=5"),
        ("apply_rope", lambda: (randn(1, 4, 1, 4), randn(2, 2), randn(2, 2)), "cos has shape"),
        ("cross_entropy", lambda: (randn(3, 5), randn(3, 5).softmax(-1)), "class indices"),
        ("cross_entropy", lambda: (randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long, device=DEVICE)), "(N, V)"),
        ("swiglu", lambda: (randn(2, 4), randn(1, 4)), "no broadcasting"),
        ("bias_gelu", lambda: (randn(2, 4), None, "sigmoid"), "approximate='sigmoid'"),
        ("layer_norm", lambda: (randn(2, 4), randn(5), None, 1e-5), "does not match"),
        ("moe_permute", lambda: (randn(2, 3, 4), torch.arange(4, device=DEVICE), 2), "token rows"),
        ("moe_permute", lambda: (randn(3, 4), torch.arange(4, device=DEVICE).int(), 2), "int64"),
        ("moe_unpermute", lambda: (randn(3, 4), torch.arange(4, device=DEVICE), randn(2, 2)), "3 rows for 4 slots"),
        ("moe_unpermute", lambda: (randn(0, 4), torch.arange(0, device=DEVICE), randn(2, 2)), "empty"),
    ],
)
def test_unsupported_calls_are_routed_to_the_reference(tk, op, args, reason_part):
    ops, _ = resolve_kernel_ops("triton", DEVICE)
    call_args = args()
    reason = getattr(ops, op).unsupported_reason(*call_args)
    assert reason is not None and reason_part in reason


def test_kernel_with_fallback_dispatch():
    calls = []
    op = KernelWithFallback(
        "double",
        kernel=lambda x: calls.append("kernel") or 2 * x,
        unsupported_reason=lambda x: None if x >= 0 else "negative",
        fallback=lambda x: calls.append("fallback") or x + x,
    )
    assert op(3) == 6 and op(-1) == -2 and op(-2) == -4
    assert calls == ["kernel", "fallback", "fallback"] and op.logged_reasons == {"negative"}


# ---------------------------------------------------------------------------------------------
# tools/bench_kernels.py: the same rule decides its "correct" column, and its rows come as JSON too.


def test_bench_kernels_writes_its_rows_as_json_next_to_the_markdown(tmp_path, capsys):
    md = tmp_path / "kernels.md"
    assert bench_kernels.main(["--ops", "rms_norm", "--dtype", "fp32", "--markdown", str(md)]) == 0
    document = read_results(rows_path(md))
    triton = [r for r in document["rows"] if r["impl"] == "triton"]
    assert [(r["op"], r["dtype"]) for r in triton] == [("rms_norm", "float32")]
    check = triton[0]["check"]
    assert check["ok"] and check["outputs"] == ["output", "grad of arg 0", "grad of arg 1"]
    assert all(e <= t for e, t in zip(check["errors"], check["tolerances"]))
    assert document["title"].startswith(kernel_bench.TITLE) and "| rms_norm |" in md.read_text()
