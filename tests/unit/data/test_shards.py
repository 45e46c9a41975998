"""The mmap token-shard format: round trips, dtype choice, and every header/size check."""

import numpy as np
import pytest

from common.errors import DataError
from data.shards import HEADER, TokenShard, TokenShardWriter, read_dataset_meta, token_dtype, write_meta


def write_shard(path, docs, vocab_size=256, eot_id=0):
    w = TokenShardWriter(path, vocab_size, eot_id)
    for d in docs:
        w.add_document(np.asarray(d))
    return w.close()


def test_round_trip_documents_and_index(tmp_path):
    docs = [[5, 6, 7], [], [200, 1], list(range(1, 100))]
    shard = TokenShard(write_shard(tmp_path / "a.bin", docs))
    assert shard.header.doc_count == 4
    assert len(shard) == sum(len(d) + 1 for d in docs)
    for i, d in enumerate(docs):
        assert shard.document(i).tolist() == d
    expected = np.concatenate([np.r_[d, 0] for d in docs]).astype(np.uint16)
    np.testing.assert_array_equal(np.asarray(shard.tokens), expected)
    assert shard.header.max_token_id == 200
    shard.verify()
    assert not list(tmp_path.glob(".*tmp*")), "temporary file left behind"


def test_dtype_follows_vocab_size(tmp_path):
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    shard = TokenShard(write_shard(tmp_path / "big.bin", [[70000, 3]], vocab_size=100_000, eot_id=99_999))
    assert shard.tokens.dtype == np.uint32
    assert shard.document(0).tolist() == [70000, 3]


def test_writer_rejects_out_of_vocab_ids(tmp_path):
    w = TokenShardWriter(tmp_path / "x.bin", 256, 0)
    with pytest.raises(DataError, match="outside"):
        w.add_document(np.array([1, 256]))
    w.abort()


def test_bad_magic_names_the_file(tmp_path):
    path = write_shard(tmp_path / "a.bin", [[1, 2]])
    raw = bytearray(path.read_bytes())
    raw[:4] = b"JUNK"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"a\.bin.*bad magic"):
        TokenShard(path)


def test_wrong_version_is_rejected(tmp_path):
    path = write_shard(tmp_path / "a.bin", [[1, 2]])
    raw = bytearray(path.read_bytes())
    raw[8:12] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="version 99"):
        TokenShard(path)


@pytest.mark.parametrize("cut", [HEADER.size - 1, HEADER.size + 3, -8])
def test_truncated_shard_is_rejected(tmp_path, cut):
    path = write_shard(tmp_path / "a.bin", [list(range(1, 50))])
    raw = path.read_bytes()
    path.write_bytes(raw[:cut])
    with pytest.raises(DataError, match=r"a\.bin.*truncated"):
        TokenShard(path)


def test_trailing_bytes_are_rejected(tmp_path):
    path = write_shard(tmp_path / "a.bin", [[1, 2, 3]])
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(DataError, match="truncated or corrupt"):
        TokenShard(path)


def test_verify_catches_flipped_token_bytes(tmp_path):
    path = write_shard(tmp_path / "a.bin", [list(range(1, 50))])
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 10] ^= 0x01
    path.write_bytes(bytes(raw))
    shard = TokenShard(path)  # header checks pass: the size is right
    with pytest.raises(DataError, match="CRC"):
        shard.verify()


def test_meta_round_trip_and_errors(tmp_path):
    write_meta(tmp_path, format="mmap", tokenizer="byte", vocab_size=256, eot_id=0,
               splits={"train": [{"file": "t.bin", "tokens": 3}]})
    meta = read_dataset_meta(tmp_path)
    assert meta.files("train") == [tmp_path / "t.bin"] and meta.tokens("train") == 3
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt"):
        read_dataset_meta(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        read_dataset_meta(tmp_path / "nope")


def test_meta_rejects_paths_outside_the_dataset(tmp_path):
    write_meta(tmp_path, format="mmap", tokenizer="byte", vocab_size=256, eot_id=0,
               splits={"train": [{"file": "../escape.bin", "tokens": 3}]})
    with pytest.raises(DataError, match="inside the dataset"):
        read_dataset_meta(tmp_path).files("train")
