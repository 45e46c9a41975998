"""tools/bench_peers.py: perfgpt's step against transformers' model of the same architecture, on the
same batches with the same optimizer, in interleaved rounds; and the attention's cheap backward."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.measure import NO_DIFFERENCE
from common.report import read_results, rows_path
from kernels.registry import REFERENCE_OPS
from model.config import ModelConfig
from model.gpt import Attention
from tools import bench_peers

pytest.importorskip("transformers", reason="needs transformers (the dev extra)")

TINY = ["--model.n_layer=1", "--model.d_model=32", "--model.max_seq_len=32", "--train.micro_batch_size=2"]


def test_both_sides_step_on_the_same_batches_with_the_same_optimizer(tmp_path, capsys):
    md, png = tmp_path / "peers.md", tmp_path / "peers.png"
    args = ["--rounds", "2", "--steps", "1", "--warmup", "1", "--profile", "--markdown", str(md), "--plot", str(png),
            *TINY]
    # Compilation would take most of a minute here; with Dynamo off the compiled sides run the same
    # code path eagerly, which is all the table's structure needs.
    with torch._dynamo.config.patch(disable=True):
        assert bench_peers.main(args) == 0
    out = capsys.readouterr().out
    document = read_results(rows_path(md))
    table = md.read_text()
    assert document["title"] == table.splitlines()[0] and document["title"] in out
    assert [(r["side"], r["mode"]) for r in document["rows"]] == [
        ("perfgpt", "eager"), ("transformers", "eager"), ("perfgpt", "compiled"), ("transformers", "compiled")]
    for row in document["rows"]:
        assert len(row["rounds_s"]) == 2 and row["step_s"] == statistics.median(row["rounds_s"])
        assert f"| {row['side']} | {row['mode']} | {row['step_s'] * 1e3:.1f} (" in table
    # the same batches in the same order (one warm-up step, 2 rounds of 1 step, 1 profiled step) ...
    seen = list(document["batches"].values())
    assert len(seen) == 4 and all(s == seen[0] for s in seen) and len(seen[0]) == 4
    # ... the same AdamW on the same parameter groups ...
    settings = list(document["optimizer"].values())
    assert all(s == settings[0] for s in settings)
    assert [g["weight_decay"] for g in settings[0]] == [0.1, 0.0] and settings[0][0]["betas"] == [0.9, 0.95]
    # ... and the same initial weights: the first step's losses agree
    losses = [r["first_loss"] for r in document["rows"]]
    assert max(losses) - min(losses) < 1e-5
    names = [r["name"] for r in document["ratios"]]
    assert names == ["perfgpt / transformers, eager", "perfgpt / transformers, compiled",
                     "perfgpt compiled / eager", "transformers compiled / eager"]
    for r in document["ratios"]:
        assert f"| {r['name']} | {r['text']} |" in table
        assert (NO_DIFFERENCE in r["text"]) == (r["min"] <= 1.0 <= r["max"])
    assert "command: `python -m tools.bench_peers --rounds 2" in table
    profiles = document["profile_ms_per_step"]
    assert list(profiles) == ["perfgpt eager", "transformers eager", "perfgpt compiled", "transformers compiled"]
    assert all(ops["aten::mm"] > 0 for ops in profiles.values())
    total = [line for line in table.splitlines() if line.startswith("| total |")]
    assert total == ["| total | " + " | ".join(f"{sum(ops.values()):.1f}" for ops in profiles.values()) + " |"]
    assert png.stat().st_size > 1000


def test_a_ratio_whose_rounds_straddle_one_is_no_difference():
    seconds = {"perfgpt eager": [1.0, 1.0, 1.0], "transformers eager": [2.0, 2.0, 2.0],
               "perfgpt compiled": [0.9, 1.1, 0.8], "transformers compiled": [1.0, 1.0, 1.0]}
    ratios = {r.name: r for r in bench_peers.ratios_of(seconds, ["eager", "compiled"])}
    assert ratios["perfgpt / transformers, eager"].text == "2.00x (2.00-2.00)"
    assert ratios["perfgpt / transformers, eager"].measured_difference
    # per round 1.11, 0.91, 1.25 faster than the peer: the medians differ, the rounds disagree
    compiled = ratios["perfgpt / transformers, compiled"]
    assert compiled.text == f"1.11x (0.91-1.25): {NO_DIFFERENCE}" and not compiled.measured_difference
    assert ratios["perfgpt compiled / eager"].text == f"1.11x (0.91-1.25): {NO_DIFFERENCE}"
    assert ratios["transformers compiled / eager"].text == "2.00x (2.00-2.00)"
    eager_only = bench_peers.ratios_of(seconds, ["eager"])
    assert [r.name for r in eager_only] == ["perfgpt / transformers, eager"]


@pytest.mark.parametrize("args, message", [
    (["--modes", "eager,fast"], "--modes 'eager,fast': give a comma-separated list of eager, compiled"),
    (["--precision.mode=bf16_master"], "precision.mode=bf16_master has no transformers equivalent here"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert bench_peers.main(args + TINY) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_attention_backward_concatenates_qkv_grads_without_zero_fill(n_kv_head):
    # Indexing q, k and v out of the fused projection made each one's backward zero-fill and add a
    # whole projection-sized gradient; split's backward writes the three into one buffer.
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, n_layer=1, n_head=4, n_kv_head=n_kv_head, d_model=32)
    attn = Attention(cfg, REFERENCE_OPS, "sdpa")
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = attn(x, None)
    with OpCounter() as counter:
        out.sum().backward()
    assert not {"select_backward", "slice_backward", "zeros", "fill_"} & set(counter.ops), counter.ops
    assert counter.ops.count("cat") == 1

