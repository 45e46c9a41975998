"""lm-evaluation-harness on trained runs: perfgpt's backend against the harness's own ``hf``
backend on the Hugging Face export of the same checkpoint, and in-training task evaluation
against a run without it (same losses, bit for bit; scores in metrics.jsonl and TensorBoard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval.models.huggingface import HFLM
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data.tokenizer import ByteTokenizer
from tests.conftest import ROOT, free_port, read_metrics, run_torchrun, run_train, step_losses, tiny_overrides
from tools import evaluate as evaluate_tool
from training.lm_eval_backend import PerfGPTLM, load_tasks, run_tasks
from training.model_io import load_source, write_export

TASK_DIR = ROOT / "tests" / "harness_tasks"
TASKS = ["perfgpt_python_mc", "perfgpt_python_gen"]
STEPS = 40


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache) -> tuple[Path, Path]:
    """The same tiny run (with dropout, so training draws from the RNG every step) without and
    with harness tasks every 10 steps."""
    root = tmp_path_factory.mktemp("harness")
    common = {"train.max_steps": STEPS, "train.log_interval": 1, "model.dropout": 0.1,
              "checkpoint.save_final": "true", "optim.warmup_steps": 5}
    plain = run_train(["--config", "configs/tiny.yaml", *tiny_overrides(root / "plain", corpus_cache, **common)])
    assert plain.returncode == 0, plain.stderr[-3000:]
    tasks = run_train(["--config", "configs/tiny.yaml", *tiny_overrides(root / "tasks", corpus_cache, **common, **{
        "harness.tasks": ",".join(TASKS), "harness.task_dir": str(TASK_DIR), "harness.interval": 10,
        "harness.limit": 6, "logging.tensorboard": "true"})])
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    return root / "plain", root / "tasks"


def test_task_evaluation_during_training_leaves_the_losses_bit_identical(runs):
    plain, tasks = runs
    assert step_losses(tasks) == step_losses(plain) and len(step_losses(plain)) == STEPS
    rows = [r for r in read_metrics(tasks) if any(k.startswith("harness/") for k in r)]
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    for row in rows:
        assert set(row) - {"step", "time"} == {"harness/perfgpt_python_mc/acc", "harness/perfgpt_python_mc/acc_norm",
                                               "harness/perfgpt_python_gen/exact_match"}
        assert all(v * 6 == round(v * 6) for k, v in row.items() if k.startswith("harness/"))  # limit 6: sixths
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tasks / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("harness/perfgpt_python_mc/acc")] == [10, 20, 30, 40]


def byte_level_hf_tokenizer() -> PreTrainedTokenizerFast:
    """perfgpt's byte tokenizer as a Hugging Face tokenizer: id b is byte b (spelled with GPT-2's
    printable stand-ins for bytes), no merges, id 0 the end-of-text token."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spelled, extra = {}, 0
    for b in range(256):
        spelled[b] = chr(b) if b in printable else chr(256 + extra)
        extra += b not in printable
    tok = Tokenizer(models.BPE(vocab={spelled[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spelled[0])


def test_perfgpt_backend_agrees_with_the_harness_hf_backend_on_the_export(runs, tmp_path):
    plain, _ = runs
    hf_dir = write_export(load_source(plain), tmp_path / "hf", "hf")
    hf_tok = byte_level_hf_tokenizer()
    hf_tok.save_pretrained(hf_dir)
    # The same mapping as perfgpt's byte tokenizer on every text the tasks hold and on every character up to
    # U+02FF but one: the spelling of end-of-text, which Hugging Face matches as that token in raw text.
    eot_spelling = hf_tok.eos_token
    texts = [line for f in TASK_DIR.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert not any(eot_spelling in text for text in texts)
    texts += ["".join(chr(c) for c in range(1, 0x300) if chr(c) != eot_spelling)]
    byte = ByteTokenizer()
    for text in texts:
        assert hf_tok.encode(text) == byte.encode(text).tolist()
        assert hf_tok.decode(hf_tok.encode(text)) == byte.decode(byte.encode(text)) == text
    assert hf_tok.encode(eot_spelling) == [0] != byte.encode(eot_spelling).tolist()

    hf = run_tasks(HFLM(pretrained=str(hf_dir), device="cpu", batch_size=4, dtype="float32"),
                   load_tasks(TASKS, TASK_DIR), log_samples=True)
    ours = run_tasks(PerfGPTLM(str(plain), batch_size=3), load_tasks(TASKS, TASK_DIR), log_samples=True)

    mc_ours, mc_hf = ours["samples"]["perfgpt_python_mc"], hf["samples"]["perfgpt_python_mc"]
    assert len(mc_ours) == len(mc_hf) == 30
    for a, b in zip(mc_ours, mc_hf):
        assert a["doc_id"] == b["doc_id"]
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
            assert abs(ll_a - ll_b) < 1e-4 and greedy_a == greedy_b
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["perfgpt_python_mc"][metric] == hf["results"]["perfgpt_python_mc"][metric]
    # A model that learned something: better than the 1-in-3 guess.
    assert ours["results"]["perfgpt_python_mc"]["acc,none"] > 0.5

    gen_ours, gen_hf = ours["samples"]["perfgpt_python_gen"], hf["samples"]["perfgpt_python_gen"]
    assert [s["filtered_resps"] for s in gen_ours] == [s["filtered_resps"] for s in gen_hf]
    assert any(s["filtered_resps"][0].strip() for s in gen_ours)  # not all empty: there is text to compare
    assert ours["results"]["perfgpt_python_gen"]["exact_match,none"] == hf["results"]["perfgpt_python_gen"][
        "exact_match,none"]


def test_the_evaluate_command_prints_the_harness_table(runs, capsys):
    plain, _ = runs
    assert evaluate_tool.main([str(plain), "--tasks", ",".join(TASKS), "--task-dir", str(TASK_DIR), "--limit", "4",
                               "--num-fewshot", "1"]) == 0
    out = capsys.readouterr().out
    assert "|perfgpt_python_mc " in out and "|acc_norm" in out and "exact_match" in out
    assert "|     1|" in out  # one few-shot example per prompt


def test_two_ranks_share_the_requests_and_score_what_one_process_scores(runs, tmp_path):
    """tools.evaluate --tasks under torchrun: each rank scores its share, rank 0 gathers the same table."""
    plain, _ = runs
    args = ["--tasks", ",".join(TASKS), "--task-dir", str(TASK_DIR)]
    assert evaluate_tool.main([str(plain), *args, "--json", str(tmp_path / "one.json")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "-m", "tools.evaluate", str(plain), *args,
                           "--json", str(tmp_path / "two.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["ranks"] == 2 and two["scores"] == one["scores"]


def test_tasks_during_fsdp_training_score_the_weights_the_checkpoint_holds(runs, corpus_cache, tmp_path):
    """Under FSDP2 each rank joins the shards into its own copy; the scores logged after the last
    step are those of the final checkpoint evaluated on its own."""
    run_dir = tmp_path / "fsdp"
    proc = run_torchrun(2, ["--config", "configs/tiny.yaml", *tiny_overrides(run_dir, corpus_cache, **{
        "parallel.strategy": "fsdp", "train.max_steps": 8, "checkpoint.save_final": "true",
        "harness.tasks": ",".join(TASKS), "harness.task_dir": str(TASK_DIR), "harness.interval": 8,
        "harness.limit": 10})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = {k.removeprefix("harness/"): v for r in read_metrics(run_dir) if r["step"] == 8 for k, v in r.items()
              if k.startswith("harness/")}
    assert set(logged) == {"perfgpt_python_mc/acc", "perfgpt_python_mc/acc_norm", "perfgpt_python_gen/exact_match"}
    out = tmp_path / "scores.json"
    assert evaluate_tool.main([str(run_dir), "--tasks", ",".join(TASKS), "--task-dir", str(TASK_DIR), "--limit", "10",
                               "--json", str(out)]) == 0
    assert json.loads(out.read_text())["scores"] == logged
