"""A job config to the objects that train: the resolved configuration, the engine (through
parallel/'s one build path) and the data.

train.py and the tools that train call these, so a benchmark measures exactly what a run
runs. Each section goes only to the code that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Collection, Mapping

import torch

from common.errors import ConfigError
from data.loader import DataBundle, build_data
from data.prefetch import DevicePrefetcher
from model.config import ModelConfig
from parallel.distributed import DistContext
from parallel.parallelize import Built, build_training, check_parameters_fit
from training.config import JobConfig
from training.model_io import with_initial_weights


@dataclass
class Job:
    """A run's configuration with every value resolved (what ``config.yaml`` records and the run
    uses), and what resolving it opened: the data and the initial weights."""

    cfg: JobConfig
    data: DataBundle
    batches: DevicePrefetcher  # the training batches, already on the device
    initial_state: dict[str, torch.Tensor] | None = None  # model.init_from's weights
    notes: list[str] = field(default_factory=list)  # what resolving changed, one log line each
    warnings: list[str] = field(default_factory=list)  # changes the user should hear about


def resolve_job(cfg: JobConfig, ctx: DistContext, explicit: Collection[str] = ()) -> Job:
    """Every value a run takes from somewhere other than its config file, decided here and only
    here, in the order they depend on each other, before anything is written or the model built:

    1. model.init_from: the architecture of the source (its weights come along); ``explicit``, the
       keys the file and the command line set (``training.config.explicit_keys``), must agree with it
    2. optim.warmup_steps: the warm-up a run of train.max_steps steps uses (``OptimConfig.for_run``)
    3. parallel.strategy: none on several data-parallel ranks trains them as DDP or FSDP2
    4. the data, opened for the resolved model and ranks; a document mask's model.eot_id from it

    A bad value anywhere is a one-line error here, with nothing written yet; so is a model whose
    parameters alone cannot fit this device (checked once its architecture is known, before the data).
    """
    notes, warnings, initial_state = [], [], None
    if cfg.model.init_from:
        cfg, source, note = with_initial_weights(cfg, explicit)
        notes.append(note)
        initial_state = source.state
    check_parameters_fit(cfg.model, ctx.device, ctx.world_size, cfg.parallel.init_on_meta)
    optim, note = cfg.optim.for_run(cfg.train.max_steps)
    warnings += [note] if note else []
    parallel, note = cfg.parallel.resolved(ctx.layout)
    notes += [note] if note else []
    cfg = replace(cfg, optim=optim, parallel=parallel)
    data, batches = build_batches(cfg, ctx)
    cfg = replace(cfg, model=with_document_eot(cfg.model, data.eot_id))
    return Job(cfg, data, batches, initial_state, notes, warnings)


def build_from_config(cfg: JobConfig, ctx: DistContext, initial_state: Mapping[str, torch.Tensor] | None = None) -> Built:
    t = cfg.train
    return build_training(
        model_cfg=cfg.model, kernels_cfg=cfg.kernels, precision_cfg=cfg.precision, parallel_cfg=cfg.parallel,
        optim_cfg=cfg.optim, ctx=ctx, seed=t.seed, micro_batch_size=t.micro_batch_size,
        grad_accum_steps=t.grad_accum_steps, compile=t.compile, compile_mode=t.compile_mode,
        compile_loss=t.compile_loss, initial_state=initial_state,
    )


def build_batches(cfg: JobConfig, ctx: DistContext) -> tuple[DataBundle, DevicePrefetcher]:
    """This rank's data, and its training batches already on the device.

    Batches are split over the data-parallel ranks only: the ranks of one tensor-parallel group
    and of one pipeline read the same batches (each needs them whole, or the first and last stage
    their inputs and targets).
    """
    t = cfg.train
    data = build_data(cfg.data, seq_len=cfg.seq_len, micro_batch_size=t.micro_batch_size, seed=t.seed,
                      rank=ctx.dims.dp_rank, world_size=ctx.layout.dp, vocab_size=cfg.model.vocab_size,
                      grad_accum_steps=t.grad_accum_steps, val_limit=t.validation_sequences)
    return data, DevicePrefetcher(data.train, ctx.device)


def with_document_eot(model_cfg: ModelConfig, data_eot_id: int | None) -> ModelConfig:
    """The model section with the dataset's end-of-text id, where a document mask needs it and
    model.eot_id does not set it; a document mask with neither is a one-line error."""
    if model_cfg.attention_mask != "document" or model_cfg.eot_id is not None:
        return model_cfg
    if data_eot_id is None:
        raise ConfigError("model.attention_mask=document needs the end-of-text id that ends each document, and "
                          "the dataset records none: set model.eot_id")
    resolved = replace(model_cfg, eot_id=int(data_eot_id))
    resolved.validate()  # the id must lie inside the model's vocabulary
    return resolved
