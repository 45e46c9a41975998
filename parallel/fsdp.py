"""FSDP2: shard parameters, gradients and optimizer state over the data-parallel ranks.

``fully_shard`` is applied bottom-up: once per transformer block (one all-gather and one
reduce-scatter per block, so block i+1's all-gather overlaps block i's compute), then on the
root, which takes the remaining parameters (embeddings, final norm, LM head). Parameters become
DTensors sharded on dim 0; the optimizer built afterwards steps only the local shards.

Precision (``MixedPrecisionPolicy``): the sharded fp32 parameters are the master weights;
FSDP2 casts them to ``param_dtype`` when it gathers them for compute and reduces gradients in
``reduce_dtype``. So ``bf16_master`` needs no separate fp32 copies under FSDP (and the model must
stay fp32 when it is wrapped).

Hybrid sharding (HSDP): on the 2-D (dp_replicate, dp_shard) part of the run's mesh, shards
within a node, where bandwidth is high, and replicates across nodes, so the slow inter-node links
carry one gradient all-reduce per step instead of every all-gather and reduce-scatter
(``parallel.fsdp_hybrid`` sets dp_replicate to the node count). With tensor parallelism the
parameters are already DTensors on the tp dimension; FSDP2 shards them further over dp_shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from common.errors import ConfigError
from model.gpt import indexed_blocks
from model.te import TEBlock
from parallel.config import ParallelConfig
from parallel.ep import shard_experts
from parallel.precision import PrecisionPolicy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def mixed_precision_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """Compute dtype for gathered weights and the dtype gradients are reduced in (decided by the policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=policy.fsdp_param_dtype, reduce_dtype=policy.fsdp_reduce_dtype)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, policy: PrecisionPolicy,
               device: torch.device, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` (a GPT with ``.blocks``) in place; materialize it first if it is on meta.

    Expert-parallel MoE layers (parallel/ep.py) shard their experts over ``expert_mesh`` instead."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    common = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(policy),
        # Pinned memory needs CUDA; on a CPU run "offload" changes nothing but is still accepted.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.fsdp_cpu_offload else OffloadPolicy(),
    )
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        _refuse_te_layers_on_meta(model)
    # The multi-token-prediction modules run after the blocks, each a unit as a block is (its experts too).
    blocks = [block for _, block in indexed_blocks(model)] + list(getattr(model, "mtp", None) or [])
    for block in blocks:
        ignored = shard_experts(block, expert_mesh, reshard_after_forward=cfg.reshard_blocks_after_forward, **common)
        fully_shard(block, reshard_after_forward=cfg.reshard_blocks_after_forward, ignored_params=ignored or None,
                    **common)
    # The root's own parameters (embeddings, LM head) are needed first thing in backward, so they
    # stay gathered after forward. An explicit False: torch < 2.8 rejects None here, and from 2.8
    # None means the same thing for a root module.
    fully_shard(model, reshard_after_forward=False, **common)
    set_prefetch(blocks, cfg.fsdp_forward_prefetch, cfg.fsdp_backward_prefetch)
    if on_meta:
        materialize(model, device if not cfg.fsdp_cpu_offload else torch.device("cpu"), mesh)
    return model


def _refuse_te_layers_on_meta(model: nn.Module) -> None:
    """Transformer Engine layers allocate their own CUDA weights and initialize them when built;
    ``to_empty`` would replace those with garbage that ``init_weights`` (GPT's init) never touches."""
    if any(isinstance(m, TEBlock) for m in model.modules()):
        raise ConfigError("parallel.init_on_meta=true cannot initialize Transformer Engine layers "
                          "(model.layers=te); set parallel.init_on_meta=false")


def set_prefetch(blocks: list[nn.Module], forward: int, backward: int) -> None:
    """Explicit prefetch: block i all-gathers the next ``forward`` blocks before its own forward,
    and in backward the ``backward`` blocks that run after it. 0 forward / 1 backward keep FSDP2's
    defaults (none in forward; one block ahead in backward, inferred from the forward order)."""
    if forward > 0:
        for i, block in enumerate(blocks):
            ahead = blocks[i + 1 : i + 1 + forward]
            if ahead:
                block.set_modules_to_forward_prefetch(ahead)
    if backward > 1:
        for i, block in enumerate(blocks):
            behind = list(reversed(blocks[max(0, i - backward) : i]))
            if behind:
                block.set_modules_to_backward_prefetch(behind)


def materialize(model: nn.Module, device: torch.device, mesh: DeviceMesh) -> None:
    """Allocate the local shards of a meta-device model and initialize them with ``init_weights``.

    DTensor's random ops draw each rank's local shard from that rank's generator; with the same
    seed everywhere (as train.py sets it) every shard would get the *same* numbers, a correlated
    init. So each shard index draws from its own seed (replicas of one shard under HSDP share
    it), and the global RNG state is restored afterwards. The weights have the distribution
    ``init_weights`` asks for, but not the values of a model built whole from the same seed.
    """
    import warnings

    model.to_empty(device=device)
    shard_index = mesh.get_local_rank(mesh.mesh_dim_names[-1])  # the shard dimension is the innermost
    seed = (torch.initial_seed() * 1_000_003 + shard_index) % 2**63
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DTensor random operators may not have complete support.*")
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
