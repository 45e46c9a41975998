"""Benchmark tasks during training: lm-evaluation-harness tasks every ``harness.interval`` steps.

At each evaluation every rank copies the whole model out of the training layout (DTensor shards
joined, ZeRO-3 partitions gathered, pipeline stages exchanged) into a plain ``GPT`` in eval mode,
and the harness spreads the task's requests over the ranks (training/lm_eval_backend.py). The copy is
built, used and dropped inside a saved and restored RNG state, and the training model, its
optimizer and the data stream are never touched: a run with evaluations has the same losses as
one without (tested bit for bit). The price is one extra copy of the weights per rank while the
tasks run.

The harness is optional: nothing here imports it until tasks are configured, so train.py starts
as fast without it.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from common.errors import CapabilityError
from common.values import is_dtensor
from model.gpt import GPT
from parallel.distributed import DistContext
from parallel.engine import Engine
from training.checkpoint import capture_rng_state, restore_rng_state
from training.config import JobConfig
from training.model_io import WRAPPER_PREFIXES

INSTALL_HINT = "pip install -e '.[eval]' (lm-evaluation-harness)"
SCORE_PREFIX = "harness/"  # metrics.jsonl / wandb / TensorBoard keys: harness/<task>/<metric>


def import_lm_eval_backend(what: str) -> Any:
    """training.lm_eval_backend, or a one-line CapabilityError saying how to install the harness."""
    try:
        import lm_eval  # noqa: F401 -- only to find out whether it is installed
    except ImportError:
        raise CapabilityError(f"{what} needs lm-evaluation-harness: {INSTALL_HINT}") from None
    from training import lm_eval_backend

    return lm_eval_backend


class TaskEvaluator:
    """Loads ``harness.tasks`` once (at start-up, so a bad task name stops the run before its
    first step) and runs them on a copy of the training model when ``due``."""

    def __init__(self, cfg: JobConfig, ctx: DistContext, tokenizer: str, eot_id: int | None):
        self.cfg, self.ctx, self.tokenizer, self.eot_id = cfg, ctx, tokenizer, eot_id
        self.backend = import_lm_eval_backend("harness.tasks")
        rng = capture_rng_state()  # loading reads datasets; whatever it draws, training does not see it
        try:
            self.tasks = self.backend.load_tasks(cfg.harness.tasks, cfg.harness.task_dir or None)
        finally:
            restore_rng_state(rng)

    def due(self, step: int) -> bool:
        return step % self.cfg.harness.interval == 0 or step == self.cfg.train.max_steps

    def run(self, engine: Engine) -> dict[str, float]:
        """A collective: every rank takes part. The scores (``harness/<task>/<metric>``) on rank 0,
        an empty dict elsewhere."""
        h, device = self.cfg.harness, self.ctx.device
        rng = capture_rng_state()
        try:
            model = eval_copy(engine, self.cfg, device)
            lm = self.backend.PerfGPTLM(model=model, tokenizer=self.tokenizer, eot_id=self.eot_id,
                                        batch_size=h.batch_size, forward_context=autocast_of(engine, device))
            results = self.backend.run_tasks(lm, self.tasks, limit=h.limit, num_fewshot=h.num_fewshot,
                                             bootstrap_iters=0)
        finally:
            restore_rng_state(rng)
        if results is None:
            return {}
        return {SCORE_PREFIX + k: v for k, v in self.backend.scores(results).items()}


def eval_copy(engine: Engine, cfg: JobConfig, device: torch.device) -> GPT:
    """A plain GPT in eval mode with the training model's current weights (a collective where the
    weights are spread over ranks)."""
    state = full_model_state(engine)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model = GPT(replace(cfg.model, dropout=0.0, recompute="none"))
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def full_model_state(engine: Engine) -> dict[str, torch.Tensor]:
    """The whole model's state dict under its plain names, on every rank."""
    module = engine.module()
    stages = list(module) if isinstance(module, nn.ModuleList) else [module]  # a pipeline's stages on this rank
    state: dict[str, torch.Tensor] = {}
    for part in stages:
        gathering = _gathered_zero3(part)
        # A copy only where the tensor would not outlive this loop (ZeRO-3 frees its gathered
        # parameters, stages travel to the other ranks); load_state_dict copies the rest.
        keep = not isinstance(gathering, contextlib.nullcontext) or len(stages) > 1 or isinstance(module, nn.ModuleList)
        with gathering:
            for name, tensor in part.state_dict().items():
                if is_dtensor(tensor):
                    tensor = tensor.full_tensor()  # a collective over the tensor's own mesh
                state[_plain_name(name)] = tensor.detach().to("cpu", copy=True) if keep else tensor.detach()
    if isinstance(module, nn.ModuleList) and dist.is_initialized() and dist.get_world_size() > 1:
        pieces: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, {k: v.cpu() for k, v in state.items()})
        state = {k: v for piece in pieces for k, v in piece.items()}
    return state


def _plain_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _gathered_zero3(module: nn.Module) -> contextlib.AbstractContextManager:
    """Under ZeRO-3 each rank holds a slice of every parameter: gather them for the copy."""
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def autocast_of(engine: Engine, device: torch.device):
    """The training forward's autocast (no FP8 context: the copy's layers are plain)."""
    dtype = engine.policy.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
