"""FSDP2's prefetch settings on 2 gloo ranks: the lists reach the real FSDP2 blocks, FSDP2 issues
exactly those all-gathers, and the losses do not change. The strategy glue in one process:
tests/unit/parallel/test_strategies.py."""

from __future__ import annotations

import pytest
import torch

from parallel.config import ParallelConfig
from parallel.precision import PrecisionConfig, precision_policy

PREFETCH_SETTINGS = ((0, 1), (2, 2))  # FSDP2's defaults, and two blocks ahead in both passes


PREFETCH_BLOCKS = 4


def _prefetch_worker(rank: int, world_size: int) -> dict:
    """Per prefetch setting: the prefetch lists on the real FSDP2 states of a sharded tiny GPT, the
    all-gathers FSDP2 issued as prefetches during training steps, and the losses of those steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from model.config import ModelConfig
    from model.gpt import GPT
    from parallel.fsdp import apply_fsdp

    issued: list[tuple[int, str]] = []
    original = FSDPParamGroup._prefetch_unshard

    def recording(target, pass_type):
        issued.append((id(target), pass_type))
        return original(target, pass_type)

    FSDPParamGroup._prefetch_unshard = staticmethod(recording)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    cfg = ModelConfig(vocab_size=64, n_layer=PREFETCH_BLOCKS, n_head=2, d_model=32, max_seq_len=16)
    results = {}
    for forward, backward in PREFETCH_SETTINGS:
        torch.manual_seed(0)
        model = apply_fsdp(GPT(cfg), mesh, ParallelConfig(strategy="fsdp", fsdp_forward_prefetch=forward,
                                                          fsdp_backward_prefetch=backward),
                           precision_policy(PrecisionConfig(), "fsdp"), torch.device("cpu"))
        states = [block._get_fsdp_state() for block in model.blocks.values()]
        block_of_state = {id(state): i for i, state in enumerate(states)}
        block_of_group = {id(g): i for i, state in enumerate(states) for g in state._fsdp_param_groups}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(rank)
        losses, calls = [], []
        for _ in range(2):  # the first step also runs FSDP2's lazy init; the second is steady state
            issued.clear()
            idx = torch.randint(0, cfg.vocab_size, (2, 17), generator=data)
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            calls.append([(block_of_group.get(target, "root"), pass_type) for target, pass_type in issued])
        results[(forward, backward)] = {
            "forward_lists": [[block_of_state[id(t)] for t in s._states_to_forward_prefetch] for s in states],
            "backward_lists": [[block_of_state[id(t)] for t in s._states_to_backward_prefetch] for s in states],
            "calls": calls,
            "losses": losses,
        }
    FSDPParamGroup._prefetch_unshard = staticmethod(original)
    return results


@pytest.fixture(scope="module")
def prefetch_results():
    from tests.gloo import run_workers

    return run_workers(_prefetch_worker, 2)


def test_prefetch_settings_reach_the_real_fsdp2_blocks(prefetch_results):
    for rank in prefetch_results:
        default, explicit = rank[(0, 1)], rank[(2, 2)]
        # FSDP2's defaults untouched: no explicit lists, no forward prefetch, and in backward each
        # module all-gathers the one that ran before it in forward (the root's is the last block)
        assert default["forward_lists"] == [[]] * PREFETCH_BLOCKS == default["backward_lists"]
        assert all(step == [(3, "backward"), (2, "backward"), (1, "backward"), (0, "backward")]
                   for step in default["calls"])
        # two blocks ahead in forward, the two blocks that run next in backward
        assert explicit["forward_lists"] == [[1, 2], [2, 3], [3], []]
        assert explicit["backward_lists"] == [[], [0], [1, 0], [2, 1]]
        for step in explicit["calls"]:
            # FSDP2 issued exactly those all-gathers, in execution order; in backward the root (not a
            # block, so on FSDP2's default) prefetches block 3, then block 3 runs and prefetches 2 and 1
            assert [b for b, p in step if p == "forward"] == [1, 2, 2, 3, 3]
            assert [b for b, p in step if p == "backward"] == [3, 2, 1, 1, 0, 0]


def test_prefetching_changes_no_loss(prefetch_results):
    for rank in prefetch_results:
        assert rank[(2, 2)]["losses"] == rank[(0, 1)]["losses"]  # bit for bit: only the timing differs
