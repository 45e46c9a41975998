"""Every error that ends a run with one clear line instead of a traceback, one class per kind.

train.py and the tools catch ``USER_FACING_ERRORS`` and print the message; anything else is a
bug and keeps its traceback. Each message is one line that names the problem and the fix.
"""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A configuration value or combination that cannot work; names the key and the valid choices."""


class LayoutError(ValueError):
    """The launcher's world/node numbers, or the parallel layout, do not describe a usable layout."""


class CapabilityError(RuntimeError):
    """This machine cannot run what the config asks for (missing package, GPU or GPU feature)."""


class CheckpointError(RuntimeError):
    """A checkpoint (saved training state) that cannot be written or used; names the file and what to do."""


class DataError(ValueError):
    """A dataset problem; names the file and the fix."""


class RecomputeError(ValueError):
    """An activation-recompute policy that cannot be applied to this model; says why and what to use."""


class InteropError(ValueError):
    """Weights or a config from another framework (Hugging Face, nanoGPT) that cannot be converted,
    or a model the other layout cannot express; names the key."""


USER_FACING_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, LayoutError, CapabilityError, CheckpointError, DataError, RecomputeError, InteropError,
)

# gloo prefixes every error with its source location, e.g.
# "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer ..."
_GLOO_SOURCE = re.compile(r"\[[^\]\s]*gloo/[^\]\s]*:\d+\]\s*")
# ...except one: when an operation times out, gloo closes every pair of its context and fails the
# other operations still pending on them with this bare text (no source location). Which of a
# rank's pending collectives reports the timeout itself and which this, is a race.
_GLOO_PAIR_CLOSED = "Application timeout caused pair closure"


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank died, hung or dropped off the network.

    NCCL and c10d raise ``DistError`` subclasses; gloo raises a plain ``RuntimeError`` (from a
    collective's ``wait()``, or from inside DDP's backward hooks), recognisable only by the gloo
    source location its messages start with, or by the exact text it gives the operations a
    timeout closed. Any other ``RuntimeError`` is a bug and keeps its traceback.
    """
    import torch.distributed as dist  # torch is heavy: only paid when a run has failed

    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return _GLOO_SOURCE.search(text) is not None or _GLOO_PAIR_CLOSED in (line.strip() for line in text.splitlines())


def describe_peer_failure(exc: BaseException) -> str:
    """One line: what the collective reported, without gloo's source path, and what to do."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    detail = _GLOO_SOURCE.sub("", lines[-1] if lines else type(exc).__name__)
    detail = detail.split(". This is typically caused")[0]  # gloo's own advice, shortened below
    return (f"a peer rank failed or timed out (parallel.timeout_s): {detail[:300]}; see the other "
            "ranks' logs for the cause, then restart all ranks with --resume latest")
