"""WebDataset loader: rank x worker disjointness and coverage, shard-level resume, bad shards."""

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("webdataset", reason="webdataset not installed")

from common.errors import DataError  # noqa: E402
from data.config import DataConfig  # noqa: E402
from data.loader import build_data  # noqa: E402
from data.shards import write_meta  # noqa: E402
from data.wds_format import TokenSampleWriter  # noqa: E402

VOCAB, EOT = 65536, 65535
T, B = 8, 2


def make_wds(root, samples=80, per_shard=10, val_samples=12, seq_len=T, encoding="raw"):
    """Sample k of the train split starts with token k*seq_len, so its first token identifies it."""
    splits = {}
    for split, n in (("train", samples), ("val", val_samples)):
        w = TokenSampleWriter(root / split, seq_len=seq_len, vocab_size=VOCAB, samples_per_shard=per_shard,
                              encoding=encoding)
        w.add_document(np.arange(n * seq_len), EOT)  # + EOT: exactly n windows
        splits[split], _ = w.close()
    write_meta(root, format="webdataset", tokenizer="test", vocab_size=VOCAB, eot_id=EOT, splits=splits,
               seq_len=seq_len, encoding=encoding)
    return root


def bundle(root, rank=0, world_size=1, seed=0, seq_len=T, vocab=VOCAB, **cfg):
    cfg.setdefault("shuffle_buffer", 0)
    config = DataConfig(format="webdataset", path=str(root), **cfg)
    return build_data(config, seq_len=seq_len, micro_batch_size=B, seed=seed, rank=rank, world_size=world_size,
                      vocab_size=vocab)


def sample_ids(stream, n_batches):
    out = []
    for _ in range(n_batches):
        x, y = next(stream)
        assert torch.equal(x[:, 1:], y[:, :-1])
        out += [int(v) // T for v in x[:, 0]]
    return out


def test_samples_decode_to_windows_and_val_is_repeatable(tmp_path):
    data = bundle(make_wds(tmp_path / "w"), shuffle_shards=False)
    x, y = next(data.train)
    assert x.shape == (B, T) and x.dtype == torch.int64
    assert x[0].tolist() == list(range(T)) and y[0].tolist() == list(range(1, T + 1))
    first = [b[0] for b in data.val.batches(3 * B)]
    again = [b[0] for b in data.val.batches(3 * B)]
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert data.val.num_batches(None) == 6
    assert "format=webdataset" in data.description


@pytest.mark.timeout(120)
@pytest.mark.parametrize("buffer", [0, 16])
def test_two_ranks_two_workers_read_each_sample_once_per_epoch(tmp_path, buffer):
    root = make_wds(tmp_path / "w", samples=80, per_shard=10)  # 8 shards: 2 per reader
    seen = []
    for rank in range(2):
        stream = bundle(root, rank=rank, world_size=2, num_workers=2, shuffle_buffer=buffer,
                        persistent_workers=False).train
        seen.append(sample_ids(stream, 20))  # 40 samples = this rank's epoch
        stream.close()
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(80))


def test_order_depends_on_seed_and_epochs_reshuffle(tmp_path):
    root = make_wds(tmp_path / "w", samples=80, per_shard=10)
    a = sample_ids(bundle(root, seed=1, shuffle_buffer=8).train, 80)
    assert a == sample_ids(bundle(root, seed=1, shuffle_buffer=8).train, 80)
    assert a != sample_ids(bundle(root, seed=2, shuffle_buffer=8).train, 80)
    assert sorted(a[:80]) == sorted(a[80:]) == list(range(80)) and a[:80] != a[80:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_without_a_shuffle_buffer(tmp_path, workers):
    root = make_wds(tmp_path / "w", samples=80, per_shard=10)
    expected = sample_ids(bundle(root, seed=3, num_workers=workers).train, 70)  # crosses an epoch
    first = bundle(root, seed=3, num_workers=workers, prefetch_factor=4).train
    sample_ids(first, 27)
    state = first.state_dict()
    first.close()
    second = bundle(root, seed=3, num_workers=workers).train
    second.load_state_dict(state)
    assert sample_ids(second, 43) == expected[27 * B :]
    second.close()


def test_resume_with_a_buffer_repeats_nothing_and_skips_at_most_the_buffer(tmp_path):
    root = make_wds(tmp_path / "w", samples=80, per_shard=10)
    first = bundle(root, seed=3, shuffle_buffer=8).train
    before = sample_ids(first, 10)
    second = bundle(root, seed=3, shuffle_buffer=8).train
    second.load_state_dict(first.state_dict())
    epoch_rest = 80 - len(before)
    after = []
    while len(after) < epoch_rest - 8:  # the rest of epoch 0, minus what was in the buffer
        after += sample_ids(second, 1)
    after = after[: epoch_rest - 8]
    assert not set(before) & set(after)
    assert len(set(before) | set(after)) == 80 - 8


def test_resume_refuses_a_different_worker_count(tmp_path):
    root = make_wds(tmp_path / "w")
    state = bundle(root).train.state_dict()
    with pytest.raises(DataError, match="readers: saved 1 now 2"):
        bundle(root, num_workers=2).train.load_state_dict(state)


def test_resampled_mode_is_deterministic_and_keeps_going(tmp_path):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10)
    a = sample_ids(bundle(root, resampled=True, seed=4).train, 60)
    assert a == sample_ids(bundle(root, resampled=True, seed=4).train, 60)
    assert set(a) <= set(range(40)) and len(a) == 120


def test_npy_samples_and_cropping_to_a_shorter_seq_len(tmp_path):
    root = make_wds(tmp_path / "w", encoding="npy", seq_len=16, samples=40)
    data = bundle(root, seq_len=8, shuffle_shards=False)
    x, y = next(data.train)
    assert x[0].tolist() == list(range(8)) and y[0].tolist() == list(range(1, 9))
    assert "cropped from 16" in data.description
    with pytest.raises(DataError, match="prepared for seq_len 16"):
        bundle(root, seq_len=32)


def test_too_few_shards_for_the_readers(tmp_path):
    root = make_wds(tmp_path / "w", samples=20, per_shard=10)
    with pytest.raises(DataError, match=r"2 WebDataset shard\(s\) cannot feed 2 rank\(s\) x 2 reader"):
        bundle(root, world_size=2, num_workers=2)


def truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_truncated_shard_names_the_file(tmp_path, workers):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10)
    truncate(root / "train" / "shard-000000.tar", 3000)
    stream = bundle(root, num_workers=workers, shuffle_shards=False).train
    with pytest.raises(DataError, match=r"shard-000000\.tar"):
        sample_ids(stream, 20)
    stream.close()


def test_skip_mode_counts_and_logs_the_bad_shard(tmp_path, caplog):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10)
    truncate(root / "train" / "shard-000001.tar", 3000)
    stream = bundle(root, shuffle_shards=False, on_bad_shard="skip").train
    with caplog.at_level(logging.WARNING, logger="perfgpt.data"):
        ids = sample_ids(stream, 16)
    assert stream.state_dict()["skipped"] == 1
    assert "shard-000001.tar" in caplog.text
    assert not set(ids[:30]) & set(range(12, 20))  # what lay past the cut in shard 1 never appears


def test_bad_samples_are_named(tmp_path):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10)
    message = r"shard-00000\d\.tar: sample \d+ has token id 65535 outside model.vocab_size=60000"
    with pytest.raises(DataError, match=message):
        sample_ids(_small_vocab_stream(root), 20)
    other = make_wds(tmp_path / "o", samples=40, per_shard=10, seq_len=4)
    meta = (other / "meta.json").read_text().replace('"seq_len": 4', '"seq_len": 8')
    (other / "meta.json").write_text(meta)
    with pytest.raises(DataError, match=r"sample 0000000000 has 5 tokens, the dataset's samples have 9"):
        sample_ids(bundle(other, shuffle_shards=False).train, 1)


def _small_vocab_stream(root):
    stream = bundle(root, shuffle_shards=False).train
    stream._dataset.vocab_size = 60000  # the model's vocab no longer covers the end-of-text id
    return stream


def test_empty_or_missing_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        bundle(tmp_path / "nothing")
    root = make_wds(tmp_path / "w", samples=40)
    (root / "train" / "shard-000002.tar").unlink()
    with pytest.raises(DataError, match=r"shard-000002\.tar is listed in .* but missing"):
        bundle(root)


def test_skip_mode_with_every_shard_bad_raises_instead_of_spinning(tmp_path):
    root = make_wds(tmp_path / "w", samples=20, per_shard=10)
    for shard in (root / "train").glob("shard-*.tar"):
        truncate(shard, 100)
    stream = bundle(root, on_bad_shard="skip").train
    with pytest.raises(DataError, match=r"got no samples in a whole epoch from 2 shard\(s\)"):
        next(stream)
