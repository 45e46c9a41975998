"""A tool started as a file, as a newcomer first tries it, answers with one line and exit code 2
(tests/unit/tools/test_run_as_file.py checks every tool in-process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("cwd, tool, args, expected", [
    (".", "estimate", ["--preset", "70b"], "python -m tools.estimate --preset 70b"),
    ("elsewhere", "evaluate", ["runs/tiny"], f"cd {ROOT} && python -m tools.evaluate runs/tiny"),
])
def test_a_tool_started_as_a_file_answers_in_one_line(tmp_path, cwd, tool, args, expected):
    where = ROOT if cwd == "." else tmp_path
    done = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *args], cwd=where,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"error: the tools run as modules from the repository root: {expected}"]
