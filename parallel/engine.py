"""The training step behind one interface, whatever the parallel layout.

The loop (``training/loop.py``) drives an ``Engine`` through a few calls: ``forward_backward``
per micro-batch, ``optimizer_step`` once per step, ``eval_loss``, ``save``/``load`` for
checkpoints, ``comm_stats`` and ``local_weights`` for what it logs and checks, ``module`` and
``optimized_parts`` for what it inspects. Each layout has its own engine, chosen once by the build
path (``parallel/parallelize.py``):

    TorchEngine     a plain module (one process)
    DDPEngine       DDP: gradient all-reduce skipped on all but the last micro-batch; comm-hook bytes
    ShardedEngine   DTensor parameters (FSDP2 and/or tensor parallel): gradient sync only on the last
                    micro-batch; DCP checkpoints that reshard to any layout
    PipelineEngine  a ShardedEngine over this rank's pipeline stages: a schedule runs the step's
                    micro-batches (parallel/pp.py)
    ZeroEngine      DeepSpeed ZeRO 1-3 (parallel/zero.py)

The torch engines share the forward (autocast from the precision policy) and the optimizer step
(``parallel/step.py``: fp16 GradScaler, fp32 master copies for bf16 weights, gradient clipping and
the finite check) over their ``OptimizedPart``s: one for the whole model, one per stage in a pipeline.
"""

from __future__ import annotations

import abc
import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from common.errors import CheckpointError
from common.values import full_value, loss_parallel_context
from parallel.checkpoint import (
    FULL_STATE_FILE,
    Staging,
    has_sharded_state,
    host_copy,
    load_sharded,
    safe_torch_load,
    save_sharded,
    stage_sharded,
)
from parallel.optim import OptimConfig
from parallel.precision import PrecisionPolicy
from parallel.step import OptimizedPart, OptimizerStep, StepResult, muon_comm_stats


class Engine(abc.ABC):
    """What the training loop, evaluation and checkpointing need from a parallel layout."""

    model: nn.Module  # the module as wrapped for training (DDP, FSDP2, DeepSpeed)
    policy: PrecisionPolicy  # what precision decided for this run (the forward's autocast, the masters)
    # Called with "data", "forward", "backward" as the step's work starts each; the training loop
    # points it at its phase marks (hang watchdog, straggler report). Must stay cheap.
    mark_phase: Callable[[str], None] = staticmethod(lambda name: None)

    @abc.abstractmethod
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, is_last_micro: bool, n_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (unscaled, detached) mean loss."""

    def forward_backward_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                              n_micro: int) -> tuple[torch.Tensor, float]:
        """Forward and backward over a step's ``n_micro`` micro-batches, taken from ``batches``
        one at a time (the next is loaded while this one computes); returns the mean loss and the
        seconds spent waiting for data."""
        loss, wait = None, 0.0
        for micro in range(n_micro):
            self.mark_phase("data")
            t0 = time.perf_counter()
            x, y = next(batches)
            wait += time.perf_counter() - t0
            micro_loss = self.forward_backward(x, y, micro == n_micro - 1, n_micro).float()
            loss = micro_loss / n_micro if loss is None else loss + micro_loss / n_micro
        return loss, wait

    @abc.abstractmethod
    def optimizer_step(self, lr: float, loss: torch.Tensor) -> StepResult:
        """Step with learning rate ``lr`` unless the gradients or ``loss`` are non-finite."""

    @abc.abstractmethod
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None: ...

    @abc.abstractmethod
    def save(self, directory: Path, rank: int) -> None:
        """Collective: write this rank's part of the model and optimizer state into ``directory``."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None: ...

    def stage_save(self, directory: Path, rank: int, staging: Staging) -> Callable[[], None]:
        """Collective: copy this rank's part of the model and optimizer state into host memory now
        (``staging``'s, reused from save to save), and return the function that writes it into
        ``directory`` (on a background thread, while training goes on)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write checkpoints in the background")

    @abc.abstractmethod
    def comm_stats(self) -> dict[str, float]:
        """This rank's gradient communication during the last step (``comm_bytes_sent``,
        ``comm_bytes_uncompressed``, ...); empty when nothing counts it. Host-side numbers: reading
        them never syncs the device. Each call starts a new count."""

    @abc.abstractmethod
    def local_weights(self) -> list[torch.Tensor]:
        """The parameter values this rank actually holds (shards, partitions, fp32 masters), for the
        finite check before a save."""

    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The user's GPT under every wrapper (for tools that inspect parameters and gradients); a
        pipeline's stages this rank holds, as one ``nn.ModuleList``."""

    def take_mtp_loss(self) -> torch.Tensor | None:
        """The mean multi-token-prediction loss of this rank's training forwards since the last call
        (None: none ran)."""
        return self.module().take_mtp_loss()

    @abc.abstractmethod
    def optimized_parts(self) -> list[OptimizedPart]:
        """The modules this rank steps, each with its optimizer (and fp32 masters): one for a whole
        model, one per pipeline stage; none where DeepSpeed owns the optimizer (ZeRO)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP / compile wrappers (FSDP2 shards in place, nothing to unwrap)."""
    while True:
        if isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


class TorchEngine(Engine):
    """A plain module; the base of the DDP, sharded and pipeline engines, which differ in gradient
    synchronization, in how they run a step's micro-batches and in how they write checkpoints.

    ``parts``: the modules that each get their own optimizer, stepped together (default: ``model``
    alone; a pipeline's stages); ``group`` and ``counted_once`` go to the ``OptimizerStep`` (the
    pipeline's group the gradient norm spans, a tied embedding's copies counted once)."""

    def __init__(self, model: nn.Module, policy: PrecisionPolicy, optim_cfg: OptimConfig, device: torch.device,
                 *, loss_parallel: bool = False, parts: list[nn.Module] | None = None,
                 group: dist.ProcessGroup | None = None, counted_once: tuple[nn.Parameter, ...] = ()):
        self.model, self.policy, self.device = model, policy, device
        # Tensor parallelism with vocab-sharded logits: the loss and its backward run in
        # loss_parallel(), and the loss comes back a replicated DTensor.
        self._loss_context = loss_parallel_context if loss_parallel else contextlib.nullcontext
        self.parts = [OptimizedPart.build(part, policy, optim_cfg, device) for part in parts or [model]]
        self.scaler = (torch.amp.GradScaler(device.type, init_scale=policy.config.fp16_init_scale)
                       if policy.grad_scaler else None)
        self._step = OptimizerStep(self.parts, grad_clip=optim_cfg.grad_clip, device=device, scaler=self.scaler,
                                   group=group, counted_once=counted_once)

    # ----------------------------------------------------------------- step

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, is_last_micro: bool, n_micro: int) -> torch.Tensor:
        with self._grad_sync(is_last_micro), self._loss_context():
            self.mark_phase("forward")
            with self.policy.forward_context(self.device):
                loss = self.model(x, y)
            self.mark_phase("backward")
            scaled = loss / n_micro
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return full_value(loss.detach())

    def _grad_sync(self, is_last_micro: bool) -> contextlib.AbstractContextManager:
        """Where gradients are averaged across ranks, skip it on all but the last micro-batch."""
        return contextlib.nullcontext()

    def optimizer_step(self, lr: float, loss: torch.Tensor) -> StepResult:
        return self._step(lr, loss)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._loss_context(), self.policy.forward_context(self.device):
            return full_value(self.model(x, y).detach())

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def comm_stats(self) -> dict[str, float]:
        return muon_comm_stats(self.parts)

    def local_weights(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.local_weights()]

    def module(self) -> nn.Module:
        return unwrap(self.model)

    def optimized_parts(self) -> list[OptimizedPart]:
        return self.parts

    # ----------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) states of the one module: model, optimizer, fp32 masters, loss scaler."""
        [part] = self.parts
        state = {"model": self.module().state_dict(), "optimizer": part.optimizer.state_dict()}
        if part.masters is not None:
            state["masters"] = part.masters.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        [part] = self.parts
        try:
            self.module().load_state_dict(state["model"])
        except RuntimeError as exc:
            detail = str(exc).strip().splitlines()[-1].strip()[:200]
            raise CheckpointError(f"checkpoint does not match the model: {detail}") from None
        part.optimizer.load_state_dict(state["optimizer"])
        if part.masters is not None:
            part.masters.load_state_dict(state["masters"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def save(self, directory: Path, rank: int) -> None:
        if rank == 0:  # every rank holds the same full state
            torch.save(self.state_dict(), directory / FULL_STATE_FILE)

    def stage_save(self, directory: Path, rank: int, staging: Staging) -> Callable[[], None]:
        if rank != 0:
            return lambda: None
        staged = host_copy(self.state_dict(), staging.storages)  # torch.save writes the same file from it
        return lambda: torch.save(staged, directory / FULL_STATE_FILE)

    def load(self, directory: Path) -> None:
        if has_sharded_state(directory):  # saved by a sharded layout: DCP reshards it into this one
            load_sharded([(self.module(), self.parts[0].optimizer)], self.scaler, directory)
            return
        self.load_state_dict(safe_torch_load(directory / FULL_STATE_FILE, map_location=self.device))


class DDPEngine(TorchEngine):
    """DDP-wrapped model: every rank holds everything; gradients are all-reduced in buckets."""

    def __init__(self, model: nn.Module, policy: PrecisionPolicy, optim_cfg: OptimConfig, device: torch.device,
                 comm_counter: Any = None):
        super().__init__(model, policy, optim_cfg, device)
        self._comm_counter = comm_counter  # a comm hook's byte counter (parallel/compression.py)

    def _grad_sync(self, is_last_micro: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if is_last_micro else self.model.no_sync()

    def comm_stats(self) -> dict[str, float]:
        hook = {} if self._comm_counter is None else self._comm_counter.pop_step()
        return hook | muon_comm_stats(self.parts)


class ShardedEngine(TorchEngine):
    """Parameters are DTensors (sharded by FSDP2 over the data-parallel ranks and/or by tensor
    parallelism) or split into pipeline stages: each rank steps only what it holds, and checkpoints
    are DCP directories that load into any other layout (or into one process)."""

    # Names a part's optimizer state is saved and loaded under instead of its own (a pipeline's
    # copy of a tied embedding); None: every parameter under its own name.
    checkpoint_aliases: dict[str, str] | None = None

    def __init__(self, model: nn.Module, policy: PrecisionPolicy, optim_cfg: OptimConfig, device: torch.device,
                 *, fsdp: bool, loss_parallel: bool = False, parts: list[nn.Module] | None = None,
                 group: dist.ProcessGroup | None = None, counted_once: tuple[nn.Parameter, ...] = ()):
        super().__init__(model, policy, optim_cfg, device, loss_parallel=loss_parallel, parts=parts, group=group,
                         counted_once=counted_once)
        self.fsdp = fsdp  # FSDP2 reduce-scatters gradients; tensor parallelism alone has none to sync

    def _grad_sync(self, is_last_micro: bool) -> contextlib.AbstractContextManager:
        if self.fsdp:
            self.model.set_requires_gradient_sync(is_last_micro)
        return contextlib.nullcontext()

    def _stateful(self) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
        return [(part.model, part.optimizer) for part in self.parts]

    def save(self, directory: Path, rank: int) -> None:
        save_sharded(self._stateful(), self.scaler, directory, aliases=self.checkpoint_aliases)

    def stage_save(self, directory: Path, rank: int, staging: Staging) -> Callable[[], None]:
        return stage_sharded(self._stateful(), self.scaler, directory, staging, aliases=self.checkpoint_aliases)

    def load(self, directory: Path) -> None:
        load_sharded(self._stateful(), self.scaler, directory, aliases=self.checkpoint_aliases)
