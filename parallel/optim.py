"""The optimizer and its learning-rate schedule: ``OptimConfig`` (the ``optim`` section, with its
``optim.muon`` subsection) and what it builds.

The engines (``parallel/engine.py``, ``parallel/zero.py``) own the optimizer, so its config and
its construction live next to them. ``optim.name=adamw``: AdamW on every parameter.
``optim.name=muon``: Muon (parallel/muon.py) on the hidden weight matrices (attention and MLP
projections, expert stacks), AdamW on the rest: embeddings, the LM head, norms, biases and MoE
routers (``muon_split``). Weight decay applies to matrices only (linear weights and embeddings),
never to norm gains and biases. The schedule is a linear warmup to the peak, a cosine decay to
``min_lr`` at ``decay_steps`` (counted from step 0), then flat; a Muon peak of its own
(``optim.muon.lr``) follows the same schedule, scaled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
import torch.nn as nn

from common.errors import ConfigError
from common.fields import doc, require_finite
from model.mup import LrScale
from parallel.muon import JORDAN_COEFFICIENTS, Muon


@dataclass(frozen=True)
class MuonConfig:
    """Muon's keys (``optim.muon.*``), read with optim.name=muon. Frozen, so a config copied with
    ``dataclasses.replace`` never shares a section that one copy changes."""

    momentum: float = doc(0.95, "momentum mu of the buffer M <- mu M + (1 - mu) G, in [0, 1)")
    nesterov: bool = doc(True, "orthogonalise (1 - mu) G + mu M (Nesterov) instead of M")
    ns_steps: int = doc(5, "Newton-Schulz iterations per step, 1-99")
    ns_coefficients: list[float] = doc(list(JORDAN_COEFFICIENTS),
                                       "quintic Newton-Schulz coefficients (a, b, c); Keller Jordan's by default")
    ns_dtype: Literal["auto", "bf16", "fp32"] = doc(
        "auto", "dtype Newton-Schulz runs in (and sharded pieces travel in); auto: bf16 on CUDA (as torch.optim.Muon), "
        "fp32 elsewhere (CPU bf16 matmuls are slower than fp32 ones)"
    )
    scale: Literal["match_rms_adamw", "original", "none"] = doc(
        "match_rms_adamw", "update scale of an A x B matrix: match_rms_adamw 0.2 sqrt(max(A, B)) (Moonlight: "
        "AdamW's lr and weight decay carry over), original sqrt(max(1, A/B)) (Keller Jordan), none 1"
    )
    lr: float | None = doc(None, "peak learning rate of the Muon matrices (same schedule); null: optim.lr")
    weight_decay: float | None = doc(None, "decoupled weight decay of the Muon matrices; null: optim.weight_decay")
    qk_clip_tau: float | None = doc(
        None, "QK-clip (Kimi K2's MuonClip): after a step whose largest pre-softmax attention logit of a head "
        "exceeded this, that head's query and key weights are scaled to bring it to the threshold (K2: 100); "
        "null: off"
    )


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = doc(
        "adamw", "adamw: AdamW everywhere; muon: Muon on hidden weight matrices (attention, MLP, experts), AdamW "
        "on embeddings, head, norms, biases and routers (keys: optim.muon.*)"
    )
    lr: float = doc(6e-4, "peak learning rate reached at the end of warmup")
    min_lr: float = doc(6e-5, "learning rate at the end of the cosine decay")
    warmup_steps: int = doc(
        100, "linear warmup length in optimizer steps; without optim.decay_steps a longer one than "
        "train.max_steps is cut to train.max_steps for the run, with a warning (a short smoke run)"
    )
    decay_steps: int | None = doc(
        None, "step at which the cosine decay reaches optim.min_lr (counted from step 0, warmup included; "
        ">= optim.warmup_steps); default: train.max_steps. Set it when one schedule spans several runs"
    )
    weight_decay: float = doc(0.1, "decoupled weight decay, applied to matrices only (not norms, biases)")
    beta1: float = doc(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = doc(0.95, "AdamW beta2, in [0, 1)")
    eps: float = doc(1e-8, "AdamW epsilon, > 0")
    grad_clip: float = doc(1.0, "clip the global gradient norm to this value; 0 disables")
    fused: Literal["auto", "on", "off"] = doc(
        "auto", "fused AdamW kernel (skips a non-finite step without a host sync): auto uses it on CUDA; on "
        "uses it on any device PyTorch's fused AdamW runs on (CPU too); not with optim.name=muon"
    )
    muon: MuonConfig = field(default_factory=MuonConfig)

    def validate(self) -> None:
        # An infinite lr turns the first update into NaN weights: finiteness comes first.
        for key in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            require_finite(f"optim.{key}", getattr(self, key), ConfigError)
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0 (got {self.lr})")
        # AdamW's decoupled decay multiplies every weight by 1 - lr x weight_decay each step: at 1 or
        # more it zeroes or flips every weight on the first step.
        if self.lr * self.weight_decay >= 1:
            raise ConfigError(f"optim.lr x optim.weight_decay = {self.lr * self.weight_decay:g} must be < 1: AdamW's "
                              "decoupled decay multiplies every weight by 1 - lr x weight_decay each step")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr must be between 0 and optim.lr={self.lr} (got {self.min_lr})")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.decay_steps is not None and self.decay_steps < 0:
            raise ConfigError(f"optim.decay_steps must be >= 0, or null for train.max_steps (got {self.decay_steps})")
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            raise ConfigError(
                f"optim.decay_steps={self.decay_steps} ends the decay before optim.warmup_steps={self.warmup_steps} "
                "ends the warmup; set optim.decay_steps >= optim.warmup_steps"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0 (got {self.eps})")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip must be >= 0, 0 disables clipping (got {self.grad_clip})")
        self._validate_muon()

    def _validate_muon(self) -> None:
        m = self.muon
        if self.name != "muon":  # Muon keys without Muon would be ignored: say so instead
            changed = [f.name for f in fields(m) if getattr(m, f.name) != getattr(MuonConfig(), f.name)]
            if changed:
                raise ConfigError(f"optim.muon.{changed[0]}={getattr(m, changed[0])} has no effect with optim.name="
                                  f"{self.name}; set optim.name=muon or leave the optim.muon keys at their defaults")
            return
        if self.fused == "on":
            raise ConfigError("optim.fused=on is AdamW's fused kernel; with optim.name=muon the AdamW parameters step "
                              "inside Muon's optimizer without it: use optim.fused=auto or off")
        for key in ("momentum", "lr", "weight_decay", "qk_clip_tau"):
            require_finite(f"optim.muon.{key}", getattr(m, key), ConfigError)
        if not 0 <= m.momentum < 1:
            raise ConfigError(f"optim.muon.momentum must be in [0, 1) (got {m.momentum})")
        if not 1 <= m.ns_steps < 100:
            raise ConfigError(f"optim.muon.ns_steps must be between 1 and 99 (got {m.ns_steps})")
        if len(m.ns_coefficients) != 3 or not all(math.isfinite(c) for c in m.ns_coefficients):
            raise ConfigError(f"optim.muon.ns_coefficients must be three finite numbers (a, b, c), e.g. "
                              f"{list(JORDAN_COEFFICIENTS)} (got {m.ns_coefficients})")
        if m.lr is not None and m.lr <= 0:
            raise ConfigError(f"optim.muon.lr must be > 0, or null for optim.lr (got {m.lr})")
        if m.weight_decay is not None and m.weight_decay < 0:
            raise ConfigError(f"optim.muon.weight_decay must be >= 0, or null for optim.weight_decay (got {m.weight_decay})")
        lr, wd = self.muon_lr, self.muon_weight_decay
        if lr * wd >= 1:
            raise ConfigError(f"Muon's lr x weight decay = {lr * wd:g} must be < 1 (optim.muon.lr or optim.lr, "
                              "optim.muon.weight_decay or optim.weight_decay): the decay multiplies every matrix by "
                              "1 - lr x weight_decay each step")
        if m.qk_clip_tau is not None and m.qk_clip_tau <= 0:
            raise ConfigError(f"optim.muon.qk_clip_tau must be > 0, or null to turn QK-clip off (got {m.qk_clip_tau})")

    @property
    def muon_lr(self) -> float:
        return self.lr if self.muon.lr is None else self.muon.lr

    @property
    def muon_weight_decay(self) -> float:
        return self.weight_decay if self.muon.weight_decay is None else self.muon.weight_decay

    def schedule(self, max_steps: int) -> dict[str, Any]:
        """The schedule of a run of ``max_steps`` steps: ``lr_at``'s keyword arguments, and what a
        checkpoint records so a resumed run can be checked against it.

        Without decay_steps the schedule ends with the run (decay_steps = max_steps), and a warm-up
        longer than the run, which would never reach ``lr``, is cut to the run's length (the first
        thing a user tries is a short smoke run of a config made for a long one). With decay_steps
        set the run may be the first slice of a longer schedule, and its warm-up stays."""
        if self.decay_steps is None:
            warmup_steps, decay_steps = min(self.warmup_steps, max_steps), max_steps
        else:
            warmup_steps, decay_steps = self.warmup_steps, self.decay_steps
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_steps": warmup_steps, "decay_steps": decay_steps}

    def for_run(self, max_steps: int) -> tuple[OptimConfig, str | None]:
        """This section with the warm-up a run of ``max_steps`` steps uses (``schedule``), and a
        warning line naming the keys if that is shorter than optim.warmup_steps."""
        warmup_steps = self.schedule(max_steps)["warmup_steps"]
        if warmup_steps == self.warmup_steps:
            return self, None
        note = (f"optim.warmup_steps={self.warmup_steps} is longer than train.max_steps={max_steps}: warming up over "
                f"{warmup_steps} steps for this run (set optim.decay_steps to keep the longer schedule)")
        return replace(self, warmup_steps=warmup_steps), note


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def decay_groups(named_params: list[tuple[str, nn.Parameter]], weight_decay: float,
                 lr_scale: LrScale | None = None) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on norm gains and biases.

    ``lr_scale`` (µP's per-parameter LR multipliers, ``model.mup.lr_multipliers``) splits each of
    the two into runs of consecutive parameters with one multiplier, kept as the group's
    ``lr_scale`` (``set_lr`` applies it). The parameters keep their order across the groups, decay
    first: a checkpoint's optimizer numbers them the same with µP and without."""
    decay = [(n, p) for n, p in named_params if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named_params if p.ndim < 2]
    groups = []
    for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
        runs: list[tuple[float, list[nn.Parameter]]] = []
        for name, param in params:
            scale = 1.0 if lr_scale is None else lr_scale(name, param)
            if not runs or runs[-1][0] != scale:
                runs.append((scale, []))
            runs[-1][1].append(param)
        for scale, members in runs or [(1.0, [])]:
            group = {"params": members, "weight_decay": wd}
            if lr_scale is not None:
                group["lr_scale"] = scale
            groups.append(group)
    return groups


def is_hidden_matrix(name: str, tensor: torch.Tensor) -> bool:
    """What Muon steps: the matrices inside the transformer blocks (linear weights of attention and
    the MLPs, shared experts, and expert stacks), not the MoE router, whose few rows score experts as
    the LM head scores tokens. Embeddings, the head, norms and biases are outside or not matrices;
    per-expert biases (E, out) are 2-D but a bias each, so the name decides, not the shape."""
    if "blocks." not in name or name.endswith("router.weight"):
        return False
    return (tensor.ndim == 2 and name.endswith(".weight")) or (tensor.ndim == 3 and _is_expert_stack(name))


def _is_expert_stack(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("w_")


def muon_split(named_params: list[tuple[str, torch.Tensor]]) -> tuple[list, list]:
    """(Muon's, AdamW's) of ``named_params``, each a list of (name, tensor) in the given order."""
    muon = [(n, p) for n, p in named_params if is_hidden_matrix(n, p)]
    return muon, [(n, p) for n, p in named_params if not is_hidden_matrix(n, p)]


def stepping_groups(named_params: list[tuple[str, torch.Tensor]], weight_decay: float, *, muon: bool,
                    lr_scale: LrScale | None = None) -> list[dict]:
    """The optimizer's parameter groups in its order: AdamW's ``decay_groups``; with Muon, the
    hidden matrices first, then ``decay_groups`` of the rest. A one-process checkpoint numbers its
    parameters in this order (parallel/checkpoint.py reads it back); µP's ``lr_scale`` splits groups
    but keeps the order."""
    if not muon:
        return decay_groups(named_params, weight_decay, lr_scale)
    matrices, rest = muon_split(named_params)
    return [{"params": [p for _, p in matrices], "muon": True}] + decay_groups(rest, weight_decay, lr_scale)


# How each of Muon's update scales sizes a hidden matrix's update, in µP's terms (model/mup.py): scaled
# to AdamW's RMS per entry its spectral norm grows with the width; the other two are width-free.
MUON_MUP_UPDATE = {"match_rms_adamw": "rms_matched", "original": "spectral", "none": "spectral"}


def muon_update(optim_cfg: OptimConfig) -> str:
    """How the optimizer's hidden-matrix updates scale with width (model.mup's ``Update``)."""
    return MUON_MUP_UPDATE[optim_cfg.muon.scale] if optim_cfg.name == "muon" else "adam"


def build_optimizer(named_params: list[tuple[str, torch.Tensor]], optim_cfg: OptimConfig,
                    device: torch.device, lr_scale: LrScale | None = None,
                    muon_lr_scale: LrScale | None = None) -> torch.optim.Optimizer:
    """The ``optim`` section's optimizer over ``named_params`` (what the engine steps: parameters or
    their fp32 masters, by parameter name). ``lr_scale``: µP's LR multipliers of what AdamW steps;
    ``muon_lr_scale``: those of the matrices Muon steps (one value: they are all hidden matrices)."""
    if optim_cfg.name == "adamw":
        return build_adamw(decay_groups(named_params, optim_cfg.weight_decay, lr_scale), optim_cfg, device)
    m = optim_cfg.muon
    groups = stepping_groups(named_params, optim_cfg.weight_decay, muon=True, lr_scale=lr_scale)
    scales = {muon_lr_scale(n, p) for n, p in muon_split(named_params)[0]} if muon_lr_scale else {1.0}
    if len(scales) > 1:
        raise ValueError(f"Muon's matrices would need {len(scales)} different LR multipliers; it keeps one")
    mup = scales.pop() if scales else 1.0
    groups[0].update(lr=optim_cfg.muon_lr * mup, lr_scale=optim_cfg.muon_lr / optim_cfg.lr * mup,
                     weight_decay=optim_cfg.muon_weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                     ns_steps=m.ns_steps, ns_coefficients=tuple(m.ns_coefficients),
                     ns_dtype=m.ns_dtype if m.ns_dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32"),
                     scale=m.scale)
    return Muon(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)


def describe_split(named_params: list[tuple[str, torch.Tensor]]) -> str:
    """One log line: which parameters Muon steps and which AdamW, with counts (whole tensors)."""
    matrices, rest = muon_split(named_params)
    experts = [p for _, p in matrices if p.ndim == 3]

    def count(items) -> str:
        return f"{sum(p.numel() for _, p in items) / 1e6:.3g}M parameters"

    expert_part = (f", {len(experts)} expert stacks of them orthogonalised per expert "
                   f"({sum(p.shape[0] for p in experts)} matrices)" if experts else "")
    kinds = sorted({_kind(n, p) for n, p in rest})
    return (f"optimizer: muon on {len(matrices)} hidden matrices ({count(matrices)}: attention and MLP projections"
            f"{expert_part}); adamw on {len(rest)} tensors ({count(rest)}: {', '.join(kinds)})")


def _kind(name: str, tensor: torch.Tensor) -> str:
    if "router" in name:
        return "MoE routers"
    if "emb" in name:
        return "embeddings"
    if "lm_head" in name:
        return "LM head"
    if name.endswith("bias") or name.rsplit(".", 1)[-1].startswith("b_"):
        return "biases"
    return "norm gains" if tensor.ndim == 1 else "other"


def build_adamw(params_or_groups, optim_cfg: OptimConfig, device: torch.device, *,
                allow_fused: bool = True) -> torch.optim.Optimizer:
    """AdamW from the ``optim`` section; ``allow_fused=False`` where the parameters live on another
    device than the one the fused kernel would run on (DeepSpeed's optimizer offload)."""
    fused = allow_fused and (optim_cfg.fused == "on" or (optim_cfg.fused == "auto" and device.type == "cuda"))
    return torch.optim.AdamW(
        params_or_groups,
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        fused=fused or None,
    )
