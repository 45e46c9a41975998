"""The alpha-beta communication model and its CLI, checked against hand-worked figures."""

from __future__ import annotations

import pytest

from analysis import comm_model as cm

CHAPTER = cm.Topology(gpus_per_node=8, nodes=8, intra_gb_s=450, inter_gb_s=100, intra_latency_us=1, inter_latency_us=5)
GB = 1e9


def test_step_counts_of_the_chapters_64_gpu_example():
    assert cm.flat_ring(CHAPTER, GB).steps == 126  # 2 x 63: reduce-scatter + all-gather, not 63
    assert cm.two_level(CHAPTER, GB).steps == 2 * 7 + 2 * 7
    assert cm.leader_based(CHAPTER, GB).steps == 2 * 7 + 2 * 7 + 7


def test_inter_node_bytes_per_gpu():
    assert cm.two_level(CHAPTER, GB).inter_bytes_per_gpu == pytest.approx(2 * 7 / 8 * GB / 8)
    assert cm.flat_ring(CHAPTER, GB).inter_bytes_per_gpu == pytest.approx(2 * 63 / 64 * GB)
    assert cm.leader_based(CHAPTER, GB).inter_bytes_per_gpu == pytest.approx(2 * 7 / 8 * GB)
    assert cm.two_level(CHAPTER, GB).nics_per_node == 8 and cm.leader_based(CHAPTER, GB).nics_per_node == 1


def test_times_worked_by_hand():
    # single ring: every one of 126 steps waits for the IB hop carrying 1/64 of the message
    flat = cm.flat_ring(CHAPTER, GB)
    assert flat.bandwidth_s == pytest.approx(126 * (GB / 64) / 100e9)
    assert flat.latency_s == pytest.approx(126 * 5e-6)
    # two-level: NVLink reduce-scatter + all-gather, then IB all-reduce of a 1/8 shard over 8 nodes
    ours = cm.two_level(CHAPTER, GB)
    assert ours.bandwidth_s == pytest.approx(2 * 7 / 8 * GB / 450e9 + 2 * 7 / 8 * (GB / 8) / 100e9)
    assert ours.latency_s == pytest.approx(14 * 1e-6 + 14 * 5e-6)
    # eight rings: NVLink carries seven rings' pieces per step, more than the NIC's one at these speeds
    multi = cm.flat_ring(CHAPTER, GB, rings=8)
    assert multi.bandwidth_s == pytest.approx(126 * 7 * (GB / 512) / 450e9)


def test_flat_ring_bandwidth_term_barely_grows_with_world_size():
    small = cm.Topology(8, 2, 450, 100, 1, 5)
    big = cm.Topology(8, 64, 450, 100, 1, 5)
    assert cm.flat_ring(big, GB).bandwidth_s / cm.flat_ring(small, GB).bandwidth_s < 1.07
    assert cm.flat_ring(big, GB).latency_s / cm.flat_ring(small, GB).latency_s > 30


def test_one_node_makes_two_level_a_plain_ring():
    node = cm.Topology(8, 1, 450, 100, 1, 5)
    assert cm.two_level(node, GB).total_s == pytest.approx(cm.flat_ring(node, GB).total_s)
    assert cm.two_level(node, GB).inter_bytes_per_gpu == 0


def test_leader_based_is_slowest_for_large_messages():
    costs = {c.algorithm: c.total_s for c in cm.all_algorithms(CHAPTER, GB)}
    assert costs["leader-based (chapter)"] == max(costs.values())
    assert costs["two-level (ours)"] < costs["flat ring"]


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_topk_break_even_is_where_the_byte_counts_cross(ranks):
    d = cm.topk_break_even_density(ranks)
    assert d == pytest.approx(2 / (3 * ranks))
    assert cm.topk_allgather_bytes(1e6, d, ranks) == pytest.approx(cm.dense_ring_bytes(1e6, ranks))


def test_compression_savings_quoted_in_the_docs():
    rows = {(r.method, r.ranks): r.saving for r in cm.compression_rows(1e9, [8, 64], [0.01])}
    assert rows[("top-k 1.00%", 8)] == pytest.approx(8.33, rel=1e-2)
    assert rows[("top-k 1.00%", 64)] == pytest.approx(1.04, rel=1e-2)  # no real saving at 64 ranks
    assert rows[("1-bit signs", 8)] == pytest.approx(8.0, rel=1e-3)
    assert rows[("bf16", 64)] == 2.0
    assert cm.powersgd_ratio(4096, 4096, 4) == 512


def test_bad_topology():
    with pytest.raises(ValueError, match="gpus_per_node"):
        cm.Topology(0, 8, 450, 100, 1, 5)


def test_cli_prints_tables_and_writes_markdown_and_plot(tmp_path, capsys):
    from tools.comm_model import main

    md, png = tmp_path / "comm.md", tmp_path / "comm.png"
    assert main(["--message-mb", "25", "--markdown", str(md), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "chapter says 63 steps" in out and "126 steps" in out and "two-level (ours)" in out
    assert "n=64: 1.04%" in out
    assert "| two-level (ours) |" not in out and "two-level (ours)" in md.read_text()
    assert png.stat().st_size > 1000


def test_cli_rejects_bad_flags():
    from tools.comm_model import main

    with pytest.raises(SystemExit):
        main(["--nodes", "0"])
