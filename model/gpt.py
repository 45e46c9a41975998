"""A decoder-only GPT, readable top to bottom.

    tokens -> embedding (+ learned positions) -> n_layer x Block -> final norm -> LM head
    Block:  x + Attention(Norm(x)),  then  x + MLP(Norm(x))        (pre-norm)

Nothing here knows about process groups, precision policies or checkpointing; those are
applied to a built model from ``parallel/`` and ``training/``. Fast paths plug in through two
seams: the attention backend (``model/attention.py``) and the fused ops (``kernels/registry.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from kernels.reference import rope_tables
from kernels.registry import REFERENCE_OPS, KernelOps
from model.attention import AttentionCore, KVCache, LayerKV
from model.config import ModelConfig
from model.te import TEBlock


class Norm(nn.Module):
    """LayerNorm or RMSNorm whose statistics are computed in fp32 whatever the input dtype."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.kind, self.eps, self.ops = cfg.norm, cfg.norm_eps, ops
        self.weight = nn.Parameter(torch.ones(cfg.d_model))
        with_bias = cfg.bias and cfg.norm == "layernorm"
        self.bias = nn.Parameter(torch.zeros(cfg.d_model)) if with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention_backend: str):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.ops = cfg.n_head, cfg.kv_heads, cfg.head_dim, ops
        self.use_rope = cfg.position == "rope"
        # One fused projection, laid out [all query heads | key heads | value heads]; with
        # n_kv_head == n_head this is exactly the (3, H, D) layout of plain multi-head attention.
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * cfg.kv_dim, bias=cfg.bias)
        self.core = AttentionCore(attention_backend, cfg.dropout)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.residual_projection = True  # scaled init, see GPT.init_weights
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: LayerKV | None = None
    ) -> torch.Tensor:
        b, t, c = x.shape
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split((c, kv_dim, kv_dim), dim=-1)
        q = q.view(b, t, self.n_head, self.head_dim)  # (B, T, H, D)
        k, v = (z.view(b, t, self.n_kv_head, self.head_dim) for z in (k, v))  # (B, T, H_kv, D)
        if self.use_rope:
            q, k = self.ops.apply_rope(q, *rope), self.ops.apply_rope(k, *rope)
        if cache is not None:  # generation: attend to every earlier position too
            k, v = cache.update(k, v)
        y = self.core(q, k, v).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.swiglu, self.ops = cfg.mlp == "swiglu", ops
        self.gelu_approximate = "tanh" if cfg.gelu == "tanh" else "none"  # torch's names for the two forms
        # fc carries the bias separately so bias + GELU can run as one fused op.
        width = 2 * cfg.d_ff if self.swiglu else cfg.d_ff
        self.fc = nn.Linear(cfg.d_model, width, bias=False)
        self.fc_bias = nn.Parameter(torch.zeros(width)) if cfg.bias else None
        self.out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.out.residual_projection = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            if self.fc_bias is not None:
                h = h + self.fc_bias
            gate, up = h.chunk(2, dim=-1)
            h = self.ops.swiglu(gate, up)
        else:
            h = self.ops.bias_gelu(h, self.fc_bias, self.gelu_approximate)
        return self.drop(self.out(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention_backend: str):
        super().__init__()
        self.norm1 = Norm(cfg, ops)
        self.attn = Attention(cfg, ops, attention_backend)
        self.norm2 = Norm(cfg, ops)
        self.mlp = MLP(cfg, ops)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: LayerKV | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cache)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps = REFERENCE_OPS, attention_backend: str = "sdpa"):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(self._make_block(cfg, ops, attention_backend, i) for i in range(cfg.n_layer))
        self.norm_f = Norm(cfg, ops)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Rotary tables are derived, not learned: non-persistent, rebuilt by init_weights().
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @staticmethod
    def _make_block(cfg: ModelConfig, ops: KernelOps, attention_backend: str, layer_idx: int) -> nn.Module:
        if cfg.layers == "te":
            return TEBlock(cfg, layer_idx)
        return Block(cfg, ops, attention_backend)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialization: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), zero biases.

        Called after construction, and again after a meta-device model is materialized.
        """
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, out_std if getattr(module, "residual_projection", False) else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, Norm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MLP) and module.fc_bias is not None:
                nn.init.zeros_(module.fc_bias)
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg.max_seq_len, self.cfg.head_dim, self.cfg.rope_theta, self.tok_emb.weight.device)
            self.rope_cos, self.rope_sin = cos, sin

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """idx (B, T) token ids -> mean next-token loss if targets are given, else logits (B, T, V).

        With a ``cache`` (generation, model/generate.py) idx holds the T tokens after the cached
        ones: they take positions [cache.length, cache.length + T) and the cache grows by T.
        """
        start, t = (cache.length if cache is not None else 0), idx.shape[1]
        if start + t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + t} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(start, start + t, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos[start:], self.rope_sin[start:]) if self.cfg.position == "rope" else None
        for i, block in enumerate(self.blocks):
            x = block(x, rope) if cache is None else block(x, rope, cache.layer(i))
        if cache is not None:
            cache.advance(t)
        logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits
        return self.ops.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Unique parameters (a tied head counts once); optionally without the embedding tables."""
        total = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            total -= self.tok_emb.weight.numel() if not self.cfg.tie_embeddings else 0
            total -= self.pos_emb.weight.numel() if self.pos_emb is not None else 0
        return total

