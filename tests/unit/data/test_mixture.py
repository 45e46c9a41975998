"""Weighted mixtures (data.sources): proportions, schedules, the global stream split by rank, exact
resume in any layout, per-source positions and validation, and one-line refusals of bad input."""

import math

import numpy as np
import pytest
import torch

from common.errors import ConfigError, DataError
from data.config import DataConfig, ScheduleEntry, SourceConfig
from data.loader import build_data
from data.schedule import MixturePlan
from tests.unit.data.mixture_data import EOT, VAL_OFFSET, VOCAB, T, mmap_dir, wds_dir
from training.config import load_config

FIRST_IDS = {"a": 0, "b": 5000, "c": 10000}


@pytest.fixture
def datasets(tmp_path):
    return {
        "a": mmap_dir(tmp_path / "a", FIRST_IDS["a"], windows=30, shards=2),
        "b": mmap_dir(tmp_path / "b", FIRST_IDS["b"], windows=11),  # small: many epochs in one test
        "c": wds_dir(tmp_path / "c", FIRST_IDS["c"], samples=24, per_shard=5),
    }


def mixture(datasets, weights=None, schedule=(), **cfg):
    weights = weights or {"a": 5, "b": 3, "c": 2}
    sources = [SourceConfig(path=str(datasets[name]), format="webdataset" if name == "c" else "mmap", weight=w)
               for name, w in weights.items()]
    config = DataConfig(sources=sources, schedule=list(schedule), shuffle_buffer=0, **cfg)
    config.validate()
    return config


def stream(config, rank=0, world=1, batch=2, accum=1, seed=7):
    return build_data(config, seq_len=T, micro_batch_size=batch, seed=seed, rank=rank, world_size=world,
                      vocab_size=VOCAB, grad_accum_steps=accum)


def source_of(token: int) -> str:
    return max((first, name) for name, first in FIRST_IDS.items() if token >= first)[1]


def firsts(batch) -> list[int]:
    x, y = batch
    assert torch.equal(x[:, 1:], y[:, :-1])
    return [int(v) for v in x[:, 0]]


def take(data_stream, n):
    return [firsts(next(data_stream)) for _ in range(n)]


def test_realised_proportions_are_within_three_standard_errors_of_the_weights(datasets):
    config = mixture(datasets)
    data = stream(config, batch=4, accum=2)
    steps = 150  # 1,200 samples
    seen = [source_of(t) for _ in range(steps * 2) for t in firsts(next(data.train))]
    n = len(seen)
    for name, weight in {"a": 0.5, "b": 0.3, "c": 0.2}.items():
        count = seen.count(name)
        assert abs(count - n * weight) <= 3 * math.sqrt(n * weight * (1 - weight)), (name, count, n * weight)
    # what the log and the checkpoint keep agrees with what was read
    metrics = data.position_metrics(data.train.state_dict())
    assert [metrics[f"data/{k}/samples"] for k in "abc"] == [seen.count(k) for k in "abc"]
    assert metrics["data/a/tokens"] == seen.count("a") * T


def test_a_source_is_read_in_its_own_order_and_an_epoch_of_one_leaves_the_others_alone(datasets):
    data = stream(mixture(datasets), batch=4)
    rows = [t for _ in range(60) for t in firsts(next(data.train))]  # b (11 windows) wraps many times
    by_source = {k: [t for t in rows if source_of(t) == k] for k in "abc"}
    b_windows = [(t - FIRST_IDS["b"]) // T for t in by_source["b"]]
    assert len(b_windows) > 3 * 11
    for epoch in range(3):  # each epoch of b visits each of its windows once, in a fresh order
        assert sorted(b_windows[11 * epoch : 11 * (epoch + 1)]) == list(range(11))
    assert b_windows[:11] != b_windows[11:22]
    # a and c: the same samples in the same order whatever b does (here: b three times larger)
    bigger = dict(datasets, b=mmap_dir(datasets["a"].parent / "b2", FIRST_IDS["b"], windows=40))
    other_stream = stream(mixture(bigger), batch=4).train
    other = [t for _ in range(60) for t in firsts(next(other_stream))]
    for name in "ac":
        assert by_source[name] == [t for t in other if source_of(t) == name]
    a_windows = [(t - FIRST_IDS["a"]) // T for t in by_source["a"]]
    assert sorted(a_windows[:30]) == list(range(30))  # two shards, one epoch: every window once


def test_two_ranks_split_the_one_process_stream_and_their_states_agree(datasets):
    config = mixture(datasets)
    one = stream(config, batch=4).train
    ranks = [stream(config, rank=r, world=2, batch=2).train for r in range(2)]
    for _ in range(25):
        assert firsts(next(one)) == firsts(next(ranks[0])) + firsts(next(ranks[1]))
    assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()
    # grad accumulation: one rank's two micro-batches are the step two ranks read at once
    accum = stream(config, batch=2, accum=2).train
    ranks = [stream(config, rank=r, world=2, batch=2).train for r in range(2)]
    for _ in range(10):
        assert firsts(next(accum)) + firsts(next(accum)) == firsts(next(ranks[0])) + firsts(next(ranks[1]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_on_one_and_two_ranks_and_from_two_ranks_to_one(datasets, workers):
    config = mixture(datasets, num_workers=workers, persistent_workers=False)
    reference = take(stream(config, batch=4).train, 40)
    ranks = [stream(config, rank=r, world=2, batch=2).train for r in range(2)]
    for _ in range(17):
        for r in ranks:
            next(r)
    saved = ranks[0].state_dict()
    for r in ranks:
        r.close()
    # 2 -> 2 ranks
    resumed = [stream(config, rank=r, world=2, batch=2).train for r in range(2)]
    for r in resumed:
        r.load_state_dict(saved)
    assert [a + b for a, b in zip(take(resumed[0], 10), take(resumed[1], 10))] == reference[17:27]
    # 2 -> 1 rank, and 1 -> 1 after that
    one = stream(config, batch=4).train
    one.load_state_dict(saved)
    assert take(one, 9) == reference[17:26]
    again = stream(config, batch=4).train
    again.load_state_dict(one.state_dict())
    assert take(again, 14) == reference[26:40]
    for s in resumed + [one, again]:
        s.close()


def test_a_different_global_batch_is_refused_on_resume(datasets):
    config = mixture(datasets)
    state = stream(config, batch=2).train.state_dict()
    with pytest.raises(DataError, match="samples_per_step: saved 2 now 4"):
        stream(config, batch=4).train.load_state_dict(state)


def test_schedule_switches_at_its_step_and_blends_linearly(datasets):
    switch = ScheduleEntry(from_step=5, weights={"a": 0, "c": 0})
    config = mixture(datasets, schedule=[switch])
    data = stream(config, batch=4)
    steps = [[source_of(t) for t in firsts(next(data.train))] for _ in range(30)]
    assert set(sum(steps[:5], [])) == {"a", "b", "c"}
    assert set(sum(steps[5:], [])) == {"b"}
    # the draws before the switch do not depend on it
    plain = stream(mixture(datasets), batch=4)
    assert [[source_of(t) for t in firsts(next(plain.train))] for _ in range(5)] == steps[:5]

    blend = ScheduleEntry(from_step=10, blend_steps=4, weights={"a": 1, "b": 1, "c": 2})
    plan = MixturePlan.from_config(mixture(datasets, schedule=[blend]), seed=0, samples_per_step=8)
    before, after = np.array([0.5, 0.3, 0.2]), np.array([0.25, 0.25, 0.5])
    for step, f in ((0, 0), (10, 0), (11, 0.25), (13, 0.75), (14, 1), (99, 1)):
        np.testing.assert_allclose(plan.weights_at(step), (1 - f) * before + f * after, atol=1e-12)


def test_each_source_has_its_own_validation_set(datasets):
    data = stream(mixture(datasets), batch=2)
    assert list(data.val_sources) == ["a", "b", "c"]
    for name, val in data.val_sources.items():
        got = [int(v) for x, y in val.batches(5) for v in x[y[:, 0] != -100][:, 0]]
        assert got == [FIRST_IDS[name] + VAL_OFFSET + T * i for i in range(5)], name


# ------------------------------------------------------------------------------ bad input, one line each


@pytest.mark.parametrize("override, message", [
    ("--data.sources=[{path: x, weight: 0}]", r"data.sources\[0\].weight must be a positive number, got 0"),
    ("--data.sources=[{path: x, weight: -1}]", r"weight must be a positive number, got -1"),
    ("--data.sources=[{path: x, format: tfrecord}]", r"data.sources\[0\].format='tfrecord' is not valid"),
    ("--data.sources=[{path: x}, {path: y}]\n--data.schedule=[{from_step: 3, weights: {x: 0, y: 0}}]",
     r"data.schedule\[0\]: the weights after this change sum to 0"),
    ("--data.sources=[{path: x}]\n--data.schedule=[{from_step: 3, weights: {z: 1}}]", r"names 'z', not a source"),
    ("--data.sources=[{path: d/x}, {path: e/x}]", r"both named 'x'"),
    ("--data.sources=[{path: x}]\n--data.path=y", "data.sources replaces data.format and data.path"),
    ("--data.schedule=[{from_step: 3, weights: {x: 1}}]", "there are none"),
])
def test_bad_mixture_configs_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, override.split("\n"))
    assert "\n" not in str(info.value)


def test_bad_sources_are_one_line_before_any_batch(datasets, tmp_path):
    empty = mmap_dir(tmp_path / "empty", 0, windows=0)
    cases = [
        ({"a": 1, "x": 1}, "x", str(tmp_path / "nowhere"), "mmap", "does not exist"),
        ({"a": 1, "x": 1}, "x", str(empty), "mmap", "source x: the train split of .* not one window of 9"),
        ({"a": 1, "x": 1}, "x", str(datasets["c"]), "mmap", "holds a webdataset dataset; set its format: webdataset"),
        ({"a": 1, "x": 1}, "x", "http://127.0.0.1:9/data", "mmap", r"http://127.0.0.1:9/data/meta.json: unreachable"),
    ]
    for weights, name, path, fmt, message in cases:
        sources = [SourceConfig(path=str(datasets["a"]), weight=1),
                   SourceConfig(path=path, format=fmt, name=name, weight=1)]
        config = DataConfig(sources=sources, retries=0)
        with pytest.raises(DataError, match=message) as info:
            stream(config)
        assert "\n" not in str(info.value)


def test_sources_with_different_tokenizers_or_too_many_ids_are_refused(datasets, tmp_path):
    other = mmap_dir(tmp_path / "other", 0, windows=5)
    meta = (other / "meta.json").read_text().replace('"tokenizer": "test"', '"tokenizer": "byte"')
    (other / "meta.json").write_text(meta)
    config = DataConfig(sources=[SourceConfig(path=str(datasets["a"])), SourceConfig(path=str(other))])
    with pytest.raises(DataError, match="sources a and other use different tokenizers"):
        stream(config)
    with pytest.raises(DataError, match=r"source a: tokenizer test .* has 65536 ids but model.vocab_size=256"):
        build_data(DataConfig(sources=[SourceConfig(path=str(datasets["a"]))]), seq_len=T, micro_batch_size=2,
                   seed=0, rank=0, world_size=1, vocab_size=256)
    assert EOT == VOCAB - 1
