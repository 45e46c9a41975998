"""Single-process checks of the strategy glue: config validation, the DeepSpeed config we
generate, FSDP2's mixed-precision policy and prefetch wiring, and the no-op / error paths of
apply_data_parallel. (The multi-process behaviour is in test_parallel_train.py and
test_fsdp_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parallel.config import ParallelConfig
from training.config import load_config
from training.distributed import DistContext
from training.fields import ConfigError


def job(*overrides: str):
    return load_config("configs/tiny.yaml", list(overrides))


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
    from parallel.zero import deepspeed_config

    cfg = job("--parallel.strategy=zero3", "--train.micro_batch_size=3", "--train.grad_accum_steps=4",
              "--optim.grad_clip=0.5", "--parallel.zero_offload_optimizer=true", "--parallel.zero_offload_params=true",
              "--parallel.zero_cpu_adam=false", "--parallel.ddp_bucket_cap_mb=1")
    ds = deepspeed_config(cfg, world_size=8)
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
    from parallel.zero import deepspeed_config

    ds = deepspeed_config(job("--parallel.strategy=zero1", f"--precision.mode={mode}"), world_size=2)
    assert ds[key] == expected
    assert "offload_optimizer" not in ds["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in ds


def test_fp8_is_refused_for_zero_with_the_supported_modes_named():
    from parallel.zero import _precision_section

    with pytest.raises(ConfigError, match="use fp32, bf16, bf16_master or fp16"):
        _precision_section(type("P", (), {"mode": "fp8"})())


# --------------------------------------------------------------------------- FSDP2 pieces


@pytest.mark.parametrize("mode, param, reduce", [
    ("fp32", None, None), ("bf16", torch.bfloat16, torch.float32), ("bf16_master", torch.bfloat16, torch.float32),
    ("fp16", torch.float16, torch.float32),
])
def test_fsdp_mixed_precision_policy_per_mode(mode, param, reduce):
    from parallel.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(mode)
    assert policy.param_dtype == param and policy.reduce_dtype == reduce


class _Block(nn.Module):
    """Records what FSDP2's prefetch setters were given."""

    def __init__(self, index: int):
        super().__init__()
        self.index, self.forward_prefetch, self.backward_prefetch = index, None, None

    def set_modules_to_forward_prefetch(self, modules):
        self.forward_prefetch = [m.index for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        self.backward_prefetch = [m.index for m in modules]


def test_prefetch_lists_point_ahead_in_forward_and_back_in_backward():
    from parallel.fsdp import set_prefetch

    blocks = [_Block(i) for i in range(4)]
    set_prefetch(blocks, forward=2, backward=2)
    assert [b.forward_prefetch for b in blocks] == [[1, 2], [2, 3], [3], None]
    assert [b.backward_prefetch for b in blocks] == [None, [0], [1, 0], [2, 1]]


def test_default_prefetch_leaves_fsdp2_defaults_alone():
    from parallel.fsdp import set_prefetch

    blocks = [_Block(i) for i in range(3)]
    set_prefetch(blocks, forward=0, backward=1)
    assert all(b.forward_prefetch is None and b.backward_prefetch is None for b in blocks)


# --------------------------------------------------------------------------- apply_data_parallel


def _single_ctx() -> DistContext:
    return DistContext(0, 1, 0, 1, 0, torch.device("cpu"), None)


@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_unsharded_strategies_in_one_process_return_the_model_itself(strategy):
    from parallel.parallelize import apply_data_parallel

    model = nn.Linear(2, 2)
    assert apply_data_parallel(model, ParallelConfig(strategy=strategy), _single_ctx()) is model


def test_fsdp_in_one_process_is_a_config_error():
    from parallel.parallelize import apply_data_parallel

    with pytest.raises(ConfigError, match="needs several processes"):
        apply_data_parallel(nn.Linear(2, 2), ParallelConfig(strategy="fsdp"), _single_ctx())


def test_layout_uses_the_configured_ranks_per_node():
    from parallel.parallelize import layout_of

    ctx = DistContext(3, 4, 3, 4, 0, torch.device("cpu"), "gloo")  # launcher: one node of 4
    dims = layout_of(ctx, local_world_size=2)  # config: pretend 2 nodes of 2
    assert (dims.nodes, dims.node_rank, dims.local_rank) == (2, 1, 1)
