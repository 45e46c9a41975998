"""Single-process checks of the strategy glue: config validation, the DeepSpeed config we
generate, FSDP2's mixed-precision policy, and the no-op / error paths of apply_data_parallel.
(FSDP2's prefetch on gloo ranks is in tests/integration/parallel/test_strategies.py.)"""

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
