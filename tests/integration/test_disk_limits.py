"""train.py on a disk that really fills up and under a real file-size limit (the kernel's ENOSPC
and EFBIG, not a mock).

- The run folder on a private 256 KiB tmpfs (a mount namespace of one command, ``unshare -rm``)
  that a filler file has left almost full, the checkpoints on the ordinary disk: metrics.jsonl
  fills up mid-run. The run must go on, say so once, save its checkpoints, and once the filler is
  removed write the held rows, so metrics.jsonl ends with every step, in order, each row whole.
- ``ulimit -f`` (RLIMIT_FSIZE) of 12 KiB on the whole process, SIGXFSZ at its default action (kill):
  train.py ignores it, so the writes fail with EFBIG instead. metrics.jsonl reaches the limit
  first (said once, training goes on), then the final checkpoint cannot be written: one line
  saying "File too large" with the file's path, exit 2, no traceback.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.conftest import ROOT, can_mount_tmpfs, tiny_overrides

TINY = "configs/tiny.yaml"


# Inside the namespace: mount the small disk on the run folder, fill all but two pages of it (one
# for config.yaml, one for the first rows of metrics.jsonl), train in the background, and free
# the space once the run has said that metrics.jsonl is full; copy the disk out for the test.
FILL_AND_TRAIN = r'''
run="$0"; log="$1"; after="$2"; shift 2
mount -t tmpfs -o size=256k tmpfs "$run" || exit 99
dd if=/dev/zero of="$run/filler" bs=4096 count=62 2>/dev/null
"$@" >"$log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null && ! grep -q "metrics: cannot write" "$log"; do sleep 0.1; done
rm -f "$run/filler"
wait "$pid"; rc=$?
cp -r "$run" "$after"
exit $rc
'''


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare -rm and tmpfs mounts (user namespaces)")
@pytest.mark.timeout(300)
def test_a_run_folder_that_fills_up_loses_no_step_and_no_checkpoint(tmp_path, corpus_cache):
    run_dir, ckpt_dir, log, after = tmp_path / "run", tmp_path / "ckpt", tmp_path / "train.log", tmp_path / "after"
    run_dir.mkdir()
    args = ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{
        "train.max_steps": 80, "checkpoint.interval": 40, "checkpoint.dir": str(ckpt_dir)})]
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", FILL_AND_TRAIN, str(run_dir), str(log), str(after),
                           sys.executable, str(ROOT / "train.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert out.count("metrics: cannot write step") == 1 and "no space left on device (ENOSPC)" in out, out[-3000:]
    assert out.count("takes rows again") == 1, out[-3000:]
    assert "Traceback" not in out
    rows = [json.loads(line) for line in (after / "metrics.jsonl").read_text().splitlines()]  # each row whole
    assert [row["step"] for row in rows] == list(range(1, 81))
    assert sorted(p.name for p in ckpt_dir.glob("step_*")) == ["step_00000040", "step_00000080"]


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.timeout(300)
def test_a_file_size_limit_is_one_line_naming_the_file_and_the_limit(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    args = ["--config", TINY, *tiny_overrides(run_dir, corpus_cache, **{"train.max_steps": 40})]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, preexec_fn=_limit_file_size, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]  # not -SIGXFSZ: train.py ignores the signal
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    target = run_dir / "checkpoints" / ".tmp-step_00000040" / "model_optim.pt"
    assert errors == [f"error: step 40: cannot save the checkpoint: File too large (EFBIG) writing {target}: the "
                      "process's file-size limit (ulimit -f) is 12,288 bytes; the previous checkpoint is untouched"], out
    assert out.count("metrics: cannot write step") == 1 and "File too large (EFBIG)" in out and "Traceback" not in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and [row["step"] for row in rows] == list(range(1, len(rows) + 1))  # whole rows, none torn
    assert out.count("row(s) (steps ") == 1 and "never reached" in out  # the held rows, counted at the end
