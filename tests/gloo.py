"""Run a function on N gloo processes on this machine and collect each rank's (picklable) result.

Process start-up dominates multi-process tests, so each test module launches once and asserts
on the parts of the results it needs.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple, env: dict) -> None:
    os.environ.clear()  # the launching test's environment, not the one the fork server started with
    os.environ.update(env)
    os.environ.update(
        WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),  # a mismatched collective fails instead of hanging
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


# Workers are forked from a server process that imported these once, instead of each importing
# torch and the project afresh (seconds per rank on a small machine). The server holds no threads
# and no process group, so forking it is safe.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "training.build",
           "parallel.tp", "parallel.pp", "tests.conftest"]


def run_workers(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size gloo processes; return each rank's result."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server first starts
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args, dict(os.environ)),
                           nprocs=world_size, join=True,
                           start_method="forkserver")
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def gloo_context(rank: int, world: int, local_world: int | None = None, parallel=None, device: str = "cpu",
                 **degrees):
    """The DistContext of a worker started by ``run_workers`` (gloo): ``local_world`` ranks per
    node, and the layout of the ``parallel`` config section on them (``Layout.of``, as train.py builds
    it), or of ``degrees`` (the layout's keys: pp, dp_replicate, dp_shard, cp, tp, ep, strategy). Builds
    the device mesh, a collective: every worker calls it with the same layout. ``device``: where this
    rank computes (a CUDA device too: gloo's collectives take CUDA tensors, and several ranks may share
    one GPU, which NCCL refuses)."""
    from parallel.dims import ParallelDims
    from parallel.distributed import DistContext
    from parallel.layout import Layout

    local = local_world or world
    layout = Layout.of(parallel, world, local) if parallel is not None else Layout(world, ranks_per_node=local, **degrees)
    dims = ParallelDims(world, local, rank, rank % local, layout=layout)
    where = torch.device(device)
    return DistContext(dims, where, "gloo", dims.build_mesh(where.type))


def data_parallel_engine(model, parallel_cfg, ctx, mode: str = "fp32", **optim):
    """``model`` wrapped for ``parallel_cfg.strategy`` through the build path's data-parallel step."""
    from parallel.optim import OptimConfig
    from parallel.parallelize import apply_data_parallel
    from parallel.precision import PrecisionConfig, precision_policy

    policy = precision_policy(PrecisionConfig(mode=mode), parallel_cfg.strategy)
    return apply_data_parallel(model, parallel_cfg, ctx, policy, OptimConfig(**optim))


def save_on_every_rank(engine, path, rank: int) -> None:
    """``engine`` saved to the directory ``path`` (rank 0 makes it) by every worker, a collective:
    no rank goes on before every shard is written."""
    if rank == 0:
        path.mkdir(parents=True)
    dist.barrier()
    engine.save(path, rank)
    dist.barrier()


def train_save_and_resume(build, train, path, rank: int, save_after: int, steps: int) -> tuple:
    """A run interrupted and resumed: an engine from ``build()`` trained by ``train(engine, steps)`` for
    steps 0 .. save_after - 1, saved to ``path`` by every worker, then on to ``steps``; a fresh engine
    from ``build()`` loads the checkpoint and trains the same remaining steps. Returns the first
    engine, the fresh one and what ``train`` returned for the first part, the rest and the resumed rest."""
    engine = build()
    head = train(engine, range(save_after))
    save_on_every_rank(engine, path, rank)
    tail = train(engine, range(save_after, steps))
    fresh = build()
    fresh.load(path)
    return engine, fresh, head, tail, train(fresh, range(save_after, steps))


def assert_resumes_exactly(run: dict, save_after: int) -> None:
    """A run of ``train_save_and_resume`` gathered as ``losses`` and ``final`` weights (uninterrupted)
    and ``resumed`` and ``resumed_final`` (the fresh engine): the resumed steps repeat the
    uninterrupted ones bit for bit."""
    assert run["resumed"] == run["losses"][save_after:]
    assert run["resumed_final"].keys() == run["final"].keys()
    for key, value in run["final"].items():
        assert torch.equal(run["resumed_final"][key], value), key
