"""Text generation from a GPT: greedy or sampled (temperature, top-k, top-p), with a KV cache.

A batch of prompts of different lengths needs no padding: every row runs at the same positions,
the shortest prompt is encoded in one forward pass, and from there each step feeds one token per
row, the row's own next prompt token while it still has one, else the token just sampled. So
positions, rotary angles and the causal mask stay those of each row alone, and a row's output
is exactly what it would be on its own (the price: the part of a longer prompt beyond the
shortest one is encoded one token per step).

With ``use_cache`` the keys and values of earlier positions are kept (``model.attention.KVCache``,
only the n_kv_head heads, or latent attention's latent and rotary key; a layer with a sliding window of W keeps only its last W - 1
positions) and each step runs the model on one new token; without it every step re-runs the
whole prefix, the slow reference the cache is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common.errors import ConfigError
from model.attention import KVCache
from model.gpt import GPT


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits. temperature=0 is greedy (argmax)."""

    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set of most likely tokens whose probability reaches p
    seed: int | None = None

    def check(self) -> None:
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids."""
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    # Shift by the maximum before dividing: with a tiny temperature (1e-40) the quotient would
    # overflow to inf and inf - inf gives NaN probabilities; shifted, the best logit stays 0 and
    # the others go to -inf, so a near-zero temperature samples like greedy decoding.
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(temperature=0.0),
    *,
    eos_id: int | None = None,
    use_cache: bool = True,
    stop_when: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The tokens generated after each prompt: ``max_new_tokens`` of them, or fewer when the row
    produced ``eos_id`` (which is included, last). The model is put in eval mode.

    ``stop_when(tokens)`` is asked about a row's generated tokens after each new one; True ends
    that row there (a stop string found in its text: what comes later would be cut anyway)."""
    cfg = model.cfg
    sampling.check()
    if cfg.layers != "torch":
        raise ConfigError(
            f"generation needs model.layers=torch (got {cfg.layers}): Transformer Engine layers take no KV cache"
        )
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lengths = [len(p) for p in prompts]
    total = max(lengths) + max_new_tokens
    if total > cfg.max_seq_len:
        raise ConfigError(
            f"the longest prompt ({max(lengths)} tokens) plus max_new_tokens={max_new_tokens} exceeds "
            f"model.max_seq_len={cfg.max_seq_len}; shorten the prompt or ask for fewer tokens"
        )
    model.eval()
    device = model.tok_emb.weight.device
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    prompt_len = torch.tensor(lengths, device=device)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)

    cache = None
    if use_cache:
        dtype = next(model.parameters()).dtype
        if cfg.is_mla:  # the latent and the shared rotary key (model.gpt.LatentAttention)
            cache = KVCache(cfg.n_layer, len(prompts), total, 1, cfg.kv_lora_rank, device, dtype,
                            value_dim=cfg.qk_rope_head_dim)
        else:
            cache = KVCache(cfg.n_layer, len(prompts), total, cfg.kv_heads, cfg.head_dim, device, dtype,
                            windows=[cfg.window_of(i) for i in range(cfg.n_layer)])
    pos = min(lengths)
    logits = model(tokens[:, :pos], cache=cache)[:, -1]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    ends = [total] * len(prompts)  # where a row stopped by stop_when ends
    while True:
        sampled = next_token(logits, sampling, generator)
        in_prompt = pos < prompt_len
        tokens[:, pos] = torch.where(in_prompt, tokens[:, pos], sampled)
        generated = ~in_prompt & ~done
        if eos_id is not None:
            done |= generated & (sampled == eos_id)
        done |= pos + 1 >= prompt_len + max_new_tokens
        if stop_when is not None:
            for row in (~done & generated).nonzero().flatten().tolist():
                if stop_when(tokens[row, lengths[row]: pos + 1].tolist()):
                    done[row], ends[row] = True, pos + 1
        pos += 1
        if bool(done.all()):
            break
        step_input = tokens[:, pos - 1 : pos] if use_cache else tokens[:, :pos]
        logits = model(step_input, cache=cache)[:, -1]
    return [_row_output(tokens[row, n : min(n + max_new_tokens, ends[row])].tolist(), eos_id)
            for row, n in enumerate(lengths)]


def _row_output(new_tokens: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in new_tokens:
        return new_tokens[: new_tokens.index(eos_id) + 1]
    return new_tokens
