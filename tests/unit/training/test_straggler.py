"""The straggler report's detection on fixed inputs: per-rank own times per step, as the loop
all-gathers them each log interval, with the slow rank, the ranks that waited for it and the
noise of a healthy run written out by hand. The report under torchrun, with a rank that sleeps in
its forward, is in tests/integration/test_restart_hang_straggler.py."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist

from training.straggler import Straggler, describe_straggler, find_straggler, gather_floats, own_time_per_step

RATIO, GAP = 0.2, 0.05  # train.straggler_threshold and train.straggler_min_gap_s at their defaults


def test_a_rank_slower_by_both_bars_is_named_against_the_median_of_the_others():
    found = find_straggler([0.10, 0.11, 0.10, 0.20], RATIO, GAP)
    assert found == Straggler(3, 0.10, pytest.approx(1.0), pytest.approx(0.10))


def test_two_ranks_are_compared_with_each_other_not_with_their_midpoint():
    # Rank 1 takes twice rank 0's time: 100% slower than the other rank (against the midpoint of
    # the two it would read 33%).
    assert find_straggler([0.10, 0.20], RATIO, GAP) == Straggler(1, 0.10, pytest.approx(1.0), pytest.approx(0.10))


@pytest.mark.parametrize("times", [
    [0.003, 0.005],  # 67% slower, but by 2 ms: the noise of a healthy 2-rank run on short steps
    [0.004, 0.0055, 0.005, 0.009],
    [10.0, 10.06, 10.0],  # by 60 ms, but 0.6% of a 10 s step
    [0.10, 0.11, 0.10, 0.12],  # 20% slower, by 20 ms: within both bars
])
def test_noise_names_no_one(times):
    assert find_straggler(times, RATIO, GAP) is None


def test_the_paused_rank_is_named_and_never_the_rank_that_waited_for_it():
    """A 2-rank DDP run, rank 1 paused for 1 s in each of four windows of 3 ms steps. Where the
    pause falls decides what each rank's own time sees:
    - in rank 1's own work (data, forward, optimizer): its own time grows, rank 0 waits in its
      backward (not own time): rank 1 is named;
    - in rank 1's forward at the step whose forward rebuilds DDP's buckets: rank 0 waits inside
      its own forward, so both own times grow by the pause and differ by noise: no one is named;
    - in rank 1's backward: both wait inside the backward's all-reduce and neither own time moves;
      the 2 ms of noise must not name rank 0."""
    paused_in_own_work = [0.003, 1.003]
    both_waited_in_own_work = [1.005, 1.003]
    paused_in_backward = [0.005, 0.003]
    windows = [paused_in_own_work, both_waited_in_own_work, paused_in_backward, paused_in_own_work]
    named = [find_straggler(times, RATIO, GAP) for times in windows]
    assert [s.rank if s else None for s in named] == [1, None, None, 1]
    assert named[0].gap_s == pytest.approx(1.0) and named[0].slower == pytest.approx(1.0 / 0.003)


def test_no_time_or_one_rank_names_no_one():
    assert find_straggler([0.5], RATIO, GAP) is None
    assert find_straggler([0.0, 0.0], RATIO, GAP) is None
    assert find_straggler([0.0, 0.3], RATIO, GAP) is None  # no median to compare with


def test_own_time_counts_only_the_phases_where_no_rank_waits_under_ddp():
    phases = {"data": 1.0, "forward": 2.0, "backward": 50.0, "optimizer": 1.0, "collective": 9.0}
    assert own_time_per_step(phases, 4) == pytest.approx(1.0)


def test_the_line_names_the_rank_its_host_both_times_and_who_waited():
    times = [0.1, 0.3, 0.1]
    line = describe_straggler(20, find_straggler(times, RATIO, GAP), times, ["a", "b", "c"])
    assert line == ("step 20: straggler rank 1 on b: 200% slower than the median of the other ranks (300.0 vs 100.0 "
                    "ms per step of data, forward and optimizer work; they waited for it)")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield types.SimpleNamespace(backend="gloo", device=torch.device("cpu"), world_size=1)
    finally:
        dist.destroy_process_group()


def test_the_gather_warns_nothing(one_rank_group):
    """torch deprecates all_gather_into_tensor with a FutureWarning, which every rank of every
    multi-process run printed once per run; the gather goes through parallel.comm's replacement."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gather_floats(one_rank_group, 0.25) == [0.25]
