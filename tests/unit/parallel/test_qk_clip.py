"""QK-clip (parallel/qk_clip.py) in one process: after a step, the query and key rows of the heads whose
largest logit exceeded the threshold are scaled as a rule written here from the Kimi K2 report, every other
weight is what the same step without QK-clip gives, and the log line says when it fired."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.distributed import DistContext
from tests.unit.model.test_head_max_logits import pairwise_max
from training.build import build_from_config
from training.config import load_config
from training.loop import format_line

MODEL = {"vocab_size": 32, "max_seq_len": 12, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32,
         "position": "rope", "attention": "reference"}
GROUP, HEAD_DIM = 2, 8  # query heads per key head, head width


def engine(tau: float | None):
    overrides = [f"--model.{k}={v}" for k, v in MODEL.items()]
    overrides += ["--optim.name=muon", "--optim.muon.ns_dtype=fp32", "--train.micro_batch_size=2",
                  "--optim.lr=0.05"]  # a large step, so the two runs' weights differ visibly
    if tau is not None:
        overrides.append(f"--optim.muon.qk_clip_tau={tau}")
    return build_from_config(load_config(None, overrides), DistContext.single()).engine


def step(eng) -> tuple[list[torch.Tensor], object]:
    """One step of two micro-batches; each layer's per-head maximum over both, seen at its attention core."""
    seen = {}
    hooks = [eng.module().blocks[i].attn.core.register_forward_hook(
        lambda mod, args, out, i=i: seen.setdefault(i, []).append(pairwise_max(args[0], args[1], None)))
        for i in ("0", "1")]
    micro = [torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    loss, _ = eng.forward_backward_step(iter([(t[:, :-1], t[:, 1:]) for t in micro]), 2)
    result = eng.optimizer_step(0.05, loss)
    for hook in hooks:
        hook.remove()
    return [torch.maximum(*seen[i]) for i in ("0", "1")], result


def expected_row_factors(maxima: torch.Tensor, tau: float) -> torch.Tensor:
    """Kimi K2: gamma_h = tau / S_h where S_h > tau; a head's logits scale by gamma_h. A key shared by a
    group of query heads takes sqrt of the group's smallest gamma, each query the rest of its own."""
    factors = []
    for g in range(len(maxima) // GROUP):
        gammas = [tau / s if s > tau else 1.0 for s in maxima[g * GROUP:(g + 1) * GROUP].tolist()]
        key = math.sqrt(min(gammas))
        factors += [x / key for x in gammas] + [key, 1.0]  # the group's query heads, its key, its value
    return torch.tensor(factors).repeat_interleave(HEAD_DIM)


def test_qk_clip_scales_the_heads_over_the_threshold_and_nothing_else():
    plain = engine(None)
    maxima, plain_result = step(plain)
    tau = float(torch.cat(maxima).median())  # about half the heads exceed it
    clipped = engine(tau)
    maxima_again, result = step(clipped)
    assert all(torch.equal(a, b) for a, b in zip(maxima, maxima_again))
    assert plain_result.qk_clipped is None
    over = sum(int((m > tau).sum()) for m in maxima)
    assert 0 < over < 8 and int(result.qk_clipped) == over
    assert float(result.max_logit) == pytest.approx(float(torch.cat(maxima).max()), rel=1e-6)
    want = dict(plain.module().named_parameters())
    for name, got in clipped.module().named_parameters():
        if ".attn.qkv." not in name:
            assert torch.equal(got, want[name]), name
            continue
        layer = int(name.split(".")[1])
        factors = expected_row_factors(maxima[layer], tau)
        expected = want[name] * factors.view(-1, *([1] * (got.ndim - 1)))
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6, msg=name)


def test_qk_clip_leaves_the_weights_alone_below_the_threshold_and_the_log_line_says_when_it_fires():
    plain, quiet = engine(None), engine(1e6)
    step(plain)
    _, result = step(quiet)
    assert int(result.qk_clipped) == 0
    want = dict(plain.module().named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in quiet.module().named_parameters())
    base = {"loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "data_wait_frac": 0.0,
            "host_peak_rss_gib": 0.1, "skipped_in_window": 0, "max_attention_logit": 12.5}
    assert "qk-clip" not in format_line(1, 10, base | {"qk_clipped_heads": 0}, 1)
    line = format_line(1, 10, base | {"qk_clipped_heads": 3}, 1)
    assert "max logit 12.5, qk-clip fired on 3 heads" in line
