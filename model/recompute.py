"""Activation recompute policies (``model.recompute``), applied in place to a built GPT.

"Recompute" here always means activations dropped in forward and rebuilt in backward; saving and
loading training state is "checkpoint" (training/checkpoint.py), a different thing with its own errors.

    none          keep every activation autograd saves (the baseline)
    selective     recompute only each block's attention core (QK^T, softmax, dropout, @V), as in
                  Korthikanti et al. 2022; pays off when the core stores the (B, H, T, T) scores,
                  i.e. with the reference attention, hardly with SDPA/flash which never store them
    op_selective  PyTorch's selective activation checkpointing over each whole block: the outputs
                  of matmuls and fused attention kernels are kept, cheap element-wise ops recomputed
    full          recompute whole blocks; only each block's input is kept
    every_k       recompute whole blocks, but only the k-th, 2k-th, ... block (counting from 1;
                  k=1 is full)
    offload       keep everything, but in (pinned) host memory via autograd's save_on_cpu

Every recompute is non-reentrant checkpointing (``use_reentrant=False``), which preserves the RNG
state, so a recomputed dropout draws the same mask as the forward did. Transformer Engine blocks
(``model.layers=te``) recompute through TE's own checkpoint, the only one that re-enters TE's FP8
autocast (``model/te.py``); op_selective cannot see TE's GEMMs (they are not aten ops) and refuses them.

How the wrapping works, and why: the chosen module keeps its identity and its place in the tree;
only its class is swapped for a subclass whose ``forward`` routes the original one through the
policy (the same trick FSDP2's ``fully_shard`` uses). So parameter names, ``state_dict`` keys and
optimizer-state FQNs are identical under every policy: a checkpoint saved with ``none`` loads with
``full`` and vice versa, and DCP/FSDP2 see the names they would see without checkpointing. A wrapper
module holding the original as a child would add a prefix to every name instead.

Order (as in torchtitan): apply recompute to the plain model, then torch.compile, then
FSDP2/DDP. FSDP2 swaps the class once more (``FSDPCheckpointedBlock``) and still calls our forward.
Under torch.compile, full/selective/every_k/op_selective become part of the compiled graph (SAC's
policy is handed to the partitioner); offload's save_on_cpu hooks cannot be traced, so dynamo runs
those blocks eagerly (a graph break, same numbers).

A model with swapped classes pickles only through its state_dict (``torch.save(model)`` of the whole
object cannot find the generated class by name); save state dicts, as the trainer does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.errors import RecomputeError
from model.config import RECOMPUTE_POLICIES
from model.gpt import indexed_blocks
from model.te import TEBlock, te_checkpoint

# Called with ("cached", tensor) for each output op_selective keeps and ("offloaded", tensor) for each
# tensor offload moves to the host: memory an outer saved_tensors_hooks cannot see. Used by
# tools/bench_memory.py; training passes none.
Observer = Callable[[str, torch.Tensor], None]

# Ops whose outputs op_selective keeps: the matmuls and fused attention kernels (expensive to redo,
# and their outputs are what backward needs anyway). Names that this torch build or the installed
# packages do not define are skipped.
SAVED_OP_NAMES = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::linear",
    "aten::_scaled_mm",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "flash_attn::_flash_attn_forward",
)


# --------------------------------------------------------------------------- what runs a forward


@dataclass(frozen=True)
class Recompute:
    """Keep only the module's inputs; run its forward again during backward."""

    label: str = "recompute"

    def __call__(self, forward: Callable, *args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@dataclass(frozen=True)
class TERecompute:
    """Recompute a Transformer Engine block with ``te.checkpoint`` (FP8-aware), not torch's."""

    label: str = "recompute"

    def __call__(self, forward: Callable, *args, **kwargs):
        return te_checkpoint(forward, *args, **kwargs)


@dataclass(frozen=True)
class SelectiveOpRecompute:
    """Recompute the module, except the outputs of ``save_ops``, which are cached in the forward."""

    save_ops: frozenset
    observer: Observer | None = None
    label: str = "op_selective"

    def __call__(self, forward: Callable, *args, **kwargs):
        # Plain partials rather than bound methods: torch.compile traces context_fn and loses `self`.
        policy = functools.partial(_keep_listed_outputs, self.save_ops)
        if self.observer is None:
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        else:
            context_fn = functools.partial(_observed_contexts, policy, self.save_ops, self.observer)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _keep_listed_outputs(save_ops: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _observed_contexts(policy: Callable, save_ops: frozenset, observer: Observer):
    """SAC's two contexts, the forward one also reporting each output SAC caches (eager measurement only)."""
    sac_forward, sac_recompute = create_selective_checkpoint_contexts(policy)
    return _Together(sac_forward, _ReportOutputs(save_ops, observer)), sac_recompute


class _ReportOutputs(TorchDispatchMode):
    # Entered inside SAC's caching mode, so it sees each op first and its output on the way back;
    # this works whether or not the torch version hands the policy function the op's output.
    def __init__(self, save_ops: frozenset, observer: Observer):
        super().__init__()
        self.save_ops, self.observer = save_ops, observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.save_ops:
            for tensor in _tensors_in(out):
                self.observer("cached", tensor)
        return out


class _Together:
    """Enter two context managers as one (the first outermost)."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        return self.outer.__exit__(*exc)


@dataclass(frozen=True)
class OffloadToHost:
    """Run the forward normally, but keep what it saves for backward in host memory."""

    pin_memory: bool
    observer: Observer | None = None
    label: str = "offload"

    def __call__(self, forward: Callable, *args, **kwargs):
        with self._hooks():
            return forward(*args, **kwargs)

    def _hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        if self.observer is None:
            return hooks
        pack_to_host, observer = hooks.pack_hook, self.observer

        def observed_pack(tensor: torch.Tensor):
            observer("offloaded", tensor)
            return pack_to_host(tensor)

        return torch.autograd.graph.saved_tensors_hooks(observed_pack, hooks.unpack_hook)


def _tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_in(item)]
    return []


# --------------------------------------------------------------------------- the class swap


class RecomputedModule:
    """Mixin placed in front of a module's own class: its forward goes through ``recompute_runner``."""

    recompute_runner: Callable

    def forward(self, *args, **kwargs):
        return self.recompute_runner(super().forward, *args, **kwargs)

    def extra_repr(self) -> str:
        own = super().extra_repr()
        mine = f"recompute={self.recompute_runner.label}"
        return f"{own}, {mine}" if own else mine


@functools.cache
def _recomputed_class(cls: type) -> type:
    # One generated class per original class, so every block shares it (as FSDP2 does for its own).
    return type(f"Recomputed{cls.__name__}", (RecomputedModule, cls), {})


def _wrap_in_place(module: nn.Module, runner: Callable) -> None:
    module.__class__ = _recomputed_class(type(module))
    module.recompute_runner = runner


# --------------------------------------------------------------------------- policies


def no_gain_note(policy: str, attention_backend: str) -> str | None:
    """One line when ``policy`` costs time and saves nothing with this attention, else None.

    Selective recompute drops the s x s attention matrix (Korthikanti et al.); a fused attention
    kernel never stores it, so the recompute re-runs the kernel for no memory.
    """
    if policy != "selective" or attention_backend not in ("sdpa", "flash_attn"):
        return None
    return (f"selective recompute with {attention_backend} attention saves nothing here (model.recompute="
            "selective saves no memory: the fused kernel keeps no s x s scores) and re-runs attention in backward: "
            "use model.recompute=none, or op_selective / full to save memory")


def apply_recompute(
    model: nn.Module, policy: str, every_k: int = 2, *, observer: Observer | None = None
) -> None:
    """Apply ``policy`` to ``model.blocks`` in place; a no-op for ``none``.

    Call on the plain model, before torch.compile and FSDP2/DDP. ``observer`` (see ``Observer``) is
    for measurement only.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise RecomputeError(f"unknown recompute policy {policy!r}; choose one of {', '.join(RECOMPUTE_POLICIES)}")
    if policy == "none":
        return
    if every_k < 1:
        raise RecomputeError(f"recompute_every_k must be >= 1 (got {every_k})")
    if not isinstance(getattr(model, "blocks", None), (nn.ModuleList, nn.ModuleDict)):
        raise RecomputeError(
            f"{type(model).__name__} has no `blocks`; apply recompute to the GPT itself, "
            "before wrapping it with torch.compile, DDP or FSDP"
        )
    if any(isinstance(m, RecomputedModule) for m in model.modules()):
        raise RecomputeError("recompute is already applied to this model; apply it once")
    for index, block in indexed_blocks(model):
        target = _target_module(policy, block, index, every_k)
        if target is not None:
            _wrap_in_place(target, _runner(policy, observer, target))


def _target_module(policy: str, block: nn.Module, index: int, every_k: int) -> nn.Module | None:
    if policy == "selective":
        core = getattr(getattr(block, "attn", None), "core", None)
        if not isinstance(core, nn.Module):
            raise RecomputeError(
                f"recompute=selective recomputes block.attn.core, which {type(block).__name__} does not have "
                "(Transformer Engine layers: use recompute=full)"
            )
        return core
    if policy == "every_k":
        return block if (index + 1) % every_k == 0 else None
    return block


def _runner(policy: str, observer: Observer | None, target: nn.Module | None = None) -> Callable:
    te_block = target is not None and _is_te_block(target)
    if policy == "op_selective":
        if te_block:
            raise RecomputeError(
                "recompute=op_selective cannot select inside Transformer Engine layers (their GEMMs are not "
                "aten ops, and torch's recompute would leave TE's FP8 autocast); use recompute=full or every_k"
            )
        return SelectiveOpRecompute(saved_ops(), observer)
    if policy == "offload":
        return OffloadToHost(pin_memory=torch.cuda.is_available(), observer=observer)
    if te_block:
        return TERecompute(label=f"{policy} (te.checkpoint)")
    return Recompute(label=policy)


def _is_te_block(module: nn.Module) -> bool:
    return isinstance(module, TEBlock)


def saved_ops() -> frozenset:
    """The op overloads named in SAVED_OP_NAMES that exist here, every overload of each."""
    found = set()
    for name in SAVED_OP_NAMES:
        namespace, op_name = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op_name, None)  # None when not registered here
        if packet is not None:
            found.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


def recomputed_modules(model: nn.Module) -> dict[str, str]:
    """{qualified module name: policy label} for every module that recompute wraps."""
    return {
        name: module.recompute_runner.label
        for name, module in model.named_modules()
        if isinstance(module, RecomputedModule)
    }


def describe_recompute(model: nn.Module) -> str:
    """One log line: which modules are wrapped, and how."""
    wrapped = recomputed_modules(model)
    if not wrapped:
        return "recompute: none (model.recompute)"
    labels = sorted(set(wrapped.values()))
    return f"recompute: {', '.join(labels)} on {len(wrapped)} modules ({', '.join(wrapped)})"
