"""Which profiled names are communication, and which collective each names: the one classifier that
the trace summary (tools/trace_summary.py) and the bottleneck doctor (analysis/doctor.py) use.

A name is communication when it comes from a communication library or from torch's collective ops:

- NCCL/RCCL kernels (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, ``ncclKernel_SendRecv...``) and
  ProcessGroupNCCL's ranges (``nccl:all_reduce``); gloo's ranges (``gloo:all_to_all``);
- c10d ops (``c10d::allreduce_``, ``c10d::send``), the functional collectives
  (``_c10d_functional::all_gather_into_tensor``, ``..._autograd::...``), DTensor's
  ``_dtensor::shard_dim_alltoall``, and ``record_param_comms``, the range torch records around
  each collective it issues;
- FSDP2's ranges that issue a collective or wait for one (``FSDP::all_gather``,
  ``FSDP::all_gather_copy_out``, ``FSDP::post_backward_reduce``, ``FSDP::post_backward_rs_wait``):
  on a backend whose work runs asynchronously (gloo) the wait for the gather is inside copy-out and
  is seen nowhere else.

Not communication: other ops whose names only resemble a collective (``aten::broadcast_tensors``,
``aten::scatter_add_``, FSDP2's copy-in ``fsdp::all_gather_copy_in``) and the two helper ops of the
functional collectives that move no data (``_wrap_tensor_autograd``, ``check_for_nan``).

Decided here: point-to-point sends and receives (a pipeline's activations and gradients) are
communication, kind ``send_recv``; all-to-all (``alltoall``, ``all_to_all_single``, expert and
context parallelism) is communication, kind ``all_to_all``; waits (``wait_tensor``) and barriers
are communication, since the time is spent blocked on peers. A kernel's name says the collective
only as a hint: NCCL runs all-to-all, and grouped collectives, inside SendRecv or Generic kernels.
"""

from __future__ import annotations

import re

SOURCE = re.compile(
    r"\b(?:nccl|rccl|gloo)"  # kernels and the process groups' own ranges
    r"|\b_?c10d(?:_functional(?:_autograd)?)?::"  # c10d and functional collective ops
    r"|^record_param_comms$|^_dtensor::shard_dim_alltoall"
    r"|(?-i:^FSDP::(?:all_gather|post_backward_reduce|post_backward_rs_wait))",  # FSDP2's ranges, not fsdp:: ops
    re.IGNORECASE,
)
MOVES_NO_DATA = re.compile(r"::(?:_wrap_tensor_autograd|check_for_nan)$")

# (pattern, kind), the first that matches wins: reduce-scatter before the plain reduce, FSDP2's
# reduce-scatter wait before the plain wait.
KINDS = tuple((re.compile(pattern, re.IGNORECASE), kind) for pattern, kind in (
    (r"reduce_?scatter|post_backward_r(?:educe|s_wait)", "reduce_scatter"),
    (r"all_?reduce", "all_reduce"),
    (r"all_?gather", "all_gather"),
    (r"all_?to_?all", "all_to_all"),
    (r"broadcast", "broadcast"),
    (r"send|recv|p2p", "send_recv"),
    (r"barrier", "barrier"),
    (r"wait", "wait"),
    (r"reduce", "reduce"),
    (r"gather", "gather"),
    (r"scatter", "scatter"),
))


def communication_kind(name: str) -> str | None:
    """The collective a profiled op, range or kernel name stands for (all_reduce, all_gather,
    reduce_scatter, all_to_all, broadcast, send_recv, barrier, wait, reduce, gather, scatter, or
    other when the name does not say), or None when it is not communication."""
    if not SOURCE.search(name) or MOVES_NO_DATA.search(name):
        return None
    return next((kind for pattern, kind in KINDS if pattern.search(name)), "other")


def is_communication(name: str) -> bool:
    return communication_kind(name) is not None
