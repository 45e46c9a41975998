"""µP (model/mup.py): at the base width it is the standard parametrization; wider, its init, logit
and attention scales are the published ones; and a coordinate check, measured: after a few AdamW
steps each layer's activation size stays flat as the width grows under µP and grows under the
standard parametrization."""

from __future__ import annotations

import math

import pytest
import torch

from common.errors import ConfigError, InteropError
from model.config import ModelConfig
from model.gpt import GPT
from model.interop import hf_layout, to_nanogpt
from model.mup import hidden_lr_multiplier, lr_multipliers
from parallel.optim import decay_groups
from parallel.step import set_lr
from training.config import load_config

BASE = 32


def config(width: int, mup: bool, **extra) -> ModelConfig:
    return ModelConfig(vocab_size=256, max_seq_len=16, n_layer=2, n_head=4, d_model=width, mup=mup,
                       mup_base_width=BASE if mup else None, **extra)


def test_at_the_base_width_mup_is_the_standard_parametrization():
    torch.manual_seed(0)
    sp = GPT(config(BASE, mup=False))
    torch.manual_seed(0)
    mup = GPT(config(BASE, mup=True))
    for (name, a), (_, b) in zip(sp.named_parameters(), mup.named_parameters()):
        assert torch.equal(a, b), name
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(sp(x), mup(x))
    optimizer = torch.optim.AdamW(decay_groups(list(mup.named_parameters()), 0.1, lr_multipliers(mup)))
    set_lr(optimizer, 3e-3)
    assert {g["lr"] for g in optimizer.param_groups} == {3e-3}


def test_wider_hidden_matrices_start_smaller_by_the_square_root_of_the_width_ratio():
    torch.manual_seed(0)
    sp = GPT(config(4 * BASE, mup=False))
    torch.manual_seed(0)
    mup = GPT(config(4 * BASE, mup=True))
    for (name, a), (_, b) in zip(sp.named_parameters(), mup.named_parameters()):
        hidden = a.ndim == 2 and name.startswith("blocks.")
        assert torch.allclose(b, a * 0.5 if hidden else a, rtol=0, atol=1e-7), name  # (4)^-1/2


def test_logits_and_attention_take_the_published_scales():
    """The µP model equals a standard one holding the same weights, with its queries rescaled so
    that attention divides by d_head (times the base width's sqrt(d_head): equality at m = 1) and
    its logits multiplied by base / width, both written here from the recipe."""
    width = 4 * BASE
    cfg = config(width, mup=True)
    torch.manual_seed(0)
    mup = GPT(cfg)
    sp = GPT(config(width, mup=False))
    sp.load_state_dict(mup.state_dict())
    head, base_head = width // 4, BASE // 4
    # SP attention divides q.k by sqrt(head); µP's logit is q.k * sqrt(base_head) / head.
    q_factor = math.sqrt(base_head) / head * math.sqrt(head)
    with torch.no_grad():
        for block in sp.blocks.values():
            rows = block.attn.qkv.weight.view(4, 3, head, width)  # per head: its query, key and value rows
            rows[:, 0] *= q_factor
            bias = block.attn.qkv.bias.view(4, 3, head)
            bias[:, 0] *= q_factor
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mup(x), sp(x) * (BASE / width), rtol=1e-5, atol=1e-6)


def activation_sizes(width: int, mup: bool, steps: int, lr: float = 3e-3,
                     mup_lr: bool = True) -> list[dict[str, float]]:
    """Mean |activation| of each layer's output on a fixed batch, after each of ``steps`` AdamW
    steps on it (the engines' param groups: µP's hidden matrices at lr x base / width, unless
    ``mup_lr`` is off: µP's init and multipliers with one LR for every parameter)."""
    torch.manual_seed(0)
    model = GPT(config(width, mup))
    scale = lr_multipliers(model) if mup_lr else None
    optimizer = torch.optim.AdamW(decay_groups(list(model.named_parameters()), 0.0, scale),
                                  betas=(0.9, 0.95))
    set_lr(optimizer, lr)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (8, 16), generator=gen), torch.randint(0, 256, (8, 16), generator=gen)
    layers = {"embedding": model.tok_emb}
    for i, block in model.blocks.items():
        layers |= {f"attention {i}": block.attn, f"mlp {i}": block.mlp, f"block {i}": block}
    seen: dict[str, float] = {}
    for name, layer in layers.items():
        layer.register_forward_hook(lambda m, i, out, name=name: seen.__setitem__(name, out.abs().mean().item()))
    sizes = []
    for _ in range(steps):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            seen["logits"] = model(x).abs().mean().item()
        sizes.append(dict(seen))
    return sizes


def test_coordinate_check_activations_stay_flat_under_mup_and_grow_under_the_standard_parametrization(one_thread):
    widths = (BASE, 2 * BASE, 4 * BASE, 8 * BASE)
    steps = 4
    growth = {}  # (parametrization, step, layer) -> size at the widest / size at the narrowest
    for mup in (False, True):
        runs = [activation_sizes(w, mup, steps) for w in widths]
        for step in range(steps):
            for layer in runs[0][step]:
                growth[mup, step, layer] = runs[-1][step][layer] / runs[0][step][layer]
    hidden = [k for k in growth if k[2] not in ("embedding", "logits")]
    for mup, step, layer in hidden:
        if mup:  # flat: within a factor 1.6 over 8x the width (measured: 0.72 .. 1.0)
            assert 1 / 1.6 < growth[mup, step, layer] < 1.6, (step, layer, growth[mup, step, layer])
        else:  # AdamW moves every weight by ~lr, so W x grows with the width (measured: 6x .. 40x)
            assert growth[mup, step, layer] > 3.0, (step, layer, growth[mup, step, layer])
    for step in range(steps):
        # The logits grow under SP; under µP they do not (they start at zero's side, by 1/sqrt(m) at init).
        assert growth[False, step, "logits"] > 2.0 and growth[True, step, "logits"] < 1.2, step
        assert 0.9 < growth[True, step, "embedding"] < 1.1


def test_coordinate_check_needs_the_hidden_learning_rate_multiplier(one_thread):
    """µP's init and output multiplier alone are not enough: with one AdamW LR for every parameter the
    hidden activations grow with the width once the updates outweigh the init (measured after 4
    steps at 8x the width: 6x .. 32x)."""
    narrow, wide = (activation_sizes(w, mup=True, steps=4, mup_lr=False)[-1] for w in (BASE, 8 * BASE))
    for layer in ("attention 0", "mlp 0", "attention 1", "mlp 1", "block 1"):
        assert wide[layer] / narrow[layer] > 3.0, (layer, wide[layer] / narrow[layer])


def adamw_first_update(grad: torch.Tensor, lr: float) -> torch.Tensor:
    return lr * grad / (grad.abs() + 1e-8)  # AdamW's first step, bias-corrected: lr x sign(g)


def orthogonalised_update(grad: torch.Tensor, lr: float, rule: str) -> torch.Tensor:
    """Muon's update with exact orthogonalisation (U V^T of the gradient's SVD) and its scale rule."""
    u, _, vt = torch.linalg.svd(grad, full_matrices=False)
    a, b = grad.shape
    scale = {"moonlight": 0.2 * math.sqrt(max(a, b)), "jordan": math.sqrt(max(1.0, a / b))}[rule]
    return lr * scale * (u @ vt)


@pytest.mark.parametrize("update, kind", [
    (adamw_first_update, "adam"),
    (lambda g, lr: orthogonalised_update(g, lr, "moonlight"), "rms_matched"),
    (lambda g, lr: orthogonalised_update(g, lr, "jordan"), "spectral"),
], ids=["adamw", "muon-rms-matched", "muon-spectral"])
def test_the_hidden_multiplier_keeps_the_updates_spectral_norm_flat_as_the_width_grows(update, kind):
    """µP's spectral condition: a hidden matrix's update has spectral norm sqrt(fan_out / fan_in) times
    a constant that does not depend on the width. Measured on a low-rank gradient (a small batch's) of
    the attention output (n x n) and MLP input (4n x n) matrices at 4x the base width, each optimizer's
    update written here; the multiplier for another optimizer misses by about 2x (sqrt of the 4x)."""
    def norm(width: int, shape: tuple[int, int], multiplier: float) -> float:
        gen = torch.Generator().manual_seed(width)
        grad = torch.randn(shape[0], 4, generator=gen) @ torch.randn(4, shape[1], generator=gen)  # rank 4
        delta = update(grad, 1e-3 * multiplier)
        return torch.linalg.matrix_norm(delta, ord=2).item() / math.sqrt(shape[0] / shape[1])

    base, wide = config(BASE, mup=True), config(4 * BASE, mup=True)
    for rows in (1, 4):  # fan_out = rows x fan_in
        ratio = {other: norm(4 * BASE, (rows * 4 * BASE, 4 * BASE), hidden_lr_multiplier(wide, other))
                 / norm(BASE, (rows * BASE, BASE), hidden_lr_multiplier(base, other))
                 for other in ("adam", "rms_matched", "spectral")}
        assert 0.75 < ratio[kind] < 1.33, (rows, ratio)
        assert all(r < 0.6 or r > 1.6 for other, r in ratio.items() if other != kind), (rows, ratio)


@pytest.mark.parametrize("override, message", [
    (["--model.mup=true"], "model.mup=true needs model.mup_base_width >= 1"),
    (["--model.mup_base_width=64"], "model.mup_base_width=64 has no effect without model.mup=true"),
    (["--model.mup=true", "--model.mup_base_width=64", "--model.moe.experts=4"], "mixture-of-experts"),
    (["--model.mup=true", "--model.mup_base_width=64", "--model.layers=te"], "needs model.layers=torch"),
    (["--model.mup=true", "--model.mup_base_width=64", "--model.init=llama"], "needs model.init=gpt2"),
])
def test_bad_mup_keys_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config("configs/tiny.yaml", override)
    assert "\n" not in str(info.value)


def test_layouts_without_the_multipliers_refuse_a_mup_model():
    cfg = config(64, mup=True)
    with pytest.raises(InteropError, match="model.mup=true: the Hugging Face layouts cannot express"):
        hf_layout(cfg)
    with pytest.raises(InteropError, match="model.mup=true: nanoGPT's GPT cannot express"):
        to_nanogpt(cfg, GPT(cfg).state_dict())
