"""Document masking (model.attention_mask=document): a packed sequence behaves as its documents run apart.

The reference is the model itself on each document alone: with positions restarting per document
the packed sequence's logits of document k equal document k's own logits; with positions counting
through the pack they equal document k run alone at its positions in the pack. Checked for the SDPA
and reference backends, learned and rotary positions. flash-attn's varlen path cannot run here: its
span bookkeeping (``document_spans``) is checked by a stand-in kernel written from flash-attn's
documented varlen semantics (each span a causal sequence, aligned bottom-right), against the mask.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch

from common.errors import ConfigError
from model.attention import document_mask, flash_varlen_attention, sdpa_attention
from model.config import ModelConfig
from model.gpt import GPT
from training.build import with_document_eot

EOT = 1
DOCS = [[5, 9, 7, 1], [4, 4, 8, 6, 2, 1], [3, 7, 9, 5, 6, 2]]  # three documents, the last one unfinished


def packed() -> torch.Tensor:
    return torch.tensor([sum(DOCS, [])])  # (1, 16)


def model(position: str, backend: str, restart: bool) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, position=position,
                      attention_mask="document", eot_id=EOT, document_positions=restart)
    return GPT(cfg, attention_backend=backend).eval()


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("restart", [True, False])
def test_three_packed_documents_give_each_documents_own_logits(backend, position, restart):
    gpt = model(position, backend, restart)
    with torch.no_grad():
        whole = gpt(packed())[0]
        start = 0
        for doc in DOCS:
            end = start + len(doc)
            positions = None if restart else torch.arange(start, end)
            alone = gpt(torch.tensor([doc]), positions=positions)[0]
            torch.testing.assert_close(whole[start:end], alone, rtol=1e-5, atol=1e-5)
            start = end
        # Without the mask the later documents see the earlier ones: the test would notice.
        causal = GPT(replace(gpt.cfg, attention_mask="causal", document_positions=False),
                     attention_backend=backend).eval()
        causal.load_state_dict(gpt.state_dict())
        assert not torch.allclose(causal(packed())[0][4:], whole[4:], atol=1e-3)


def test_document_numbers_and_restarting_positions():
    gpt = model("rope", "sdpa", True)
    docs = gpt.document_ids(packed())
    assert docs.tolist() == [[0] * 4 + [1] * 6 + [2] * 6]
    from model.gpt import document_positions

    assert document_positions(docs).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]]


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=True, window_size=(-1, -1)):
    """flash_attn_varlen_func as documented: sequence i is q[cu_q[i]:cu_q[i+1]] against
    k[cu_k[i]:cu_k[i+1]], causal aligned bottom-right; (total, H, D) layouts, GQA by head groups;
    window_size=(left, 0): query i sees keys i + s_k - s_q - left <= j <= i + s_k - s_q."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        assert qs.stop - qs.start <= max_q and ks.stop - ks.start <= max_k
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[qs], k[ks], v[ks]))
        s_q, s_k = qs.stop - qs.start, ks.stop - ks.start
        rows, cols = torch.arange(s_q)[:, None] + s_k - s_q, torch.arange(s_k)[None, :]
        band = (cols <= rows) & ((cols >= rows - window_size[0]) if window_size[0] >= 0 else True)
        out[qs] = sdpa_attention(qi, ki, vi, 0.0, band)[0].transpose(0, 1)
    return out


# The whole sequence; a context-parallel chunk's queries (at 4, row 0's first two documents hold
# no query and are left out, keys too).
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("q_len", [16, 8, 4])
def test_flash_varlen_spans_equal_the_document_mask(monkeypatch, q_len, window):
    """With a sliding window too: flash-attn's window_size (W - 1, 0) inside each document span is
    the window of the (T, S) mask the other backends get."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_stand_in))
    g = torch.Generator().manual_seed(0)
    documents = torch.tensor([[0] * 4 + [1] * 6 + [2] * 6, [0] * 11 + [1] * 5])  # (2, 16)
    q = torch.randn(2, q_len, 4, 8, generator=g)
    k, v = torch.randn(2, 16, 2, 8, generator=g), torch.randn(2, 16, 2, 8, generator=g)
    got = flash_varlen_attention(q, k, v, documents, 0.0, (-1, -1) if window is None else (window - 1, 0))
    mask = document_mask(documents, q_len, window)
    want = sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, mask).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_document_mask_without_an_end_of_text_id_is_one_line():
    cfg = ModelConfig(attention_mask="document")
    with pytest.raises(ConfigError, match="model.attention_mask=document needs the end-of-text id.*set model.eot_id"):
        with_document_eot(cfg, None)
    assert with_document_eot(cfg, 0).eot_id == 0  # the dataset's id when the config has none
    assert with_document_eot(ModelConfig(attention_mask="document", eot_id=7), 0).eot_id == 7
    with pytest.raises(ConfigError, match="model.document_positions=true .* needs model.attention_mask=document"):
        ModelConfig(document_positions=True).validate()
