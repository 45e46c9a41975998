"""A job config to the objects that train: the engine (through parallel/'s one build path) and data.

train.py and the tools that train call these, so a benchmark measures exactly what a run
runs. Each section goes only to the code that owns it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from common.errors import ConfigError
from data.loader import DataBundle, build_data
from data.prefetch import DevicePrefetcher
from model.config import ModelConfig
from parallel.distributed import DistContext
from parallel.parallelize import Built, build_training
from training.config import JobConfig


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
                      rank=ctx.dims.dp_rank, world_size=ctx.dims.dp_size, vocab_size=cfg.model.vocab_size,
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
