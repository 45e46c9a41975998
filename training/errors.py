"""Errors that end a run with one clear line instead of a traceback."""

from __future__ import annotations


class CapabilityError(RuntimeError):
    """This machine cannot run what the config asks for (missing package, GPU or GPU feature)."""


def user_facing_errors() -> tuple[type[BaseException], ...]:
    from data.errors import DataError
    from training.checkpoint import CheckpointError
    from training.fields import ConfigError

    return (ConfigError, CheckpointError, DataError, CapabilityError)
