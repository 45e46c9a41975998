"""The parallel layout value (parallel/layout.py): every rule's one-line error, the strategy it resolves,
and its two renderings: one line of config words, and overrides that load back into the same layout."""

from __future__ import annotations

import pytest

from common.errors import ConfigError, LayoutError
from model.config import ModelConfig, MoEConfig
from parallel.config import ParallelConfig
from parallel.layout import Layout, check_model
from training.config import load_config

# A model every layout below can split: 8 layers, 8 heads, d_ff 256, vocabulary 256, 64 tokens, 8 experts.
MODEL = ModelConfig(vocab_size=256, max_seq_len=64, n_layer=8, n_head=8, d_model=64)
MOE = ModelConfig(vocab_size=256, max_seq_len=64, n_layer=8, n_head=8, d_model=64, moe=MoEConfig(experts=8))
LOADABLE = ["--model.vocab_size=256", "--model.max_seq_len=64", "--model.n_layer=8", "--model.n_head=8",
            "--model.d_model=64", "--model.moe.experts=8", "--train.grad_accum_steps=4"]


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


# --------------------------------------------------------------------------- the section's own keys


@pytest.mark.parametrize("keys, message", [
    (dict(tp=0), r"parallel.tp must be >= 1 \(got 0\)"),
    (dict(ep=-1), r"parallel.ep must be >= 1 \(got -1\)"),
    (dict(pp_virtual_stages=0), r"parallel.pp_virtual_stages must be >= 1"),
    (dict(dp_shard=0), r"parallel.dp_shard must be >= 1, or -1 for the ranks left over \(got 0\)"),
    (dict(pp_schedule="gpipe"), r"parallel.pp_schedule=gpipe has no effect with parallel.pp=1 \(no pipeline\)"),
    (dict(pp=2, pp_virtual_stages=2), r"parallel.pp_schedule=1f1b runs one stage per rank"),
    (dict(pp=2, pp_schedule="interleaved_1f1b"), r"interleaved_1f1b needs parallel.pp_virtual_stages >= 2"),
    (dict(ep=2, cp=4, strategy="fsdp"), r"parallel.ep=2 with parallel.cp=4: .* ep must be a multiple of cp"),
    (dict(dp_replicate=2, strategy="ddp"), r"parallel.dp_replicate=2 is HSDP's replicate dimension: it needs "
                                           r"parallel.strategy=fsdp \(got ddp\)"),
    (dict(etp=2), r"parallel.etp=2 splits each routed expert over the tensor-parallel ranks: it must be 1 \(experts "
                  r"replicated over tp\) or parallel.tp=1; set parallel.etp=1 or parallel.tp=2$"),
    (dict(tp=4, etp=2), r"parallel.etp=2 .* must be 1 \(experts replicated over tp\) or parallel.tp=4; set "
                        r"parallel.etp=1$"),
])
def test_rules_on_the_sections_keys_are_config_errors(keys, message):
    with pytest.raises(ConfigError, match=message) as error:
        Layout(16, **keys)
    one_line(error)
    with pytest.raises(ConfigError, match=message):  # and the config says the same when it is loaded
        ParallelConfig(**keys).validate()


@pytest.mark.parametrize("keys, message", [
    (dict(fsdp_hybrid=True, ep=2), r"parallel.ep=2 with parallel.fsdp_hybrid: set parallel.dp_replicate"),
    (dict(fsdp_hybrid=True, tp=2), r"parallel.fsdp_hybrid is the shorthand for dp_replicate=<nodes>"),
    (dict(tp=2, strategy="ddp"), r"parallel.strategy=ddp cannot wrap tensor- or pipeline-parallel models"),
    (dict(pp=2, strategy="zero3"), r"parallel.strategy=zero3 cannot wrap tensor- or pipeline-parallel models"),
    (dict(cp=2, strategy="zero2"), r"parallel.cp=2 with parallel.strategy=zero2 is not supported"),
    (dict(ep=2, strategy="zero1"), r"parallel.ep=2 with parallel.strategy=zero1 is not supported"),
])
def test_what_this_trainer_composes_is_checked_for_the_section(keys, message):
    section = ParallelConfig(**{"strategy": "fsdp", **keys})
    with pytest.raises(ConfigError, match=message) as error:
        section.validate()
    one_line(error)
    with pytest.raises(ConfigError, match=message):
        Layout.of(section, 16, 8)


def test_the_estimator_may_describe_other_frameworks_compositions():
    """Megatron-LM runs DDP under tensor parallelism: a Layout holds it; only the trainer refuses it."""
    assert Layout(16, strategy="ddp", tp=8).dp == 2


# --------------------------------------------------------------------------- the world size


@pytest.mark.parametrize("world, keys, message", [
    (4, dict(tp=3), r"parallel.pp=1 x parallel.dp_replicate=1 x parallel.cp=1 x parallel.tp=3 = 3 does not divide the 4 ranks"),
    (4, dict(tp=2, dp_shard=4), r"= 8 ranks, but 4 were launched; make the product equal the world size \(dp_shard "
                                r"counts every data-parallel rank the dense weights shard over, the ep ranks among them"),
    (6, dict(ep=4), r"parallel.ep=4 must divide the dp_shard=6 ranks it is carved out of"),
    (6, dict(ep=4, cp=2), r"parallel.ep=4 must divide the dp_shard=3 x cp=2 = 6 ranks .*a multiple of 2"),
])
def test_rules_on_the_world_size_are_layout_errors(world, keys, message):
    with pytest.raises(LayoutError, match=message) as error:
        Layout(world, **keys)
    one_line(error)


def test_tensor_parallel_groups_stay_inside_a_node():
    with pytest.raises(LayoutError, match="parallel.tp=4 must divide the 2 ranks per node") as error:
        Layout(8, tp=4, ranks_per_node=2)
    one_line(error)
    assert Layout(8, tp=4).dp == 2  # no launcher, no node size: the estimator's layouts


def test_a_sharded_strategy_needs_something_to_shard():
    with pytest.raises(LayoutError, match=r"parallel.strategy=fsdp, but the layout leaves one data-parallel rank "
                                          r"\(strategy=fsdp dp_shard=1 tp=2 pp=1 .*\): nothing to shard over") as error:
        Layout.of(ParallelConfig(strategy="fsdp", tp=2), 2, 2)
    one_line(error)
    assert Layout.of(ParallelConfig(strategy="fsdp", cp=2), 2, 2).fsdp  # cp ranks shard the weights too


def test_dp_shard_counts_the_expert_parallel_ranks():
    """world = pp x dp_replicate x dp_shard x cp x tp, ep inside dp_shard x cp: 4 ranks with ep=2 are
    dp_shard=4 (not 2, the count an earlier version's config used), 2 of them holding the same experts."""
    layout = Layout(4, ep=2, dp_shard=4)
    assert (layout.dp, layout.edp, layout.ep_shard, layout.strategy) == (4, 2, 2, "fsdp")
    spans = Layout(8, ep=4, cp=2)  # an ep group: 2 dp_shard ranks x the cp pair
    assert (spans.dp_shard, spans.dp_shard_cp, spans.ep_shard, spans.edp) == (4, 8, 2, 2)
    old_words = load_config(None, LOADABLE + ["--parallel.ep=2", "--parallel.dp_shard=2"])
    with pytest.raises(LayoutError, match="dp_shard counts every data-parallel rank the dense weights shard over"):
        Layout.of(old_words.parallel, 4, 4)


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("model, layout, seq_len, micro_batches, message", [
    (MODEL, Layout(2, ep=2), 64, 1, r"parallel.ep=2 shards routed experts, but the model has none"),
    (ModelConfig(vocab_size=256, n_head=8, d_model=64, moe=MoEConfig(experts=6)), Layout(4, ep=4), 64, 1,
     r"parallel.ep=4 must divide model.moe.experts=6"),
    (MODEL, Layout(16, tp=16), 64, 1, r"parallel.tp=16 must divide model.n_head=8"),
    (ModelConfig(vocab_size=256, n_head=8, n_kv_head=2, d_model=64), Layout(4, tp=4), 64, 1,
     r"parallel.tp=4 must divide model.n_kv_head=2"),
    (ModelConfig(vocab_size=256, n_head=8, d_model=64, d_ff=100), Layout(8, tp=8), 64, 1,
     r"parallel.tp=8 must divide model.d_ff=100"),
    (ModelConfig(vocab_size=250, n_head=8, d_model=64), Layout(4, tp=4), 64, 1, r"must divide model.vocab_size=250"),
    (MODEL, Layout(4, tp=4), 62, 1, r"parallel.sequence_parallel splits the sequence over parallel.tp=4 ranks: "
                                    r"data.seq_len=62 must divide by it"),
    (MODEL, Layout(3, pp=3), 64, 3, r"model.n_layer=8 must divide into parallel.pp x pp_virtual_stages = 3"),
    (MODEL, Layout(4, pp=4), 64, 2, r"train.grad_accum_steps=2 is the number of pipeline micro-batches: it must be "
                                    r">= parallel.pp=4"),
    (MODEL, Layout(2, pp=2, pp_schedule="zero_bubble"), 64, 3, r"parallel.pp_schedule=zero_bubble needs "
                                                               r"train.grad_accum_steps \(micro-batches\) divisible"),
    (MODEL, Layout(4, cp=4), 60, 1, r"parallel.cp=4 splits each sequence into 2 x cp = 8 equal chunks: "
                                    r"data.seq_len=60 must divide by 8"),
    (MODEL, Layout(8, cp=2, tp=4), 12, 1, r"splits each cp rank's 6 tokens over parallel.tp=4"),
    (MODEL, Layout(2, tp=2, etp=2), 64, 1, r"parallel.etp=2 splits routed experts over the tp ranks, but the model "
                                           r"has none: set model.moe.experts or parallel.etp=1"),
    (ModelConfig(vocab_size=256, n_head=8, d_model=64, moe=MoEConfig(experts=8, d_ff=36)), Layout(8, tp=8, etp=8),
     64, 1, r"parallel.etp=8 must divide the experts' width model.moe.d_ff=36 .*; choose model.moe.d_ff a multiple "
            r"of it or parallel.etp=1"),
    (ModelConfig(vocab_size=256, n_head=8, d_model=64, moe=MoEConfig(experts=8, bias=True)), Layout(2, tp=2, etp=2),
     64, 1, r"parallel.etp=2 with model.moe.bias is not supported yet .*; set parallel.etp=1"),
])
def test_rules_against_the_model_are_config_errors(model, layout, seq_len, micro_batches, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_model(layout, model, seq_len=seq_len, micro_batches=micro_batches)
    one_line(error)


def test_expert_tensor_parallelism_with_transformer_engine_layers_is_refused():
    """etp splits routed experts, and Transformer Engine blocks have none (nor take tp: they bring their own)."""
    with pytest.raises(ConfigError, match=r"model.moe.experts needs model.layers=torch \(Transformer Engine blocks "
                                          r"have a dense MLP\)") as error:
        load_config(None, LOADABLE + ["--model.layers=te", "--parallel.tp=2", "--parallel.etp=2"])
    one_line(error)


def test_the_trainers_config_runs_the_same_model_rules():
    with pytest.raises(ConfigError, match=r"parallel.cp=4 splits each sequence .* model.max_seq_len=20 must divide by 8"):
        load_config(None, ["--parallel.cp=4", "--model.max_seq_len=20", "--parallel.strategy=fsdp"])


# --------------------------------------------------------------------------- the strategy, decided once


@pytest.mark.parametrize("world, keys, strategy, note", [
    (1, {}, "none", None),
    (4, {}, "ddp", "parallel: strategy none with 4 data-parallel ranks -> ddp (gradients averaged)"),
    (8, dict(tp=2), "fsdp", "parallel: strategy none with 4 data-parallel ranks -> fsdp (gradients averaged)"),
    (2, dict(tp=2), "none", None),
    (2, dict(cp=2), "fsdp", "parallel: strategy none with parallel.cp=2 -> fsdp (context-parallel ranks average "
                            "gradients as data-parallel ones do)"),
    (2, dict(ep=2), "fsdp", "parallel: strategy none with parallel.ep=2 -> fsdp (expert and dense gradients averaged "
                            "through FSDP2's meshes)"),
    (4, dict(strategy="zero2"), "zero2", None),
])
def test_strategy_none_becomes_what_the_layout_needs(world, keys, strategy, note):
    section = ParallelConfig(**keys)
    layout = Layout.of(section, world, world)
    assert layout.strategy == strategy and layout.fsdp == (strategy == "fsdp")
    resolved, said = section.resolved(layout)
    assert (resolved.strategy, said) == (strategy, note)
    assert Layout.of(resolved, world, world) == layout  # resolving twice changes nothing


def test_hsdp_shorthand_is_one_replica_per_node():
    layout = Layout.of(ParallelConfig(strategy="fsdp", fsdp_hybrid=True), 8, 4)
    assert layout == Layout(8, strategy="fsdp", dp_replicate=2, dp_shard=4, ranks_per_node=4)


# --------------------------------------------------------------------------- one line, and back to overrides


GRID = [
    (1, 1, {}),
    (4, 4, {}),
    (4, 4, dict(strategy="zero2")),
    (8, 8, dict(strategy="fsdp", dp_replicate=2)),
    (8, 4, dict(tp=2, pp=2)),
    (8, 8, dict(cp=2, tp=2, sequence_parallel=False)),
    (8, 8, dict(ep=2)),
    (8, 8, dict(ep=4, cp=2)),
    (8, 8, dict(ep=2, tp=2, dp_shard=4)),
    (16, 8, dict(strategy="fsdp", ep=2, dp_replicate=2)),
    (8, 8, dict(pp=2, pp_schedule="zero_bubble", pp_virtual_stages=2, cp=2)),
    (16, 8, dict(strategy="fsdp", pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, tp=2, dp_replicate=2)),
    (8, 8, dict(pp=4, pp_schedule="gpipe")),
    (8, 8, dict(strategy="fsdp", ep=2, tp=2, etp=2)),
]


@pytest.mark.parametrize("world, per_node, keys", GRID, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}{w}" for k, w in v.items()) or "default")
def test_overrides_load_back_into_the_same_layout(world, per_node, keys):
    layout = Layout(world, ranks_per_node=per_node, **keys)
    cfg = load_config(None, LOADABLE + layout.overrides())  # the trainer's whole validation on the way
    assert Layout.of(cfg.parallel, world, per_node) == layout
    line = layout.describe()
    assert "\n" not in line and line.startswith(f"strategy={layout.strategy} ")
    words = dict(word.split("=") for word in line.split())
    assert all(words[key] == str(getattr(layout, key)) for key in ("dp_shard", "tp", "pp"))
    for key in ("dp_replicate", "ep", "etp", "cp", "pp_virtual_stages"):  # named where they apply
        assert (key in words) == (getattr(layout, key) > 1)
    assert ("pp_schedule" in words) == (layout.pp > 1) and ("sequence_parallel" in words) == (layout.tp > 1)
