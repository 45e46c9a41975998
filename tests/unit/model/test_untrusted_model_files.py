"""A Hugging Face model folder or a nanoGPT checkpoint from someone else: every malformed value is
one line naming it (never a traceback from deep inside a reader), and a sharded model's weight
index cannot send the reader outside the model folder.

Each case starts from a folder ``transformers`` itself wrote (``save_pretrained``) or a checkpoint
``interop.to_nanogpt`` wrote, which load as they are; one value is then changed as a damaged
download or a crafted upload would change it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from common.errors import InteropError
from model import interop
from model.config import ModelConfig
from model.gpt import GPT
from tools import export as export_tool

transformers = pytest.importorskip("transformers", reason="needs transformers (the dev extra)")
pytest.importorskip("safetensors", reason="needs safetensors (the dev extra)")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """GPT-2, Llama, a sharded Llama and a Qwen3-MoE folder, as transformers writes them."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=1, n_head=4, bos_token_id=None, eos_token_id=None,
    )).save_pretrained(root / "gpt2")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=None, eos_token_id=None))
    llama.save_pretrained(root / "llama")
    llama.save_pretrained(root / "sharded", max_shard_size="20KB")
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, bos_token_id=None, eos_token_id=None)).save_pretrained(root / "qwen3_moe")
    return {name: root / name for name in ("gpt2", "llama", "sharded", "qwen3_moe")}


def _copy(saved: dict[str, Path], name: str, tmp_path: Path) -> Path:
    folder = tmp_path / name
    shutil.copytree(saved[name], folder, symlinks=True)
    return folder


def _edit(file: Path, change: Callable[[dict], Any]) -> None:
    content = json.loads(file.read_text())
    change(content)
    file.write_text(json.dumps(content))


def _refused(read: Callable[[], Any], *fragments: str) -> str:
    with pytest.raises(InteropError) as info:
        read()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_untouched_folders_load(saved):
    for folder in saved.values():
        interop.read_hf_dir(folder)


# --------------------------------------------------------------------------- the weight index


def _move_first_shard_out(folder: Path) -> str:
    """The first shard moved beside the folder, the index pointing at it there: the weights load
    exactly as before unless the reader refuses to leave the folder."""
    index = folder / interop.SAFETENSORS_INDEX
    first = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    outside = folder.parent / "outside_shard"
    outside.mkdir()
    shutil.move(folder / first, outside / first)
    _edit(index, lambda c: c.update(weight_map={k: f"../outside_shard/{v}" if v == first else v
                                                for k, v in c["weight_map"].items()}))
    return first


@pytest.mark.parametrize("shard,fragment", [
    (None, "climbs out of the folder with '..'"),
    ("/etc/hostname", "is an absolute path"),
    (5, "is not a string (int)"),
    (["model-00001-of-00002.safetensors"], "is not a string (list)"),
])
def test_a_weight_index_naming_a_file_outside_the_folder_is_refused(saved, tmp_path, shard, fragment):
    folder = _copy(saved, "sharded", tmp_path)
    if shard is None:
        _move_first_shard_out(folder)
    else:
        _edit(folder / interop.SAFETENSORS_INDEX,
              lambda c: c["weight_map"].update({next(iter(c["weight_map"])): shard}))
    _refused(lambda: interop.read_hf_dir(folder), str(folder / interop.SAFETENSORS_INDEX), fragment,
             "refusing to read weights from outside the model folder")


def test_the_hub_cache_layout_of_links_into_a_blob_folder_still_loads(saved, tmp_path):
    """The Hub's cache keeps each file of a snapshot as a link to ``../../blobs/<hash>``: a link out
    of the folder is how a downloaded model looks, so only the index's names are held to the folder."""
    folder, blobs = tmp_path / "snapshots" / "rev", tmp_path / "blobs"
    folder.mkdir(parents=True)
    blobs.mkdir()
    for file in saved["sharded"].iterdir():
        shutil.copy(file, blobs / file.name)
        (folder / file.name).symlink_to(os.path.relpath(blobs / file.name, folder))
    cfg, state = interop.read_hf_dir(folder)
    ref_cfg, ref_state = interop.read_hf_dir(saved["sharded"])
    assert cfg == ref_cfg and all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_a_shard_that_is_a_fifo_is_refused_without_blocking(saved, tmp_path):
    folder = _copy(saved, "sharded", tmp_path)
    first = sorted(set(json.loads((folder / interop.SAFETENSORS_INDEX).read_text())["weight_map"].values()))[0]
    (folder / first).unlink()
    os.mkfifo(folder / first)
    _refused(lambda: interop.read_hf_dir(folder), "is a FIFO, not a regular file")


# --------------------------------------------------------------------------- config.json values

BAD_VALUES = [
    ("gpt2", {"n_embd": 10**30}, "n_embd=1000000000000000000000000000000 must be between 1 and"),
    ("gpt2", {"n_embd": 2**30}, "more than any model can hold"),  # in range alone, overflowing as a model
    ("gpt2", {"n_head": 0}, "n_head=0 must be between 1 and"),
    ("llama", {"num_attention_heads": 0}, "num_attention_heads=0 must be between 1 and"),
    ("llama", {"rope_scaling": "linear"}, "rope_scaling='linear' must be an object"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope type 'linear'"),
    ("llama", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config quant_method='mxfp4'"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, "rope_theta='big'"),
    ("gpt2", {"activation_function": ["gelu"]}, "activation_function=['gelu'] must be a string"),
    ("qwen3_moe", {"mlp_only_layers": 5}, "mlp_only_layers=5 must be a list of layer indices"),
    ("llama", {"rms_norm_eps": float("inf")}, "rms_norm_eps=inf must be a finite number"),
    ("gpt2", {"eos_token_id": {"id": 1}}, "eos_token_id={'id': 1} must be a token id"),
    ("llama", {"num_attention_heads": 2**31 - 1, "hidden_size": 2**31 - 1, "num_key_value_heads": 2},
     "must divide model.n_head"),  # the divisors the message lists are not counted up to 2**31
]


@pytest.mark.parametrize("family,change,fragment", BAD_VALUES)
def test_a_malformed_config_value_is_one_line(saved, tmp_path, family, change, fragment):
    folder = _copy(saved, family, tmp_path)
    _edit(folder / interop.CONFIG_FILE, lambda c: c.update(change))
    with pytest.raises((InteropError, ValueError)) as info:  # ConfigError (a ValueError) from validation
        interop.read_hf_dir(folder)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_config_nested_100000_deep_is_one_line(saved, tmp_path):
    folder = _copy(saved, "gpt2", tmp_path)
    (folder / interop.CONFIG_FILE).write_text('{"model_type": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(lambda: interop.read_hf_dir(folder), "nests JSON arrays or objects too deeply")


def test_the_export_tool_says_it_in_one_line_and_exits_2(saved, tmp_path, capsys):
    folder = _copy(saved, "llama", tmp_path)
    _edit(folder / interop.CONFIG_FILE, lambda c: c.update(num_attention_heads=0))
    assert export_tool.main([str(folder), "--format", "safetensors", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config.json num_attention_heads=0") and "\n" not in err, err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- nanoGPT model_args


def _nanogpt(**args: Any) -> dict:
    cfg = ModelConfig(vocab_size=97, max_seq_len=16, n_layer=1, n_head=4, d_model=32, d_ff=128, norm="layernorm",
                      norm_eps=1e-5, mlp="gelu", gelu="exact", position="learned", tie_embeddings=True)
    torch.manual_seed(0)
    checkpoint = interop.to_nanogpt(cfg, GPT(cfg).state_dict())
    checkpoint["model_args"].update(args)
    return checkpoint


def test_an_untouched_nanogpt_checkpoint_loads(tmp_path):
    torch.save(_nanogpt(), tmp_path / "ckpt.pt")
    assert interop.read_nanogpt_ckpt(tmp_path / "ckpt.pt")[0].d_model == 32


@pytest.mark.parametrize("args,fragment", [
    ({"n_embd": "32"}, "n_embd='32' must be an integer"),
    ({"n_layer": 1.5}, "n_layer=1.5 must be an integer"),
    ({"vocab_size": 10**30}, "vocab_size=1000000000000000000000000000000 must be between 1 and"),
    ({"block_size": None}, "block_size=None must be an integer"),
    ({"bias": "no"}, "bias='no' must be true or false"),
    ({"dropout": "x"}, "dropout='x' must be a number"),
])
def test_a_malformed_nanogpt_model_arg_is_one_line(tmp_path, args, fragment):
    torch.save(_nanogpt(**args), tmp_path / "ckpt.pt")
    _refused(lambda: interop.read_nanogpt_ckpt(tmp_path / "ckpt.pt"), f"nanoGPT model_args {fragment}")
