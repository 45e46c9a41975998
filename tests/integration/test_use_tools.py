"""tools/export.py, tools/sample.py, tools/evaluate.py and model.init_from, as a user runs them.

Exports from sharded checkpoints (FSDP2, ZeRO-3) are tested against the one-process export in
tests/integration/test_strategies_under_torchrun.py, which already trains those runs; the tensor-parallel checkpoint in
tests/integration/parallel/test_tp_pp.py. Here: sampling against ``transformers``' own generate, training
from imported weights, evaluation against the training loop's validation loss, and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from data.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.gpt import GPT
from model.interop import to_nanogpt
from tests.conftest import read_metrics, run_train, tiny_overrides
from tools import evaluate as evaluate_tool
from tools import export as export_tool
from tools import sample as sample_tool
from training.model_io import ModelSource, load_source, write_export

TINY = "configs/tiny.yaml"


def hf_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def one_line_error(capsys, code: int, *fragments: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("llama", [False, True])
def test_sample_cli_greedy_equals_transformers_generate(tmp_path, capsys, llama):
    cfg = (ModelConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, norm="rmsnorm",
                       mlp="swiglu", position="rope", tie_embeddings=False, bias=False) if llama else
           ModelConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64))
    torch.manual_seed(3)
    model = GPT(cfg)
    write_export(ModelSource(cfg, model.state_dict(), "byte", None, "test"), tmp_path / "hf", "hf")
    prompts = ["def f(x):", "import"]
    assert sample_tool.main([str(tmp_path / "hf"), *(a for p in prompts for a in ("--prompt", p)), "--greedy",
                             "--max-new-tokens", "32"]) == 0
    printed = capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = ByteTokenizer()
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt).tolist()])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                          min_new_tokens=32, pad_token_id=0)
        expected = tok.decode(out[0, ids.shape[1]:].tolist())
        assert f"--- {prompt!r} + 32 new tokens:\n{expected}\n" in printed


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory, corpus_cache) -> tuple[Path, Path, object]:
    """A run started from a Hugging Face GPT-2 directory: one step at a negligible learning rate,
    validation after it."""
    root = tmp_path_factory.mktemp("imported")
    hf = hf_gpt2()
    hf.save_pretrained(root / "hf")
    run_dir = root / "run"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "model.init_from": str(root / "hf"), "train.max_steps": 1, "optim.lr": 1e-9,
        "optim.min_lr": 0.0, "optim.warmup_steps": 0, "train.eval_interval": 1, "train.eval_steps": 2,
        "checkpoint.save_final": "true"})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, root / "hf", (hf, proc.stdout)


def test_init_from_a_hugging_face_directory_trains_from_its_weights(imported_run):
    run_dir, hf_dir, (hf, stdout) = imported_run
    # tiny_overrides set the source's shape (2 layers of width 64, 64 positions); tiny.yaml's own 4 x 128 would be
    # refused (tests/unit/model/test_moe_interop.py)
    assert "model.init_from: Hugging Face gpt2 model" in stdout and "architecture from it (the same as" in stdout
    trained = load_source(run_dir)
    ours = trained.build()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # one step at lr 1e-9 leaves the imported model's function in place
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
    # ... while a model from the config's own random init would be far off.
    torch.manual_seed(0)
    with torch.no_grad():
        assert (GPT(trained.cfg)(tokens) - hf(tokens).logits).abs().max() > 0.1


def test_evaluate_reproduces_the_training_loops_validation_loss(imported_run, capsys):
    run_dir, _, _ = imported_run
    val = [m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m][-1]
    out = run_dir / "eval.json"
    # By default the run's validation set: train.eval_steps=2 x train.micro_batch_size=4 sequences,
    # here in batches of 3 (the last one padded): the same figure.
    assert evaluate_tool.main([str(run_dir), "--batch-size", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["loss"] == pytest.approx(val, abs=1e-5) and result["tokens"] == 2 * 4 * 64
    assert result["sequences"] == 8
    # Byte tokenizer: one byte per token except end-of-text (id 0).
    assert 0 < result["bytes"] <= result["tokens"]
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * result["tokens"] / result["bytes"] / 0.6931471805599453)
    assert evaluate_tool.main([str(run_dir), "--split", "test"]) == 2
    assert "has no split 'test'; its splits: train, val" in capsys.readouterr().err


def test_bad_sources_are_one_line_errors(tmp_path, capsys):
    out = ["--format", "hf", "--out", str(tmp_path / "out")]
    one_line_error(capsys, export_tool.main([str(tmp_path / "nothing"), *out]), "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error(capsys, export_tool.main([str(tmp_path / "empty"), *out]), "holds no complete perfgpt checkpoint")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    one_line_error(capsys, export_tool.main([str(tmp_path / "bad.safetensors"), *out]), "cannot read")
    hf_gpt2().save_pretrained(tmp_path / "hf")  # a plain HF directory: no tokenizer recorded
    capsys.readouterr()  # transformers' progress bar
    one_line_error(capsys, sample_tool.main([str(tmp_path / "hf"), "--prompt", "x"]), "pass --tokenizer")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    one_line_error(capsys, export_tool.main([str(tmp_path / "hf"), *out]), "h.2")


# --------------------------------------------------------------------------- ordinary mistakes, one line each


def tiny_export(tmp_path: Path, fmt: str = "safetensors") -> Path:
    cfg = ModelConfig(vocab_size=256, max_seq_len=64, n_layer=1, n_head=2, d_model=32)
    torch.manual_seed(0)
    return write_export(ModelSource(cfg, GPT(cfg).state_dict(), "byte", 0, "test"), tmp_path / f"model-{fmt}", fmt)


def test_export_never_replaces_an_earlier_export_or_another_models_files_silently(tmp_path, capsys):
    source = tiny_export(tmp_path, "hf")
    out = tmp_path / "out"
    assert export_tool.main([str(source), "--format", "hf", "--out", str(out)]) == 0
    written = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    one_line_error(capsys, export_tool.main([str(source), "--format", "hf", "--out", str(out), "--dtype", "bf16"]),
                   "already holds an export", "--overwrite")
    assert (out / "model.safetensors").read_bytes() == written  # nothing overwritten
    assert export_tool.main([str(source), "--format", "hf", "--out", str(out), "--dtype", "bf16", "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() != written
    # another model's directory: its tokenizer would stay beside our weights, so refused even with --overwrite
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "tokenizer.json").write_text("{}")
    capsys.readouterr()
    one_line_error(capsys, export_tool.main([str(source), "--format", "hf", "--out", str(other), "--overwrite"]),
                   "holds tokenizer.json")
    assert (other / "config.json").read_text() == "{}"


def test_sample_names_bad_prompts_tokenizers_and_survives_a_tiny_temperature(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = str(tiny_export(tmp_path))
    one_line_error(capsys, sample_tool.main([source, "--prompt", "ab\udcff", "--max-new-tokens", "2"]),
                   "--prompt #1 is not valid UTF-8", "0xff")
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(299)} | {"[UNK]": 299, "<|endoftext|>": 300},
                                    unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    one_line_error(capsys, sample_tool.main([source, "--prompt", "w1", "--tokenizer", f"hf:{tmp_path / 'big.json'}"]),
                   "has 301 ids, more than the model's vocabulary of 256")
    # a positive temperature too small to divide by samples like greedy decoding instead of failing
    assert sample_tool.main([source, "--prompt", "ab", "--temperature", "1e-40", "--max-new-tokens", "8"]) == 0
    tiny = capsys.readouterr().out
    assert sample_tool.main([source, "--prompt", "ab", "--greedy", "--max-new-tokens", "8"]) == 0
    assert tiny == capsys.readouterr().out


def test_init_from_and_export_name_a_damaged_source(tmp_path, capsys):
    out = ["--format", "safetensors", "--out", str(tmp_path / "out")]
    hf_gpt2().save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps([config]))
    one_line_error(capsys, export_tool.main([str(tmp_path / "hf"), *out]), "config.json", "not a JSON object")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "n_embd": "sixty-four"}))
    one_line_error(capsys, export_tool.main([str(tmp_path / "hf"), *out]), "n_embd='sixty-four'", "integer")
    cfg = ModelConfig(vocab_size=256, max_seq_len=64, n_layer=1, n_head=2, d_model=32, gelu="exact")
    nano = to_nanogpt(cfg, GPT(cfg).state_dict())
    nano["model"]["transformer.wte.weight"] = "not a tensor"
    torch.save(nano, tmp_path / "ckpt.pt")
    one_line_error(capsys, export_tool.main([str(tmp_path / "ckpt.pt"), *out]),
                   "'transformer.wte.weight' is a str, not a tensor")


def test_evaluate_checks_its_json_path_before_evaluating(tmp_path, capsys):
    source = str(tiny_export(tmp_path))
    one_line_error(capsys, evaluate_tool.main([source, "--json", str(tmp_path)]), "is a directory")
    one_line_error(capsys, evaluate_tool.main([source, "--json", str(tmp_path / "no" / "x.json")]), "does not exist")


@pytest.mark.parametrize("budget", ["-1", "0", "nan", "inf"])
def test_diagnose_refuses_a_memory_budget_that_is_not_a_size(capsys, budget):
    from tools import diagnose

    one_line_error(capsys, diagnose.main(["--config", TINY, "--memory-budget-gib", budget]),
                   "--memory-budget-gib must be a finite number of GiB > 0")
