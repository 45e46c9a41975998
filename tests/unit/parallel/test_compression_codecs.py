"""Gradient compression in one process: bit packing, error feedback's residuals per parameter, and
the hook refusing a module DDP does not wrap. The hooks on 2 gloo processes (the exchanged mean,
bytes on the wire, training against uncompressed DDP): tests/integration/parallel/test_compression.py."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.compression import ErrorFeedback, pack_bits, unpack_bits


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1001])
def test_pack_bits_round_trip_and_size(numel):
    bits = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8)
    assert torch.equal(unpack_bits(packed, numel), bits)


def test_pack_bits_order_is_msb_first():
    assert pack_bits(torch.tensor([True] + [False] * 7)).item() == 128
    assert pack_bits(torch.tensor([False] * 7 + [True, True])).tolist() == [1, 128]


def test_error_feedback_adds_residual_per_segment():
    fb = ErrorFeedback()
    fb.keep(torch.tensor([1.0, 2.0, 3.0]), [(10, 2), (11, 1)])
    # a rebuilt bucket with the parameters in another order still gets the right residuals
    out = fb.corrected(torch.zeros(3), [(11, 1), (10, 2)])
    assert out.tolist() == [3.0, 1.0, 2.0]


def test_register_comm_hook_rejects_a_plain_module():
    from common.errors import ConfigError
    from parallel.compression import register_comm_hook
    from parallel.config import ParallelConfig

    cfg = ParallelConfig(strategy="ddp", ddp_comm_hook="topk")
    with pytest.raises(ConfigError, match="DDP-wrapped"):
        register_comm_hook(torch.nn.Linear(2, 2), cfg)
    assert register_comm_hook(torch.nn.Linear(2, 2), ParallelConfig(strategy="ddp")) is None
