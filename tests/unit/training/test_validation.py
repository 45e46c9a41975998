"""The validation loss is the mean over one fixed set of sequences, whatever the ranks and batches.

In one process: each rank's sums (``training.loop.validation_sums``) are computed on its own share
of the set and added, as the all-reduce adds them, and the loss equals one cross-entropy over all
the set's sequences at once, computed from the plain model. Multi-process layouts (DDP, FSDP2,
ZeRO, tp, pp) are checked against one process in tests/integration/test_strategies_under_torchrun.py
and tests/integration/parallel/test_tp_pp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data.bundle import ValSource
from parallel.distributed import DistContext
from training.build import build_from_config
from training.config import load_config
from training.loop import evaluate, validation_sums

VOCAB, T, WINDOWS = 64, 16, 11


def windows() -> torch.Tensor:
    return torch.randint(0, VOCAB, (WINDOWS, T + 1), generator=torch.Generator().manual_seed(0))


def source(rank: int, world: int, batch: int) -> ValSource:
    data = windows().numpy()
    return ValSource(lambda: iter(data), available=WINDOWS, seq_len=T, batch_size=batch, rank=rank, world_size=world)


@pytest.fixture(scope="module")
def engine():
    cfg = load_config(None, [f"--model.vocab_size={VOCAB}", f"--model.max_seq_len={T}", "--model.n_layer=2",
                             "--model.d_model=32", "--model.n_head=4"])
    return build_from_config(cfg, DistContext.single()).engine


@pytest.mark.parametrize("n", [11, 7, 3])
def test_the_loss_is_the_mean_over_the_set_for_any_ranks_and_batch(engine, n):
    tokens = windows()[:n]
    with torch.no_grad():
        logits = engine.module()(tokens[:, :-1])
    reference = float(F.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten()))
    for world in (1, 2, 3, 4):
        for batch in (1, 2, 3):
            sums = sum(validation_sums(engine, source(r, world, batch), n, torch.device("cpu")) for r in range(world))
            assert float(sums[1]) == n * T, (world, batch)  # every target of the set counted once
            assert float(sums[0] / sums[1]) == pytest.approx(reference, abs=1e-6), (world, batch)
    assert evaluate(engine, source(0, 1, 4), n, DistContext.single()) == pytest.approx(reference, abs=1e-6)
