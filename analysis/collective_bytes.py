"""Bytes a rank sends in collectives and point-to-point ops, counted from the tensors they are handed,
and grouped by the mesh dimension of their process group.

``CommBytes`` is a dispatch mode: while it is active it sees every op that reaches the dispatcher,
so both the c10d ops that torch.distributed's Python calls issue (DDP, FSDP2, DeepSpeed, the
pipeline's sends) and the functional collectives DTensor issues when it redistributes (tensor
parallelism). Each op it prices (``PRICES``) adds, under (process group, collective), the bytes
this rank sends by the convention of the estimator's formulas (analysis/estimator.CommVolume):

- all-reduce over n ranks: 2(n-1)/n of the tensor; all-gather and reduce-scatter: (n-1)/n of the
  whole (gathered) tensor. These are a ring's bytes, exact per rank when the pieces are equal;
  with unequal pieces (a list all-gather) they are the ranks' mean;
- all-to-all: the rows of the input this rank sends to the other ranks (its own split stays), with
  the split sizes it is given, equal splits when none are;
- broadcast: (n-1)/n of the tensor on the root, nothing elsewhere;
- send: the tensor; receives are the peers' sends and are not counted twice.

Other developers extend ``PRICES`` (op name -> pricing function) when a new collective appears;
a communication op that is neither priced nor a receive or a wait is counted in ``unpriced``, so
what a measurement leaves out can be seen.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.dims import FSDP_SHARD_CP

# Namespaces of torch's communication ops, and those of their ops that send nothing themselves.
NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")
SENDS_NOTHING = frozenset({
    "c10d::recv_", "c10d::recv_any_source_", "c10d::barrier", "c10d::monitored_barrier_", "c10d::check_for_nan",
    "_c10d_functional::irecv", "_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd",
})

Priced = tuple[str, float]  # (collective, bytes this rank sends)
Pricer = Callable[[dict, dist.ProcessGroup], "Priced | None"]


def ring_bytes_sent(kind: str, whole: float, n: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal (ring) collective over ``n`` ranks on a ``whole``-byte
    tensor: what the estimator's formulas count (analysis/estimator.CommVolume.sent_per_gpu)."""
    if kind == "send":
        return whole
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    return 2 * frac * whole if kind == "all_reduce" else frac * whole


def _nbytes(value) -> int:
    """Bytes of a tensor, or of the tensors in (nested) lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# --------------------------------------------------------------------------- pricing, by argument name


def _ring(kind: str, arg: str, per_rank: bool = False) -> Pricer:
    """A ring collective on the tensors of ``arg``: the whole tensor, or (``per_rank``) this rank's piece of it."""
    def price(args: dict, group: dist.ProcessGroup) -> Priced:
        whole = _nbytes(args[arg]) * (group.size() if per_rank else 1)
        return kind, ring_bytes_sent(kind, whole, group.size())
    return price


def all_to_all_bytes_sent(inputs: torch.Tensor | list[torch.Tensor], input_split_sizes, rank: int, n: int) -> float:
    """Bytes this rank sends in an all-to-all: everything but the part that stays with it.

    ``inputs`` is one tensor split along dim 0 by ``input_split_sizes`` (rows per destination rank;
    empty or None: n equal parts), or a list with one tensor per destination rank."""
    if isinstance(inputs, (list, tuple)):
        return float(sum(_nbytes(t) for peer, t in enumerate(inputs) if peer != rank))
    whole = _nbytes(inputs)
    rows = inputs.shape[0] if inputs.dim() else 1
    if not rows:
        return 0.0
    own_rows = int(input_split_sizes[rank]) if input_split_sizes else rows / n
    return whole - whole * own_rows / rows


def _all_to_all(arg: str, splits: str | None) -> Pricer:
    def price(args: dict, group: dist.ProcessGroup) -> Priced:
        split_sizes = args.get(splits) if splits else None
        return "all_to_all", all_to_all_bytes_sent(args[arg], split_sizes, group.rank(), group.size())
    return price


def _broadcast(arg: str, root: str) -> Pricer:
    def price(args: dict, group: dist.ProcessGroup) -> Priced | None:
        if args.get(root, 0) != group.rank():
            return None  # only the root sends in the pipelined broadcast counted here
        return "broadcast", ring_bytes_sent("broadcast", _nbytes(args[arg]), group.size())
    return price


def _send(arg: str) -> Pricer:
    return lambda args, group: ("send", float(_nbytes(args[arg])))


def _batch_p2p(args: dict, group: dist.ProcessGroup) -> Priced:
    sent = [t for op, t in zip(args["op_list"], args["tensors"]) if op == "isend"]
    return "send", float(_nbytes(sent))


# Op (namespace::name) -> its price. c10d ops are what torch.distributed's calls dispatch to;
# _c10d_functional ops are DTensor's and the functional collectives' (their autograd variants
# dispatch to these in forward and backward); _dtensor::shard_dim_alltoall is DTensor's
# Shard(i) -> Shard(j) on a backend with all-to-all.
PRICES: dict[str, Pricer] = {
    "c10d::allreduce_": _ring("all_reduce", "tensors"),
    "c10d::allreduce_coalesced_": _ring("all_reduce", "tensors"),
    "c10d::_allgather_base_": _ring("all_gather", "output_tensor"),
    "c10d::allgather_": _ring("all_gather", "output_tensors"),  # n pieces per input
    "c10d::allgather_coalesced_": _ring("all_gather", "output_lists"),
    "c10d::allgather_into_tensor_coalesced_": _ring("all_gather", "outputs"),
    "c10d::_reduce_scatter_base_": _ring("reduce_scatter", "input_tensor"),
    "c10d::reduce_scatter_": _ring("reduce_scatter", "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": _ring("reduce_scatter", "inputs"),
    "c10d::alltoall_base_": _all_to_all("input", "input_split_sizes"),
    "c10d::alltoall_": _all_to_all("input_tensors", None),
    "c10d::broadcast_": _broadcast("tensors", "root_rank"),
    "c10d::send": _send("tensors"),
    "_c10d_functional::all_reduce": _ring("all_reduce", "input"),
    "_c10d_functional::all_reduce_": _ring("all_reduce", "input"),
    "_c10d_functional::all_reduce_coalesced": _ring("all_reduce", "inputs"),
    "_c10d_functional::all_reduce_coalesced_": _ring("all_reduce", "inputs"),
    "_c10d_functional::all_gather_into_tensor": _ring("all_gather", "input", per_rank=True),
    "_c10d_functional::all_gather_into_tensor_out": _ring("all_gather", "input", per_rank=True),
    "_c10d_functional::all_gather_into_tensor_coalesced": _ring("all_gather", "inputs", per_rank=True),
    "_c10d_functional::reduce_scatter_tensor": _ring("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_out": _ring("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": _ring("reduce_scatter", "inputs"),
    "_c10d_functional::all_to_all_single": _all_to_all("input", "input_split_sizes"),
    "_c10d_functional::broadcast": _broadcast("input", "src"),
    "_c10d_functional::broadcast_": _broadcast("input", "src"),
    "_c10d_functional::isend": _send("tensor"),
    "_c10d_functional::batch_p2p_ops": _batch_p2p,
    "_dtensor::shard_dim_alltoall": _all_to_all("input", None),
}


# --------------------------------------------------------------------------- the counter


class CommBytes(TorchDispatchMode):
    """Bytes this rank sends per (process group name, collective) while active, and the calls.

    For a DTensor op it steps aside (NotImplemented, as torch's CommDebugMode does) so that DTensor
    lowers it first and the collectives it issues come back through this mode. The ops a priced op
    runs inside are not seen (the mode is off while its handler runs), so nothing is counted twice."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[tuple[str, str], float] = {}  # (process group name, collective) -> bytes
        self.calls: dict[tuple[str, str], int] = {}
        self.unpriced: dict[str, int] = {}  # communication ops seen but not in PRICES -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        namespace = getattr(func, "namespace", "")
        if namespace not in NAMESPACES:
            return
        name = func._schema.name
        price = PRICES.get(name)
        if price is None:
            if name not in SENDS_NOTHING:
                self.unpriced[name] = self.unpriced.get(name, 0) + 1
            return
        named = {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}
        group = _group_of(named)
        priced = price(named, group) if group is not None else None
        if priced is None:
            return
        kind, nbytes = priced
        key = (group.group_name, kind)
        self.sent[key] = self.sent.get(key, 0.0) + nbytes
        self.calls[key] = self.calls.get(key, 0) + 1


def _group_of(named: dict) -> dist.ProcessGroup | None:
    """The process group of an op: c10d's ``process_group`` (boxed) or a functional op's ``group_name``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = named.get("process_group", named.get("group_name"))
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        return _resolve_process_group(group)
    return None


# --------------------------------------------------------------------------- by mesh dimension


def dimension_of_groups(mesh) -> dict[str, str]:
    """Process group name -> the mesh dimension that owns it; the data-parallel dimensions
    (dp_shard, dp_replicate, and edp, the ranks holding the same experts) are all "dp"."""
    names: dict[str, str] = {}
    if mesh is not None:
        dims = tuple(mesh.mesh_dim_names or ())
        for dim in dims:
            names.setdefault(mesh.get_group(dim).group_name, "dp" if dim.startswith("dp_") or dim == "edp" else dim)
        # build_mesh flattens dp_shard x cp into FSDP2's shard dimension, and edp x ep back into
        # dp_shard for the dense weights: data parallel too
        flattened = [name for parts, name in (({"dp_shard", "cp"}, FSDP_SHARD_CP), ({"edp", "ep"}, "dp_shard"))
                     if parts <= set(dims)]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flattened dim from root mesh.*")
            for name in flattened:
                names.setdefault(mesh[name].get_group().group_name, "dp")
    return names


def bytes_by_dimension(counter: CommBytes, mesh) -> tuple[dict[str, float], dict[str, list]]:
    """Bytes sent per mesh dimension, and per "<dimension> <collective>": [calls, bytes].

    A group outside the mesh is data parallel when every dimension of the mesh is (DDP and
    DeepSpeed reduce over the default group or groups of their own), otherwise "other". The ep
    ranks are data-parallel ranks too: only their all-to-alls (expert dispatch and combine) are
    "ep"; anything else on the ep group is FSDP2 sharding the dense weights over it, "dp"."""
    names = dimension_of_groups(mesh)
    outside = "dp" if all(dim in ("dp", "ep") for dim in names.values()) else "other"
    totals: dict[str, float] = {}
    detail: dict[str, list] = {}
    for (group, kind), nbytes in sorted(counter.sent.items()):
        dim = names.get(group, outside)
        if dim == "ep" and kind != "all_to_all":
            dim = "dp"
        totals[dim] = totals.get(dim, 0.0) + nbytes
        entry = detail.setdefault(f"{dim} {kind}", [0, 0.0])
        entry[0] += counter.calls[(group, kind)]
        entry[1] += nbytes
    return totals, detail
