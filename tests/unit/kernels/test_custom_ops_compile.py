"""The Triton kernels are ``perfgpt::`` custom ops, so torch.compile traces through them.

Before, each kernel call was wrapped in ``torch.compiler.disable``: a graph break on each side of
every fused op. Now ``kernels/triton/_common.py``'s ``kernel_op`` registers each host launcher as
a custom op with its autograd formula, and a compiled model is one graph:

- in the interpreter (TRITON_INTERPRET=1, this CPU session) each op is an opaque
  ``torch.library.custom_op`` node with a fake (shape) implementation; the tests here compile
  every op with ``fullgraph=True``, count graph breaks, check that the ops are in the graph, and
  hold the compiled results to the kernels' tolerance rule (``common.measure.check_against_fp32``);
  the tiny GPT compiled whole (tens of seconds here) is in
  tests/integration/kernels/test_custom_ops_compile.py;
- with compiled Triton each op is a ``torch.library.triton_op``, which AOTAutograd replaces by
  the kernels themselves (``triton_kernel_wrapper_functional`` nodes) so that Inductor schedules
  them. A CPU machine cannot launch them, but it can trace them in a subprocess
  (tests/integration/kernels/test_custom_ops_compile.py). On a CUDA machine the in-process tests
  run that path for real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="needs the triton package (pip install triton)")

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from common.measure import check_against_fp32  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.registry import TRITON_OPS, resolve_kernel_ops  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
# aot_eager runs dynamo and AOTAutograd (fake tracing, functionalization, the autograd formulas),
# which is where a custom op can fail to trace; Inductor on CPU would only add C++ build time.
BACKEND = "aot_eager" if INTERPRETED else "inductor"


@pytest.fixture(scope="module")
def ops():
    kernel_ops, reason = resolve_kernel_ops("triton", DEVICE)
    assert kernel_ops.backend == "triton", reason
    return kernel_ops


class RecordingBackend:
    """A torch.compile backend that notes every op each graph calls, then hands over to BACKEND."""

    def __init__(self):
        self.targets: set[str] = set()
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        self.targets.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)


def compile_counting_breaks(fn):
    """fn compiled as one graph; the backend and the graph-break counter to look at afterwards."""
    torch._dynamo.reset()
    counters.clear()
    backend = RecordingBackend()
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def assert_one_graph_through_the_ops(backend: RecordingBackend, op_names: set[str]) -> None:
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert backend.graphs >= 1
    in_graph = {t.split(".")[1] for t in backend.targets if t.startswith("perfgpt.")}
    assert op_names <= in_graph, f"expected perfgpt ops {sorted(op_names)} in the graph, found {sorted(in_graph)}"


def assert_no_fallback(kernel_ops) -> None:
    for name in TRITON_OPS:
        op = getattr(kernel_ops, name)
        assert not op.logged_reasons, f"{name} fell back to the reference: {op.logged_reasons}"


# ------------------------------------------------------------------------------------ every op


def _randn(*shape, dtype, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)


def _ce_targets(n: int, vocab: int) -> torch.Tensor:
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    targets[1] = -100
    return targets


def _moe_slots() -> torch.Tensor:
    """8 of 5 tokens' 10 (token, choice) slots, in an expert order: slots 3 and 6 dropped."""
    return torch.tensor([9, 0, 4, 2, 7, 1, 5, 8], device=DEVICE)


# op field -> (inputs for a dtype, positions differentiated, the perfgpt ops its graph must hold)
OP_CASES = {
    "layer_norm": (lambda d: [_randn(3, 5, 24, dtype=d), _randn(24, dtype=d, seed=1), _randn(24, dtype=d, seed=2),
                              1e-5], [0, 1, 2], {"layer_norm_fwd"}),
    "layer_norm_gelu": (lambda d: [_randn(6, 40, dtype=d), _randn(40, dtype=d, seed=1), None, 1e-5, "none"],
                        [0, 1], {"layer_norm_fwd"}),
    "rms_norm": (lambda d: [_randn(6, 40, dtype=d), _randn(40, dtype=d, seed=1), 1e-6], [0, 1], {"rms_norm_fwd"}),
    "bias_gelu": (lambda d: [_randn(6, 40, dtype=d, scale=2.0), _randn(40, dtype=d, seed=1), "tanh"], [0, 1],
                  {"bias_gelu_fwd"}),
    "swiglu": (lambda d: [_randn(6, 40, dtype=d, scale=2.0), _randn(6, 40, dtype=d, seed=1)], [0, 1],
               {"swiglu_fwd"}),
    "cross_entropy": (lambda d: [_randn(8, 50, dtype=d, scale=3.0), _ce_targets(8, 50)], [0],
                      {"cross_entropy_fwd"}),
    "apply_rope": (lambda d: [_randn(2, 5, 3, 16, dtype=d, scale=2.0), *reference.rope_tables(7, 16, 1e4, DEVICE)],
                   [0], {"rope"}),
    "moe_permute": (lambda d: [_randn(5, 24, dtype=d), _moe_slots(), 2], [0], {"moe_permute_fwd"}),
    "moe_unpermute": (lambda d: [_randn(8, 24, dtype=d), _moe_slots(), _randn(5, 2, dtype=torch.float32, seed=1)],
                      [0, 2], {"moe_unpermute_fwd"}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_each_op_compiles_into_one_graph_within_the_kernel_tolerance(ops, name):
    """bf16 inputs; forward and gradients by the project's rule (common/measure.py): at most twice
    eager bf16's error against fp32, plus the rounding floor."""
    make_args, positions, expected_ops = OP_CASES[name]
    compiled, backend = compile_counting_breaks(getattr(ops, name))
    check = check_against_fp32(compiled, getattr(reference, name), make_args(torch.bfloat16), positions,
                               interpreted=INTERPRETED)
    assert check.ok, "; ".join(check.failures())
    assert_one_graph_through_the_ops(backend, expected_ops)
    assert_no_fallback(ops)


def test_in_place_rope_without_autograd_is_one_mutating_op_in_the_graph(ops):
    """Inference and KV caches rotate q/k where they lie: the mutating op, traced, still one graph."""
    cos, sin = reference.rope_tables(6, 16, 1e4, DEVICE)
    qkv = _randn(2, 6, 3, 2, 16, dtype=torch.float32)
    expected = reference.apply_rope(qkv[:, :, 0].clone(), cos, sin)

    def rotate_q(qkv):
        q = qkv[:, :, 0]
        ops.apply_rope(q, cos, sin, inplace=True)
        return qkv

    compiled, backend = compile_counting_breaks(rotate_q)
    with torch.no_grad():
        out = compiled(qkv.clone())
    assert_one_graph_through_the_ops(backend, {"rope_"})
    torch.testing.assert_close(out[:, :, 0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, :, 1:], qkv[:, :, 1:], rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_the_registrations_pass_opcheck(ops):
    """torch.library.opcheck: schema, autograd registration, fake vs real outputs, AOT dispatch."""
    from kernels.triton import load_op_modules

    modules = load_op_modules()
    x, up = (_randn(4, 24, dtype=torch.float32, seed=s).requires_grad_() for s in (0, 1))
    w, b = (_randn(24, dtype=torch.float32, seed=s).requires_grad_() for s in (2, 3))
    q = _randn(2, 4, 3, 16, dtype=torch.float32).requires_grad_()
    cos, sin = reference.rope_tables(5, 16, 1e4, DEVICE)
    tokens = _randn(5, 24, dtype=torch.float32, seed=4).requires_grad_()  # 5 tokens, top-2: _moe_slots' 10 slots
    cases = [
        (modules["layer_norm"].layer_norm_fwd, (x, w, b, 1e-5, "tanh")),
        (modules["layer_norm"].layer_norm_fwd, (x, w, None, 1e-5, None)),
        (modules["rms_norm"].rms_norm_fwd, (x, w, 1e-6)),
        (modules["bias_gelu"].bias_gelu_fwd, (x, b, "none")),
        (modules["swiglu"].swiglu_fwd, (x, up)),
        (modules["cross_entropy"].cross_entropy_fwd, (x, _ce_targets(4, 24), -100)),
        (modules["rope"].rope, (q, cos, sin, False)),
        (modules["rope"].rope_, (q.detach().clone(), cos, sin)),
        (modules["moe_permute"].moe_permute_fwd, (tokens, _moe_slots(), 2)),
        (modules["moe_permute"].moe_unpermute_fwd, (up[:3].repeat(3, 1)[:8], _moe_slots(), w[:10].view(5, 2), 5, 2)),
        (modules["moe_permute"].moe_unpermute_fwd, (up[:3].repeat(3, 1)[:8], _moe_slots(), None, 5, 2)),
    ]
    for op, args in cases:
        results = torch.library.opcheck(op, args)
        assert all(r == "SUCCESS" for r in results.values()), (op, results)
