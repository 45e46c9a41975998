"""tools/prepare_data.py run as a user runs it: --help, and bad input as one line with exit code 2."""

import subprocess
import sys


def test_cli_help_and_error_exit(tmp_path):
    run = [sys.executable, "-m", "tools.prepare_data"]
    assert "--output" in subprocess.run(run + ["--help"], capture_output=True, text=True, check=True).stdout
    bad = subprocess.run(run + [str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr
