"""mmap loader: batches, determinism, rank x worker disjointness, exact resume, bad data, prefetcher."""

import numpy as np
import pytest
import torch

from common.errors import DataError
from data.bundle import IGNORE_INDEX
from data.config import DataConfig
from data.loader import build_data
from data.prefetch import DevicePrefetcher
from data.shards import HEADER, TokenShardWriter, write_meta

VOCAB, EOT = 65536, 65535
T, B = 8, 2


def make_dataset(root, train_tokens=(400, 321), val_tokens=200):
    """Shards whose token at global position p is p, so a window is identified by its first token."""
    root.mkdir(parents=True, exist_ok=True)
    splits, next_id = {}, 0
    for split, sizes in (("train", train_tokens), ("val", (val_tokens,))):
        entries = []
        for i, n in enumerate(sizes):
            name = f"{split}-{i:06d}.bin"
            w = TokenShardWriter(root / name, VOCAB, EOT)
            w.add_document(np.arange(next_id, next_id + n - 1))  # + EOT makes n tokens
            next_id += n
            w.close()
            entries.append({"file": name, "tokens": n})
        splits[split] = entries
    write_meta(root, format="mmap", tokenizer="test", vocab_size=VOCAB, eot_id=EOT, splits=splits)
    return root


def bundle(root, rank=0, world_size=1, seed=0, batch=B, seq_len=T, vocab=VOCAB, **cfg):
    config = DataConfig(format="mmap", path=str(root), **cfg)
    return build_data(config, seq_len=seq_len, micro_batch_size=batch, seed=seed, rank=rank,
                      world_size=world_size, vocab_size=vocab)


def take(stream, n):
    return [next(stream) for _ in range(n)]


def window_starts(batches):
    return [int(v) for x, _ in batches for v in x[:, 0]]


def test_batches_are_windows_shifted_by_one(tmp_path):
    data = bundle(make_dataset(tmp_path / "d"))
    x, y = next(data.train)
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], x[:, -1] + 1)  # consecutive ids: the label continues the window
    assert "format=mmap" in data.description


def test_same_seed_same_order_other_seed_differs(tmp_path):
    root = make_dataset(tmp_path / "d")
    a = window_starts(take(bundle(root, seed=1).train, 20))
    b = window_starts(take(bundle(root, seed=1).train, 20))
    c = window_starts(take(bundle(root, seed=2).train, 20))
    assert a == b and a != c


def test_epochs_cover_all_windows_and_reshuffle(tmp_path):
    root = make_dataset(tmp_path / "d")
    stream = bundle(root).train
    per_epoch = stream.batches_per_epoch
    epoch0 = window_starts(take(stream, per_epoch))
    epoch1 = window_starts(take(stream, per_epoch))
    # shard 0: 400 tokens -> 49 windows starting at 0, 8, ...; shard 1 starts at id 400
    expected = {8 * k for k in range(49)} | {400 + 8 * k for k in range(40)}
    assert len(epoch0) == len(set(epoch0)) == per_epoch * B
    assert set(epoch0) <= expected and len(expected - set(epoch0)) == len(expected) % B  # dropped remainder
    assert epoch0 != epoch1


@pytest.mark.timeout(120)
def test_two_ranks_two_workers_disjoint_and_complete(tmp_path):
    root = make_dataset(tmp_path / "d", train_tokens=(8 * 40 + 1,))  # 40 windows: 10 batches per rank
    seen = []
    for rank in range(2):
        stream = bundle(root, rank=rank, world_size=2, num_workers=2, persistent_workers=False).train
        assert stream.batches_per_epoch == 10
        seen.append(window_starts(take(stream, 10)))
        stream.close()
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == [8 * k for k in range(40)]


@pytest.mark.timeout(120)
def test_workers_do_not_change_the_stream(tmp_path):
    root = make_dataset(tmp_path / "d")
    plain = window_starts(take(bundle(root, rank=1, world_size=2).train, 15))
    stream = bundle(root, rank=1, world_size=2, num_workers=2).train
    assert window_starts(take(stream, 15)) == plain
    stream.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_across_an_epoch_boundary(tmp_path, workers):
    root = make_dataset(tmp_path / "d")
    reference = bundle(root, seed=5).train
    expected = window_starts(take(reference, 60))
    interrupted = bundle(root, seed=5, num_workers=workers, prefetch_factor=4).train
    take(interrupted, 37)  # workers have prefetched further; the state must not count that
    state = interrupted.state_dict()
    interrupted.close()
    resumed = bundle(root, seed=5, num_workers=workers).train
    resumed.load_state_dict(state)
    assert window_starts(take(resumed, 23)) == expected[37 * B :]
    resumed.close()


def test_state_is_plain_and_survives_weights_only_load(tmp_path):
    stream = bundle(make_dataset(tmp_path / "d")).train
    take(stream, 3)
    torch.save({"data": stream.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["data"]
    assert state == stream.state_dict()


def test_resume_with_a_different_layout_is_refused(tmp_path):
    root = make_dataset(tmp_path / "d")
    state = bundle(root, batch=2).train.state_dict()
    with pytest.raises(DataError, match="batch_size: saved 2 now 4"):
        bundle(root, batch=4).train.load_state_dict(state)


@pytest.mark.parametrize("n", [12, 7, 5, 100, None])
def test_validation_is_the_first_windows_of_the_split_whatever_the_ranks(tmp_path, n):
    """1, 2 or 3 ranks share out the same first n windows (each once); every rank runs the same
    number of full-size batches, rows past its share padded with targets the loss ignores."""
    root = make_dataset(tmp_path / "d", val_tokens=8 * 12 + 1)  # 12 windows, the first at token 721
    expected = [721 + T * i for i in range(min(n or 12, 12))]
    for world in (1, 2, 3):
        per_rank = [list(bundle(root, rank=r, world_size=world).val.batches(n)) for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1
        seen = []
        for batches in per_rank:
            for x, y in batches:
                assert x.shape == y.shape == (B, T)
                real = y[:, 0] != IGNORE_INDEX
                assert (y[~real] == IGNORE_INDEX).all() and (x[~real] == 0).all()
                assert torch.equal(x[real][:, 1:], y[real][:, :-1])
                seen += [int(v) for v in x[real][:, 0]]
        assert sorted(seen) == expected, world
        assert len(per_rank[0]) == -(-len(expected) // (B * world))  # no batch of padding only beyond that
    val = bundle(root, rank=1, world_size=2).val
    assert window_starts(val.batches(5)) == window_starts(val.batches(5))  # repeatable
    assert "the first 5 of 12 windows" in val.describe(5) and "asks for more" in val.describe(100)


def test_too_small_for_one_batch(tmp_path):
    root = make_dataset(tmp_path / "d", train_tokens=(20,))
    with pytest.raises(DataError, match=r"train split .*train-000000\.bin.* too small"):
        bundle(root, batch=4)


def test_model_vocab_smaller_than_tokenizer(tmp_path):
    with pytest.raises(DataError, match="model.vocab_size >= 65536"):
        bundle(make_dataset(tmp_path / "d"), vocab=256)


def test_format_mismatch_and_missing_directory(tmp_path):
    root = make_dataset(tmp_path / "d")
    with pytest.raises(DataError, match="does not exist"):
        bundle(tmp_path / "missing")
    cfg = DataConfig(format="webdataset", path=str(root))
    with pytest.raises(DataError, match="set data.format=mmap"):
        build_data(cfg, seq_len=T, micro_batch_size=B, seed=0, rank=0, world_size=1, vocab_size=VOCAB)


def corrupt_token(path, index, value):
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 2 * index : HEADER.size + 2 * index + 2] = int(value).to_bytes(2, "little")
    path.write_bytes(bytes(raw))


def make_byte_dataset(root, tokens=8 * 4 + 1):
    root.mkdir(parents=True)
    w = TokenShardWriter(root / "train-000000.bin", 256, 0)
    w.add_document(np.arange(tokens - 1) % 200 + 1)
    w.close()
    w = TokenShardWriter(root / "val-000000.bin", 256, 0)
    w.add_document(np.arange(tokens - 1) % 200 + 1)
    w.close()
    write_meta(root, format="mmap", tokenizer="byte", vocab_size=256, eot_id=0,
               splits={s: [{"file": f"{s}-000000.bin", "tokens": tokens}] for s in ("train", "val")})
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_out_of_vocab_token_in_a_window_names_the_file(tmp_path, workers):
    """A header that passes its checks can still sit on corrupt data: each batch is checked."""
    root = make_byte_dataset(tmp_path / "d")
    corrupt_token(root / "train-000000.bin", 3, 300)  # the header still says max id 32
    # verify=header: with the default lazy check the chunk CRC would catch this first
    stream = bundle(root, num_workers=workers, vocab=256, verify="header").train
    with pytest.raises(DataError, match=r"train-000000\.bin: token id 300 is outside model.vocab_size=256"):
        take(stream, 4)
    stream.close()
    with pytest.raises(DataError, match="CRC"):  # verify=full finds it when opening
        bundle(root, vocab=256, verify="full")


def test_header_max_id_beyond_model_vocab_is_rejected_or_skipped(tmp_path):
    root = make_dataset(tmp_path / "d", train_tokens=(400, 321))
    # the model vocab covers the tokenizer but not shard 1's ids, which go above 400
    meta = (root / "meta.json").read_text().replace('"vocab_size": 65536', '"vocab_size": 300')
    (root / "meta.json").write_text(meta)
    with pytest.raises(DataError, match=r"train-000000\.bin: token id 65535 is outside model.vocab_size=300"):
        bundle(root, vocab=300)


def test_truncated_shard_errors_or_is_skipped_and_reported(tmp_path):
    root = make_dataset(tmp_path / "d", train_tokens=(400, 321))
    bad = root / "train-000001.bin"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"train-000001\.bin.*truncated"):
        bundle(root)
    data = bundle(root, on_bad_shard="skip")
    assert len(data.skipped_shards) == 1 and "train-000001.bin" in data.description
    assert max(window_starts(take(data.train, data.train.batches_per_epoch))) < 400


def test_creating_the_stream_leaves_the_global_rng_alone(tmp_path):
    root = make_dataset(tmp_path / "d")
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    take(bundle(root).train, 2)
    assert torch.equal(torch.rand(3), expected)


def test_cpu_prefetcher_is_a_pass_through_with_the_stream_state(tmp_path):
    root = make_dataset(tmp_path / "d")
    plain = take(bundle(root).train, 6)
    pre = DevicePrefetcher(bundle(root).train, "cpu")
    got = take(pre, 4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, plain))
    state = pre.state_dict()
    assert state["position"] == 4 and pre.batches_per_epoch > 0
    again = DevicePrefetcher(bundle(root).train, "cpu")
    again.load_state_dict(state)
    assert torch.equal(next(again)[0], plain[4][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetcher_overlaps_and_does_not_count_the_pending_batch(tmp_path):
    root = make_dataset(tmp_path / "d")
    plain = take(bundle(root).train, 5)
    pre = DevicePrefetcher(bundle(root, pin_memory=True).train, "cuda")
    x, y = next(pre)
    assert x.is_cuda and torch.equal(x.cpu(), plain[0][0])
    assert pre.state_dict()["position"] == 1  # batch 2 is in flight on the side stream
    x, y = next(pre)
    assert torch.equal(y.cpu(), plain[1][1])
