"""Measured bytes saved for backward, checked against counts derived by hand from the model code.

Tiny GPT in fp32 (4 bytes per element): B=2, T=32, d=64, H=4, L=4, d_ff=4d, LayerNorm with bias,
GELU MLP, learned positions, dropout 0. Write N = B*T*d.

What one block saves for backward with ``none`` and the reference attention, tensor by tensor:
  norm1: its input x and the fp32 mean and rstd            4N + 8BT
  qkv linear: its input (norm1's output)                   4N
  QK^T: matmul copies the transposed q and k views          8N
  causal mask for masked_fill (bool, T x T)                 T^2
  softmax output (B, H, T, T)                               4BHT^2
  probs @ V: the contiguous copy of v (probs already kept)  4N
  proj linear: its input                                    4N
  norm2                                                     4N + 8BT
  fc (no bias, the bias is fused with GELU): its input      4N
  GELU: its input (B, T, 4d)                                16N
  out linear: its input (GELU's output)                     16N
  total                                                     64N + 16BT + 4BHT^2 + T^2 bytes

selective recomputes the attention core, which then keeps only q, k, v: the qkv output, one 12N
buffer, instead of the 12N of copies above, so exactly the scores' 4BHT^2 + T^2 disappear.
full keeps only each block's input: N elements, 4N bytes; everything else is recomputed.
op_selective keeps every matmul output (qkv 3N, scores BHT^2, attention out N, proj N, fc 4N,
out N elements) plus the block input N: (11N + BHT^2) * 4 bytes.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from model.config import ModelConfig
from tools import bench_memory
from tools.bench_memory import measure_saved_bytes

B, T, D, H, L = 2, 32, 64, 4, 4
N = B * T * D
CFG = ModelConfig(vocab_size=256, max_seq_len=T, d_model=D, n_head=H, n_layer=L)
NONE_PER_BLOCK = 64 * N + 16 * B * T + 4 * B * H * T * T + T * T
SCORES = 4 * B * H * T * T + T * T


@pytest.fixture(scope="module")
def measured():
    return {
        (policy, backend): measure_saved_bytes(CFG, policy, T, B, backend, torch.float32)
        for backend in ("reference", "sdpa")
        for policy in ("none", "selective", "op_selective", "full", "every_k", "offload")
    }


def test_none_saves_what_the_model_code_says(measured):
    assert measured["none", "reference"]["block_bytes"] == [NONE_PER_BLOCK] * L


def test_saved_bytes_order_none_over_selective_over_full_with_reference_attention(measured):
    none, selective, full = (measured[p, "reference"] for p in ("none", "selective", "full"))
    assert none["saved_bytes"] > selective["saved_bytes"] > full["saved_bytes"]
    assert none["per_layer_bytes"] - selective["per_layer_bytes"] == SCORES


def test_full_keeps_only_block_inputs(measured):
    """Bound: each block keeps its input (B, T, d), 4N bytes; parts outside the blocks keep what they
    keep without checkpointing, so the total is L * 4N plus none's outside-the-blocks bytes."""
    full, none = measured["full", "reference"], measured["none", "reference"]
    assert full["block_bytes"] == [4 * N] * L
    assert full["outside_bytes"] == none["outside_bytes"] > 0
    assert full["saved_bytes"] == L * 4 * N + none["outside_bytes"]


def test_selective_saves_little_with_sdpa_which_never_stores_scores(measured):
    none, selective = measured["none", "sdpa"], measured["selective", "sdpa"]
    saved_by_selective = none["saved_bytes"] - selective["saved_bytes"]
    assert 0 <= saved_by_selective < 0.01 * none["saved_bytes"]
    assert measured["full", "sdpa"]["block_bytes"] == [4 * N] * L  # full does not depend on the backend


def test_op_selective_counts_what_the_sac_cache_keeps(measured):
    row = measured["op_selective", "reference"]
    matmul_outputs = 4 * (10 * N + B * H * T * T)
    assert row["block_cached_bytes"] == [matmul_outputs] * L
    assert row["block_bytes"] == [matmul_outputs + 4 * N] * L


def test_every_k_alternates_full_and_none_blocks(measured):
    row = measured["every_k", "reference"]  # k = 2: blocks 1 and 3 are recomputed
    assert row["block_bytes"] == [NONE_PER_BLOCK, 4 * N, NONE_PER_BLOCK, 4 * N]


def test_offload_moves_every_block_activation_to_the_host(measured):
    offload, none = measured["offload", "reference"], measured["none", "reference"]
    assert offload["block_bytes"] == [0] * L
    assert offload["block_offloaded_bytes"] == none["block_bytes"]  # on CPU nothing is copied twice
    assert offload["outside_bytes"] == none["outside_bytes"]


def test_bf16_halves_the_block_inputs_kept_by_full():
    row = measure_saved_bytes(CFG, "full", T, B, "reference", torch.bfloat16)
    assert row["block_bytes"] == [2 * N] * L


def test_cli_writes_table_markdown_and_plot(tmp_path, capsys):
    markdown, plot = tmp_path / "recompute.md", tmp_path / "recompute.png"
    args = ["--d-model", "32", "--n-head", "2", "--n-layer", "2", "--seq-len", "16", "--micro-batch", "2",
            "--steps", "1", "--attention", "reference", "--device", "cpu", "--markdown", str(markdown), "--plot", str(plot)]
    assert bench_memory.main(args) == 0
    out = capsys.readouterr().out
    for policy in ("none", "selective", "op_selective", "full", "every_k", "offload"):
        assert f" {policy} " in out
    assert "time vs none" in out
    assert markdown.read_text().count("\n| reference |") == 6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_input_in_one_line(capsys):
    assert bench_memory.main(["--steps", "0", "--device", "cpu"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_estimate_columns_appear_only_when_the_estimator_provides_them(monkeypatch):
    row = measure_saved_bytes(CFG, "full", T, B, "reference", torch.float32) | {
        "step_seconds": 0.1, "overhead": 1.0, "saved_vs_none": 0.1,
    }
    args = (CFG, T, B, "full", torch.float32, "reference", "cpu")
    monkeypatch.setitem(sys.modules, "analysis.estimator", None)  # import fails as if absent
    assert bench_memory.analytic_per_layer_bytes(*args) is None
    assert bench_memory.exact_per_layer_bytes(*args) is None
    table = bench_memory.format_table([row | {"analytic_per_layer_bytes": None, "exact_per_layer_bytes": None}])
    assert "Korthikanti" not in table and "exact count" not in table

    # An estimator with only the formula, and a narrower signature than the bench could pass.
    fake = types.ModuleType("analysis.estimator")
    fake.activation_bytes_per_layer = lambda cfg, s, b, policy, dtype_bytes=2: s * b * cfg.d_model * dtype_bytes
    monkeypatch.setitem(sys.modules, "analysis.estimator", fake)
    estimate = bench_memory.analytic_per_layer_bytes(*args)
    assert estimate == 4 * N
    assert bench_memory.exact_per_layer_bytes(*args) is None
    table = bench_memory.format_table([row | {"analytic_per_layer_bytes": estimate, "exact_per_layer_bytes": None}])
    assert "Korthikanti/block MiB" in table and "exact count" not in table
