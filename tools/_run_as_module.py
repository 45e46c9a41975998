"""What a tool does when it is started as a file (``python tools/estimate.py``) instead of as a module:
one line saying how to run it, and exit code 2, instead of a ModuleNotFoundError traceback.

Started as a file, Python puts ``tools/`` first on the import path instead of the repository root,
so the project's packages (``common``, ``model``, ...) cannot be imported. Each tool checks, before
its imports, whether it has a package (``__package__`` is ``tools`` under ``python -m tools.<name>``,
torchrun's ``-m`` and an import, and empty for a file); only when it has none does it import this
module, which is then found next to it and uses the standard library only.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import NoReturn


def usage_line(tool_file: str, args: list[str], cwd: Path) -> str:
    """The command that runs ``tool_file`` with ``args``: as a module, from the repository root."""
    tool = Path(tool_file).resolve()
    root = tool.parents[1]
    command = shlex.join(["python", "-m", f"tools.{tool.stem}", *args])
    where = "" if cwd.resolve() == root else f"cd {shlex.quote(str(root))} && "
    return f"error: the tools run as modules from the repository root: {where}{command}"


def exit_with_usage(tool_file: str) -> NoReturn:
    print(usage_line(tool_file, sys.argv[1:], Path.cwd()), file=sys.stderr)
    raise SystemExit(2)
