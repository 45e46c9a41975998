"""What runs wrote before a model key was renamed stays readable: checkpoint metadata and exports
that hold the flat ``moe_*`` keys (before they became the ``model.moe`` section) resume, load and
export as the model they describe; a changed value is still named, under its new key."""

from __future__ import annotations

import json

import pytest
import torch

from common.errors import CheckpointError
from model.config import ModelConfig, MoEConfig
from model.gpt import GPT
from parallel.checkpoint import FULL_STATE_FILE
from training import checkpoint as ckpt
from training.config import to_dict
from training.model_io import META_MODEL, SAFETENSORS_NAME, load_source

MOE = MoEConfig(experts=4, top_k=2, d_ff=16, capacity=1.5, aux_loss=0.02, backend="loop")
CFG = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32, mlp="swiglu", moe=MOE)


def flat_model_dict(cfg: ModelConfig) -> dict:
    """The model section as checkpoints wrote it before the MoE section: every MoE key flat,
    ``moe_<key>``, beside the others (and activation recompute under its still older names)."""
    saved = {k: v for k, v in to_dict(cfg).items() if k != "moe"}
    saved |= {f"moe_{k}": v for k, v in to_dict(cfg.moe).items()}
    saved["checkpointing"] = saved.pop("recompute")
    return saved


@pytest.fixture()
def old_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)

    def write(d):
        torch.save({"model": model.state_dict()}, d / FULL_STATE_FILE)

    step_dir = ckpt.save_checkpoint(tmp_path / "checkpoints", 3, write, {"step": 3}, rank=0, world_size=1,
                                    strategy="none", barrier=lambda: None, keep_last=0,
                                    extra_meta={"model": flat_model_dict(CFG), "tokenizer": "byte"})
    assert "moe_experts" in json.loads((step_dir / ckpt.META).read_text())["model"]  # really the old form
    return step_dir, model


def test_an_old_checkpoint_loads_as_the_model_it_describes(old_checkpoint):
    step_dir, model = old_checkpoint
    source = load_source(step_dir)  # what tools.sample / export / evaluate and init_from read
    assert source.cfg == CFG and source.cfg.moe == MOE
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(source.build()(x), model.eval()(x), rtol=0, atol=0)


def test_an_old_checkpoint_resumes_and_a_changed_moe_key_is_named(old_checkpoint):
    step_dir, _ = old_checkpoint
    meta = ckpt.read_checkpoint_meta(step_dir, 1, "none", to_dict(CFG))  # resume's check of the model
    assert meta["model"] == to_dict(CFG)
    other = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(**{**MOE.__dict__, "top_k": 1})})
    with pytest.raises(CheckpointError, match=r"does not match the model of this run \(model\.moe\.top_k: 2 -> 1\)"):
        ckpt.read_checkpoint_meta(step_dir, 1, "none", to_dict(other))


def test_an_old_export_loads(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    model = GPT(CFG)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    save_file(tensors, str(tmp_path / SAFETENSORS_NAME),
              metadata={"format": "pt", META_MODEL: json.dumps(flat_model_dict(CFG))})
    source = load_source(tmp_path / SAFETENSORS_NAME)
    assert source.cfg == CFG
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(source.build()(x), model.eval()(x), rtol=0, atol=0)
