"""End to end: tools/prepare_data.py output trains with the train.py command it prints, for each prepared format."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    for i in range(20):
        (folder / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    return folder


def run(cmd, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["mmap", "webdataset"])
def test_prepare_then_train_three_steps(tmp_path, corpus, fmt):
    data = tmp_path / "data"
    out = run([sys.executable, "-m", "tools.prepare_data", str(corpus), "--out", str(data), "--output", fmt,
               "--seq-len", "32", "--samples-per-shard", "100", "--val-fraction", "0.2", "--workers", "1",
               "--no-progress"], tmp_path)
    printed = next(line for line in out.splitlines() if line.startswith("train with: ")).removeprefix("train with: ")
    python, script, *args = printed.split()
    assert (python, script) == ("python", "train.py")
    log = run([sys.executable, str(ROOT / script), *args, "--train.max_steps=3", "--optim.warmup_steps=1",
               "--train.eval_interval=3", "--train.eval_steps=1", "--train.micro_batch_size=4",
               "--checkpoint.save_final=false", f"--logging.run_dir={tmp_path / 'run'}"], ROOT)
    assert f"data: format={fmt}" in log
    assert "step 3/3" in log and "val_loss" in log
