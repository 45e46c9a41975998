"""Every command block of docs/data.md runs as written, in order, from the root of a copy of the
repository (so the runs and the prepared data it writes stay out of the checkout)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(3600)  # five short runs and a preparation: minutes on a quiet machine, far more on a busy one
def test_the_data_guide_runs_as_written(tmp_path):
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "data.md").read_text(), re.S)
    assert len(blocks) >= 5
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", "runs", "prepared", "__pycache__", ".pytest_cache"))
    for block in blocks:
        done = subprocess.run(["bash", "-e", "-c", block], cwd=repo, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        for line in block.splitlines():
            if line.startswith("python train.py"):
                assert "done: 20 steps" in done.stdout, block
