"""analysis/deepseek_bench.py (behind tools/bench_deepseek.py): the variants it trains have the active
parameters the comparison claims, counted on the built modules; the overrides handed to train.py
rebuild each variant; a dense twin that cannot match is refused in one line."""

from __future__ import annotations

import pytest

from analysis.deepseek_bench import config_overrides, paired_difference, variant_models
from analysis.moe_bench import dense_twin
from analysis.training_runs import Curve, Run
from common.errors import ConfigError
from model.flops import count_parameters
from model.gpt import GPT
from training.config import load_config

CONFIG = "configs/tiny-mla.yaml"
OVERRIDES = ["--model.d_ff=320", "--model.n_layer=3"]  # dense layers as wide as a token's experts


def module_counts(model: GPT) -> tuple[int, int]:
    """(active parameters, router parameters) read off the modules: a routed expert stack (experts
    first) counts top_k of its experts, everything else counts whole."""
    moe = model.cfg.moe
    active = routers = 0
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"):
            assert p.shape[0] == moe.experts
            active += p.numel() // moe.experts * moe.top_k
        else:
            active += p.numel()
            routers += p.numel() if ".router." in name else 0
    return active, routers


def test_the_dense_twin_holds_the_active_parameters_of_the_moe_model_but_its_routers():
    models = variant_models(load_config(CONFIG, OVERRIDES).model, mtp_depth=1, mtp_weight=0.3)
    assert list(models) == ["moe", "moe-mtp", "dense-twin", "dense-twin-mtp"]
    for moe, twin in (("moe", "dense-twin"), ("moe-mtp", "dense-twin-mtp")):
        active, routers = module_counts(GPT(models[moe]))
        dense = sum(p.numel() for p in GPT(models[twin]).parameters())
        # the routers: one per MoE block, the MTP module's block included (4 with MTP here, 2 without)
        assert routers == (models[moe].n_moe_layers + models[moe].mtp_depth) * 16 * 128
        assert active - routers == dense
        assert (count_parameters(models[moe], active=True), count_parameters(models[twin])) == (active, dense)
    assert models["moe-mtp"].mtp_loss_weight == 0.3 and models["moe"].mtp_depth == 0


def test_the_overrides_given_to_train_py_rebuild_every_variant():
    base = load_config(CONFIG, OVERRIDES).model
    for name, model in variant_models(base, mtp_depth=2, mtp_weight=0.5).items():
        settings = config_overrides(base, model)
        assert load_config(CONFIG, [*OVERRIDES, *settings]).model == model, name
    assert config_overrides(base, base) == ()


def test_a_dense_layer_of_another_width_has_no_dense_twin():
    with pytest.raises(ConfigError, match=r"dense layers' model.d_ff=384 .* = 320, .* set model.d_ff=320"):
        dense_twin(load_config(CONFIG).model)


def test_the_loss_is_paired_with_the_baseline_at_the_same_seed():
    def curve(seed, loss):
        return Curve(Run("v", seed, 10), val={10: loss})

    got = paired_difference([curve(0, 2.0), curve(1, 2.5), curve(2, 2.1)], [curve(2, 2.0), curve(0, 2.2), curve(1, 2.4)])
    assert got == pytest.approx({"median": 0.1, "min": -0.2, "max": 0.1, "n": 3})
