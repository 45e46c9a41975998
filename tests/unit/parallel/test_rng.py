"""Dropout's generators under tensor parallelism (parallel/rng.py), in one process: what a rank of a
tp group draws in a split region, that the group stays in step after it, that recompute replays it,
and which of a model's dropouts a tensor-parallel rank splits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.attention import AttentionCore
from model.config import ModelConfig
from model.gpt import GPT
from parallel.rng import seed_activation_rng, split_rng
from parallel.tp import SplitRNG, split_dropout


def _mask_in_split_region(rank: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask rank ``rank`` draws in a split region from a given default state, and what the
    default generator draws next."""
    torch.manual_seed(seed)
    with split_rng(rank):
        mask = F.dropout(torch.ones(64, 64), p=0.5) != 0
    return mask, torch.rand(8)


def test_ranks_of_a_group_draw_their_own_masks_and_stay_in_step():
    mask0, after0 = _mask_in_split_region(0)
    mask1, after1 = _mask_in_split_region(1)
    again0, _ = _mask_in_split_region(0)
    assert torch.equal(mask0, again0)  # a function of the default state and the rank
    assert (mask0 != mask1).float().mean() > 0.3  # independent masks differ in about half the places
    # The default generator moved by the same single draw on every rank: replicated regions after a
    # split one still draw the same masks on all ranks of the group.
    assert torch.equal(after0, after1)
    torch.manual_seed(5)
    torch.randint(2**62, (1,))
    assert torch.equal(after0, torch.rand(8))


def test_the_default_generator_is_untouched_by_what_the_region_draws():
    torch.manual_seed(3)
    with split_rng(0):
        torch.rand(1000)  # many draws inside
    inside_many = torch.rand(4)
    torch.manual_seed(3)
    with split_rng(0):
        pass
    assert torch.equal(inside_many, torch.rand(4))


def test_recompute_replays_a_split_region_mask():
    """Checkpointed, the region runs twice (forward, then again in backward); both must drop the
    same elements, so the gradient equals the one of a run without recompute from the same state."""
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(4, 32)

    def region(x):
        with split_rng(1):
            return F.dropout(x @ w, p=0.5)

    def grad(recompute: bool) -> torch.Tensor:
        torch.manual_seed(11)
        w.grad = None
        y = checkpoint(region, x, use_reentrant=False) if recompute else region(x)
        torch.rand(3)  # the forward moves on before the backward recomputes
        (y * torch.arange(32.0)).sum().backward()
        return w.grad.clone()

    torch.testing.assert_close(grad(True), grad(False), rtol=0, atol=0)


def test_each_tensor_parallel_group_seeds_its_own_default_generator():
    def after(group: int) -> torch.Tensor:
        torch.manual_seed(7)
        torch.rand(5)  # what building the weights drew
        seed_activation_rng(1337, group)
        return torch.rand(16)

    torch.manual_seed(7)
    torch.rand(5)
    one_process = torch.rand(16)
    assert torch.equal(after(0), one_process)  # group 0 draws as one process with the same seed
    assert torch.equal(after(1), after(1))
    assert not torch.equal(after(1), after(0)) and not torch.equal(after(1), after(2))


def _tiny_gpt(**overrides) -> GPT:
    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=2, n_head=2, d_model=16, dropout=0.1, **overrides)
    return GPT(cfg, attention_backend="reference")


def test_a_rank_splits_the_attention_core_always_and_the_residual_dropouts_under_sequence_parallelism():
    for sequence_parallel in (False, True):
        model = _tiny_gpt()
        split_dropout(model, 1, sequence_parallel)
        split = {name for name, m in model.named_modules() if isinstance(m, SplitRNG)}
        cores = {name for name, m in model.named_modules() if isinstance(m, AttentionCore)}
        dropouts = {name for name, m in model.named_modules() if isinstance(m, nn.Dropout)}
        assert cores and dropouts and all(model.get_submodule(n).split_rank == 1 for n in split)
        assert split == (cores | dropouts if sequence_parallel else cores)


def test_a_split_dropout_draws_the_mask_of_its_rank():
    """A split model drops what the plain model drops inside ``split_rng`` of its rank."""
    x = torch.randn(2, 8, 16)
    plain = nn.Dropout(0.3)
    split = nn.Dropout(0.3)
    split_dropout(nn.Sequential(split), 1, sequence_parallel=True)
    torch.manual_seed(2)
    got = split(x)
    torch.manual_seed(2)
    with split_rng(1):
        want = plain(x)
    assert torch.equal(got, want)
    torch.manual_seed(2)
    assert not torch.equal(plain(x), got)
