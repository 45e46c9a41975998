"""A job config to the objects that train: the engine (through parallel/'s one build path) and data.

train.py and the tools that train call these, so a benchmark measures exactly what a run
runs. Each section goes only to the code that owns it.
"""

from __future__ import annotations

from typing import Mapping

import torch

from data.loader import DataBundle, build_data
from data.prefetch import DevicePrefetcher
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
                      rank=ctx.dims.dp_rank, world_size=ctx.dims.dp_size, vocab_size=cfg.model.vocab_size)
    return data, DevicePrefetcher(data.train, ctx.device)
