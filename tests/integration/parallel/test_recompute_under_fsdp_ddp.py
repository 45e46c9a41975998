"""Checkpointing composes with FSDP2 and DDP: 2 gloo ranks, same gradients as without checkpointing."""

from __future__ import annotations

import pytest
import torch

from tests.gloo import run_workers

WORLD = 2
# selective and every_k use the same recompute wrapper as full, on other modules; these three cover
# the three mechanisms (recompute, SAC cache, saved-tensor hooks).
POLICIES = ("full", "op_selective", "offload")


def _build(policy: str):
    from model.config import ModelConfig
    from model.gpt import GPT
    from model.recompute import apply_recompute

    torch.manual_seed(0)
    model = GPT(ModelConfig(max_seq_len=16, d_model=32, n_head=2, n_layer=2), attention_backend="reference")
    apply_recompute(model, policy)
    return model


def _step(model, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own micro-batch
    tokens = torch.randint(0, 256, (2, 17), generator=gen)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731  FSDP2 grads are DTensors
    return {name: full(p.grad).clone() for name, p in model.named_parameters()}


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))
    fsdp_expected = _step(_fsdp2(_build("none"), mesh), rank)
    ddp_expected = _step(DDP(_build("none")), rank)
    for policy in POLICIES:
        sharded = _fsdp2(_build(policy), mesh)
        assert [n for n, _ in sharded.named_parameters()] == list(fsdp_expected), policy
        _assert_close(_step(sharded, rank), fsdp_expected, f"FSDP2 {policy}")
        _assert_close(_step(DDP(_build(policy)), rank), ddp_expected, f"DDP {policy}")
    return True


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        # Same kernels and the same reduction order on both sides: equal up to float rounding.
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7, msg=f"{what}: {name}")


@pytest.mark.timeout(180)
def test_policies_give_the_same_gradients_under_fsdp2_and_ddp():
    assert run_workers(_worker, WORLD) == [True] * WORLD
