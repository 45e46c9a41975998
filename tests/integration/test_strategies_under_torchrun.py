"""The real train.py under torchrun (2 gloo processes) for every strategy against one process.

Why the comparison is exact up to float rounding: the data loader gives rank r of W every W-th
window of the epoch's permutation, so 2 ranks with micro-batch B read, step for step, exactly
the 2B windows that 1 process with micro-batch 2B reads (also with gradient accumulation: fsdp
and zero2 run 2 micro-batches of B/2, which exercises FSDP2's deferred reduce-scatter and
DeepSpeed's accumulation boundary). The model is built from the same seed on every rank,
dropout is 0, so each strategy computes the same global-batch gradient as the single process; only
the order of floating-point sums differs (per-rank means averaged by a collective vs one mean over
2B sequences). Tolerance: 1e-5 on the loss of each of 4 steps and on the validation loss (fp32;
observed differences are ~1e-6). The validation set is 13 windows in every run (train.eval_sequences):
1 process reads them in batches of 8, 2 ranks share them 7 + 6 in batches of their micro-batch,
padding the rest, so the figure is the same set's mean whatever the layout.

Resume: the FSDP2 and ZeRO-3 runs save a checkpoint at step 2; a second launch resumes from it
and must reproduce steps 3-4 bit for bit (model, optimizer and data position all restored).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, free_port, read_metrics, run_train, step_losses, tiny_overrides

TINY = "configs/tiny.yaml"
STEPS = 4
LOSS_TOL = 1e-5
# Micro-batches per rank x accumulation steps x 2 ranks = 8 sequences per step, the single run's
# micro-batch. Rank r's k-th step then reads windows [8k, 8k + 8) of the permutation either way.
ACCUMULATE = {"train.micro_batch_size": 2, "train.grad_accum_steps": 2}
PER_STRATEGY = {"ddp": {}, "fsdp": ACCUMULATE, "zero1": {}, "zero2": ACCUMULATE, "zero3": {}}
COMMON = {"train.max_steps": STEPS, "train.eval_interval": 2, "train.eval_sequences": 13, "checkpoint.interval": 2,
          "checkpoint.save_final": "false", "checkpoint.keep_last": 0}


def torchrun(run_dir: Path, corpus_cache: str, extra: dict, resume: str | None = None) -> subprocess.CompletedProcess:
    args = ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{**COMMON, **extra})]
    if resume:
        args += ["--resume", resume]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "train.py", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env=env,
    )


def val_loss(run_dir: Path, step: int = STEPS) -> float:
    return next(m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m and m["step"] == step)


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus_cache) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{**COMMON, "train.micro_batch_size": 8})])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, corpus_cache):
    """strategy -> run dir, launched on first use and shared by the parity and resume tests."""
    done: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in done:
            run_dir = tmp_path_factory.mktemp(strategy) / "run"
            proc = torchrun(run_dir, corpus_cache, {"parallel.strategy": strategy, **PER_STRATEGY[strategy]})
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"strategy={strategy} " in proc.stdout and "[rank 1 local 1 node 0]" in proc.stdout
            done[strategy] = run_dir
        return done[strategy]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_two_rank_losses_match_one_process_with_the_same_global_batch(strategy, single, parallel_runs):
    run_dir = parallel_runs(strategy)
    ours, reference = step_losses(run_dir), step_losses(single)
    assert sorted(ours) == list(range(1, STEPS + 1))
    for step in reference:
        assert ours[step] == pytest.approx(reference[step], abs=LOSS_TOL), f"step {step}"
    for step in (2, STEPS):
        assert val_loss(run_dir, step) == pytest.approx(val_loss(single, step), abs=LOSS_TOL), f"val at {step}"
    # Training did something: the losses are not all the same number.
    assert len({round(v, 4) for v in ours.values()}) > 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, saved", [("fsdp", "dcp"), ("zero3", "deepspeed")])
def test_resume_from_a_sharded_checkpoint_reproduces_the_next_steps(strategy, saved, parallel_runs, tmp_path,
                                                                    corpus_cache):
    full = parallel_runs(strategy)
    checkpoint = full / "checkpoints" / "step_00000002"
    assert (checkpoint / saved).is_dir() and (checkpoint / "meta.json").is_file()
    resumed = tmp_path / "resumed"
    proc = torchrun(resumed, corpus_cache, {"parallel.strategy": strategy, **PER_STRATEGY[strategy]},
                    resume=str(checkpoint))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing from" in proc.stdout
    expected = {s: v for s, v in step_losses(full).items() if s > 2}
    assert step_losses(resumed) == expected  # bit for bit


@pytest.mark.timeout(300)
def test_evaluate_on_a_two_rank_checkpoint_gives_the_logged_validation_loss(parallel_runs, tmp_path):
    """tools/evaluate.py, one process, on the FSDP2 run's step-2 checkpoint: by default the run's
    validation set (13 windows), so its loss is the val_loss the 2 ranks logged at step 2."""
    import json

    from tools.evaluate import main as evaluate_main

    run_dir = parallel_runs("fsdp")
    out = tmp_path / "eval.json"
    assert evaluate_main([str(run_dir / "checkpoints" / "step_00000002"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sequences"] == 13 and result["tokens"] == 13 * 64
    assert result["loss"] == pytest.approx(val_loss(run_dir, 2), abs=LOSS_TOL)


@pytest.mark.timeout(300)
def test_one_process_reshards_a_two_rank_fsdp_checkpoint(parallel_runs, tmp_path, corpus_cache):
    """checkpoint.reshard=true: the FSDP2 run's step-2 checkpoint (DCP, 2 ranks) resumed by train.py in
    one process continues at step 3 with the saved weights and the schedule's step-3 learning rate;
    the data stream restarts, so step 3's loss is the saved model's loss on the first batch."""
    from parallel.optim import lr_at
    from training.config import load_config
    from training.model_io import load_source

    checkpoint = parallel_runs("fsdp") / "checkpoints" / "step_00000002"
    run_dir = tmp_path / "resharded"
    overrides = {**COMMON, "train.micro_batch_size": 8, "checkpoint.reshard": "true"}
    proc = run_train(["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **overrides),
                      "--resume", str(checkpoint)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharded" in proc.stdout + proc.stderr and "at step 2" in proc.stdout
    rows = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    assert sorted(rows) == [3, 4]
    cfg = load_config(run_dir / "config.yaml")
    assert rows[3]["lr"] == pytest.approx(lr_at(2, **cfg.lr_schedule()), rel=1e-12)

    # The reference: the checkpoint read by the export path (another reader of DCP), its loss on the
    # first batch of a one-process stream.
    from data.loader import build_data

    model = load_source(checkpoint).build()
    data = build_data(cfg.data, seq_len=cfg.seq_len, micro_batch_size=8, seed=cfg.train.seed, rank=0, world_size=1,
                      vocab_size=cfg.model.vocab_size)
    x, y = next(data.train)
    with torch.no_grad():
        expected = float(model(x, y))
    assert rows[3]["loss"] == pytest.approx(expected, abs=LOSS_TOL)


@pytest.mark.timeout(120)
def test_a_sharded_strategy_in_one_process_is_a_one_line_error(tmp_path, corpus_cache):
    proc = run_train(["--config", TINY, *tiny_overrides(tmp_path / "run", corpus_cache, **{"parallel.strategy": "fsdp"})])
    assert proc.returncode == 2
    assert "needs several processes; launch with torchrun" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- export (tools/export.py)

# Two AdamW steps from the same weights on the same global batch: the runs differ only in the
# rounding of the gradient sums (~1e-7 relative), which Adam's normalised first steps carry into
# the weights at most as a fraction of lr (3e-3), on near-zero gradients.
WEIGHT_TOL = 1e-4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_export_of_a_sharded_checkpoint_equals_the_one_process_export(strategy, single, parallel_runs, tmp_path):
    from safetensors.torch import load_file

    from tools.export import main as export_main

    def exported(run_dir: Path, step: int, label: str) -> dict:
        out = tmp_path / label
        assert export_main([str(run_dir / "checkpoints" / f"step_{step:08d}"), "--format", "safetensors",
                            "--out", str(out)]) == 0
        return load_file(out / "model.safetensors")

    ours, reference = exported(parallel_runs(strategy), 2, strategy), exported(single, 2, "single")
    assert set(ours) == set(reference) and "lm_head.weight" not in ours  # tied: stored once
    worst = max(float((ours[k] - reference[k]).abs().max()) for k in reference)
    assert worst <= WEIGHT_TOL, worst
    # The tolerance is far below what two steps change: a stale (initial) or wrong tensor would show.
    from model.gpt import GPT
    from training.config import load_config
    from training.model_io import load_source

    torch.manual_seed(load_config(single / "config.yaml").train.seed)  # as the build path seeds, then builds
    initial = GPT(load_source(single).cfg).state_dict()
    assert min(float((initial[k] - reference[k]).abs().max()) for k in reference if k.endswith("weight")) > 5 * WEIGHT_TOL


@pytest.mark.timeout(300)
def test_a_zero3_checkpoint_exports_to_a_hugging_face_model_with_the_same_logits(parallel_runs, tmp_path):
    import transformers

    from tools.export import main as export_main
    from training.model_io import load_source

    checkpoint = parallel_runs("zero3") / "checkpoints" / "step_00000002"
    assert export_main([str(checkpoint), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert all(not keys for keys in info.values()), info  # no missing, unexpected or mismatched keys
    ours = load_source(checkpoint).build()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
