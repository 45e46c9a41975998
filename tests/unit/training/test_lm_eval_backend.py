"""The perfgpt backend of lm-evaluation-harness in-process: rolling log-likelihood against
tools/evaluate.py's loss, the KV-cache generation against generation without it, and the one-line
errors of ``python -m tools.evaluate --tasks`` (its agreement with the harness's own ``hf``
backend, on a trained checkpoint, is in tests/integration/test_harness.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from lm_eval.api.instance import Instance

from data.shards import TokenShardWriter, write_meta
from data.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.generate import generate
from model.gpt import GPT
from tests.conftest import ROOT
from tools import evaluate as evaluate_tool
from training.lm_eval_backend import PerfGPTLM, cut_at_stop, load_tasks
from training.model_io import ModelSource, write_export

TASK_DIR = ROOT / "tests" / "harness_tasks"
SEQ = 32


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=256, max_seq_len=SEQ, n_layer=2, n_head=4, d_model=32)).eval()


@pytest.fixture
def exported(tmp_path) -> Path:
    """An export that records the byte tokenizer, as a checkpoint of the default corpus does."""
    model = tiny_model()
    return write_export(ModelSource(model.cfg, model.state_dict(), "byte", 0, "test"), tmp_path / "st", "safetensors")


def one_line_error(capsys, code: int, *fragments: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if line.startswith("error: ")]  # the harness may log its own warnings first
    assert code == 2 and len(err) == 1, err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    return err[0]


def test_rolling_loglikelihood_equals_the_loss_evaluate_reports_on_the_same_tokens(tmp_path, exported):
    """The harness's rolling windows (end-of-text, then disjoint windows of SEQ predicted tokens,
    each with full context) are tools/evaluate.py's windows over a split that holds end-of-text
    and then the text: the summed log-likelihood is minus the summed loss."""
    text = ("import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n        print(os.path.abspath(name))"
            "\n\nif __name__ == '__main__':\n    main(sys.argv[1:])\n" * 3)
    ids = ByteTokenizer().encode(text)[: 8 * SEQ]  # whole windows: no partial one at the end
    data = tmp_path / "data"
    data.mkdir()
    splits = {}
    for split, docs in (("train", [ids]), ("val", [np.zeros(0, np.uint32), ids])):  # val: eot, then the text
        writer = TokenShardWriter(data / f"{split}-000000.bin", 256, 0)
        for doc in docs:
            writer.add_document(doc)
        writer.close()
        splits[split] = [{"file": f"{split}-000000.bin", "tokens": writer.token_count, "documents": len(docs)}]
    write_meta(data, format="mmap", tokenizer="byte", vocab_size=256, eot_id=0, splits=splits)
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"model": {"vocab_size": 256, "max_seq_len": SEQ},
                                      "data": {"format": "mmap", "path": str(data)}}))
    out = tmp_path / "eval.json"
    assert evaluate_tool.main([str(exported), "--config", str(config), "--batch-size", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == len(ids)

    lm = PerfGPTLM(str(exported), batch_size=5)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(ByteTokenizer().decode(ids),), idx=0)
    (loglikelihood,) = lm.loglikelihood_rolling([request])
    assert -loglikelihood / len(ids) == pytest.approx(report["loss"], rel=1e-6)


def test_scores_do_not_depend_on_the_batch_size(exported):
    """Right padding never reaches a causal model's earlier positions: one request per batch and
    seven per batch give the same log-likelihoods and the same generations."""
    pairs = [("import", " os"), ("def f(x):", "\n    return x"), ("class", " A:"), ("a" * 40, "b")]  # the last is cut
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs]
    gen = [Instance(request_type="generate_until", doc={}, arguments=(p, {"until": ["\n"], "max_gen_toks": 8}), idx=0)
           for p in ("import", "def f(", "x = 1")]
    one, seven = PerfGPTLM(str(exported), batch_size=1), PerfGPTLM(str(exported), batch_size=7)
    for a, b in zip(one.loglikelihood(requests), seven.loglikelihood(requests)):
        assert a[0] == pytest.approx(b[0], abs=1e-5) and a[1] == b[1]
    assert one.generate_until(gen) == seven.generate_until(gen)


def test_generation_is_the_models_greedy_continuation_cut_at_the_stop_string(exported):
    lm = PerfGPTLM(str(exported), batch_size=2)
    prompts = ["import", "def f(x", "for i in"]
    gen = [Instance(request_type="generate_until", doc={}, arguments=(p, {"until": ["e"], "max_gen_toks": 12}), idx=0)
           for p in prompts]
    tok = ByteTokenizer()
    expected = [cut_at_stop(tok.decode(row), ["e"]) for row in
                generate(lm.model, [tok.encode(p).tolist() for p in prompts], 12, eos_id=0, use_cache=False)]
    assert lm.generate_until(gen) == expected


def test_the_local_tasks_load_without_the_harness_index():
    tasks = load_tasks(["perfgpt_python_mc", str(TASK_DIR / "perfgpt_python_gen.yaml")], TASK_DIR)
    assert sorted(tasks["tasks"]) == ["perfgpt_python_gen", "perfgpt_python_mc"]
    assert len(tasks["tasks"]["perfgpt_python_mc"].test_docs()) == 30


def broken_task_dir(root: Path) -> Path:
    """A task directory whose one file does not parse (its line 2)."""
    broken = root / "tasks"
    broken.mkdir()
    (broken / "broken.yaml").write_text("task: broken\n  output_type: [multiple_choice\n")
    return broken


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, exported, monkeypatch):
    def run(*args: str) -> int:
        return evaluate_tool.main([str(exported), *args])

    # (A name neither the task directory nor the harness knows is looked up in the harness's whole
    # index: tests/integration/training/test_lm_eval_backend.py.)
    one_line_error(capsys, run("--tasks", str(broken_task_dir(tmp_path) / "broken.yaml")), "broken.yaml does not parse")

    torch.manual_seed(0)  # a Hugging Face directory of its own records no tokenizer
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1,
                                                         n_head=2)).save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    one_line_error(capsys, evaluate_tool.main([str(tmp_path / "hf"), "--tasks", "perfgpt_python_mc", "--task-dir",
                                               str(TASK_DIR)]), "does not record its tokenizer", "tokenizer=byte")
    one_line_error(capsys, run("--tasks", "perfgpt_python_mc", "--task-dir", str(TASK_DIR), "--batch-size", "0"),
                   "batch_size must be a positive integer")
    # A tokenizer with more ids than the model's vocabulary: refused before any request, as tools.sample does.
    small = GPT(ModelConfig(vocab_size=100, max_seq_len=SEQ, n_layer=1, n_head=4, d_model=32))
    small_export = write_export(ModelSource(small.cfg, small.state_dict(), "byte", 0, "test"), tmp_path / "small",
                                "safetensors")
    one_line_error(capsys, evaluate_tool.main([str(small_export), "--tasks", "perfgpt_python_mc", "--task-dir",
                                               str(TASK_DIR), "--limit", "2"]),
                   "tokenizer byte has 256 ids, more than the model's vocabulary of 100")

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the harness were not installed
    one_line_error(capsys, run("--tasks", "perfgpt_python_mc"), "pip install -e '.[eval]'")
