"""torch.compile per transformer block (Inductor on CPU) gives the eager loss and gradients."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from parallel.parallelize import apply_compile


@pytest.mark.timeout(300)
def test_compiled_blocks_match_eager_loss_and_grads():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)
    eager = GPT(cfg)
    compiled = GPT(cfg)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, enabled=True, mode="default", compile_loss=False)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # compiling keeps checkpoint keys
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    loss_e, loss_c = eager(x, y), compiled(x, y)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    loss_e.backward()
    loss_c.backward()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_disabled_is_a_no_op():
    model = GPT(ModelConfig(n_layer=1, d_model=32, n_head=2, vocab_size=32, max_seq_len=8))
    before = [type(b) for b in model.blocks.values()]
    apply_compile(model, enabled=False, mode="default", compile_loss=True)
    assert [type(b) for b in model.blocks.values()] == before and model.blocks["0"]._compiled_call_impl is None


def _graph_ops(gelu_input: torch.Tensor) -> tuple[set[str], set[str], torch.Tensor, torch.Tensor]:
    """Compile reference.bias_gelu; the aten ops of its forward and backward graphs, its output and input grad."""
    from torch._dynamo.backends.common import aot_autograd

    from kernels import reference

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(reference.bias_gelu, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    x = gelu_input.clone().requires_grad_()
    out = compiled(x, None, "tanh")
    out.backward(torch.ones_like(out))
    torch._dynamo.reset()
    fw, bw = ({str(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in graphs)
    return fw, bw, out.detach(), x.grad


def test_compiled_tanh_gelu_on_cpu_is_spelled_through_sigmoid_and_is_the_same_function():
    x = torch.randn(64, 96, dtype=torch.float64) * 3
    fw, bw, out, grad = _graph_ops(x)
    # Inductor's CPU code evaluates tanh about three times slower than the exponential in a sigmoid.
    assert not any("tanh" in op or "gelu" in op for op in fw | bw), (fw, bw)
    assert any("sigmoid" in op for op in fw) and any("sigmoid" in op for op in bw)
    reference_x = x.clone().requires_grad_()
    expected = torch.nn.functional.gelu(reference_x, approximate="tanh")
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, reference_x.grad, rtol=1e-12, atol=1e-12)


def test_eager_tanh_gelu_stays_aten_gelu():
    from kernels import reference

    x = torch.randn(8, 40) * 3
    assert torch.equal(reference.bias_gelu(x, None, "tanh"), torch.nn.functional.gelu(x, approximate="tanh"))
