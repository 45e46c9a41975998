"""The two helpers every config section uses; kept apart so sections import nothing heavy."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration problem; its message is one line naming the key and the fix."""


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line help text (shown by --help-config)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
