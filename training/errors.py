"""Errors that end a run with one clear line instead of a traceback."""

from __future__ import annotations

import re

# gloo prefixes every error with its source location, e.g.
# "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer ..."
_GLOO_SOURCE = re.compile(r"\[[^\]\s]*gloo/[^\]\s]*:\d+\]\s*")


class CapabilityError(RuntimeError):
    """This machine cannot run what the config asks for (missing package, GPU or GPU feature)."""


def user_facing_errors() -> tuple[type[BaseException], ...]:
    from data.errors import DataError
    from training.checkpoint import CheckpointError
    from training.fields import ConfigError

    return (ConfigError, CheckpointError, DataError, CapabilityError)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank died, hung or dropped off the network.

    NCCL and c10d raise ``DistError`` subclasses; gloo raises a plain ``RuntimeError`` (from a
    collective's ``wait()``, or from inside DDP's backward hooks), recognisable only by the gloo
    source location its messages start with. Any other ``RuntimeError`` is a bug and keeps its
    traceback.
    """
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and _GLOO_SOURCE.search(str(exc)) is not None


def describe_peer_failure(exc: BaseException) -> str:
    """One line: what the collective reported, without gloo's source path, and what to do."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    detail = _GLOO_SOURCE.sub("", lines[-1] if lines else type(exc).__name__)
    detail = detail.split(". This is typically caused")[0]  # gloo's own advice, shortened below
    return (f"a peer rank failed or timed out (parallel.timeout_s): {detail[:300]}; see the other "
            "ranks' logs for the cause, then restart all ranks with --resume latest")
