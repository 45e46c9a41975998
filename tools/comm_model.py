"""Alpha-beta estimate of one gradient all-reduce: flat ring vs leader-based vs two-level, and
where gradient compression stops paying (analysis/comm_model.py holds the formulas).

The default topology is the chapter's 64-GPU example (section 8.3): 8 nodes x 8 H100, NVLink
inside a node, InfiniBand between nodes at the 100 GB/s its diagram draws, with one NIC per GPU.
The chapter gives no latencies and no message size: 1 us per NVLink step and 5 us per network
step are assumptions, and three message sizes are shown (1 MB latency-bound, 25 MB = one DDP
bucket, 1000 MB a whole model's gradients). A DGX H100 has 400 Gb/s NDR NICs: --inter-gbs 50.

Examples:
  python -m tools.comm_model                                    # the chapter's 64-GPU example
  python -m tools.comm_model --nodes 32 --inter-gbs 50 --message-mb 100
  python -m tools.comm_model --markdown docs/comm_model.md --plot docs/comm_model.png
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

from analysis import comm_model as cm
from common.hardware import DEVICES
from common.report import human_bytes, markdown_table, new_figure, save_figure, text_table

CHAPTER_FLAT_RING_STEPS = 63  # "需要 63 步才能完成一圈" in the chapter's diagram


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8)")
    p.add_argument("--nodes", type=int, default=8, help="number of nodes (default 8)")
    p.add_argument(
        "--intra-gbs",
        type=float,
        default=DEVICES["H100"].nvlink_one_way_gb_s,
        help="intra-node GB/s per GPU, one direction (default: H100 NVLink 450; the '900' is both directions)",
    )
    p.add_argument(
        "--inter-gbs", type=float, default=100.0, help="inter-node GB/s per GPU NIC (default: the chapter's 100)"
    )
    p.add_argument("--intra-latency-us", type=float, default=1.0, help="latency per intra-node step, us (assumed 1)")
    p.add_argument("--inter-latency-us", type=float, default=5.0, help="latency per inter-node step, us (assumed 5)")
    p.add_argument(
        "--message-mb", type=float, nargs="+", default=[1.0, 25.0, 1000.0],
        help="bytes all-reduced per GPU, in MB (1e6); several values give several blocks",
    )
    p.add_argument(
        "--densities", type=float, nargs="+", default=[0.01, 0.001], help="top-k densities for the compression table"
    )
    p.add_argument("--markdown", type=Path, help="also write the tables as Markdown to this file")
    p.add_argument("--plot", type=Path, help="write a PNG of all-reduce time vs message size")
    args = p.parse_args(argv)
    try:
        args.topology = cm.Topology(
            args.gpus_per_node, args.nodes, args.intra_gbs, args.inter_gbs, args.intra_latency_us, args.inter_latency_us
        )
    except ValueError as exc:
        p.error(str(exc))
    if any(m <= 0 for m in args.message_mb) or any(not 0 < d <= 1 for d in args.densities):
        p.error("--message-mb must be > 0 and --densities in (0, 1]")
    return args


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def allreduce_rows(top: cm.Topology, messages_mb: list[float]) -> tuple[list[str], list[list[str]]]:
    headers = ["message", "algorithm", "steps", "NICs busy/node", "bytes per busy NIC", "latency ms", "bandwidth ms",
               "total ms", "vs flat ring"]  # fmt: skip
    rows = []
    for mb in messages_mb:
        costs = cm.all_algorithms(top, mb * 1e6)
        flat = costs[0].total_s
        for c in costs:
            rows.append(
                [f"{mb:g} MB", c.algorithm, str(c.steps), str(c.nics_per_node), human_bytes(c.inter_bytes_per_gpu),
                 _ms(c.latency_s), _ms(c.bandwidth_s), _ms(c.total_s), f"{flat / c.total_s:.2f}x"]
            )  # fmt: skip
    return headers, rows


def chapter_checks(top: cm.Topology) -> list[str]:
    flat, ours = cm.flat_ring(top, 1.0), cm.two_level(top, 1.0)
    lines = [
        f"flat ring over {top.world} GPUs: chapter says {CHAPTER_FLAT_RING_STEPS} steps; a ring all-reduce is "
        f"reduce-scatter + all-gather = 2*({top.world}-1) = {flat.steps} steps "
        f"(63 is one trip round the ring, i.e. half of it)" if top.world == 64 else
        f"flat ring over {top.world} GPUs: 2*({top.world}-1) = {flat.steps} steps",
        f"two-level: 2*({top.gpus_per_node}-1) intra + 2*({top.nodes}-1) inter = {ours.steps} steps; inter-node bytes "
        f"per GPU 2(N-1)/N * M/L = {ours.inter_bytes_per_gpu:.4f} M, vs {flat.inter_bytes_per_gpu:.4f} M through one "
        "NIC per node for a single flat ring",
        "NVLink '900 GB/s' is the bidirectional total per GPU; a ring step sends one way: "
        f"{top.intra_gb_s:g} GB/s used",
        "the chapter's leader-only code sends the whole message through the leader's NIC: "
        f"{cm.leader_based(top, 1.0).inter_bytes_per_gpu:.4f} M per leader while {top.gpus_per_node - 1} NICs idle",
    ]
    return lines


def compression_table(top: cm.Topology, densities: list[float]) -> tuple[list[str], list[list[str]], list[str]]:
    entries = 1e9  # the ratios do not depend on it
    ranks = sorted({2, 8, top.world})
    headers = ["method", "ranks", "bytes/rank vs dense fp32 ring", "saving", "pays?"]
    rows = []
    for r in cm.compression_rows(entries, ranks, densities):
        rows.append([r.method, str(r.ranks), f"{r.bytes_per_rank / r.dense_bytes_per_rank:.3f}", f"{r.saving:.2f}x",
                     _pays(r.saving)])  # fmt: skip
    notes = [
        "top-k (int64 index + fp32 value, all-gather) breaks even at density 2/(3n): "
        + ", ".join(f"n={n}: {cm.topk_break_even_density(n):.2%}" for n in ranks),
        "with int32 indices the break-even is 1/n: "
        + ", ".join(f"n={n}: {cm.topk_break_even_density(n, 4):.2%}" for n in ranks),
        "1-bit all-gathers (n-1)*numel/8 bytes: saving ~64/n, gone at n=64 "
        "(beyond that it needs a compressed reduce-scatter instead)",
        f"PowerSGD is an all-reduce of P and Q, saving independent of n: 4096x4096 at rank 4 -> "
        f"{cm.powersgd_ratio(4096, 4096, 4):.0f}x",
    ]
    return headers, rows, notes


def _pays(saving: float) -> str:
    if saving > 1.05:
        return "yes"
    return "no" if saving < 0.95 else "break-even"


def plot(top: cm.Topology, path: Path) -> None:
    sizes = [10 ** (k / 4) for k in range(0, 4 * 4 + 1)]  # 1 MB .. 10 GB
    fig, ax = new_figure()
    names = [c.algorithm for c in cm.all_algorithms(top, 1.0)]
    for i, name in enumerate(names):
        ax.loglog(sizes, [cm.all_algorithms(top, mb * 1e6)[i].total_s * 1e3 for mb in sizes], label=name)
    ax.set_xlabel("message per GPU (MB)")
    ax.set_ylabel("all-reduce time (ms), alpha-beta model")
    ax.set_title(f"{top.nodes} nodes x {top.gpus_per_node} GPUs, {top.intra_gb_s:g}/{top.inter_gb_s:g} GB/s")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    top = args.topology
    assumptions = (
        f"{top.nodes} nodes x {top.gpus_per_node} GPUs = {top.world}; intra {top.intra_gb_s:g} GB/s one way, "
        f"{top.intra_latency_us:g} us/step; inter {top.inter_gb_s:g} GB/s per GPU NIC, "
        f"{top.inter_latency_us:g} us/step; "
        "peak bandwidths (no efficiency factor), ring algorithms"
    )
    headers, rows = allreduce_rows(top, args.message_mb)
    checks = chapter_checks(top)
    c_headers, c_rows, c_notes = compression_table(top, args.densities)

    print(f"All-reduce cost model: {assumptions}\n")
    print(text_table(headers, rows))
    print("\nChecks against the chapter's 8.3 example:")
    print("\n".join(f"  - {line}" for line in checks))
    print("\nGradient compression, bytes on the wire per rank (dense fp32 ring all-reduce = 1):\n")
    print(text_table(c_headers, c_rows))
    print("\n".join(f"  - {line}" for line in c_notes))

    if args.markdown:
        md = [
            "# All-reduce cost model (alpha-beta)", "", f"Assumptions: {assumptions}.", "",
            markdown_table(headers, rows), "", "## Checks against the chapter", "",
            *[f"- {line}" for line in checks], "", "## Gradient compression", "",
            markdown_table(c_headers, c_rows), "", *[f"- {line}" for line in c_notes], "",
        ]  # fmt: skip
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(md))
        print(f"\nwrote {args.markdown}")
    if args.plot:
        plot(top, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
