"""Context parallelism: every sequence split over the cp ranks, attention still exact over all of it.

Applied in place to a built GPT over the ``cp`` mesh dimension (``apply_context_parallel``); the
model code has no cp in it. With cp ranks and sequences of T tokens:

    split      the sequence is cut into 2*cp chunks of c = T / (2 cp) tokens; rank i keeps chunks
               i and 2cp-1-i. Under a causal mask chunk g attends to (g + 1) c keys, so every rank
               does (i + 1) + (2cp - i) = 2cp + 1 chunk-lengths of key work: the same on all ranks
               (a plain split into cp pieces would leave the last rank cp times the first's work).
    positions  each token keeps its position in the whole sequence (RoPE, learned positions).
    attention  per layer, the keys and values (only the KV heads, under GQA) are all-gathered over
               the cp group and put back in sequence order; each local query chunk g attends to the
               prefix of (g + 1) c keys, with the causal mask aligned bottom-right, which every
               backend does (flash-attn, SDPA, the reference). Backward reduce-scatters (sums) the
               gradients of the gathered keys and values back to the ranks that computed them.
               This is the all-gather form Llama 3 used in production: exact, backend-independent,
               and its traffic is 2 (cp - 1) / cp of one layer's K/V per rank. A layer with a
               sliding window of W tokens gives each chunk only the keys its queries can see,
               from W - 1 before the chunk's start on (crossing into earlier chunks as needed).
               Latent attention (model.attention_kind=mla) gathers what its keys and values are
               made from instead: the normalised latent and the rotated shared key, kv_lora_rank +
               qk_rope_head_dim numbers per token (DeepSeek-V3: 576, where its keys and values
               are 320 per head: 40,960 for its 128 heads, or 128 / tp of them), and every rank
               up-projects the whole sequence's keys and values from them. The price is that
               up-projection repeated for the other ranks' tokens: 2 x 512 x 256 FLOPs per head and
               token in DeepSeek-V3, where the causal scores and values cost 320 x T on average
               (T = 4096: 1.3M). Its backward's latent gradients are reduce-scattered as K/V's are.
    loss       each rank returns cp * (its summed token losses) / (tokens of the whole sequence), so
               the mean over the cp ranks is the mean over every token, and the gradients the cp
               ranks average (as data-parallel ranks: ``ParallelDims.fsdp_dims`` folds cp into the
               FSDP2 shard dimension, as torchtitan does) are those of that mean. An MoE layer's
               load-balancing loss takes its expert counts summed over the cp group (the whole
               sequences' load) and its mean scores from the local tokens, so its cp mean is exact too.
    MTP        the multi-token-prediction depths read the tokens k ahead, which lie in other chunks:
               every cp rank has the whole sequences' ids and targets, so each takes its positions of
               the shifted ones (``tokens_ahead``), and scales each depth's loss as above.
    capacity   an MoE layer with a capacity factor counts it over the whole sequences and keeps the
               copies one process keeps: the cp ranks exchange their per-chunk expert counts (one
               small all-gather per layer) to know how many copies of each expert come before theirs.

Every cp rank of one data-parallel rank reads the same batch (they share ``dp_rank``) and keeps its
chunks; with a document mask the document numbers are taken from the whole sequence before the
split, so a chunk knows which document its first token continues.

Under pipeline parallelism every stage is made context-parallel over its own cp group (the cp ranks
of one stage gather K/V among themselves). The first stage cuts the token ids into this rank's
chunks; a later stage receives only the hidden states of those chunks, so the pipeline gives every
stage the whole sequence's length and document numbers with its micro-batch (parallel/pp.py), from
which it takes its positions; the last stage's loss is scaled as above (``scale_local_loss``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from data.bundle import IGNORE_INDEX
from model.attention import AttentionCore
from model.gpt import GPT, LatentAttention, document_positions, tokens_ahead
from model.moe import moe_layers


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2*cp sequence chunks this cp rank holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def local_token_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(seq_len / cp,) the positions in the whole sequence of the tokens this cp rank holds."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in chunk_ids(cp, rank)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading dimension (cp, *x.shape); backward reduce-scatters (sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))  # ranks along dim 0
        dist.all_gather_single(out, x, group=group)
        return out.unflatten(0, (-1, x.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.flatten(0, 1).contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T/cp, ...) the chunks of every cp rank -> (B, T, ...) in sequence order."""
    parts = _GatherSequence.apply(local, group)  # (cp, B, 2c, ...)
    parts = parts.unflatten(2, (2, -1))  # (cp, B, 2, c, ...): each rank's two chunks
    # Chunks 0..cp-1 are the ranks' first chunks in rank order; chunks cp..2cp-1 their second ones,
    # in reverse rank order.
    chunks = torch.cat([parts[:, :, 0], parts.flip(0)[:, :, 1]])  # (2cp, B, c, ...)
    return chunks.movedim(0, 1).flatten(1, 2)


def gather_latent(latent: torch.Tensor, k_rot: torch.Tensor, group: dist.ProcessGroup
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention's keys and values for the whole sequence, from what every cp rank holds of
    it: the normalised latent (B, T/cp, 1, kv_lora_rank) and the rotated shared key (B, T/cp, 1,
    qk_rope_head_dim), in one collective; each rank then up-projects every position's keys and
    values itself (``model.gpt.LatentAttention``)."""
    whole = gather_sequence(torch.cat((latent, k_rot), dim=-1), group)
    return whole.split((latent.shape[-1], k_rot.shape[-1]), dim=-1)


class ContextParallelCore(nn.Module):
    """An attention core over a cp rank's two chunks: gathers the keys and values of the whole
    sequence, then runs the wrapped core once per chunk against the keys it may see."""

    def __init__(self, inner: AttentionCore, group: dist.ProcessGroup, cp: int, rank: int, keys_whole: bool = False):
        super().__init__()
        self.inner, self.group, self.chunks, self.keys_whole = inner, group, chunk_ids(cp, rank), keys_whole

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: this rank's chunks (B, 2c, heads, D); k, v: the same chunks, or with ``keys_whole`` the
        whole sequence's (latent attention gathered its latent instead); ``documents`` (B, T): of the
        whole sequence."""
        if self.keys_whole:
            k_all, v_all = k, v
        else:
            kv = gather_sequence(torch.stack((k, v), dim=2), self.group)  # one collective: (B, T, 2, H_kv, D)
            k_all, v_all = kv.unbind(2)
        c = q.shape[1] // 2
        window = self.inner.window
        out = []
        for j, g in enumerate(self.chunks):
            end = (g + 1) * c  # keys up to the end of this chunk; the queries are its last c of them
            # With a sliding window the chunk's first query sees back to end - c - window + 1 only; the
            # keys before, possibly in earlier chunks, are left out (the masks align bottom-right).
            start = 0 if window is None else max(0, end - c - window + 1)
            docs = None if documents is None else documents[:, start:end]
            out.append(self.inner(q[:, j * c:(j + 1) * c], k_all[:, start:end], v_all[:, start:end], docs, sinks))
        return torch.cat(out, dim=1)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"


class ContextParallelGPT(GPT):
    """A GPT whose ``forward`` takes whole sequences and runs this cp rank's chunks of them.

    Installed by swapping the class of a built GPT (as FSDP2 and model/recompute.py do), so module
    names and state_dict keys stay those of the plain model. Logits come back for the local tokens
    only (``local_token_index`` says which); the loss as described in the module docstring.

    A pipeline stage without the embedding takes the hidden states of this rank's tokens from the
    stage before; the pipeline passes it the whole sequence's length (``seq_len``) and document
    numbers (``documents``), which one process derives from the token ids (parallel/pp.py).
    """

    cp_group: dist.ProcessGroup
    cp: int
    cp_rank: int

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache=None, *,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                seq_len: int | None = None, ahead_ids: torch.Tensor | None = None,
                ahead_targets: torch.Tensor | None = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("a context-parallel model does not generate with a KV cache; generate with the plain model")
        takes_ids = self.takes_ids
        if not takes_ids and seq_len is None:
            raise ValueError("a context-parallel pipeline stage without the embedding needs seq_len, the length of "
                             "the whole sequence its hidden states are chunks of")
        t = idx.shape[1] if takes_ids else seq_len
        index = local_token_index(t, self.cp, self.cp_rank, idx.device)
        if documents is None:
            documents = self.document_ids(idx)  # of the whole sequence: keys span all of it
        if positions is None:
            restart = documents is not None and self.cfg.document_positions
            positions = document_positions(documents) if restart else torch.arange(t, device=idx.device)
        positions = positions[..., index]
        ahead = {}
        if self.mtp is not None and self.lm_head is not None and self.training and torch.is_grad_enabled() and (
                ahead_ids is not None or targets is not None):
            # The tokens ahead of this rank's positions cross into other chunks: taken from the whole
            # sequences (every cp rank holds them), each depth's loss scaled as the next-token loss is.
            if ahead_ids is None:
                ahead_ids, ahead_targets = tokens_ahead(idx, targets, len(self.mtp), documents)
            scale = torch.stack([scale_local_loss(torch.ones((), device=idx.device), ahead_targets[:, k], self.cp,
                                                  self.cp_rank) for k in range(len(self.mtp))])
            ahead = {"ahead_ids": ahead_ids[..., index], "ahead_targets": ahead_targets[..., index],
                     "ahead_scale": scale}
        out = super().forward(idx[:, index] if takes_ids else idx, None if targets is None else targets[:, index],
                              positions=positions, documents=documents, **ahead)
        return out if targets is None else scale_local_loss(out, targets, self.cp, self.cp_rank)


def scale_local_loss(loss: torch.Tensor, targets: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """``loss``, the mean over this cp rank's real targets of ``targets`` (B, T, the whole sequence's),
    rescaled so that the cp ranks' mean is the mean over the whole sequence's real targets (the
    counts are known here: every rank has all targets)."""
    local = (local_targets(targets, cp, cp_rank) != IGNORE_INDEX).sum()
    total = (targets != IGNORE_INDEX).sum().clamp(min=1)
    return torch.where(local > 0, loss * (local * cp / total), loss.new_zeros(()))


def local_targets(targets: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """(B, T / cp) the targets of this cp rank's tokens, from the whole sequence's (B, T)."""
    return targets[:, local_token_index(targets.shape[1], cp, cp_rank, targets.device)]


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def earlier_on_other_ranks(experts: torch.Tensor, n_experts: int, group: dist.ProcessGroup, cp: int, rank: int
                           ) -> tuple[torch.Tensor, int]:
    """For this cp rank's expert choices (B, 2c, k) (its two chunks of each sequence): per choice, the
    choices of the same expert that other cp ranks hold and that one process would meet before it
    (``model.moe.permute``'s ``earlier``), and the tokens of the whole sequences (capacity's T).
    One all-gather of the per-chunk expert counts (B, 2, E)."""
    b, s, k = experts.shape
    counts = chunk_expert_counts(experts, n_experts)
    gathered = counts.new_empty((cp * b, 2, n_experts))
    dist.all_gather_single(gathered, counts, group=group)
    return earlier_from_counts(gathered.unflatten(0, (cp, b)), experts, rank), b * s * cp


def chunk_expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(B, 2, E): how many of a cp rank's choices (B, 2c, k) in each of its two chunks go to each expert."""
    per_chunk = experts.reshape(experts.shape[0], 2, -1)  # (B, 2, c*k)
    counts = torch.zeros(*per_chunk.shape[:2], n_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(2, per_chunk, torch.ones_like(per_chunk))


def earlier_from_counts(counts: torch.Tensor, experts: torch.Tensor, rank: int) -> torch.Tensor:
    """``earlier_on_other_ranks``'s first value from every cp rank's ``chunk_expert_counts`` (cp, B, 2, E).

    In one process an expert keeps its copies in token order (row by row, position by position), so
    a copy's place is the copies of its expert in every chunk before its own (all ranks') plus those
    before it in its chunk; this rank counts only its own chunks before, and the difference is what
    the other ranks add."""
    cp, b, s, k = counts.shape[0], *experts.shape
    # Chunks in sequence order: 0..cp-1 are the ranks' first chunks, cp..2cp-1 their second, reversed.
    ordered = torch.cat([counts[:, :, 0], counts.flip(0)[:, :, 1]]).movedim(0, 1).flatten(0, 1)  # (B*2cp, E)
    before_all = (ordered.cumsum(0) - ordered).unflatten(0, (b, 2 * cp))
    mine = counts[rank].flatten(0, 1)
    before_mine = (mine.cumsum(0) - mine).unflatten(0, (b, 2))
    earlier = before_all[:, list(chunk_ids(cp, rank))] - before_mine  # (B, 2, E)
    return earlier.gather(2, experts.reshape(b, 2, -1)).view(b, s, k)


def apply_context_parallel(model: GPT, cp_group: dist.ProcessGroup | None) -> None:
    """Split ``model``'s sequences over ``cp_group`` (a no-op without one), in place: the GPT's
    class becomes ``ContextParallelGPT`` and each block's attention core a ``ContextParallelCore``."""
    if cp_group is None:
        return
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    for block in [*model.blocks.values(), *(module.block for module in model.mtp or [])]:
        latent = isinstance(block.attn, LatentAttention)
        if latent:
            block.attn.gather_latent = functools.partial(gather_latent, group=cp_group)
        block.attn.core = ContextParallelCore(block.attn.core, cp_group, cp, rank, keys_whole=latent)
    for moe in moe_layers([model]):
        moe.sum_over_sequence = functools.partial(_all_reduce_sum, group=cp_group)
        if moe.token_mean is None:  # under tp's sequence slices capacity stays per slice (model/moe.py)
            moe.earlier_elsewhere = functools.partial(earlier_on_other_ranks, n_experts=moe.n_experts,
                                                      group=cp_group, cp=cp, rank=rank)
    model.cp_group, model.cp, model.cp_rank = cp_group, cp, rank
    model.__class__ = type(f"ContextParallel{type(model).__name__}", (ContextParallelGPT, type(model)), {})
