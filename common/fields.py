"""Helpers every config section uses: a documented field, and the choices of a ``Literal`` field."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line help text (shown by --help-config)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def choices(section: type, key: str) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` field of a config dataclass accepts, in declaration order.

    Code that needs the list of valid values (error messages, CLI choices, estimator loops)
    reads it from the config instead of keeping a second copy that can drift.
    """
    hints = typing.get_type_hints(section)
    if key not in {f.name for f in dataclasses.fields(section)}:
        raise KeyError(f"{section.__name__} has no field {key!r}")
    tp = hints[key]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is not typing.Literal:
        raise TypeError(f"{section.__name__}.{key} is not a Literal field")
    return typing.get_args(tp)


# Parameters and optimizer states are float32 at least: a value beyond float32's range is inf
# there (or makes torch raise mid-step), although Python calls it finite.
FLOAT32_MAX = 3.4028234663852886e38


def require_finite(key: str, value: float | None, error: type[Exception]) -> None:
    """Raise ``error`` naming ``key`` unless ``value`` is None or a finite float32-range number.

    inf and nan pass comparison-based range checks (nan fails none of them), so finiteness is
    checked first wherever a value reaches the weights.
    """
    if value is not None and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise error(f"{key} must be a finite number within float32 range (got {value})")
