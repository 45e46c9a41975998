"""Alpha-beta cost of all-reduce on a two-level cluster, and where gradient compression pays.

A message of b bytes over a link costs alpha + b / beta (alpha: per-step latency, beta:
bandwidth in one direction). Per-rank figures, M = bytes each rank all-reduces, N nodes of L GPUs,
p = N * L:

- flat ring (one ring through all p GPUs, the chapter's picture): reduce-scatter then
  all-gather, 2(p-1) steps of M/p each. Every step waits for the ring's slowest hop, the one
  between nodes, so T = 2(p-1) * (alpha_inter + M/(p * beta_inter)). The bandwidth term
  2(p-1)/p * M/beta barely grows with p; the latency term grows linearly. A single ring uses one
  NIC per node. (NCCL runs several rings at once, each crossing nodes on a different NIC: the
  row "flat ring xL" — then NVLink, carrying the other L-1 rings, can become the limit.)
- leader-based (the chapter's code): node all-reduce, all-reduce among node leaders, node
  broadcast. The whole M crosses the network through the leader's one NIC.
- two-level (parallel/comm.py): intra-node reduce-scatter (L-1 steps of M/L), inter-node
  all-reduce of each M/L shard among same-local-index ranks (2(N-1) steps of M/(L*N), all L
  NICs busy), intra-node all-gather (L-1 steps). Inter-node bytes per GPU: 2(N-1)/N * M/L.

Compression, dense fp32 ring all-reduce as the reference (2(p-1)/p * 4 bytes per entry):
- top-k all-gathers (index, value) pairs, (p-1) * k * (index + value) bytes: saves bytes only
  below density d* = 2 * value_dense / (p * (index + value)) -> 2/(3p) for int64 + fp32.
- 1-bit all-gathers packed signs, (p-1) * n/8 bytes (+ scales): saves ~64/p.
- PowerSGD all-reduces P (n x r) and Q (m x r) instead of an n x m matrix: nm / ((n + m) r),
  independent of p.
- bf16 all-reduce: 2x.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nodes: int
    intra_gb_s: float  # per GPU, one direction (NVLink 4: 450; datasheets quote 900 bidirectional)
    inter_gb_s: float  # per GPU NIC, one direction
    intra_latency_us: float
    inter_latency_us: float

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(
                f"topology needs gpus_per_node >= 1 and nodes >= 1, got {self.gpus_per_node}, {self.nodes}"
            )
        if min(self.intra_gb_s, self.inter_gb_s) <= 0 or min(self.intra_latency_us, self.inter_latency_us) < 0:
            raise ValueError("bandwidths must be > 0 and latencies >= 0")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class AllReduceCost:
    algorithm: str
    steps: int  # sequential communication steps (each pays one latency)
    inter_bytes_per_gpu: float  # bytes each busy NIC sends (leader-based, single ring: one per node)
    nics_per_node: int  # NICs of a node that carry traffic
    latency_s: float
    bandwidth_s: float

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s


def _ring(p: int, message: float, alpha_s: float, beta_b_s: float) -> tuple[int, float, float]:
    """A ring all-reduce among p ranks: (steps, latency, bandwidth time); 0 for p == 1."""
    if p == 1:
        return 0, 0.0, 0.0
    steps = 2 * (p - 1)
    return steps, steps * alpha_s, steps * (message / p) / beta_b_s


def _half_ring(p: int, message: float, alpha_s: float, beta_b_s: float) -> tuple[int, float, float]:
    """A ring reduce-scatter or all-gather of a `message`-byte buffer among p ranks."""
    if p == 1:
        return 0, 0.0, 0.0
    return p - 1, (p - 1) * alpha_s, (p - 1) * (message / p) / beta_b_s


def _units(top: Topology) -> tuple[float, float, float, float]:
    return (top.intra_latency_us * 1e-6, top.intra_gb_s * 1e9, top.inter_latency_us * 1e-6, top.inter_gb_s * 1e9)


def flat_ring(top: Topology, message_bytes: float, rings: int = 1) -> AllReduceCost:
    """One ring through all GPUs, or `rings` rings at once, each leaving the node through its own NIC.

    A step moves 1/p of each ring's share. With one ring the inter-node hop sets the pace. With
    several, each GPU's NIC carries one ring's share while its NVLink carries the other rings',
    so a step lasts as long as the slower of the two.
    """
    a_in, b_in, a_out, b_out = _units(top)
    p = top.world
    if p == 1:
        return AllReduceCost("flat ring", 0, 0.0, 0, 0.0, 0.0)
    steps = 2 * (p - 1)
    chunk = message_bytes / (rings * p)  # one ring's piece per step
    if top.nodes == 1:
        alpha, per_step = a_in, rings * chunk / b_in
        inter = 0.0
    else:
        alpha = a_out
        per_step = max(chunk / b_out, (rings - 1) * chunk / b_in)
        inter = steps * chunk
    name = "flat ring" if rings == 1 else f"flat ring x{rings} (NCCL-like)"
    nics = 0 if top.nodes == 1 else rings
    return AllReduceCost(name, steps, inter, nics, steps * alpha, steps * per_step)


def leader_based(top: Topology, message_bytes: float) -> AllReduceCost:
    """The chapter's design: node all-reduce, leaders' all-reduce, node broadcast (pipelined)."""
    a_in, b_in, a_out, b_out = _units(top)
    s1, l1, w1 = _ring(top.gpus_per_node, message_bytes, a_in, b_in)
    s2, l2, w2 = _ring(top.nodes, message_bytes, a_out, b_out)
    # a pipelined broadcast down a chain: L-1 latencies, the message crosses each link once
    s3 = top.gpus_per_node - 1
    l3, w3 = s3 * a_in, (message_bytes / b_in if s3 else 0.0)
    inter = 2 * (top.nodes - 1) / top.nodes * message_bytes
    nics = 1 if top.nodes > 1 else 0
    return AllReduceCost("leader-based (chapter)", s1 + s2 + s3, inter, nics, l1 + l2 + l3, w1 + w2 + w3)


def two_level(top: Topology, message_bytes: float) -> AllReduceCost:
    """Reduce-scatter in the node, all-reduce of each shard across nodes, all-gather in the node."""
    a_in, b_in, a_out, b_out = _units(top)
    local, nodes = top.gpus_per_node, top.nodes
    s1, l1, w1 = _half_ring(local, message_bytes, a_in, b_in)
    s2, l2, w2 = _ring(nodes, message_bytes / local, a_out, b_out)
    inter = 2 * (nodes - 1) / nodes * message_bytes / local
    nics = local if nodes > 1 else 0
    return AllReduceCost("two-level (ours)", 2 * s1 + s2, inter, nics, 2 * l1 + l2, 2 * w1 + w2)


def all_algorithms(top: Topology, message_bytes: float) -> list[AllReduceCost]:
    rows = [flat_ring(top, message_bytes)]
    if top.nodes > 1 and top.gpus_per_node > 1:
        rows.append(flat_ring(top, message_bytes, rings=top.gpus_per_node))
    rows += [leader_based(top, message_bytes), two_level(top, message_bytes)]
    return rows


# --------------------------------------------------------------------------- compression


def dense_ring_bytes(entries: float, ranks: int, value_bytes: int = 4) -> float:
    """Bytes one rank sends in a ring all-reduce of `entries` values."""
    return 2 * (ranks - 1) / ranks * entries * value_bytes


def topk_allgather_bytes(
    entries: float, density: float, ranks: int, index_bytes: int = 8, value_bytes: int = 4
) -> float:
    """Bytes one rank sends all-gathering its k = density * entries (index, value) pairs."""
    return (ranks - 1) * density * entries * (index_bytes + value_bytes)


def topk_break_even_density(
    ranks: int, index_bytes: int = 8, value_bytes: int = 4, dense_value_bytes: int = 4
) -> float:
    """Density below which the sparse all-gather sends fewer bytes than a dense ring all-reduce."""
    return 2 * dense_value_bytes / (ranks * (index_bytes + value_bytes))


def onebit_allgather_bytes(entries: float, ranks: int, tensors: int = 1) -> float:
    return (ranks - 1) * (entries / 8 + 4 * tensors)


def powersgd_ratio(rows: int, cols: int, rank: int) -> float:
    """Dense entries over PowerSGD's all-reduced entries for one rows x cols matrix."""
    return rows * cols / ((rows + cols) * rank)


@dataclass(frozen=True)
class CompressionRow:
    method: str
    ranks: int
    bytes_per_rank: float
    dense_bytes_per_rank: float

    @property
    def saving(self) -> float:
        return self.dense_bytes_per_rank / self.bytes_per_rank


def compression_rows(entries: float, rank_counts: list[int], densities: list[float]) -> list[CompressionRow]:
    rows = []
    for p in rank_counts:
        dense = dense_ring_bytes(entries, p)
        for d in densities:
            rows.append(CompressionRow(f"top-k {d:.2%}", p, topk_allgather_bytes(entries, d, p), dense))
        rows.append(CompressionRow("1-bit signs", p, onebit_allgather_bytes(entries, p), dense))
        rows.append(CompressionRow("bf16", p, dense_ring_bytes(entries, p, value_bytes=2), dense))
    return rows
