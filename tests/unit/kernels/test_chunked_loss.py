"""kernels.loss_chunk_tokens: the LM head and cross-entropy a chunk of tokens at a time.

Against the plain loss (the whole (tokens x vocab) logits, then cross-entropy) on the same model:
the loss and every gradient agree to float rounding (the sums run in another order), with ignored
targets and a chunk size that does not divide the tokens; and no tensor of vocabulary width with
more rows than a chunk is ever produced, in forward or backward (the plain loss produces the whole).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.errors import ConfigError
from kernels.registry import REFERENCE_OPS, with_loss_chunks
from model.config import ModelConfig
from model.gpt import GPT
from training.config import load_config

VOCAB, CHUNK = 101, 20  # a vocabulary no other width equals; chunks of 20, 20 and 8 of the 48 tokens


class WidestVocabRows(TorchDispatchMode):
    """The most rows of any tensor an op returns whose last dimension is the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def loss_and_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict, int]:
    model.zero_grad(set_to_none=True)
    with WidestVocabRows() as widest:
        loss = model(idx, targets)
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, widest.rows


@pytest.mark.parametrize("tied, mtp_depth", [(True, 0), (False, 0), (False, 2)])
def test_chunked_loss_equals_the_plain_loss_without_the_whole_logits(tied, mtp_depth):
    # with multi-token prediction every depth's head runs in chunks too (its gradients are compared)
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=16, n_layer=2, n_head=2, d_model=16, tie_embeddings=tied,
                      mtp_depth=mtp_depth)
    torch.manual_seed(0)
    plain = GPT(cfg)
    chunked = GPT(cfg, with_loss_chunks(REFERENCE_OPS, CHUNK))
    chunked.load_state_dict(plain.state_dict())
    idx = torch.randint(0, VOCAB, (3, 16))
    targets = torch.randint(0, VOCAB, (3, 16))
    targets[1, 4:16] = targets[2, :] = -100  # ignored targets; the third chunk wholly so
    ref_loss, ref_grads, ref_rows = loss_and_grads(plain, idx, targets)
    loss, grads, rows = loss_and_grads(chunked, idx, targets)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert ref_rows == 3 * 16 and rows <= CHUNK


def test_loss_chunks_are_refused_where_the_head_is_split_or_piped():
    base = ["--kernels.loss_chunk_tokens=1024"]
    assert load_config(None, base).kernels.loss_chunk_tokens == 1024
    with pytest.raises(ConfigError, match="kernels.loss_chunk_tokens=1024 with parallel.tp=2.*loss_parallel"):
        load_config(None, base + ["--parallel.tp=2"]).validate_layout()
    with pytest.raises(ConfigError, match="kernels.loss_chunk_tokens=1024 with parallel.pp=2"):
        load_config(None, base + ["--parallel.pp=2", "--train.grad_accum_steps=2"]).validate_layout()
    with pytest.raises(ConfigError, match="kernels.loss_chunk_tokens must be >= 0"):
        load_config(None, ["--kernels.loss_chunk_tokens=-1"]).validate_layout()
