"""Context parallelism's layout in one process: every cp rank gets the same attention work, an MoE
capacity over cp chunks keeps the copies one process keeps, and the layouts that cannot run are
refused before any work, in one line. The layouts' numbers against one process, on gloo ranks:
tests/integration/parallel/test_cp.py."""

from __future__ import annotations

import pytest
import torch

from model.attention import causal_mask
from parallel.cp import chunk_ids, local_token_index
from parallel.dims import ParallelDims
from parallel.layout import Layout
from training.config import load_config


def test_every_cp_rank_does_the_same_attention_work():
    """Counted from the masks the ranks' chunks run under: (query, key) pairs per rank are equal,
    and the ranks' tokens are the whole sequence, each once."""
    for cp in (2, 4):
        seq = 8 * cp
        c = seq // (2 * cp)
        pairs = [sum(int(causal_mask(c, (g + 1) * c, "cpu").sum()) for g in chunk_ids(cp, r)) for r in range(cp)]
        assert len(set(pairs)) == 1, pairs
        # A plain split into cp pieces would not balance: its last rank sees the most keys.
        plain = [int(causal_mask(2 * c, (r + 1) * 2 * c, "cpu").sum()) for r in range(cp)]
        assert plain[-1] > plain[0]
        held = torch.cat([local_token_index(seq, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(seq))


def test_cp_ranks_sit_inside_tp_and_join_the_shard_group():
    dims = ParallelDims(8, 8, 5, 5, layout=Layout(8, cp=2, tp=2))
    assert (dims.layout.dp_shard, dims.coordinate("cp"), dims.coordinate("tp"), dims.dp_rank) == (2, 0, 1, 1)
    assert dims.fsdp_dims() == ("dp_shard_cp",)
    assert ParallelDims(4, 4, 0, 0, layout=Layout(4, cp=4)).fsdp_dims() == ("cp",)
    both = load_config(None, ["--parallel.cp=2", "--parallel.pp=2", "--train.grad_accum_steps=2"]).parallel
    assert (both.cp, both.pp) == (2, 2)  # composed (parallel/pp.py passes every stage what cp needs)
    zero_bubble = load_config(None, ["--parallel.cp=2", "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble",
                                     "--parallel.pp_virtual_stages=2", "--model.n_layer=4",
                                     "--train.grad_accum_steps=2"]).parallel
    assert zero_bubble.pp_schedule == "zero_bubble"  # its split backward under FSDP2: trained below


@pytest.mark.parametrize("args, message", [
    (["--parallel.cp=4", "--model.max_seq_len=100"], "parallel.cp=4 splits each sequence into 2 x cp = 8 equal chunks"),
    (["--parallel.cp=2", "--parallel.strategy=zero1"], "parallel.cp=2 with parallel.strategy=zero1 is not supported"),
    (["--parallel.cp=4", "--parallel.ep=2", "--model.moe.experts=4"], "parallel.ep=2 with parallel.cp=4: an expert-"),
])
def test_train_py_refuses_bad_cp_layouts_in_one_line(capsys, args, message):
    import train

    assert train.main(["--config", "configs/tiny.yaml", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_capacity_over_cp_chunks_keeps_the_copies_one_process_keeps():
    """Every cp rank's kept (token, expert) copies, placed with the other ranks' per-chunk counts,
    are one process's kept copies over the whole batch, for dropping capacities."""
    from model.moe import expert_capacity, permute
    from parallel.cp import chunk_expert_counts, earlier_from_counts

    g = torch.Generator().manual_seed(0)
    for cp, batch, seq, k, experts in [(2, 2, 16, 2, 4), (4, 3, 32, 1, 3), (2, 1, 8, 3, 5)]:
        choice = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(batch * seq)]).view(batch, seq, k)
        capacity = expert_capacity(batch * seq, k, experts, 0.7)
        x = torch.arange(batch * seq, dtype=torch.float32)[:, None]  # each row says which token it is
        _, whole = permute(x, choice.flatten(0, 1), experts, capacity)
        expected = sorted(whole.slots.tolist())  # flat t * k + j over the whole batch
        counts = torch.stack([chunk_expert_counts(choice[:, local_token_index(seq, cp, r)], experts)
                              for r in range(cp)])
        kept = []
        for r in range(cp):
            index = local_token_index(seq, cp, r)
            mine = choice[:, index]  # (B, seq / cp, k)
            earlier = earlier_from_counts(counts, mine, r)
            _, part = permute(x[:batch * len(index)], mine.flatten(0, 1), experts, capacity, earlier=earlier)
            token = (torch.arange(batch)[:, None] * seq + index).flatten()  # local token -> whole-batch token
            kept += [int(token[s // k]) * k + s % k for s in part.slots.tolist()]
        assert sorted(kept) == expected and len(expected) < batch * seq * k  # some copies were dropped
