"""tools/reproduce.py run as a user runs it: every chapter table is written, with the figures the
corrections call for, and a rebuild from the saved measurements gives the same tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.analysis.test_chapter_tables import TABLES

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.timeout(180)
def test_quick_run_writes_every_table(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.reproduce", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in TABLES:
        text = (out / f"{name}.md").read_text()
        assert "chapter's claim" in text and "measured here" in text, name
        assert "| " in text and "**Verdict**" in text, name
    assert (out / "README.md").is_file()
    pngs = {p.stem for p in out.glob("*.png")}
    assert pngs == set(TABLES) - {"data_formats", "priority"}
    assert all((out / f"{name}.png").read_bytes()[:4] == b"\x89PNG" for name in pngs)
    recompute = (out / "activation_recompute.md").read_text()
    assert "1,940 GiB" in recompute and "340 GiB" in recompute and "20.0 GiB" in recompute
    assert "~80 GB" in recompute  # the chapter's claim stays next to ours
    if not torch.cuda.is_available():
        assert "needs GPU" in (out / "attention.md").read_text()
        # the measurements were saved: a rebuild from them (no measuring) gives the same tables
        from tools import reproduce

        first = {name: (out / f"{name}.md").read_text() for name in TABLES}
        for name in TABLES:
            (out / f"{name}.md").unlink()
        assert reproduce.main(["--reuse-measurements", "--out", str(out), "--device", "cpu"]) == 0
        assert {name: (out / f"{name}.md").read_text() for name in TABLES} == first
