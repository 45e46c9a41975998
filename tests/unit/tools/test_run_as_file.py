"""Every tool started as a file (``python tools/<name>.py``, where the project's packages do not
import) says in one line to run it as a module from the repository root, and exits 2, before it
imports anything of the project. Here each tool runs as Python runs a file, in-process: with
``tools/`` first on the import path and no package; tests/integration/test_tools_run_as_files.py
starts a few as a user would."""

from __future__ import annotations

import runpy
import sys

import pytest

from tests.conftest import ROOT

TOOLS = sorted(p for p in (ROOT / "tools").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.stem)
def test_a_tool_started_as_a_file_says_how_to_run_it(tool, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tool.parent))  # what `python tools/<name>.py` puts first
    monkeypatch.setattr(sys, "argv", [str(tool), "--help"])  # without the check: the tool's help, exit 0
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(tool), run_name="__main__")  # a file: no package
    err = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2
    assert err == [f"error: the tools run as modules from the repository root: python -m tools.{tool.stem} --help"]


def test_the_line_names_the_root_to_change_to_and_quotes_the_arguments(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from _run_as_module import usage_line
    finally:
        sys.path.remove(str(ROOT / "tools"))
    line = usage_line(str(ROOT / "tools" / "estimate.py"), ["--preset", "70b", "--x=a b"], tmp_path)
    assert line.endswith(f"cd {ROOT} && python -m tools.estimate --preset 70b '--x=a b'")
    assert usage_line(str(ROOT / "tools" / "sample.py"), [], ROOT).endswith(": python -m tools.sample")


def test_imported_as_a_module_a_tool_does_not_stop():
    from tools import estimate

    assert estimate.__package__ == "tools" and callable(estimate.main)
