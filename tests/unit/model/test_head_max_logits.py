"""QK-clip's seam in the model: ``head_max_logits`` and ``Attention.max_logit``, against scores
computed one query-key pair at a time."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import head_max_logits
from model.config import ModelConfig
from model.gpt import GPT, document_ids


def pairwise_max(q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """Each query head's largest q_i . k_j / sqrt(d) over the pairs j <= i (same document, i - j < window),
    by loops."""
    q, k = q.detach(), k.detach()
    b, t, h, d = q.shape
    group = h // k.shape[2]
    best = torch.full((h,), float("-inf"))
    for n in range(b):
        for head in range(h):
            for i in range(t):
                for j in range(i + 1):
                    if window is not None and i - j >= window:
                        continue
                    if documents is not None and documents[n, i] != documents[n, j]:
                        continue
                    logit = float(q[n, i, head] @ k[n, j, head // group]) / math.sqrt(d)
                    best[head] = max(best[head], logit)
    return best


@pytest.mark.parametrize("with_documents", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_head_max_logits_is_the_largest_allowed_pairwise_logit(with_documents, window):
    torch.manual_seed(0)
    q, k = torch.randn(2, 7, 4, 8), torch.randn(2, 7, 2, 8) * 3  # grouped-query: two query heads per key
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2]]) if with_documents else None
    torch.testing.assert_close(head_max_logits(q, k, documents, window), pairwise_max(q, k, documents, window),
                               atol=1e-5, rtol=0)


def test_training_forwards_keep_a_running_max_and_others_do_not():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, max_seq_len=8, n_layer=1, n_head=4, n_kv_head=2, d_model=32, position="rope",
                      attention_mask="document", eot_id=1)
    gpt = GPT(cfg, attention_backend="reference")
    attn = gpt.blocks["0"].attn
    seen = []
    attn.core.register_forward_hook(lambda mod, args, out: seen.append(pairwise_max(args[0], args[1], args[3])))
    batches = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    for tokens in batches:
        gpt(tokens)
    assert attn.max_logit is None  # off unless QK-clip asks for it
    attn.max_logit = torch.full((4,), float("-inf"))
    seen.clear()
    for tokens in batches:
        assert document_ids(cfg, tokens) is not None
        gpt(tokens)
    torch.testing.assert_close(attn.max_logit, torch.maximum(*seen), atol=1e-5, rtol=0)
    before = attn.max_logit.clone()
    gpt.eval()
    gpt(batches[0] * 0 + 5)
    with torch.no_grad():
        gpt.train()(batches[0] * 0 + 5)
    assert torch.equal(attn.max_logit, before)  # evaluation forwards leave it alone
