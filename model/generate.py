"""Text generation from a GPT: greedy or sampled (temperature, top-k, top-p), with a KV cache.

A batch of prompts of different lengths is padded on the left, as transformers' ``generate``
does: every prompt ends at the same column, so all of them are encoded in one forward pass and
each later step feeds one sampled token per row. Each row's positions count from its own first
token, and the padding is a document of its own (the document mask, ``model/attention.py``), so no
real token attends to it: a row's output is what it would be alone, up to the float rounding of a
masked attention. (Feeding the part of a longer prompt beyond the shortest one token per step
instead cost one forward per token: in lm-eval's batches of unequal prompts, most of the time.)
A model trained with ``model.attention_mask=document`` keeps that token-per-step way, as its own
document numbers come from the tokens, and so does one with sliding-window layers (their bounded
cache keeps no mask for the positions it dropped).

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
    longest = max(lengths)
    # Left padding needs every key position in the document mask: not with a sliding window's bounded cache.
    windowed = cfg.is_mla or any(cfg.window_of(i) for i in range(cfg.n_layer))  # latent cache: not tested padded
    pad = ([longest - n for n in lengths] if len(set(lengths)) > 1 and cfg.attention_mask == "causal" and not windowed
           else None)
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        start = pad[row] if pad else 0
        tokens[row, start: start + len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    positions = documents = None
    if pad:  # every prompt now ends at column `longest`: from there on the rows move together
        first = torch.tensor(pad, device=device)[:, None]
        columns = torch.arange(total, device=device)[None, :]
        documents = (columns >= first).long()  # padding is document 0, the row's own text document 1
        positions = (columns - first).clamp(min=0)
        lengths = [longest] * len(prompts)
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

    def forward(start: int, end: int) -> torch.Tensor:
        """The logits after column end - 1, from the columns [start, end) (the cache holds the rest)."""
        if positions is None:
            return model(tokens[:, start:end], cache=cache)[:, -1]
        return model(tokens[:, start:end], cache=cache, positions=positions[:, start:end],
                     documents=documents[:, :end])[:, -1]

    pos = min(lengths)
    logits = forward(0, pos)
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
        logits = forward(pos - 1 if use_cache else 0, pos)
    return [_row_output(tokens[row, n : min(n + max_new_tokens, ends[row])].tolist(), eos_id)
            for row, n in enumerate(lengths)]


def _row_output(new_tokens: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in new_tokens:
        return new_tokens[: new_tokens.index(eos_id) + 1]
    return new_tokens
