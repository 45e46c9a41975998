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
