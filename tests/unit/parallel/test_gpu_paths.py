"""GPU-path decisions checked on CPU: DeepSpeed's own parser on our generated config, Transformer
Engine's recompute, FP8 shape rules, meta-device init with TE layers, and capability checks for
flash-attn and bf16.

No GPU and no Transformer Engine here: the device queries are monkeypatched to describe a V100
(compute capability 7.0) or an A100 (8.0), and a stand-in ``transformer_engine.pytorch`` records
how its ``checkpoint`` is called. What runs is our decision code, not the GPU libraries.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn as nn

from common.errors import CapabilityError, ConfigError
from parallel.precision import PrecisionConfig, precision_policy


def job(*overrides: str):
    from training.config import load_config

    return load_config("configs/tiny.yaml", list(overrides))


def test_the_fsdp_root_gets_an_explicit_bool_that_every_supported_torch_accepts(monkeypatch):
    """``reshard_after_forward=None`` is accepted only from torch 2.8; the floor is 2.6."""
    import torch.distributed.fsdp as fsdp_api

    from parallel.config import ParallelConfig
    from parallel.fsdp import apply_fsdp

    calls = []
    monkeypatch.setattr(fsdp_api, "fully_shard", lambda module, **kw: calls.append(kw["reshard_after_forward"]))
    for reshard in (True, False):
        calls.clear()
        model = _Stack([nn.Linear(4, 4), nn.Linear(4, 4)])
        apply_fsdp(model, None, ParallelConfig(strategy="fsdp", fsdp_reshard_after_forward=reshard),
                   precision_policy(PrecisionConfig(), "fsdp"), torch.device("cpu"))
        assert calls == [reshard, reshard, False]  # two blocks, then the root kept gathered


STRATEGIES = ("zero1", "zero2", "zero3")
MODES = ("fp32", "bf16", "bf16_master", "fp16")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", MODES)
def test_deepspeed_parses_our_config_into_what_we_asked_for(strategy, mode):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    from parallel.zero import deepspeed_config

    cfg = job(f"--parallel.strategy={strategy}", f"--precision.mode={mode}", "--train.micro_batch_size=3",
              "--train.grad_accum_steps=2", "--optim.grad_clip=0.5", "--parallel.ddp_bucket_cap_mb=2")
    # Without a process group DeepSpeedConfig counts one rank, and checks the batch product for it.
    policy = precision_policy(cfg.precision, strategy)
    parsed = DeepSpeedConfig(deepspeed_config(cfg.parallel, policy, cfg.optim, micro_batch_size=3,
                                              grad_accum_steps=2, world_size=1))
    assert parsed.zero_optimization_stage == int(strategy[-1])
    batch = (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps, parsed.train_batch_size)
    assert batch == (3, 2, 6)
    assert parsed.gradient_clipping == 0.5
    bucket = 2 * 2**20 // 4
    assert parsed.zero_config.reduce_bucket_size == bucket and parsed.zero_config.allgather_bucket_size == bucket
    assert parsed.torch_autocast_enabled == (mode == "bf16")
    if mode == "bf16":
        assert parsed.torch_autocast_dtype == torch.bfloat16
    assert parsed.bfloat16_config.enabled == (mode == "bf16_master")
    if mode == "bf16_master":
        assert parsed.bfloat16_config.check_grad_overflow is True
    assert parsed.float16_config.enabled == (mode == "fp16")
    if mode == "fp16":
        assert parsed.float16_config.loss_scale == 0 and parsed.float16_config.initial_scale_power == 16


# --------------------------------------------------------------------------- stand-ins for TE


class _Stack(nn.Module):
    """The shape parallel/ and model/recompute.py rely on: an embedding and ``.blocks``."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return x


def _fake_te_block(width: int = 4) -> nn.Module:
    """An instance of model.te.TEBlock (what the checks look for) holding a plain layer."""
    from model.te import TEBlock

    class StandInTEBlock(TEBlock):
        def __init__(self):
            nn.Module.__init__(self)  # TEBlock's own __init__ needs Transformer Engine
            self.layer = nn.Linear(width, width)

        def forward(self, x: torch.Tensor, rope: object = None) -> torch.Tensor:
            return torch.tanh(self.layer(x))

    return StandInTEBlock()


@pytest.fixture
def te_checkpoint_calls(monkeypatch) -> list[dict]:
    """A stand-in ``transformer_engine.pytorch`` whose ``checkpoint`` records its keyword arguments."""
    calls: list[dict] = []

    def checkpoint(function, *args, **kwargs):
        calls.append(dict(kwargs))
        kwargs.pop("use_reentrant", None)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    package = types.ModuleType("transformer_engine")
    package.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.__spec__ = importlib.machinery.ModuleSpec("transformer_engine.pytorch", None)
    pytorch.checkpoint = checkpoint
    package.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    return calls


# --------------------------------------------------------------------------- FP8 + recompute


@pytest.mark.parametrize("policy, every_k, expected_calls", [("full", 2, 3), ("every_k", 2, 1)])
def test_te_blocks_recompute_through_te_checkpoint(te_checkpoint_calls, policy, every_k, expected_calls):
    from model.recompute import apply_recompute, recomputed_modules

    model = _Stack([_fake_te_block() for _ in range(3)])
    apply_recompute(model, policy, every_k)
    assert all("te.checkpoint" in label for label in recomputed_modules(model).values())
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    assert len(te_checkpoint_calls) == expected_calls
    assert all(call["use_reentrant"] is False for call in te_checkpoint_calls)
    assert all(p.grad is not None for p in model.blocks.parameters())


def test_torch_blocks_keep_torch_checkpoint(te_checkpoint_calls):
    from model.recompute import apply_recompute

    model = _Stack([nn.Linear(4, 4) for _ in range(2)])
    apply_recompute(model, "full")
    model(torch.tensor([[1, 2]])).sum().backward()
    assert te_checkpoint_calls == []


def test_op_selective_refuses_te_blocks():
    from model.recompute import RecomputeError, apply_recompute

    with pytest.raises(RecomputeError, match="op_selective cannot select inside Transformer Engine layers"):
        apply_recompute(_Stack([_fake_te_block()]), "op_selective")


# --------------------------------------------------------------------------- FP8 shapes

FP8 = ("--precision.mode=fp8", "--model.layers=te", "--model.d_model=64")


@pytest.mark.parametrize("overrides, key", [
    (("--train.micro_batch_size=3", "--model.max_seq_len=30"), "model.max_seq_len"),
    (("--train.micro_batch_size=1", "--data.seq_len=36"), "data.seq_len"),
])
def test_fp8_needs_tokens_per_micro_batch_divisible_by_8(overrides, key):
    with pytest.raises(ConfigError, match=rf"train\.micro_batch_size x {key} divisible by 8"):
        job(*FP8, *overrides)


def test_fp8_accepts_tokens_per_micro_batch_divisible_by_8():
    cfg = job(*FP8, "--train.micro_batch_size=4", "--model.max_seq_len=30")  # 120 rows
    assert cfg.precision.mode == "fp8"


# --------------------------------------------------------------------------- meta init + TE


def test_init_on_meta_with_te_layers_is_a_config_error():
    with pytest.raises(ConfigError, match="init_on_meta=true cannot initialize Transformer Engine layers"):
        job("--parallel.strategy=fsdp", "--parallel.init_on_meta=true", "--model.layers=te")


def test_fsdp_refuses_to_materialize_te_layers_from_meta(monkeypatch):
    """The library path too (tools and tests call apply_fsdp directly), before any sharding."""
    import torch.distributed.fsdp as fsdp_api

    from parallel.config import ParallelConfig
    from parallel.fsdp import apply_fsdp

    monkeypatch.setattr(fsdp_api, "fully_shard", lambda *a, **k: pytest.fail("sharded a model it should refuse"))
    with torch.device("meta"):
        model = _Stack([])
    model.blocks.append(_fake_te_block())  # TE allocates its own (CUDA) weights, not on meta
    with pytest.raises(ConfigError, match="init_on_meta=true cannot initialize Transformer Engine layers"):
        apply_fsdp(model, None, ParallelConfig(strategy="fsdp", init_on_meta=True),
                   precision_policy(PrecisionConfig(), "fsdp"), torch.device("cpu"))


# --------------------------------------------------------------------------- V100 vs A100


@pytest.fixture
def gpu(monkeypatch):
    """Describe a CUDA GPU of the given compute capability, with flash-attn installed."""
    import model.attention as attention

    def describe(capability: tuple[int, int]) -> torch.device:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        # What torch answers by default on a V100 too: a bf16 tensor can be created (emulation).
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
        return torch.device("cuda", 0)

    return describe


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_attention_skips_flash_attn_below_compute_capability_8(gpu, dtype):
    from model.attention import select_attention

    backend, why = select_attention("auto", gpu((7, 0)), dtype, 64)
    assert backend == "sdpa" and "compute capability 7.0" in why


def test_auto_attention_takes_flash_attn_on_ampere(gpu):
    from model.attention import select_attention

    assert select_attention("auto", gpu((8, 0)), torch.bfloat16, 64)[0] == "flash_attn"


def test_requested_flash_attn_on_a_v100_is_a_one_line_capability_error(gpu):
    from model.attention import select_attention

    with pytest.raises(CapabilityError, match="compute capability 7.0, flash-attn 2 needs 8.0"):
        select_attention("flash_attn", gpu((7, 0)), torch.float16, 64)


@pytest.mark.parametrize("mode", ["bf16", "bf16_master"])
def test_bf16_on_a_v100_is_refused_although_torch_reports_emulated_support(gpu, mode):
    from parallel.precision import check_precision_supported

    with pytest.raises(CapabilityError, match=r"compute capability 7\.0\) has no bf16 tensor cores.*use fp16"):
        check_precision_supported(mode, gpu((7, 0)))


@pytest.mark.parametrize("mode", ["bf16", "bf16_master", "fp16"])
def test_bf16_and_fp16_pass_on_an_a100(gpu, mode):
    from parallel.precision import check_precision_supported

    check_precision_supported(mode, gpu((8, 0)))


def test_fp16_passes_on_a_v100(gpu):
    from parallel.precision import check_precision_supported

    check_precision_supported("fp16", gpu((7, 0)))
