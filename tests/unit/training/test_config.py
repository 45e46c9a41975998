"""Config loading: types, overrides, and one-line errors that name the key and the choices."""

from __future__ import annotations

import dataclasses
import glob
import re

import pytest
import torch

from common.errors import ConfigError
from model.flops import count_parameters
from model.gpt import GPT
from training.config import JobConfig, describe_fields, dump_yaml, load_config


def test_overrides_are_typed_and_take_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 7\noptim:\n  lr: 1.0e-3\n  warmup_steps: 2\n")
    cfg = load_config(path, ["--train.max_steps=9", "--optim.lr=3e-4", "--model.position=rope"])
    assert cfg.train.max_steps == 9 and isinstance(cfg.train.max_steps, int)
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model.position == "rope"
    assert cfg.name == "c"


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--train.foo=1"], "unknown key train.foo; valid keys in train: max_steps"),
        (["--precision.mode=fp9"], "precision.mode='fp9' is not valid; choose one of: fp32, bf16, fp16, bf16_master, fp8"),
        (["--train.max_steps=ten"], "train.max_steps must be an integer, got 'ten'"),
        (["--model.n_head=3"], "model.n_head=3 must divide model.d_model=128"),
        (["--precision.mode=fp8"], "precision.mode=fp8 needs model.layers=te"),
        (["--data.format=mmap"], "data.format=mmap needs data.path"),
        (["--train.compile=maybe"], "train.compile must be true or false"),
        (["train.max_steps"], "must look like --section.key=value"),
    ],
)
def test_bad_values_give_one_line_errors(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_fp8_checks_gemm_dims_divisible_by_16():
    with pytest.raises(ConfigError, match="divisible by 16; not: model.d_model=72"):
        load_config(None, ["--model.layers=te", "--precision.mode=fp8", "--model.d_model=72", "--model.n_head=4"])


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["--train.max_steps=3", "--optim.warmup_steps=1"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    again = load_config(path)
    again.name = cfg.name
    assert again == cfg


def _leaf_defaults(config: object, prefix: str = "") -> dict[str, object]:
    """Every settable key of a config, in declaration order, with its declared default (before any
    derivation such as model.d_ff, which help shows as declared)."""
    leaves = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            leaves.update(_leaf_defaults(value, f"{prefix}{f.name}."))
        else:
            leaves[f"{prefix}{f.name}"] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return leaves


def test_help_lists_every_key_with_help(capsys):
    import train

    assert train.main(["--help-config"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = _leaf_defaults(JobConfig())
    assert len(printed) == len(expected)
    for line, (key, default) in zip(printed, expected.items()):
        head = f"--{key}={default!r}"
        assert line.startswith(head + "  "), (line, head)
        help_text = line[len(head):].strip()
        # a real sentence, not a blank or a placeholder: at least two words
        assert len(help_text.split()) >= 2, f"{key} has no help text: {line!r}"
    assert printed == describe_fields(JobConfig)


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_parses_and_builds_on_meta(path):
    overrides = [] if path.endswith(("tiny.yaml", "tiny-mixture.yaml")) else ["--data.path=unused"]
    cfg = load_config(path, overrides)
    with torch.device("meta"):
        model = GPT(cfg.model)
    assert model.num_parameters() == count_parameters(cfg.model)


def test_on_and_off_stay_words_where_a_key_takes_them():
    """YAML 1.1 reads a bare on/off as true/false; a key whose choices are on/off gets the word back."""
    assert load_config("configs/tiny.yaml", ["--optim.fused=on"]).optim.fused == "on"
    assert load_config("configs/tiny.yaml", ["--optim.fused=off"]).optim.fused == "off"


@pytest.mark.parametrize("old, new, value", [("model.checkpointing", "model.recompute", "full"),
                                             ("model.checkpoint_every_k", "model.recompute_every_k", 3),
                                             ("model.moe_experts", "model.moe.experts", 8),
                                             ("model.moe_capacity", "model.moe.capacity", 1.5),
                                             ("model.moe_backend", "model.moe.backend", "loop")])
def test_a_renamed_key_names_its_new_name(tmp_path, old, new, value):
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} is now called {re.escape(new)} ") as err:
        load_config(None, [f"--{old}={value}"])
    assert "\n" not in str(err.value)
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} is now called {re.escape(new)} "):
        load_config(path)
    assert load_config(None, [f"--{new}={value}"]).model.value_of(new.split(".", 1)[1]) == value
    # a config.yaml a run wrote before the rename is read under the new name
    assert load_config(path, saved=True).model.value_of(new.split(".", 1)[1]) == value


def test_the_moe_section_reads_from_yaml_and_overrides_and_is_listed_in_help(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text("model:\n  mlp: swiglu\n  moe:\n    experts: 16\n    top_k: 4\n")
    cfg = load_config(path, ["--model.moe.experts=8", "--model.moe.capacity=1.25"])
    assert (cfg.model.moe.experts, cfg.model.moe.top_k, cfg.model.moe.capacity) == (8, 4, 1.25)
    with pytest.raises(ConfigError, match=r"^unknown key model\.moe\.expert; valid keys in model\.moe: experts, "):
        load_config(None, ["--model.moe.expert=8"])
    listed = [line.split("=", 1)[0] for line in describe_fields(JobConfig)]
    assert "--model.moe.experts" in listed and "--model.moe.backend" in listed
    assert not [key for key in listed if key.startswith("--model.moe_")]


@pytest.mark.parametrize("overrides, message", [
    (["--optim.lr=3e38"], "optim.lr x optim.weight_decay = 3e+37 must be < 1"),
    (["--optim.lr=0.5", "--optim.weight_decay=4"], "optim.lr x optim.weight_decay = 2 must be < 1"),
    # keys that would be silently ignored are named instead
    (["--parallel.pp_schedule=gpipe"], "parallel.pp_schedule=gpipe has no effect with parallel.pp=1"),
    (["--parallel.pp_virtual_stages=2", "--parallel.pp_schedule=interleaved_1f1b"],
     "parallel.pp_schedule=interleaved_1f1b has no effect with parallel.pp=1"),
    (["--train.compile_loss=true"], "train.compile_loss=True has no effect without train.compile=true"),
    (["--train.compile_mode=max-autotune"], "train.compile_mode=max-autotune has no effect without train.compile"),
    (["--train.hang_timeout_s=-1"], "train.hang_timeout_s must be >= 0 (got -1.0)"),
    (["--train.straggler_threshold=nan"], "train.straggler_threshold must be a finite number"),
    (["--train.hang_timeout_s=600", "--train.hang_grace_s=60"],
     "train.hang_grace_s=60 is shorter than train.hang_timeout_s=600"),
])
def test_values_that_cannot_work_or_would_be_ignored_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)
    assert load_config(None, ["--train.compile=true", "--train.compile_loss=true"]).train.compile_loss
