"""The built-in stdlib corpus: content equals the source files, cached by key, safe to build concurrently."""

import multiprocessing

import numpy as np
import pytest

from data.config import DataConfig
from data.default_corpus import ensure_default_corpus, is_validation_document, list_source_files, stdlib_root
from data.loader import build_data
from data.shards import TokenShard, read_dataset_meta

SMALL_MB = 0.4  # a few dozen files: builds in well under a second


def test_corpus_holds_the_stdlib_files_as_bytes(tmp_path):
    root = ensure_default_corpus(str(tmp_path), SMALL_MB, 0.2)
    meta = read_dataset_meta(root)
    assert (meta.format, meta.tokenizer, meta.vocab_size, meta.eot_id) == ("mmap", "byte", 256, 0)
    files = [rel for rel, _ in list_source_files(stdlib_root(), int(SMALL_MB * 1e6))]
    expected = {"train": [], "val": []}
    for rel in files:
        raw = (stdlib_root() / rel).read_bytes()
        if raw and b"\0" not in raw:
            expected["val" if is_validation_document(rel, 0.2) else "train"].append(raw)
    assert expected["train"] and expected["val"]
    for split in ("train", "val"):
        shard = TokenShard(meta.files(split)[0])
        shard.verify()
        got = [shard.document(i).astype(np.uint8).tobytes() for i in range(shard.header.doc_count)]
        assert got == expected[split]
    assert "test" not in {part for rel in files for part in rel.split("/")[:-1]}


def test_second_call_reuses_the_cache_and_settings_change_the_key(tmp_path):
    first = ensure_default_corpus(str(tmp_path), SMALL_MB, 0.05)
    stamp = (first / "meta.json").stat().st_mtime_ns
    assert ensure_default_corpus(str(tmp_path), SMALL_MB, 0.05) == first
    assert (first / "meta.json").stat().st_mtime_ns == stamp
    other = ensure_default_corpus(str(tmp_path), SMALL_MB / 2, 0.05)
    assert other != first and (other / "meta.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary build directory left behind"


def _build_in_child(cache_dir, queue):
    queue.put(str(ensure_default_corpus(cache_dir, SMALL_MB, 0.05)))


@pytest.mark.timeout(120)
def test_concurrent_builders_agree_on_one_valid_corpus(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    paths = {queue.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths.pop().rsplit("/", 1)[1]]


def test_build_data_default_format_trains_on_the_corpus(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path), default_corpus_max_mb=SMALL_MB, val_fraction=0.2)
    data = build_data(cfg, seq_len=64, micro_batch_size=4, seed=0, rank=0, world_size=1, vocab_size=256)
    x, y = next(data.train)
    assert x.shape == (4, 64) and int(x.max()) < 256
    assert data.val.available >= 1
    assert len(list(data.val.batches(None))) == -(-data.val.available // 4)  # every window, in batches of 4
    assert "format=default" in data.description and "tokenizer=byte" in data.description
