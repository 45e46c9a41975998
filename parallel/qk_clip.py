"""QK-clip (Kimi K2's MuonClip, Kimi Team 2025): keep attention logits from growing without bound.

After each optimizer step, every head h whose largest pre-softmax logit S_h = max q_i . k_j / sqrt(d)
over the step's training forwards exceeded the threshold tau gets gamma_h = tau / S_h, and its
query and key weights are scaled so that its logits scale by exactly gamma_h; heads at or below
tau are left alone, and so are the optimizer's states. For multi-head attention that is K2's rule,
W_q and W_k of the head each times sqrt(gamma_h). Under grouped-query attention one key head
serves several query heads, so scaling it would touch heads that did not exceed tau: the key is
scaled by sqrt(min gamma) over its group and each query head by gamma_h / sqrt(min gamma), which
gives every head exactly gamma_h (and K2's rule when the group is one head). Biases of the
projection are scaled with their rows, so q and k scale exactly; rotary embeddings are linear and
keep the factor.

The logits come from the model's seam (``Attention.max_logit``, filled by
``model.attention.head_max_logits`` in training forwards); the maxima are taken over the
data-parallel ranks (every replica then scales alike), and the scaling reaches each rank's
shard of the fused QKV weight (model/gpt.py's grouped layout) wherever FSDP2 put it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from common.values import is_dtensor, local_shard
from model.gpt import Attention
from parallel.muon import held_indices


class QKClip:
    """QK-clip over the attention layers of ``model`` (a model or a pipeline stage, maybe wrapped).

    ``stepped``: the tensor the optimizer steps for each parameter name (the parameter, or its fp32
    master); the scaling goes there, before masters are copied into the model."""

    def __init__(self, model: nn.Module, stepped: dict[str, torch.Tensor], tau: float):
        self.tau = tau
        self.layers = []  # (attention, its qkv weight, its qkv bias or None, rows of the weight held here)
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                weight = stepped[f"{name}.qkv.weight"]
                bias = stepped.get(f"{name}.qkv.bias")
                heads = weight.shape[0] // ((module.group + 2) * module.head_dim) * module.group
                module.max_logit = torch.full((heads,), float("-inf"), device=local_shard(weight).device)
                self.layers.append((module, weight, bias))
        self.groups = _replica_groups(model, self.layers[0][1] if self.layers else None)
        self._rows: dict[int, object] = {}

    @torch.no_grad()
    def __call__(self, applied: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip after a step (``applied``: it was not skipped, else only the maxima are reset).
        Returns the number of heads clipped and the largest logit of the step (device tensors)."""
        if not self.layers:
            zero = torch.zeros(())
            return zero.long(), zero.fill_(float("-inf"))
        maxima = torch.stack([attn.max_logit for attn, _, _ in self.layers])  # (layers, heads)
        for group in self.groups:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        over = maxima > self.tau
        if applied:
            gamma = torch.where(over, self.tau / maxima, torch.ones_like(maxima))
            for (attn, weight, bias), layer_gamma in zip(self.layers, gamma):
                rows = row_scales(layer_gamma, attn.group, attn.head_dim)
                for tensor in (weight, bias):
                    if tensor is not None:
                        local = local_shard(tensor)
                        scale = rows[self._held_rows(tensor)]
                        local.mul_(scale.view(-1, *([1] * (local.ndim - 1))).to(local.dtype))
        for attn, _, _ in self.layers:
            attn.max_logit.fill_(float("-inf"))
        return (over.sum() if applied else torch.zeros((), dtype=torch.long, device=maxima.device)), maxima.max()

    def _held_rows(self, tensor: torch.Tensor):
        """The rows of the whole projection this rank holds (all of them unless sharded)."""
        if id(tensor) not in self._rows:
            if is_dtensor(tensor):
                rows = held_indices(tensor.shape, tensor.device_mesh, tensor.placements)[0]
                self._rows[id(tensor)] = torch.tensor(rows, dtype=torch.long, device=local_shard(tensor).device)
            else:
                self._rows[id(tensor)] = slice(None)
        return self._rows[id(tensor)]


def row_scales(gamma: torch.Tensor, group: int, head_dim: int) -> torch.Tensor:
    """(rows,) the factor of each row of the fused QKV projection, from each query head's gamma (H,):
    per key/value group, its query heads' rows, its key rows, its value rows (model/gpt.py's layout)."""
    per_group = gamma.view(-1, group)  # (H_kv, group)
    key = per_group.min(dim=1, keepdim=True).values.sqrt()  # (H_kv, 1)
    factors = torch.cat([per_group / key, key, torch.ones_like(key)], dim=1)  # (H_kv, group + 2)
    return factors.repeat_interleave(head_dim, dim=1).reshape(-1)


def _replica_groups(model: nn.Module, weight: torch.Tensor | None) -> list[dist.ProcessGroup]:
    """The process groups over which the same attention layers see other data: a DTensor weight's
    mesh (FSDP2's data-parallel dimensions, with the ep ranks for dense weights), or DDP's group."""
    if weight is not None and is_dtensor(weight):
        mesh = weight.device_mesh
        return [mesh.get_group(d) for d in range(mesh.ndim)]
    group = getattr(model, "process_group", None)  # DistributedDataParallel
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return [group if group is not None else dist.group.WORLD]
    return []
