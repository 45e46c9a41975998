"""Data integrity in a process of its own: a process that exits with its loader workers running
stops them, and tools/prepare_data.py reports invalid UTF-8 (and stops on it when asked)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.data.test_integrity import B, T, prepared, utf8_inputs

ROOT = Path(__file__).resolve().parents[3]


EXIT_WITH_LIVE_WORKERS = """
import sys
sys.path.insert(0, {root!r})
from data.bundle import IGNORE_INDEX
from data.config import DataConfig
from data.loader import build_data

data = build_data(DataConfig(format="mmap", path={path!r}, sampling="sequential", num_workers=2), seq_len={T},
                  micro_batch_size={B}, seed=0, rank=0, world_size=1, vocab_size=256)
next(data.train)
print("read a batch", flush=True)
# Leaves with the workers running and never closes the stream, as a crashing trainer does.
"""


@pytest.mark.timeout(120)
def test_a_process_exits_while_its_loader_workers_run(tmp_path):
    """Loader workers ignore SIGTERM (it is the trainer's, to save); exit must still stop them."""
    script = EXIT_WITH_LIVE_WORKERS.format(root=str(ROOT), path=str(prepared(tmp_path)), T=T, B=B)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "read a batch", proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_cli_reports_replacements_and_stops_on_error(tmp_path):
    inputs = [str(p) for p in utf8_inputs(tmp_path)]
    run = [sys.executable, "-m", "tools.prepare_data", *inputs, "--no-progress", "--workers", "1"]
    done = subprocess.run(run + ["--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "warning: replaced 4 invalid UTF-8 sequence(s) with U+FFFD in 2 file(s)/line(s)" in done.stderr
    assert "bad.txt (byte 3, 3 replaced)" in done.stderr and "rows.jsonl:2 (byte 34" in done.stderr
    failed = subprocess.run(run + ["--out", str(tmp_path / "b"), "--on-invalid-utf8", "error"],
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines() == [f"error: {inputs[-2]}: invalid UTF-8 at byte offset 3; fix the "
                                                  f"file, or pass --on-invalid-utf8 replace to replace each invalid "
                                                  f"sequence with U+FFFD"]
    assert not (tmp_path / "b" / "meta.json").exists()
