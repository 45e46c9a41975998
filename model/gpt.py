"""A decoder-only GPT, readable top to bottom.

    tokens -> embedding (+ learned positions) -> n_layer x Block -> final norm -> LM head
    Block:  x + Attention(Norm(x)),  then  x + MLP(Norm(x))        (pre-norm)
            the MLP is routed experts (model/moe.py) in the layers the model.moe.* keys pick;
            attention has a sliding window in the layers model.sliding_window_* pick, and
            optionally sinks (a learned logit per head in the softmax) and biases

Nothing here knows about process groups, precision policies or checkpointing; those are
applied to a built model from ``parallel/`` and ``training/``. Fast paths plug in through two
seams: the attention backend (``model/attention.py``) and the fused ops (``kernels/registry.py``).

Two layout choices let ``parallel/`` split the model without changing it. The fused QKV
projection stores, for each key/value head, its query heads' rows, then its key rows, then its
value rows (``group_qkv``), so any contiguous slice of whole key/value groups is a complete set
of heads (tensor parallelism shards it by rows). ``blocks`` is keyed by layer index, so a
pipeline stage that keeps some blocks keeps their names, and a stage without the embedding or the
head (``None``) takes hidden states in or gives them out.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from common.values import local_shard
from kernels.reference import clamped_swiglu
from kernels.registry import REFERENCE_OPS, KernelOps
from model.attention import AttentionCore, KVCache, LayerKV, head_max_logits
from model.config import ModelConfig
from model.moe import MoE, join_aux_gradient, take_aux_loss, with_aux_gradient
from model.mup import output_multiplier, query_scale, scale_hidden_init
from model.rope import latent_softmax_gain, rope_tables
from model.te import TEBlock


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) each token's position inside its document, from the (B, T) document numbers."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values  # where each document begins
    return index - first


IGNORED_TARGET = -100  # a target the loss leaves out: torch's cross_entropy default (data/bundle.py IGNORE_INDEX)


def tokens_ahead(idx: torch.Tensor, targets: torch.Tensor, depth: int, documents: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, D, T) twice, for the multi-token-prediction depths k = 1..D: at position i the token id
    k ahead (idx[i + k]) and its target (targets[i + k]). Where i + k is past the sequence or, under
    the document mask, in another document than i, the target is ``IGNORED_TARGET`` (the id, 0, is
    never read by a kept target: those positions are causally after every kept one of the same
    document). Every depth keeps the whole length T, so a split of the sequence (tensor-parallel
    slices, context-parallel chunks) takes its positions of these as it takes its positions of x."""
    b, t = idx.shape
    ids, tgts = [], []
    for k in range(1, depth + 1):
        k = min(k, t)
        ids.append(torch.cat([idx[:, k:], idx.new_zeros(b, k)], dim=1))
        tail = torch.full((b, k), IGNORED_TARGET, dtype=targets.dtype, device=targets.device)
        ahead = torch.cat([targets[:, k:], tail], dim=1)
        if documents is not None:
            same = torch.zeros_like(documents, dtype=torch.bool)
            same[:, : t - k] = documents[:, k:] == documents[:, : t - k]
            ahead = torch.where(same, ahead, IGNORED_TARGET)
        tgts.append(ahead)
    return torch.stack(ids, 1), torch.stack(tgts, 1)


def document_ids(cfg: ModelConfig, idx: torch.Tensor) -> torch.Tensor | None:
    """(B, T) the document number of each token id under model.attention_mask=document, else None.
    A document ends with (and includes) its end-of-text token; the next token starts another."""
    if cfg.attention_mask != "document":
        return None
    if cfg.eot_id is None:
        raise ValueError("model.attention_mask=document needs model.eot_id (the end-of-text id)")
    ends = (idx == cfg.eot_id).int()
    return ends.cumsum(1) - ends  # end-of-text tokens before this one


class Norm(nn.Module):
    """LayerNorm or RMSNorm whose statistics are computed in fp32 whatever the input dtype.

    ``width``/``kind`` default to the residual stream's; a head's query/key norm is an RMSNorm
    of head_dim."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, width: int | None = None, kind: str | None = None,
                 eps: float | None = None):
        super().__init__()
        self.kind, self.eps, self.ops = kind or cfg.norm, cfg.norm_eps if eps is None else eps, ops
        self.weight = nn.Parameter(torch.ones(width or cfg.d_model))
        with_bias = cfg.bias and self.kind == "layernorm"
        self.bias = nn.Parameter(torch.zeros(width or cfg.d_model)) if with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


def truncated_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std) redrawn beyond 3 std, in place: no rare huge initial weight."""
    return nn.init.trunc_normal_(weight, 0.0, std, -3 * std, 3 * std)


def group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """Rows of separate q, k, v projections (weights or biases) in the fused layout: for each
    key/value head, the rows of the query heads that read it, its key rows, its value rows."""
    q, k, v = (z.reshape(n_kv_head, -1, *z.shape[1:]) for z in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def split_qkv(fused: torch.Tensor, n_head: int, n_kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``group_qkv``: (q, k, v) rows in head order."""
    group = n_head // n_kv_head
    per_head = fused.shape[0] // (n_kv_head * (group + 2))
    g = fused.reshape(n_kv_head, group + 2, per_head, *fused.shape[1:])
    q = g[:, :group].reshape(-1, *fused.shape[1:])
    return q, g[:, group].reshape(-1, *fused.shape[1:]), g[:, group + 1].reshape(-1, *fused.shape[1:])


def indexed_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, block) for ``model.blocks``: a GPT's ModuleDict keyed by layer index (a
    pipeline stage keeps only some keys), or a plain ModuleList counted from 0."""
    blocks = model.blocks
    if isinstance(blocks, nn.ModuleDict):
        return [(int(name), block) for name, block in blocks.items()]
    return list(enumerate(blocks))


class Sinks(nn.Module):
    """gpt-oss's attention sinks: one learned logit per head that joins the head's softmax and
    carries no value. A module of its own so tensor parallelism splits it by heads, as it splits
    the projections (parallel/tp.py)."""

    def __init__(self, n_head: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_head))

    def forward(self) -> torch.Tensor:
        return self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention_backend: str, layer_idx: int = 0):
        super().__init__()
        self.group, self.head_dim, self.ops = cfg.n_head // cfg.kv_heads, cfg.head_dim, ops
        self.use_rope = cfg.position == "rope"
        self.qkv = nn.Linear(cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim, bias=cfg.has_qkv_bias)  # rows: see group_qkv
        self.qkv.init_rows = lambda q_k_v: group_qkv(*q_k_v.split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim)), cfg.kv_heads)
        # Qwen3's query/key norms: one RMSNorm of head_dim shared by the heads, before the rotation.
        self.q_norm = Norm(cfg, ops, cfg.head_dim, "rmsnorm") if cfg.qk_norm else None
        self.k_norm = Norm(cfg, ops, cfg.head_dim, "rmsnorm") if cfg.qk_norm else None
        self.sinks = Sinks(cfg.n_head) if cfg.attention_sinks else None
        self.core = AttentionCore(attention_backend, cfg.dropout, cfg.window_of(layer_idx), cfg.attention_sinks)
        self.proj = nn.Linear(cfg.q_dim, cfg.d_model, bias=cfg.has_proj_bias)
        self.proj.residual_projection = True  # scaled init, see GPT.init_weights
        self.resid_drop = nn.Dropout(cfg.dropout)
        # QK-clip's seam (parallel/qk_clip.py): a tensor here asks training forwards to keep each
        # head's largest attention logit in it (a running max, reset by the optimizer step); None: off.
        self.max_logit: torch.Tensor | None = None
        self.q_scale = query_scale(cfg)  # µP: attention logits over d_head, not sqrt(d_head) (model/mup.py)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: LayerKV | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # Per key/value head: its query heads, its key, its value. Head counts are read from the
        # projection's width, which is all of them, or a tensor-parallel rank's share.
        h = self.qkv(x).view(b, t, -1, self.group + 2, self.head_dim)  # (B, T, H_kv, group + 2, D)
        # split, not indexing: its backward concatenates the three gradients into one buffer,
        # where each index's backward would zero-fill and add a whole (B, T, H_kv, group + 2, D) copy.
        q, k, v = h.split((self.group, 1, 1), dim=3)
        q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3)  # (B, T, H, D), (B, T, H_kv, D) twice
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.ops.apply_rope(q, *rope), self.ops.apply_rope(k, *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if cache is not None:  # generation: attend to the earlier positions this layer sees too
            k, v = cache.update(k, v)
        if self.max_logit is not None and self.training and torch.is_grad_enabled():
            self.max_logit = torch.maximum(self.max_logit, head_max_logits(q, k, documents, self.core.window))
        y = self.core(q, k, v, documents, None if self.sinks is None else self.sinks()).flatten(2)  # (B, T, H * D)
        return self.resid_drop(self.proj(y))


LATENT_NORM_EPS = 1e-6  # DeepSeek's query and key/value latent norms keep their own epsilon, whatever the model's


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA), model.attention_kind=mla.

        query:  x -> q_down (q_lora_rank) -> RMSNorm -> q_up -> per head [nope | rope]   (or one projection)
        keys:   x -> kv_down -> [latent (kv_lora_rank) | one rotary key (qk_rope_head_dim)]
                latent -> RMSNorm -> kv_up -> per head [key nope | value]
                key = [key nope | the shared rotary key], the same rotary part in every head

    A generation cache keeps only the normalised latent and the rotated shared key per token
    (``kv_lora_rank + qk_rope_head_dim`` numbers, whatever the head count) and up-projects them at
    every step. Head counts are read from the projections' widths, as in ``Attention``.
    """

    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention_backend: str, layer_idx: int = 0):
        super().__init__()
        self.ops, self.nope, self.rope, self.v_dim = ops, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_down, self.q_norm = None, None
            self.q_up = nn.Linear(cfg.d_model, cfg.q_dim, bias=False)
        else:
            self.q_down = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=cfg.has_qkv_bias)
            self.q_norm = Norm(cfg, ops, cfg.q_lora_rank, "rmsnorm", LATENT_NORM_EPS)
            self.q_up = nn.Linear(cfg.q_lora_rank, cfg.q_dim, bias=False)
        self.kv_down = nn.Linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.has_qkv_bias)
        self.kv_norm = Norm(cfg, ops, cfg.kv_lora_rank, "rmsnorm", LATENT_NORM_EPS)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, cfg.n_head * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        # The scores' scale is 1/sqrt(nope + rope) (the core's, from the query width) times this.
        self.gain = latent_softmax_gain(cfg.rope_scaling)
        # flash-attn 2 wants values as wide as keys; model.attention=flash_attn is refused, auto's pick replaced
        self.core = AttentionCore("sdpa" if attention_backend == "flash_attn" else attention_backend, cfg.dropout)
        self.proj = nn.Linear(cfg.n_head * cfg.v_head_dim, cfg.d_model, bias=cfg.has_proj_bias)
        self.proj.residual_projection = True
        self.resid_drop = nn.Dropout(cfg.dropout)
        # Context parallelism's seam (parallel/cp.py): a function that turns this rank's chunks of the
        # latent and rotary key into the whole sequence's, in order; the keys and values are then
        # up-projected from those. None: the input is the whole sequence.
        self.gather_latent = None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: LayerKV | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_up(x if self.q_down is None else self.q_norm(self.q_down(x)))
        q_nope, q_rot = q.view(b, t, -1, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        latent, k_rot = self.kv_down(x).split((self.kv_rank, self.rope), dim=-1)
        latent, k_rot = self.kv_norm(latent).unsqueeze(2), self.ops.apply_rope(k_rot.unsqueeze(2), *rope)
        if cache is not None:  # (B, S, 1, kv_lora_rank) and (B, S, 1, qk_rope_head_dim): what the cache holds
            latent, k_rot = cache.update(latent, k_rot)
        elif self.gather_latent is not None:
            latent, k_rot = self.gather_latent(latent, k_rot)
        kv = self.kv_up(latent.squeeze(2))
        k_nope, v = kv.view(*kv.shape[:2], -1, self.nope + self.v_dim).split((self.nope, self.v_dim), dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, self.ops.apply_rope(q_rot, *rope)], dim=-1)
        if self.gain != 1.0:
            q = q * self.gain
        y = self.core(q, k, v, documents).flatten(2)  # (B, T, H * v_head_dim)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """GELU: out(gelu(fc(x))). SwiGLU: out(silu(gate(x)) * fc(x)), fc being the "up" projection;
    with model.swiglu_limit, gpt-oss's clamped form (kernels/reference.py ``clamped_swiglu``)."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.gelu_approximate = "tanh" if cfg.gelu == "tanh" else "none"  # torch's names for the two forms
        self.clamp = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)
        # The gate is registered first: GPT.init_weights draws it before fc, as it drew the gate
        # half of the fused gate|up projection this replaces, so a seed gives the same weights.
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.out.residual_projection = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None and self.clamp is not None:
            h = clamped_swiglu(self.gate(x), self.fc(x), *self.clamp)
        elif self.gate is not None:
            h = self.ops.swiglu(self.gate(x), self.fc(x))
        else:
            h = self.ops.bias_gelu(self.fc(x), None, self.gelu_approximate)  # the bias is in the GEMM
        return self.drop(self.out(h))


def make_mlp(cfg: ModelConfig, ops: KernelOps, expert_backend: str, layer_idx: int) -> nn.Module:
    """A block's MLP: dense, or routed experts (model/moe.py) in the layers the model.moe.* keys pick."""
    if not cfg.is_moe_layer(layer_idx):
        return MLP(cfg, ops)
    width = cfg.moe.shared_experts * cfg.expert_d_ff
    shared = MLP(dataclasses.replace(cfg, d_ff=width), ops) if width else None
    return MoE(cfg, ops, expert_backend, shared=shared, layer_idx=layer_idx)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention_backend: str, expert_backend: str = "loop",
                 layer_idx: int = 0):
        super().__init__()
        self.norm1 = Norm(cfg, ops)
        self.attn = (LatentAttention if cfg.is_mla else Attention)(cfg, ops, attention_backend, layer_idx)
        self.norm2 = Norm(cfg, ops)
        self.mlp = make_mlp(cfg, ops, expert_backend, layer_idx)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: LayerKV | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cache, documents)
        return x + self.mlp(self.norm2(x))


class MTPModule(nn.Module):
    """One multi-token-prediction module (DeepSeek-V3): position i joins the previous depth's hidden
    state at i with the embedding of the token k positions ahead, each RMS-normalised, projects the
    pair [h; e] back to d_model and runs one block; its own final norm, then the model's shared head,
    predicts the token k + 1 ahead. Embedding and head are the model's (passed in, not held)."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention_backend: str, expert_backend: str,
                 layer_idx: int):
        super().__init__()
        self.norm_h, self.norm_e = Norm(cfg, ops), Norm(cfg, ops)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg, ops, attention_backend, expert_backend, layer_idx)
        self.norm_out = Norm(cfg, ops)

    def forward(self, h: torch.Tensor, ahead: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, C) the previous depth's states, ``ahead`` (B, T, C) the embeddings k ahead -> this
        depth's states (B, T, C) and their final norm, for the head (inside forward: FSDP2 gathers the
        module's parameters for its forward only)."""
        h = self.block(self.proj(torch.cat([self.norm_h(h), self.norm_e(ahead)], dim=-1)), rope, None, documents)
        return h, self.norm_out(h)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps = REFERENCE_OPS, attention_backend: str = "sdpa",
                 expert_backend: str = "loop"):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # False: a pipeline stage after the first, whose input is hidden states; the last stage may
        # keep ``tok_emb`` all the same, for its multi-token-prediction modules (parallel/pp.py).
        self.takes_ids = True
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): self._make_block(cfg, ops, attention_backend, expert_backend, i)
                                     for i in range(cfg.n_layer)})
        self.norm_f = Norm(cfg, ops)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Multi-token prediction, after the head in the state dict's order; its blocks number on from the last.
        self.mtp = nn.ModuleList([MTPModule(cfg, ops, attention_backend, expert_backend, cfg.n_layer + k)
                                  for k in range(cfg.mtp_depth)]) if cfg.mtp_depth else None
        # Sum and count of the multi-token-prediction losses (mean over depths, detached) since the log read them.
        self.mtp_window: list[torch.Tensor] = []
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.output_multiplier = output_multiplier(cfg)  # µP: logits x base width / width (model/mup.py)
        # Rotary tables are derived, not learned: non-persistent, rebuilt by init_weights().
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @staticmethod
    def _make_block(cfg: ModelConfig, ops: KernelOps, attention_backend: str, expert_backend: str,
                    layer_idx: int) -> nn.Module:
        if cfg.layers == "te":
            return TEBlock(cfg, layer_idx)
        return Block(cfg, ops, attention_backend, expert_backend, layer_idx)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The initial weights of ``model.init``; norm gains one, biases and sinks zero;
        under µP the hidden matrices then scaled by (width / base width)^-1/2 (model/mup.py).

        gpt2: N(0, 0.02) everywhere, residual projections N(0, 0.02/sqrt(2L)). llama: ``_init_llama``.
        Called after construction, and again after a meta-device model is materialized.
        """
        if self.cfg.init == "llama":
            self._init_llama()
        else:
            self._init_gpt2()
        scale_hidden_init(self, self.cfg)
        for module in self.modules():
            if isinstance(module, Sinks):
                nn.init.zeros_(module.weight)  # a sink starts as one more unit of softmax mass
        if self.cfg.position == "rope":
            self.rope_cos, self.rope_sin = rope_tables(self.cfg, next(self.parameters()).device)

    def _init_gpt2(self) -> None:
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                w_std = out_std if getattr(module, "residual_projection", False) else std
                if hasattr(module, "init_rows"):  # drawn in q, k, v order, stored grouped
                    module.weight.copy_(module.init_rows(torch.empty_like(module.weight).normal_(0.0, w_std)))
                else:
                    nn.init.normal_(module.weight, 0.0, w_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, MoE):  # its router is an nn.Linear, drawn above
                module.init_weights(std, out_std)
            elif isinstance(module, Norm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def _init_llama(self) -> None:
        """torchtitan's Llama scheme: normals truncated at 3 std; in block i the output projections
        (attention's, the MLP's up and down) std/sqrt(2(i + 1)), so deeper blocks add less to the
        residual stream at first; a unit-variance token table and an LM head of std d_model^-0.5,
        so the first logits have unit scale (a tied table is drawn as the head)."""
        std = self.cfg.init_std
        for i, block in indexed_blocks(self):
            out_std = std / math.sqrt(2 * (i + 1))
            up = {id(m.fc) for m in block.modules() if isinstance(m, MLP) and m.gate is not None}  # SwiGLU's
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    w_std = out_std if id(module) in up or getattr(module, "residual_projection", False) else std
                    truncated_normal_(module.weight, w_std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, MoE):  # its router is an nn.Linear, drawn above
                    module.init_weights(std, out_std, draw=truncated_normal_, up_std=out_std)
                elif isinstance(module, Norm):
                    nn.init.ones_(module.weight)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
        for k, module in enumerate(self.mtp or []):  # as block n_layer + k, its projection an input one
            out_std = std / math.sqrt(2 * (self.cfg.n_layer + k + 1))
            up = {id(m.fc) for m in module.modules() if isinstance(m, MLP) and m.gate is not None}
            for sub in module.modules():
                if isinstance(sub, nn.Linear):
                    residual = id(sub) in up or getattr(sub, "residual_projection", False)
                    truncated_normal_(sub.weight, out_std if residual else std)
                elif isinstance(sub, MoE):
                    sub.init_weights(std, out_std, draw=truncated_normal_, up_std=out_std)
                elif isinstance(sub, Norm):
                    nn.init.ones_(sub.weight)
        head_std = self.cfg.d_model ** -0.5
        if self.tok_emb is not None and not self.cfg.tie_embeddings:
            nn.init.normal_(self.tok_emb.weight, 0.0, 1.0)
        if self.lm_head is not None:
            truncated_normal_(self.lm_head.weight, head_std)
        elif self.tok_emb is not None and self.cfg.tie_embeddings:
            truncated_normal_(self.tok_emb.weight, head_std)
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb.weight, 0.0, std)
        if self.norm_f is not None:
            nn.init.ones_(self.norm_f.weight)
            if self.norm_f.bias is not None:
                nn.init.zeros_(self.norm_f.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None, *,
        positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
        ahead_ids: torch.Tensor | None = None, ahead_targets: torch.Tensor | None = None,
        ahead_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """idx (B, T) token ids -> mean next-token loss if targets are given, else logits (B, T, V).

        With a ``cache`` (generation, model/generate.py) idx holds the T tokens after the cached
        ones: they take positions [cache.length, cache.length + T) and the cache grows by T.
        A pipeline stage without the embedding takes hidden states (B, T, C) instead of ids; one
        without the head returns hidden states.

        ``positions`` (T,) or (B, T): the position of each token, when idx is not a whole sequence
        from 0 (a context-parallel rank's chunks, parallel/cp.py) or positions restart per document.
        ``documents`` (B, S): the document number of each key position attention sees (a packed
        sequence, ``model.attention_mask=document``; computed from idx when not given).
        ``ahead_ids``, ``ahead_targets`` (B, D, T) ``tokens_ahead`` of this forward's positions, for
        the multi-token-prediction modules when a training forward cannot derive them from idx and
        targets itself: a pipeline's last stage (its input is hidden states, its loss is taken
        outside, so its logits carry the modules' gradient) or a context-parallel rank's chunks
        (with ``ahead_scale`` (D,), what each depth's mean over these positions is multiplied by).
        """
        start, t = (cache.length if cache is not None else 0), idx.shape[1]
        if start + t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + t} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if documents is None and cache is None:
            documents = self.document_ids(idx)
        if positions is None and documents is not None and self.cfg.document_positions:
            positions = document_positions(documents)
        x = idx
        if self.takes_ids:
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(start, start + t, device=idx.device) if positions is None else positions)
            x = self.drop(x)
        rope = None
        if self.cfg.position == "rope":
            # Without positions, the tables from ``start`` on: a later pipeline stage's input may be a
            # sequence-parallel shard of the T positions that attention sees whole.
            rope = ((self.rope_cos[start:], self.rope_sin[start:]) if positions is None
                    else (self.rope_cos[positions], self.rope_sin[positions]))
        for name, block in self.blocks.items():
            layer_cache = None if cache is None else cache.layer(int(name))
            x = block(x, rope, layer_cache, documents)
        if cache is not None:
            cache.advance(t)
        # MoE load-balancing losses of this forward's blocks (training only). With targets they join
        # the loss's gradient but not its value, so the loss logged stays the language-model loss;
        # without (a pipeline stage's output) the output carries their gradient back.
        # Only a training forward sets them: generation and evaluation skip the walk over every module
        # (per generated token, it cost as much as a block's attention on a small model).
        training = self.training and torch.is_grad_enabled()
        aux = take_aux_loss(self.blocks.modules()) if training else None
        if self.lm_head is None:
            return x if aux is None else with_aux_gradient(x, aux)
        if self.mtp is not None and training and (ahead_ids is not None or targets is not None):
            if ahead_ids is None:
                ahead_ids, ahead_targets = tokens_ahead(idx, targets, len(self.mtp), documents)
            mtp = self._mtp_loss(x, ahead_ids, ahead_targets, rope, documents, ahead_scale)
            aux = mtp if aux is None else aux + mtp
        if targets is not None and self.ops.head_loss is not None:  # kernels.loss_chunk_tokens: no whole logits
            h = self.norm_f(x)  # (logits x m) = (h x m) @ W^T: the multiplier goes on the hidden states
            loss = self.ops.head_loss(h * self.output_multiplier if self.output_multiplier != 1.0 else h,
                                      self.lm_head.weight, targets)
        else:
            logits = self.lm_head(self.norm_f(x))
            if self.output_multiplier != 1.0:
                logits = logits * self.output_multiplier
            if targets is None:
                return logits if aux is None else with_aux_gradient(logits, aux)
            loss = self.ops.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return loss if aux is None else join_aux_gradient(loss, aux)

    def _mtp_loss(self, h: torch.Tensor, ahead_ids: torch.Tensor, ahead_targets: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor] | None, documents: torch.Tensor | None,
                  scale: torch.Tensor | None) -> torch.Tensor:
        """model.mtp_loss_weight x the mean over depths k = 1..D of depth k's loss: at position i it
        reads the token at i + k and predicts the one at i + k + 1 (``tokens_ahead``), over the
        positions whose targets are kept (the last k of the sequence are not). Every depth runs on the
        whole length: a kept position attends only to earlier positions of its document, whose targets
        are kept too, so the dropped ones change no kept loss. MoE layers of the modules add their
        balancing losses (their routing counts every position)."""
        losses = []
        for k, module in enumerate(self.mtp):
            h, normed = module(h, self.tok_emb(ahead_ids[:, k]), rope, documents)
            if self.ops.head_loss is not None:  # kernels.loss_chunk_tokens: no depth's whole logits either
                loss = self.ops.head_loss(normed, self.lm_head.weight, ahead_targets[:, k])
            else:
                logits = self.lm_head(normed)
                loss = self.ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), ahead_targets[:, k].reshape(-1))
            losses.append(local_shard(loss))  # a replicated DTensor under loss parallelism: its value
        mean = torch.stack(losses)
        mean = (mean if scale is None else mean * scale).mean()
        self.mtp_window.append(mean.detach())
        total = mean * self.cfg.mtp_loss_weight
        aux = take_aux_loss(self.mtp.modules())
        return total if aux is None else total + aux

    def take_mtp_loss(self) -> torch.Tensor | None:
        """The mean multi-token-prediction loss of the training forwards since the last call (None: none ran)."""
        window, self.mtp_window = self.mtp_window, []
        return torch.stack(window).mean() if window else None

    def document_ids(self, idx: torch.Tensor) -> torch.Tensor | None:
        """(B, T) the document number of each token under model.attention_mask=document, else None
        (also for a pipeline stage without the embedding: its input is hidden states, not ids)."""
        return document_ids(self.cfg, idx) if self.takes_ids else None

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Unique parameters (a tied head counts once); optionally without the embedding tables."""
        total = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            total -= self.tok_emb.weight.numel() if not self.cfg.tie_embeddings else 0
            total -= self.pos_emb.weight.numel() if self.pos_emb is not None else 0
        return total

