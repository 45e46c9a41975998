"""µP's per-parameter learning rates in the engines' AdamW (parallel/optim.py's param groups,
parallel/step.py's set_lr): measured on the first step, which moves every weight by the LR its
group was given; kept across a checkpoint; found under a wrapper's parameter names."""

from __future__ import annotations

import io

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.gpt import GPT
from model.mup import lr_multipliers
from parallel.distributed import DistContext
from training.build import build_from_config
from training.config import load_config

LR = 1e-2


def engine_of(width: int, base: int | None):
    mup = ["--model.mup=true", f"--model.mup_base_width={base}"] if base else []
    cfg = load_config(None, ["--model.vocab_size=64", "--model.max_seq_len=8", "--model.n_layer=2", "--model.n_head=2",
                             f"--model.d_model={width}", "--optim.weight_decay=0", "--optim.grad_clip=0", *mup])
    return build_from_config(cfg, DistContext.single()).engine


def one_step(engine, seed: int = 0) -> None:
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(seed))
    loss = engine.forward_backward(tokens[:, :-1], tokens[:, 1:], True, 1)
    engine.optimizer_step(LR, loss)


def test_the_first_adamw_step_moves_hidden_matrices_by_lr_times_base_over_width_and_the_rest_by_lr():
    # AdamW's first update is lr * g / (|g| + eps): lr per entry wherever the gradient is not tiny,
    # so the median move of each weight is the LR its group ran at.
    engine = engine_of(64, base=16)  # m = 4
    before = {n: p.detach().clone() for n, p in engine.module().named_parameters()}
    one_step(engine)
    for name, param in engine.module().named_parameters():
        moved = (param.detach() - before[name]).abs().median().item()
        expected = LR / 4 if param.ndim == 2 and name.startswith("blocks.") else LR
        assert abs(moved - expected) < 0.02 * expected, (name, moved, expected)


def test_without_mup_every_parameter_moves_by_the_lr():
    engine = engine_of(64, base=None)
    before = {n: p.detach().clone() for n, p in engine.module().named_parameters()}
    one_step(engine)
    for name, param in engine.module().named_parameters():
        assert abs((param.detach() - before[name]).abs().median().item() - LR) < 0.02 * LR, name


def test_a_resumed_mup_optimizer_continues_exactly():
    first = engine_of(64, base=16)
    for seed in range(2):
        one_step(first, seed)
    resumed = engine_of(64, base=16)
    saved = io.BytesIO()  # a copy, as a checkpoint holds: the live state would share the moments' tensors
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    for engine in (first, resumed):
        one_step(engine, seed=5)
    for (name, a), (_, b) in zip(first.module().named_parameters(), resumed.module().named_parameters()):
        assert torch.equal(a, b), name
    assert sorted(g["lr_scale"] for g in resumed.optimized_parts()[0].optimizer.param_groups) == [0.25, 1.0, 1.0]


class Wrapper(nn.Module):  # DDP's layout of names: module.<the model's names>
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def test_the_multipliers_are_found_under_a_wrappers_names():
    model = Wrapper(GPT(ModelConfig(vocab_size=64, max_seq_len=8, n_layer=1, n_head=2, d_model=32, mup=True,
                                    mup_base_width=8)))
    scale = lr_multipliers(model)
    got = {name: scale(name, p) for name, p in model.named_parameters()}
    assert got["module.blocks.0.attn.qkv.weight"] == got["module.blocks.0.mlp.fc.weight"] == 0.25
    assert got["module.tok_emb.weight"] == got["module.blocks.0.attn.qkv.bias"] == got["module.norm_f.weight"] == 1.0
    assert lr_multipliers(Wrapper(GPT(ModelConfig(vocab_size=64, max_seq_len=8, n_layer=1)))) is None


def muon_engine_of(width: int, base: int, scale: str):
    cfg = load_config(None, ["--model.vocab_size=64", "--model.max_seq_len=8", "--model.n_layer=2", "--model.n_head=2",
                             f"--model.d_model={width}", "--optim.weight_decay=0", "--optim.grad_clip=0",
                             "--optim.name=muon", f"--optim.muon.scale={scale}", "--model.mup=true",
                             f"--model.mup_base_width={base}"])
    return build_from_config(cfg, DistContext.single()).engine


def test_under_muon_the_hidden_matrices_take_the_multiplier_of_its_update_scale_and_adamw_keeps_its_own():
    """Muon's group runs at optim.lr x m^-1/2 when its update matches AdamW's RMS (its spectral norm
    grows as sqrt(width)) and at optim.lr with Keller Jordan's width-free scale; the embeddings, head
    and norms AdamW steps keep multiplier 1, as without Muon. Read from the groups set_lr fills."""
    for scale, expected in (("match_rms_adamw", 4 ** -0.5), ("original", 1.0), ("none", 1.0)):
        engine = muon_engine_of(64, 16, scale)  # m = 4
        one_step(engine)
        groups = engine.optimized_parts()[0].optimizer.param_groups
        assert groups[0].get("muon") and abs(groups[0]["lr"] / LR - expected) < 1e-12, (scale, groups[0]["lr"])
        assert all(g.get("lr_scale", 1.0) == 1.0 and g["lr"] == LR for g in groups[1:]), scale
