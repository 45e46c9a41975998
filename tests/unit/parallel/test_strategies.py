"""Single-process checks of the strategy glue: config validation, the DeepSpeed config we
generate, FSDP2's mixed-precision policy and prefetch wiring, and the no-op / error paths of
apply_data_parallel. (The multi-process behaviour is in test_parallel_train.py and
test_fsdp_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from common.errors import ConfigError
from parallel.config import ParallelConfig
from parallel.distributed import DistContext
from parallel.precision import PrecisionConfig, precision_policy
from training.config import load_config


def job(*overrides: str):
    return load_config("configs/tiny.yaml", list(overrides))


def ds_config(cfg, world_size: int) -> dict:
    from parallel.zero import deepspeed_config

    policy = precision_policy(cfg.precision, cfg.parallel.strategy)
    return deepspeed_config(cfg.parallel, policy, cfg.optim, micro_batch_size=cfg.train.micro_batch_size,
                            grad_accum_steps=cfg.train.grad_accum_steps, world_size=world_size)


# --------------------------------------------------------------------------- config validation


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.init_on_meta=true"], "init_on_meta needs parallel.strategy=fsdp"),
    (["--parallel.strategy=zero2", "--parallel.zero_offload_params=true"], "only stage 3 partitions parameters"),
    (["--parallel.strategy=ddp", "--parallel.zero_offload_optimizer=true"], "needs parallel.strategy=zero1, zero2"),
    (["--parallel.strategy=ddp", "--parallel.fsdp_hybrid=true"], "fsdp_hybrid needs parallel.strategy=fsdp"),
    (["--parallel.fsdp_backward_prefetch=0"], "fsdp_backward_prefetch must be >= 1"),
    (["--parallel.ddp_bucket_cap_mb=0"], "ddp_bucket_cap_mb must be > 0"),
])
def test_inconsistent_strategy_options_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        job(*overrides)


def test_valid_strategy_options_load():
    cfg = job("--parallel.strategy=zero3", "--parallel.zero_offload_params=true", "--parallel.zero_offload_optimizer=true")
    assert cfg.parallel.zero_offload_params and cfg.parallel.zero_offload_optimizer


# --------------------------------------------------------------------------- DeepSpeed config


def test_deepspeed_config_carries_batch_clipping_stage_and_offload():
    cfg = job("--parallel.strategy=zero3", "--train.micro_batch_size=3", "--train.grad_accum_steps=4",
              "--optim.grad_clip=0.5", "--parallel.zero_offload_optimizer=true", "--parallel.zero_offload_params=true",
              "--parallel.zero_cpu_adam=false", "--parallel.ddp_bucket_cap_mb=1")
    ds = ds_config(cfg, world_size=8)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 3 * 4 * 8  # DeepSpeed checks this product itself
    assert ds["gradient_clipping"] == 0.5
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 2**20 // 4  # fp32 elements in 1 MB
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False  # torch AdamW allowed on the offloaded masters
    assert "bf16" not in ds and "fp16" not in ds and "torch_autocast" not in ds  # fp32


@pytest.mark.parametrize("mode, key, expected", [
    ("bf16", "torch_autocast", {"enabled": True, "dtype": "bfloat16"}),
    ("bf16_master", "bf16", {"enabled": True, "check_grad_overflow": True}),
    ("fp16", "fp16", {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}),
])
def test_deepspeed_precision_sections_follow_precision_mode(mode, key, expected):
    ds = ds_config(job("--parallel.strategy=zero1", f"--precision.mode={mode}"), world_size=2)
    assert ds[key] == expected
    assert "offload_optimizer" not in ds["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in ds


def test_fp8_is_refused_for_zero_with_the_supported_modes_named():
    with pytest.raises(ConfigError, match="use fp32, bf16, bf16_master or fp16"):
        precision_policy(PrecisionConfig(mode="fp8"), "zero1")


# --------------------------------------------------------------------------- FSDP2 pieces


@pytest.mark.parametrize("mode, param, reduce", [
    ("fp32", None, None), ("bf16", torch.bfloat16, torch.float32), ("bf16_master", torch.bfloat16, torch.float32),
    ("fp16", torch.float16, torch.float32),
])
def test_fsdp_mixed_precision_policy_per_mode(mode, param, reduce):
    from parallel.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(precision_policy(PrecisionConfig(mode=mode), "fsdp"))
    assert policy.param_dtype == param and policy.reduce_dtype == reduce


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


# --------------------------------------------------------------------------- apply_data_parallel


@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_unsharded_strategies_in_one_process_return_the_model_itself(strategy):
    from tests.gloo import data_parallel_engine

    model = nn.Linear(2, 2)
    assert data_parallel_engine(model, ParallelConfig(strategy=strategy), DistContext.single()).model is model


def test_fsdp_in_one_process_is_a_config_error():
    from tests.gloo import data_parallel_engine

    with pytest.raises(ConfigError, match="needs several processes"):
        data_parallel_engine(nn.Linear(2, 2), ParallelConfig(strategy="fsdp"), DistContext.single())


def test_layout_uses_the_configured_ranks_per_node():
    from parallel.dims import ParallelDims

    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}  # launcher: one node of 4
    dims = ParallelDims.from_env(env, local_world_size=2)  # config: pretend 2 nodes of 2
    assert (dims.nodes, dims.node_rank, dims.local_rank) == (2, 1, 1)
    assert dims.device_index == 3  # the launcher's LOCAL_RANK still names the device
