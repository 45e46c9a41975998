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

import pytest
import torch

from analysis import estimator as est
from analysis import recompute_bench
from analysis.recompute_bench import measure_saved_bytes
from common.errors import ConfigError
from common.measure import provenance
from common.report import read_results, rows_path
from model.config import ModelConfig
from tools import bench_memory

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


def test_cli_writes_the_rows_as_json_next_to_the_markdown(tmp_path):
    markdown = tmp_path / "recompute.md"
    args = ["--d-model", "32", "--n-head", "2", "--n-layer", "1", "--seq-len", "16", "--micro-batch", "2",
            "--steps", "1", "--attention", "sdpa", "--policies", "none", "full", "--device", "cpu",
            "--markdown", str(markdown)]
    assert bench_memory.main(args) == 0
    document = read_results(rows_path(markdown))
    assert [(r["attention"], r["policy"]) for r in document["rows"]] == [("sdpa", "none"), ("sdpa", "full")]
    assert document["rows"][1]["block_bytes"] == [4 * 2 * 16 * 32]  # full keeps the block input: B*T*d fp32
    where = provenance(torch.device("cpu"))
    assert where["hardware"] in document["title"] and where["date"] in document["title"]


def test_estimate_columns_come_from_the_estimator_and_its_errors_stay_errors(monkeypatch):
    args = (CFG, T, B, "full", torch.float32, "reference", "cpu")
    assert recompute_bench.analytic_per_layer_bytes(*args) == est.activation_bytes_per_layer(
        CFG, T, B, "full", 4, attention="reference", dropout_mask_bytes=4)
    assert recompute_bench.exact_per_layer_bytes(*args) == est.saved_bytes_per_layer(
        CFG, T, B, "full", 4, attention="reference", device="cpu")
    # a backend the exact count does not model has no cell, decided up front, not by a swallowed error
    assert recompute_bench.exact_per_layer_bytes(CFG, T, B, "full", torch.float32, "flash_attn", "cpu") is None
    row = measure_saved_bytes(CFG, "full", T, B, "reference", torch.float32) | {
        "step_seconds": 0.1, "overhead": 1.0, "saved_vs_none": 0.1,
    }
    table = recompute_bench.format_table([row | {"analytic_per_layer_bytes": 1.0, "exact_per_layer_bytes": None}])
    assert "Korthikanti/block MiB" in table and "exact count" not in table

    def broken(*args, **kwargs):
        raise ConfigError("the estimator cannot do this")

    monkeypatch.setattr(est, "activation_bytes_per_layer", broken)
    with pytest.raises(ConfigError, match="the estimator cannot do this"):
        recompute_bench.analytic_per_layer_bytes(*args)
