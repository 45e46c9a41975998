"""Mixture-of-experts throughput, side by side: a MoE GPT with its expert GEMMs grouped
(``torch._grouped_mm``) or looped per expert, and the dense GPT with the same active parameters.

Each variant runs the same training step (forward, backward, AdamW) on the same batch; the
variants are timed in interleaved rounds (``common.measure.interleaved``), so a busy spell of a
shared machine hits them alike, and every ratio is taken round by round and reported as its
median with the min-max over rounds. The dense twin has one MLP as wide as the top-k experts
together (plus the shared experts), so it runs the same MLP FLOPs per token as the MoE model; the
MoE model adds only the router and the permutation, and holds (and steps) every expert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from common.errors import ConfigError
from common.measure import RatioSummary, Summary, interleaved, speedup, summarize
from model.config import ModelConfig, MoEConfig
from model.flops import count_parameters
from model.gpt import GPT


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """The dense GPT whose MLP is as wide as a token's experts together: the same active MLP weights
    (the MoE model's active parameters are the twin's plus its routers'). Its one MLP width serves
    every layer, so a MoE model whose dense layers (moe.first_dense, moe.every) are another width
    has no such twin: that is refused."""
    width = (cfg.moe.top_k + cfg.moe.shared_experts) * cfg.expert_d_ff
    if cfg.n_moe_layers < cfg.n_layer and cfg.d_ff != width:
        raise ConfigError(f"the dense layers' model.d_ff={cfg.d_ff} differs from a token's experts together, (top_k "
                          f"{cfg.moe.top_k} + shared {cfg.moe.shared_experts}) x {cfg.expert_d_ff} = {width}, so no "
                          f"dense model has the same active parameters; set model.d_ff={width} (as DeepSeek-V3's "
                          "dense layers are)")
    return dataclasses.replace(cfg, moe=MoEConfig(), d_ff=width)


@dataclass(frozen=True)
class Variant:
    name: str
    total_params: int
    active_params: int
    seconds: Summary  # per training step
    tokens_per_s: float  # at the median step time
    vs_dense: RatioSummary  # speed relative to the dense twin (above 1: faster)


def training_step(model: GPT, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_moe_benchmark(cfg: ModelConfig, *, batch: int, seq_len: int, rounds: int, device: torch.device,
                      seed: int = 0) -> tuple[list[Variant], RatioSummary]:
    """Every variant's step time, and grouped_mm's speed-up over the per-expert loop."""
    configs = {"moe, grouped_mm": (cfg, "grouped_mm"), "moe, per-expert loop": (cfg, "loop"),
               "dense, equal active": (dense_twin(cfg), "loop")}
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).to(device)
    steps = {}
    for name, (c, backend) in configs.items():
        torch.manual_seed(seed)
        steps[name] = training_step(GPT(c, expert_backend=backend).to(device).train(), x)
    samples = interleaved(steps, rounds, warmup=2, device=device, progress="MoE variants")
    dense = samples["dense, equal active"]
    variants = []
    for name, (c, _) in configs.items():
        s = summarize(samples[name])
        variants.append(Variant(name, count_parameters(c), count_parameters(c, active=True), s,
                                batch * seq_len / s.median, speedup(samples[name], dense)))
    return variants, speedup(samples["moe, grouped_mm"], samples["moe, per-expert loop"])


def table_rows(variants: list[Variant]) -> list[list[str]]:
    return [[v.name, f"{v.total_params / 1e6:.2f}M", f"{v.active_params / 1e6:.2f}M",
             f"{v.seconds.median * 1e3:.0f} ({v.seconds.min * 1e3:.0f}-{v.seconds.max * 1e3:.0f})",
             f"{v.tokens_per_s:,.0f}", v.vs_dense.text()] for v in variants]


TABLE_HEADERS = ["variant", "params", "active", "ms/step median (min-max)", "tokens/s", "speed vs dense"]
