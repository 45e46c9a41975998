"""Attention backends behind one interface: core(q, k, v) -> out, all (B, T, heads, D), causal.

k and v may have fewer heads than q (grouped-query attention; one head = multi-query): query
head i attends to key/value head i // (H / H_kv), the grouping of flash-attn, SDPA's
``enable_gqa`` and Hugging Face's ``repeat_kv``.

- flash_attn: the flash-attn package (CUDA compute capability >= 8.0, fp16/bf16, head_dim <= 256).
  Imported only here. Takes the narrow k/v as they are.
- sdpa: torch.nn.functional.scaled_dot_product_attention (picks its own fused kernel). Narrow k/v
  go in with ``enable_gqa`` where a fused kernel accepts them, else are repeated first (below).
- reference: explicit QK^T / sqrt(d), causal mask, softmax, dropout, @V. It materializes the
  (B, H, T, T) scores, which is what the memory tools measure against, and repeats narrow k/v.

Two variants change what a query sees (``model.sliding_window``, ``model.attention_sinks``):
- a sliding window of W tokens: query i sees keys i - W < j <= i (itself and W - 1 before it),
  Hugging Face's convention. flash-attn takes it as ``window_size=(W - 1, 0)``; SDPA and the
  reference as an explicit (T, S) mask, with which SDPA leaves its flash kernel for one that
  takes a mask.
- attention sinks (gpt-oss): a learned logit per head joins each softmax's denominator and
  carries no value, so a head can put weight on nothing. Neither SDPA nor flash-attn 2 has the
  term, so a core with sinks runs the reference path, exactly, whatever backend it was given
  (``select_attention`` says so).

``select_attention`` resolves ``auto`` and explains the choice in one line for the log.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import CapabilityError

# What "auto" resolves to (model.attention's other choices): the kernels that actually run.
ATTENTION_BACKENDS = ("flash_attn", "sdpa", "reference")
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 builds its kernels for Ampere, Ada and Hopper only


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_attention(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                     window: int | None = None, sinks: bool = False, latent: bool = False) -> tuple[str, str]:
    """Resolve model.attention to a concrete backend, with the reason. ``window``: the sliding
    window of the layers that have one; ``sinks``: the model has attention sinks; ``latent``:
    DeepSeek's latent attention, whose values are narrower than its queries and keys."""
    if latent and requested in ("auto", "flash_attn"):
        if requested == "flash_attn":
            raise CapabilityError("model.attention=flash_attn cannot run model.attention_kind=mla: flash-attn 2 wants "
                                  "values as wide as queries and keys; use model.attention=sdpa, reference or auto")
        return "sdpa", ("attention: sdpa (auto: model.attention_kind=mla has values narrower than its queries and "
                        "keys, which flash-attn 2 does not take)")
    if sinks:
        if requested in ("sdpa", "flash_attn"):
            raise CapabilityError(f"model.attention={requested} cannot run model.attention_sinks: it has no sink term "
                                  "in its softmax; use model.attention=reference or auto")
        return "reference", ("attention: reference (model.attention_sinks: SDPA and flash-attn 2 have no sink term in "
                             "their softmax; the explicit path computes it exactly and keeps the (T, S) scores)")
    flash_ok, flash_why = _flash_usable(device, dtype, head_dim)
    windowed = "" if window is None else f", sliding window {window} as flash-attn's window_size"
    masked = "" if window is None else f"; sliding window {window} as an explicit (T, S) mask"
    if requested == "auto":
        if flash_ok:
            return "flash_attn", f"attention: flash_attn (auto: package installed, CUDA >= sm80, half precision{windowed})"
        return "sdpa", f"attention: sdpa (auto: flash_attn not used because {flash_why}{masked})"
    if requested == "flash_attn" and not flash_ok:
        raise CapabilityError(
            f"model.attention=flash_attn cannot run: {flash_why}; "
            "install with `pip install perfgpt[flash]` on a CUDA machine or use model.attention=sdpa"
        )
    return requested, f"attention: {requested} (requested{windowed if requested == 'flash_attn' else masked})"


def _flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"device is {device.type}, flash-attn needs CUDA"
    if not flash_attn_available():
        return False, "the flash_attn package is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FLASH_MIN_CAPABILITY:
        return False, f"this GPU has compute capability {major}.{minor}, flash-attn 2 needs 8.0 or newer (Ampere on)"
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"compute dtype is {dtype}, flash-attn needs fp16/bf16"
    if head_dim > 256:
        return False, f"head_dim={head_dim} > 256"
    return True, ""


class AttentionCore(nn.Module):
    """The part Korthikanti-style selective recompute re-runs: scores, softmax, dropout, @V.

    ``window``: this layer's sliding window in tokens (None: the whole context). ``sinks``: the
    layer has attention sinks, which only the reference path computes (module docstring)."""

    def __init__(self, backend: str, dropout: float, window: int | None = None, sinks: bool = False):
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
        self.backend = "reference" if sinks else backend
        self.dropout = dropout
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, T, H, D), k and v (B, S, H_kv, D) with H_kv dividing H -> (B, T, H, D).

        S > T when k/v come from a KV cache or cover a longer prefix than the queries (a context-
        parallel chunk, parallel/cp.py): the queries are the last T of S positions, and query i sees
        keys up to position S - T + i (the causal mask aligned bottom-right), and with a window none
        before S - T + i - window. ``documents`` (B, S), the document number of each key position,
        restricts each query to keys of its own document. ``sinks`` (H,): each head's sink logit.
        """
        p = self.dropout if self.training else 0.0
        if self.backend == "flash_attn":
            window = (-1, -1) if self.window is None else (self.window - 1, 0)
            if documents is not None:
                return flash_varlen_attention(q, k, v, documents, p, window)
            from flash_attn import flash_attn_func

            # (B, T, H, D) and GQA natively; causal and the window align bottom-right when S > T (flash-attn >= 2.1)
            return flash_attn_func(q, k, v, dropout_p=p, causal=True, window_size=window)
        mask = attention_mask(q.shape[1], k.shape[1], q.device, documents, self.window)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if self.backend == "sdpa":
            out = sdpa_attention(q, k, v, p, mask)
        else:
            groups = q.shape[1] // k.shape[1]
            out = reference_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), p, mask, sinks)
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return f"backend={self.backend}, dropout={self.dropout}{window}"


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv * groups, T, D), each head repeated for its group of query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA on (B, H, T, D) with k/v of H_kv heads; ``mask`` (B, 1, T, S) bool replaces the
    causal mask when given (``document_mask``).

    ``enable_gqa`` only helps where a fused kernel takes unequal head counts: the CPU flash kernel,
    and on CUDA the flash kernel (sm80+, fp16/bf16, head_dim <= 256). Elsewhere (fp32 on CUDA, older
    GPUs) SDPA would drop from the memory-efficient kernel to the math path, which materializes
    the (T, T) scores; repeating k/v first keeps the memory-efficient kernel.
    """
    groups = q.shape[1] // k.shape[1]
    causal = _sdpa_causal(q.shape[-2], k.shape[-2], q.device) if mask is None else {"attn_mask": mask}
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **causal)
    if _sdpa_takes_gqa(q):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=True, **causal)
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), dropout_p=dropout_p, **causal)


def _sdpa_causal(q_len: int, k_len: int, device: torch.device) -> dict:
    """SDPA's causal arguments; ``is_causal`` alone aligns the mask top-left, wrong for a KV cache."""
    if q_len == k_len:
        return {"is_causal": True}
    if q_len == 1:
        return {}  # the newest position sees every key
    return {"attn_mask": causal_mask(q_len, k_len, device)}


def causal_mask(q_len: int, k_len: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(q_len, k_len) bool, True where query i, at position k_len - q_len + i, may see key j: j up
    to that position, and with a ``window`` of W tokens, after its position - W."""
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)
    return allowed if window is None else allowed.triu(diagonal=k_len - q_len - window + 1)


def attention_mask(q_len: int, k_len: int, device: torch.device, documents: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor | None:
    """The mask that replaces a backend's plain causal one: (T, S) with a window, (B, 1, T, S) with
    documents; None when causal alone (every backend has its own)."""
    if documents is not None:
        return document_mask(documents, q_len, window)
    return None if window is None else causal_mask(q_len, k_len, device, window)


def document_mask(documents: torch.Tensor, q_len: int, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, S) bool: causal (bottom-right), within the window if any, and within one document.
    ``documents`` (B, S) numbers the document of each key position; the T queries are the last T
    positions. Each query sees at least itself, so no row is empty (an empty row would make
    softmax NaN)."""
    k_len = documents.shape[1]
    same = documents[:, -q_len:, None] == documents[:, None, :]  # (B, T, S)
    return (same & causal_mask(q_len, k_len, documents.device, window)).unsqueeze(1)


def document_mask_note(backend: str, batch: int, seq_len: int, cp: int = 1) -> str:
    """One log line: how the document mask runs on ``backend``, and what its mask costs."""
    if backend == "flash_attn":
        return "attention mask: document, through flash-attn's varlen kernel (no mask materialized)"
    q_len = seq_len // cp  # a context-parallel rank's queries; keys are the whole sequence
    size = batch * q_len * seq_len  # bool: one byte per (query, key)
    return (f"attention mask: document, as an explicit bool mask for {backend}: up to {batch} x {q_len} x {seq_len} = "
            f"{size / 2**20:.2f} MiB in each layer, kept for backward (SDPA then runs a kernel that takes a mask, not "
            "flash; flash-attn's varlen path has none)")


def document_spans(documents: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """flash-attn's varlen description of a document mask, flattened over the batch: cumulative
    query and key lengths per (row, document) span (int32, n + 1 entries), the flat index (into
    B * S) of the keys those spans cover, and the longest query and key span.

    Queries are the last ``q_len`` positions and keys run to the end, so a document's queries are
    the last of its keys: flash-attn's bottom-right causal alignment within each span is exact.
    Documents that end before the first query hold no query and are left out, keys included."""
    k_len = documents.shape[1]
    first = k_len - q_len
    q_counts, k_counts, key_index = [], [], []
    for r, row in enumerate(documents.tolist()):  # one host sync per call: the spans are the kernel's shapes
        start = 0
        for end in [i for i in range(1, k_len) if row[i] != row[i - 1]] + [k_len]:
            if end > first:
                q_counts.append(end - max(start, first))
                k_counts.append(end - start)
                key_index.extend(range(r * k_len + start, r * k_len + end))
            start = end
    device = documents.device
    cu_q = torch.tensor([0] + q_counts, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_counts, device=device).cumsum(0).to(torch.int32)
    return cu_q, cu_k, torch.tensor(key_index, device=device), max(q_counts), max(k_counts)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                           dropout_p: float, window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """The document mask through flash-attn's varlen kernel: every document a sequence of its own,
    nothing (T, S)-sized materialized. q (B, T, H, D), k and v (B, S, H_kv, D); ``window``
    flash-attn's window_size, aligned bottom-right in each document as the causal mask is."""
    from flash_attn import flash_attn_varlen_func

    b, t, h, d = q.shape
    cu_q, cu_k, keys, max_q, max_k = document_spans(documents, t)
    k, v = (z.reshape(-1, z.shape[2], d).index_select(0, keys) for z in (k, v))
    out = flash_attn_varlen_func(q.reshape(b * t, h, d), k, v, cu_q, cu_k, max_q, max_k,
                                 dropout_p=dropout_p, causal=True, window_size=window)
    return out.view(b, t, h, d)


def _sdpa_takes_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA gets the narrow k/v (enable_gqa): on CPU, and on CUDA where its flash kernel
    runs (16-bit, head dim <= 256, Ampere or later); other CUDA kernels get k/v repeated per group."""
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
        return False
    return torch.cuda.get_device_capability(q.device) >= FLASH_MIN_CAPABILITY


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                        mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + causal mask) V on q (B, H, T, D), k and v (B, H, S >= T, D); softmax in fp32.
    ``mask`` (T, S) or (B, 1, T, S) bool replaces the causal mask when given (``attention_mask``).
    ``sinks`` (H,): one more logit per head in the softmax, whose probability goes to no value."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    allowed = causal_mask(q.shape[-2], k.shape[-2], q.device) if mask is None else mask
    scores = scores.masked_fill(~allowed, float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """(H,) per query head, the largest pre-softmax logit q . k / sqrt(D) over every query and the
    keys it may see (causal, within ``window`` tokens and within its document when given), over the batch.
    q (B, T, H, D), k (B, S, H_kv, D), the last T of S positions being the queries.

    What QK-clip reads (parallel/qk_clip.py). It recomputes QK^T, which no fused kernel returns, in
    fp32 and in blocks of queries so the scores held at once stay small."""
    b, t, h, d = q.shape
    q = q.transpose(1, 2).float()  # (B, H, T, D)
    k = repeat_kv(k.transpose(1, 2), h // k.shape[2]).float()  # (B, H, S, D)
    allowed = causal_mask(t, k.shape[2], q.device, window) if documents is None else document_mask(documents, t, window)
    best = torch.full((h,), float("-inf"), device=q.device)
    block = max(1, 2**22 // max(1, b * h * k.shape[2]))
    for start in range(0, t, block):
        scores = (q[:, :, start:start + block] @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        scores = scores.masked_fill(~allowed[..., start:start + block, :], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


class KVCache:
    """Keys and values of every layer, kept between generation steps so each new token attends
    to the past without recomputing it.

    Per layer (B, positions, n_kv_head, D): only the key/value heads, so grouped-query attention
    shrinks the cache by n_head / n_kv_head. Latent attention (``model.gpt.LatentAttention``) keeps
    one "head" of its latent in the keys' place and its rotary key in the values' (``value_dim``:
    their widths differ), kv_lora_rank + qk_rope_head_dim numbers per token and layer. A layer with a sliding window of W tokens keeps only
    its last W - 1 positions (what the next token can still see), so its memory stays bounded
    however long the generation runs; the others keep every position up to ``max_len``.
    ``length`` positions have been seen; the model passes the next T to every layer at
    [length, length + T), then ``advance(T)``.
    """

    def __init__(self, n_layer: int, batch: int, max_len: int, n_kv_head: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype, windows: list[int | None] | None = None,
                 value_dim: int | None = None):
        self.max_len, self.length = max_len, 0
        self.windows = list(windows) if windows is not None else [None] * n_layer
        held = [max_len if w is None else min(max_len, w - 1) for w in self.windows]
        self.keys = [torch.zeros((batch, n, n_kv_head, head_dim), device=device, dtype=dtype) for n in held]
        self.values = [torch.zeros((batch, n, n_kv_head, value_dim or head_dim), device=device, dtype=dtype)
                       for n in held]

    def layer(self, index: int) -> "LayerKV":
        return LayerKV(self, index)

    def advance(self, t: int) -> None:
        self.length += t


class LayerKV:
    """One layer's view of a ``KVCache``: what ``Attention.forward`` receives."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, T, H_kv, D) after the cached positions; return the positions the T new
        queries may see, in order, ending with these T (the queries are the last T of them)."""
        start, keys, values = self.cache.length, self.cache.keys[self.index], self.cache.values[self.index]
        end = start + k.shape[1]
        if end > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} positions; {end} were asked for")
        if self.cache.windows[self.index] is None:
            keys[:, start:end], values[:, start:end] = k, v
            return keys[:, :end], values[:, :end]
        # A window: the store holds the last min(start, W - 1) positions in order; keep the newest again.
        held = min(start, keys.shape[1])
        k_all, v_all = torch.cat([keys[:, :held], k], dim=1), torch.cat([values[:, :held], v], dim=1)
        keep = min(keys.shape[1], k_all.shape[1])
        if keep:
            keys[:, :keep], values[:, :keep] = k_all[:, -keep:], v_all[:, -keep:]
        return k_all, v_all
