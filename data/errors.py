"""The one exception type data problems are reported with."""

from __future__ import annotations


class DataError(ValueError):
    """A user-facing data problem; the message is one line naming the file and the fix."""
