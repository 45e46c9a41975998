"""Multi-token prediction under the document mask, and what stays refused with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError
from model.gpt import GPT
from tests.unit.model.test_deepseek import mla_model, mtp_reference
from tests.unit.model.test_interop import VOCAB


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_mtp_under_the_document_mask_equals_each_document_alone(attention):
    """Packed documents: the main loss and every depth's MTP loss equal those of each document run
    alone (positions from 0, the written-out reference), summed over the documents: no depth reads a
    token or predicts a target of another document, and no position attends across one."""
    torch.manual_seed(0)
    cfg = mla_model(mtp_depth=2, attention_kind="gqa", attention_mask="document", document_positions=True)
    packed = GPT(cfg, attention_backend=attention).train()
    alone = GPT(dataclasses.replace(cfg, attention_mask="causal"), attention_backend=attention).train()
    alone.load_state_dict(packed.state_dict())
    lengths = [(4, 7, 6), (3, 9, 5)]  # documents of each row, each ending with the end-of-text id 0
    rows = []
    for row in lengths:
        docs = [torch.cat([torch.randint(1, VOCAB, (n - 1,)), torch.zeros(1, dtype=torch.long)]) for n in row]
        rows.append(torch.cat(docs + [torch.randint(1, VOCAB, (1,))]))  # the last target
    seq = torch.stack(rows)
    main = packed(seq[:, :-1], seq[:, 1:])
    got = packed.take_mtp_loss()
    sums, counts = torch.zeros(3), torch.zeros(3)  # main, depth 1, depth 2
    with torch.no_grad():
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                ref_main, ref_depths = mtp_reference(alone, seq[b:b + 1, start:start + n + 1])
                for d, (loss, count) in enumerate(zip([ref_main, *ref_depths], [n, n - 1, n - 2])):
                    sums[d] += loss * count
                    counts[d] += count
                start += n
    expected = sums / counts
    torch.testing.assert_close(main.detach(), expected[0])
    torch.testing.assert_close(got, expected[1:].mean())


def test_mtp_with_the_zero_bubble_schedule_is_refused_in_one_line():
    from training.config import load_config

    with pytest.raises(ConfigError, match="model.mtp_depth=1 with parallel.pp_schedule=zero_bubble is not supported")\
            as err:
        load_config(None, ["--model.mtp_depth=1", "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble",
                           "--parallel.pp_virtual_stages=2", "--train.grad_accum_steps=2", "--model.n_layer=4"])
    assert "\n" not in str(err.value)
