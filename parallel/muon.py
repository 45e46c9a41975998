"""Muon for the hidden weight matrices, AdamW for everything else, in one optimizer.

Muon (Keller Jordan, 2024) replaces a matrix's update by the orthogonalised momentum: for a weight
W (fan_out x fan_in) with gradient G and momentum buffer M, each step

    M <- mu M + (1 - mu) G                      (torch.optim.Muon's and Jordan's form of momentum)
    U <- (1 - mu) G + mu M  with Nesterov, else  M
    O <- NS_k(U)                                k Newton-Schulz steps on U / ||U||_F
    W <- (1 - lr wd) W - lr s O                 s: the update scale rule

NS_k is the quintic iteration X <- a X + (b A + c A^2) X with A = X X^T, run on the wide
orientation (fewer rows than columns) so A is the smaller Gram matrix. Jordan's coefficients
(3.4445, -4.7750, 2.0315) push every singular value towards [0.7, 1.2] in five steps instead of
exactly 1: cheaper, and no worse for training. Scale rules (``update_scale``):
``match_rms_adamw`` s = 0.2 sqrt(max(A, B)) (Moonlight, Liu et al. 2025: the update's RMS becomes
AdamW's typical 0.2, so AdamW's learning rate and weight decay carry over), ``original``
s = sqrt(max(1, A / B)) (Jordan's), ``none`` s = 1. Expert stacks (E, in, out), the layout
model/moe.py stores, are orthogonalised per expert, as E matrices of fan_in x fan_out.

Which parameters go where is decided by ``parallel/optim.py`` (``muon_split``); this module steps
``muon=True`` groups with the rule above and hands the other groups to torch's own AdamW, whose
class it extends, so the AdamW part is torch.optim.AdamW exactly (same state names, same kernels).

Sharded matrices (FSDP2, tensor parallelism: DTensor parameters) need the whole matrix for
Newton-Schulz. The momentum is kept and updated shard by shard; then, per process group that
shards matrices, the matrices are taken in order of size, n at a time for n ranks, and each of
the n goes to a different owner rank (the least loaded so far, so the work spreads evenly): one
all-to-all sends every rank's pieces to their owners, each owner assembles its matrix,
orthogonalises it, and a second all-to-all sends each rank its piece of the result. A rank sends
and receives 2 (n - 1) / n^2 of the matrix bytes per matrix on average, n/2 times less than
all-gathering every matrix everywhere, and computes 1/n of the Newton-Schulz work. Pieces travel
in the Newton-Schulz dtype (bf16 by default: the first thing the iteration does is cast to it).
Where each rank's piece sits in the whole matrix comes from DTensor's own split, run once on
small index tensors, so any placement DTensor makes (FSDP2's dim-0 shards, tensor parallelism's
row or column shards, and the two combined, strided included) assembles correctly. Expert stacks
sharded on their expert dimension only (expert parallelism, FSDP2 over experts) hold whole
experts on every rank and are orthogonalised where they are, with no communication; replicated
parameters (one process, DDP) likewise. Bytes sent are counted per step (``pop_comm_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from common.values import is_dtensor, local_shard

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SCALE_RULES = ("match_rms_adamw", "original", "none")
JORDAN_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # floor of ||U||_F: a zero momentum stays zero instead of becoming NaN


def matrix_dims(shape: Sequence[int]) -> tuple[int, int]:
    """(fan_out, fan_in) of a weight Muon steps: nn.Linear's (out, in), or one expert of an (E, in, out) stack."""
    if len(shape) == 2:
        return shape[0], shape[1]
    if len(shape) == 3:
        return shape[2], shape[1]
    raise ValueError(f"Muon steps matrices and expert stacks, not a tensor of shape {tuple(shape)}")


def update_scale(rule: str, fan_out: int, fan_in: int) -> float:
    """The factor s of the update of a fan_out x fan_in matrix (see the module docstring)."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if rule == "original":
        return math.sqrt(max(1, fan_out / fan_in))
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown Muon scale rule {rule!r}; choose one of {SCALE_RULES}")


def newton_schulz(u: torch.Tensor, steps: int, coefficients: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """U (m, n), or a stack (E, m, n) orthogonalised per matrix -> NS_k(U) in ``dtype``."""
    a, b, c = coefficients
    x = u.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    batched = x.ndim == 3
    norm = x.norm(dim=(-2, -1), keepdim=True) if batched else x.norm()
    x = x / norm.clamp(min=NS_EPS)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.mT
        if batched:
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


# --------------------------------------------------------------------------- where the pieces of a matrix live


Index = slice | torch.Tensor  # the rows (or columns) of the whole matrix a piece covers


@dataclass
class Spread:
    """A matrix sharded over a process group: each group rank's piece, as (rows, columns) of the whole."""

    group: dist.ProcessGroup
    rank: int  # this rank's index in the group
    shape: tuple[int, int]
    pieces: list[tuple[Index, Index]]  # per group rank
    owner: int = -1  # the group rank that orthogonalises it (``assign_owners``)

    def piece_shape(self, rank: int) -> tuple[int, int]:
        return tuple(_length(index, size) for index, size in zip(self.pieces[rank], self.shape))

    def piece_numel(self, rank: int) -> int:
        rows, cols = self.piece_shape(rank)
        return rows * cols

    @property
    def cost(self) -> int:
        """Newton-Schulz work, up to a constant: the Gram matrix is min(m, n)^2 x max(m, n)."""
        m, n = self.shape
        return m * n * min(m, n)


def _length(index: Index, size: int) -> int:
    return len(range(size)[index]) if isinstance(index, slice) else index.numel()


def _as_index(values: list[int], device: torch.device) -> Index:
    """A contiguous run as a slice (plain Shard placements), anything else as an index tensor."""
    if not values:
        return slice(0, 0)
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, dtype=torch.long, device=device)


def held_indices(shape: Sequence[int], mesh, placements) -> list[list[int]]:
    """Per dimension of a DTensor of global ``shape``, the indices of it this rank holds.

    DTensor splits each dimension independently, so its own split of a small index tensor per
    dimension (that dimension's indices, the others as short as the split allows) tells where the
    local piece sits, for every placement it makes. ``src_data_rank=None``: split locally, send nothing."""
    from torch.distributed.tensor import distribute_tensor

    ways = [1] * len(shape)  # the ranks splitting each dimension
    for placement, size in zip(placements, mesh.shape):
        if hasattr(placement, "dim"):  # Shard and _StridedShard (which torch does not count as is_shard)
            ways[placement.dim] *= size
    held = []
    for d, size in enumerate(shape):
        proxy_shape = [size if e == d else ways[e] for e in range(len(shape))]
        view = [size if e == d else 1 for e in range(len(shape))]
        proxy = torch.arange(size, device=mesh.device_type).view(view).expand(proxy_shape).contiguous()
        local = distribute_tensor(proxy, mesh, placements, src_data_rank=None).to_local()
        held.append(local.movedim(d, 0).reshape(local.shape[d], -1)[:, 0].tolist() if local.numel() else [])
    return held


def spread_of(param: torch.Tensor, groups: dict[tuple[int, ...], dist.ProcessGroup]) -> Spread | None:
    """How a Muon matrix is spread over ranks: None when this rank holds whole matrices (a plain
    tensor, a replicated DTensor, an expert stack split only over its experts). A collective on the
    matrix's group the first time (the ranks exchange where their pieces sit). ``groups``: process
    groups made so far for several mesh dimensions together, by member ranks."""
    if not is_dtensor(param):
        return None
    mesh, placements = param.device_mesh, param.placements
    shard_dims = [i for i, p in enumerate(placements) if hasattr(p, "dim")]
    if all(placements[i].dim < param.ndim - 2 for i in shard_dims):
        return None
    if param.ndim != 2:
        raise ValueError(f"Muon cannot orthogonalise a {tuple(param.shape)} expert stack split along its matrices "
                         f"({placements}); only a split over experts keeps each expert whole on its rank")
    group = _group_over(mesh, shard_dims, groups)
    rows, cols = held_indices(param.shape, mesh, placements)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rows, cols), group=group)
    device = local_shard(param).device
    pieces = [(_as_index(r, device), _as_index(c, device)) if r and c else (slice(0, 0), slice(0, 0))
              for r, c in everyone]
    spread = Spread(group, dist.get_rank(group), tuple(param.shape), pieces)
    if spread.piece_shape(spread.rank) != tuple(local_shard(param).shape):
        raise RuntimeError(f"Muon placed this rank's {tuple(local_shard(param).shape)} shard of a {tuple(param.shape)} "
                           f"matrix as {spread.piece_shape(spread.rank)} ({placements})")
    return spread


def _group_over(mesh, dims: list[int], groups: dict[tuple[int, ...], dist.ProcessGroup]) -> dist.ProcessGroup:
    """The process group of the ranks that differ from this one only along mesh dimensions ``dims``."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    coordinate = mesh.get_coordinate()
    select = tuple(slice(None) if i in dims else coordinate[i] for i in range(mesh.ndim))
    members = tuple(mesh.mesh[select].flatten().tolist())
    if members not in groups:  # every member gets here with the same members, the others never
        groups[members] = dist.new_group(list(members), use_local_synchronization=True)
    return groups[members]


def assign_owners(spreads: list[Spread]) -> list[list[Spread]]:
    """Rounds of at most n matrices of one group, largest first, each owned by a different rank:
    the round's largest goes to the rank with the least work so far (ties: the lower rank)."""
    if not spreads:
        return []
    n = dist.get_world_size(spreads[0].group)
    order = sorted(spreads, key=lambda s: -s.cost)  # stable: model order among equals
    load = [0] * n
    rounds = []
    for start in range(0, len(order), n):
        batch = order[start:start + n]
        for spread, owner in zip(batch, sorted(range(n), key=lambda r: (load[r], r))):
            spread.owner = owner
            load[owner] += spread.cost
        rounds.append(batch)
    return rounds


def _put(whole: torch.Tensor, index: tuple[Index, Index], piece: torch.Tensor) -> None:
    rows, cols = index
    if isinstance(rows, slice) and isinstance(cols, slice):
        whole[rows, cols] = piece
    elif isinstance(rows, slice):
        whole[rows].index_copy_(1, cols, piece)  # whole[rows] is a view: the copy lands in whole
    elif isinstance(cols, slice):
        whole[:, cols].index_copy_(0, rows, piece)
    else:
        whole[rows[:, None], cols] = piece


def _take(whole: torch.Tensor, index: tuple[Index, Index]) -> torch.Tensor:
    rows, cols = index
    rows_taken = whole[rows] if isinstance(rows, slice) else whole.index_select(0, rows)
    return rows_taken[:, cols] if isinstance(cols, slice) else rows_taken.index_select(1, cols)


def orthogonalise_round(batch: list[Spread], pieces: list[torch.Tensor], orthogonalise) -> tuple[list[torch.Tensor], int]:
    """One round: this rank's ``pieces`` of the ``batch`` matrices (in the Newton-Schulz dtype) to
    their owners, ``orthogonalise`` (whole matrix -> result) on the one this rank owns, the results'
    pieces back. Returns this rank's piece of each result, and the bytes this rank sent."""
    group, me = batch[0].group, batch[0].rank
    n = dist.get_world_size(group)
    by_owner = {spread.owner: i for i, spread in enumerate(batch)}
    empty = pieces[0].new_empty(0)
    send = [pieces[by_owner[d]].reshape(-1) if d in by_owner else empty for d in range(n)]
    send_splits = [t.numel() for t in send]
    mine = batch[by_owner[me]] if me in by_owner else None
    recv_splits = [mine.piece_numel(s) if mine is not None else 0 for s in range(n)]
    received = empty.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, torch.cat(send), recv_splits, send_splits, group=group)
    back = [empty]
    if mine is not None:
        whole = empty.new_empty(mine.shape)
        for s, chunk in enumerate(received.split(recv_splits)):
            _put(whole, mine.pieces[s], chunk.view(mine.piece_shape(s)))
        result = orthogonalise(whole)
        back = [_take(result, mine.pieces[s]).reshape(-1) for s in range(n)]
    results = torch.empty(sum(send_splits), dtype=back[0].dtype if mine is not None else empty.dtype,
                          device=empty.device)
    dist.all_to_all_single(results, torch.cat(back), send_splits, recv_splits, group=group)
    out = list(results.split(send_splits))
    sent = sum(k for d, k in enumerate(send_splits) if d != me) + sum(k for s, k in enumerate(recv_splits) if s != me)
    return [out[spread.owner].view(piece.shape) for spread, piece in zip(batch, pieces)], sent * empty.element_size()


# --------------------------------------------------------------------------- the optimizer


class Muon(torch.optim.AdamW):
    """Muon on the parameter groups marked ``muon=True``, torch's AdamW on the others.

    A Muon group's keys: ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_steps``,
    ``ns_coefficients`` (a, b, c), ``ns_dtype`` ("bf16" or "fp32") and ``scale`` (a rule of
    ``SCALE_RULES``). State per Muon matrix: ``momentum_buffer`` (shaped and sharded like the
    parameter, so DCP saves and reshards it like AdamW's moments) and a ``step`` count."""

    def __init__(self, param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
        for group in param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                for p in group["params"]:
                    matrix_dims(p.shape)  # a vector or a 4-D tensor is refused here, not mid-step
        super().__init__(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        self._plan: tuple[dict[int, Spread], list[list[Spread]]] | None = None
        self._groups_made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._bytes_sent = 0

    def pop_comm_bytes(self) -> int:
        """Bytes this rank sent to orthogonalise sharded matrices since the last call."""
        sent, self._bytes_sent = self._bytes_sent, 0
        return sent

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_groups = [g for g in self.param_groups if g["muon"]]
        if muon_groups:
            self._muon_step(muon_groups)
        # AdamW steps the parameters that have a gradient: the Muon matrices' are hidden from it.
        hidden = [(p, p.grad) for g in muon_groups for p in g["params"] if p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            super().step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        entries = []  # (param, group, this rank's piece of U in the Newton-Schulz dtype)
        for group in groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if is_dtensor(grad) and grad.placements != p.placements:
                    grad = grad.redistribute(placements=p.placements)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    # a step count as AdamW keeps one: torch's Adam expects it in every state it loads
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                g, m = local_shard(grad), local_shard(state["momentum_buffer"])
                m.lerp_(g, 1 - mu)
                u = g.lerp(m, mu) if group["nesterov"] else m
                entries.append((p, group, u.to(NS_DTYPES[group["ns_dtype"]])))
        updates = self._orthogonalise(entries, self._spreads(groups))
        for (p, group, _), update in zip(entries, updates):
            lr = group["lr"]
            local = local_shard(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-(lr * update_scale(group["scale"], *matrix_dims(p.shape))))

    def _spreads(self, groups: list[dict]) -> tuple[dict[int, Spread], list[list[Spread]]]:
        """Every sharded Muon matrix's spread (by id of the parameter) and the rounds they are
        orthogonalised in; made on the first step, a collective of each group's ranks, which hold
        the same matrices in the same order."""
        if self._plan is None:
            spreads, by_group = {}, {}
            for p in (p for group in groups for p in group["params"]):
                spread = spread_of(p, self._groups_made)
                if spread is not None:
                    spreads[id(p)] = spread
                    by_group.setdefault(id(spread.group), []).append(spread)
            self._plan = spreads, [batch for members in by_group.values() for batch in assign_owners(members)]
        return self._plan

    def _orthogonalise(self, entries: list[tuple[torch.Tensor, dict, torch.Tensor]],
                       plan: tuple[dict[int, Spread], list[list[Spread]]]) -> list[torch.Tensor]:
        """NS_k of each entry's U: where it lies whole, here; a sharded one in its round."""
        spreads, rounds = plan
        out, by_spread = {}, {}
        for p, group, u in entries:
            if id(p) in spreads:
                by_spread[id(spreads[id(p)])] = (p, group, u)
            else:
                out[id(p)] = newton_schulz(u, group["ns_steps"], group["ns_coefficients"], NS_DTYPES[group["ns_dtype"]])
        for batch in rounds:
            if any(id(spread) not in by_spread for spread in batch):
                raise RuntimeError("a sharded Muon matrix has no gradient on this rank; every rank of its group "
                                   "must step the same matrices")
            members = [by_spread[id(spread)] for spread in batch]
            _, group, _ = members[0]  # one Newton-Schulz setting per optimizer (parallel/optim.py)
            results, sent = orthogonalise_round(
                batch, [u for _, _, u in members],
                lambda whole: newton_schulz(whole, group["ns_steps"], group["ns_coefficients"], whole.dtype))
            self._bytes_sent += sent
            out.update((id(p), result) for (p, _, _), result in zip(members, results))
        return [out[id(p)] for p, _, _ in entries]
