"""Recompute policies under per-block torch.compile (Inductor builds, minutes on a small machine):
the same loss and gradients as the eager model without recompute."""

from __future__ import annotations

import pytest
import torch

from model.gpt import GPT
from tests.unit.model.test_recompute import loss_and_grads, tiny_config, with_policy


@pytest.mark.timeout(240)
def test_policies_compose_with_per_block_torch_compile():
    """Checkpointing first, then torch.compile of each block (the trainer's and torchtitan's order).

    offload runs its blocks eagerly under compile (dynamo cannot trace save_on_cpu's hooks and falls
    back for that frame); it is still checked for the same numbers.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(tiny_config(n_layer=2), attention_backend="sdpa")
    loss0, grads0 = loss_and_grads(with_policy(base, "none"))
    for policy in ("full", "op_selective", "selective", "offload"):
        model = with_policy(base, policy)
        for block in model.blocks.values():
            block.compile()
        loss, grads = loss_and_grads(model)
        # Inductor fuses and reorders float ops, so compiled vs eager agrees to rounding, not bits.
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-6, msg=f"{policy} {name}")
        assert list(model.state_dict()) == list(base.state_dict())
    torch._dynamo.reset()
