"""Transformer Engine's FP8 layers (``model.layers=te``, ``precision.mode=fp8``) under DDP: 2 ranks
against one process on the same global batch, in the same mode.

GPU tier: it needs a CUDA device with FP8 tensor cores and Transformer Engine, and skips, saying
which is missing, where one is not (on a machine without Transformer Engine, train.py refuses the
mode in one line: tests/integration/test_train.py). tools/gpu_bench.sh's gpu-tests stage runs it
(``pytest -m gpu tests/``). The ranks talk over gloo, whose collectives take CUDA tensors, so both
may share one GPU (NCCL refuses two ranks on one device); with two GPUs each rank takes its own.
FP8's scales come from the amaxes of the tokens a rank sees, so the ranks round otherwise than one
process: losses and gradient norms are held to test_layout_seams.py's FP8 tolerances, as torchao's
FP8 layouts are there.
"""

from __future__ import annotations

import pytest
import torch

from model.te import te_available
from parallel.distributed import DistContext
from tests.gloo import gloo_context, run_workers
from tests.integration.parallel.test_cp import batches
from tests.integration.parallel.test_layout_seams import PRECISION, STEPS, job

WORLD = 2
# Every GEMM dimension a multiple of 16 (d_model 64, d_ff 192, fused QKV 128), as FP8 needs.
TE_FP8 = {"model.d_model": 64, "model.layers": "te", "precision.mode": "fp8", "precision.fp8_backend": "te"}


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not te_available(), reason="needs Transformer Engine (pip install 'perfgpt[te]')"),
    pytest.mark.skipif(not fp8_capable(), reason="needs FP8 tensor cores (compute capability >= 8.9)"),
]


def fp8_enabled() -> bool:
    """Whether Transformer Engine's FP8 autocast is on (its state manager moved in newer versions)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager.is_fp8_enabled()


def train(engine, ctx: DistContext, cfg, global_batch) -> dict:
    """Losses and gradient norms of STEPS steps, and whether the first TE block ran in FP8 each time.
    ``global_batch(step)``: the (inputs, targets) pairs this process trains on at ``step``."""
    from model.te import TEBlock

    in_fp8 = []
    first = next(m for m in engine.module().modules() if isinstance(m, TEBlock))
    hook = first.register_forward_hook(lambda m, args, out: in_fp8.append(fp8_enabled()))
    losses, norms = [], []
    for step in range(STEPS):
        pairs = [(x.to(ctx.device), y.to(ctx.device)) for x, y in global_batch(step)]
        loss, _ = engine.forward_backward_step(iter(pairs), len(pairs))
        norms.append(float(engine.optimizer_step(cfg.optim.lr, loss).grad_norm))
        losses.append(float(ctx.all_reduce_mean(loss.detach().float().clone())))
    hook.remove()
    return {"losses": losses, "norms": norms, "in_fp8": in_fp8}


def worker(rank: int, world: int) -> dict:
    from training.build import build_from_config

    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    cfg = job({"strategy": "ddp"}, TE_FP8)
    ctx = gloo_context(rank, world, parallel=cfg.parallel, device=f"cuda:{index}")
    assert ctx.layout.strategy == "ddp" and ctx.layout.dp == world
    return train(build_from_config(cfg, ctx).engine, ctx, cfg, lambda step: list(batches(step, rank)))


def one_process() -> dict:
    from training.build import build_from_config

    cfg = job({}, TE_FP8)
    ctx = DistContext.single("cuda")
    return train(build_from_config(cfg, ctx).engine, ctx, cfg,
                 lambda step: [b for r in range(WORLD) for b in batches(step, r)])


def test_te_fp8_under_ddp_on_two_ranks_tracks_one_process():
    ranks = run_workers(worker, WORLD)
    ref = one_process()
    loss_tol, norm_tol, _ = PRECISION["fp8"]
    assert ref["in_fp8"] and all(ref["in_fp8"]), "one process: the TE blocks did not run in FP8"
    for rank, got in enumerate(ranks):
        assert got["in_fp8"] and all(got["in_fp8"]), f"rank {rank}: the TE blocks did not run in FP8"
        assert got["losses"] == pytest.approx(ref["losses"], abs=loss_tol), rank
        assert got["norms"] == pytest.approx(ref["norms"], rel=norm_tol), rank
