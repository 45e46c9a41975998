"""The ``perfgpt::`` custom ops under torch.compile, the parts that take tens of seconds here:

- the tiny GPT on the Triton ops compiled whole (``fullgraph=True``): one graph through the ops,
  and the compiled loss and gradients within the eager kernels' tolerance of the reference model;
- with compiled Triton each op is a ``torch.library.triton_op``, which AOTAutograd replaces by the
  kernels themselves (``triton_kernel_wrapper_functional`` nodes) so that Inductor schedules them.
  A CPU machine cannot launch them, but it can trace them: a subprocess with TRITON_INTERPRET
  unset and a Hopper target named on paper (as tests/integration/kernels/test_sm90_compile.py
  does) traces every op forward and backward with fake tensors and checks that no ``perfgpt`` op
  is left, only kernels.

Each op compiled alone, in the interpreter: tests/unit/kernels/test_custom_ops_compile.py (whose
op cases the subprocess traces, and whose compile helpers these tests use).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs the triton package (pip install triton)")

from kernels.registry import REFERENCE_OPS, TRITON_OPS  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from tests.unit.kernels.test_custom_ops_compile import (  # noqa: E402
    DEVICE,
    assert_no_fallback,
    assert_one_graph_through_the_ops,
    compile_counting_breaks,
    ops,  # noqa: F401 -- the module fixture the tests take
)
from tests.unit.kernels.test_gpt_on_triton_kernels import assert_fp32_loss_and_grads_match  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def tiny_twins(norm: str, mlp: str, kernel_ops) -> tuple[GPT, GPT, ModelConfig]:
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32, norm=norm, mlp=mlp,
                      position="rope")
    cfg.validate()
    torch.manual_seed(0)
    reference_model = GPT(cfg, REFERENCE_OPS).to(DEVICE)
    with torch.no_grad():
        for p in reference_model.parameters():  # norms and biases away from 1 and 0: every path carries weight
            p.add_(0.1 * torch.randn_like(p))
    kernel_model = GPT(cfg, kernel_ops).to(DEVICE)
    kernel_model.load_state_dict(reference_model.state_dict())
    return reference_model, kernel_model, cfg


def loss_and_grads(model, idx, targets, forward=None):
    model.zero_grad(set_to_none=True)
    loss = (model if forward is None else forward)(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("norm,mlp,expected_ops", [
    ("layernorm", "gelu", {"layer_norm_fwd", "bias_gelu_fwd", "rope", "cross_entropy_fwd"}),
    ("rmsnorm", "swiglu", {"rms_norm_fwd", "swiglu_fwd", "rope", "cross_entropy_fwd"}),
])
def test_compiled_gpt_on_the_triton_ops_is_one_graph_and_matches_the_reference(ops, norm, mlp, expected_ops):
    reference_model, kernel_model, cfg = tiny_twins(norm, mlp, ops)
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=generator).to(DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=generator).to(DEVICE)
    targets[0, :3] = -100
    compiled, backend = compile_counting_breaks(kernel_model)
    loss, grads = loss_and_grads(kernel_model, idx, targets, forward=compiled)
    assert_one_graph_through_the_ops(backend, expected_ops)
    assert_no_fallback(ops)
    ref_loss, ref_grads = loss_and_grads(reference_model, idx, targets)
    assert_fp32_loss_and_grads_match(loss, grads, ref_loss, ref_grads)  # the tolerance of the eager kernels



TRACE_FOR_HOPPER = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from functorch.compile import aot_function, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode


class HopperOnPaper:
    # What torch's kernel-mutation analysis asks Triton for: the target to lower the kernels to.
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(HopperOnPaper())
from kernels import reference
from kernels.registry import TRITON_OPS
from kernels.triton import _common, load_op_modules
from tests.unit.kernels.test_custom_ops_compile import OP_CASES

assert not _common.INTERPRETED
modules = load_op_modules()
graphs = []


def capture(gm, inputs):
    graphs.append(gm)
    return make_boxed_func(gm)


def report(what, gm):
    # The graph Inductor would get calls the kernels, and no perfgpt op is left opaque.
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    kernels = [t for t in targets if "triton_kernel_wrapper_functional" in t]
    left = [t for t in targets if t.startswith("perfgpt.")]
    assert kernels and not left, (what, targets)
    print(f"{what}: {len(kernels)} kernel(s)", flush=True)


for field, (module, function) in TRITON_OPS.items():
    graphs.clear()

    make_args, positions, _ = OP_CASES[field]
    real_args = make_args(torch.bfloat16)
    with FakeTensorMode() as fake:
        args = [fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real_args]
        for i in positions:
            args[i].requires_grad_()
        out = aot_function(getattr(modules[module], function), fw_compiler=capture, bw_compiler=capture)(*args)
        out.float().sum().backward()
    assert len(graphs) == 2, (field, len(graphs))
    for kind, gm in zip(("forward", "backward"), graphs):
        report(f"{field} {kind}", gm)


def rotate_q_in_place(q, cos, sin):
    modules["rope"].rope_(q, cos, sin)
    return q


graphs = []
real_args = OP_CASES["apply_rope"][0](torch.bfloat16)
with FakeTensorMode() as fake:
    aot_function(rotate_q_in_place, fw_compiler=capture)(*[fake.from_tensor(a) for a in real_args])
report("rope_ forward", graphs[0])
"""


@pytest.mark.timeout(300)
def test_compiled_triton_ops_decompose_into_their_kernels_for_inductor():
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("needs triton's NVIDIA backend to lower the kernels for the mutation analysis")
    # "0", not unset: importing this file in the subprocess must not switch the interpreter on.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset; 1 is the GPU default
    proc = subprocess.run([sys.executable, "-c", TRACE_FOR_HOPPER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" kernel(s)") == 2 * len(TRITON_OPS) + 1, proc.stdout
