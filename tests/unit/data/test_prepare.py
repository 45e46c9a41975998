"""tools/prepare_data.py logic: every input kind round-trips, output is deterministic, bad inputs are named."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from common.errors import DataError
from data.prepare import PrepareOptions, is_validation_index, prepare
from data.shards import TokenShard, read_dataset_meta
from data.tokenizer import ByteTokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TEXTS = [f"document {i}: " + "héllo wörld " * (i % 7 + 1) + "\n" * (i % 3) for i in range(30)]


def opts(inputs, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("val_fraction", 0.1)
    return PrepareOptions(inputs=[str(p) for p in inputs], out_dir=str(out), **kw)


def read_documents(out):
    """Documents of each split from an mmap dataset, in order."""
    meta = read_dataset_meta(out)
    docs = {}
    for split in ("train", "val"):
        docs[split] = []
        for path in meta.files(split):
            shard = TokenShard(path)
            docs[split] += [shard.document(i).tolist() for i in range(shard.header.doc_count)]
    return docs


def expected_documents(texts, tok, val_fraction=0.1):
    docs = {"train": [], "val": []}
    for i, text in enumerate(texts):
        docs["val" if is_validation_index(i, val_fraction) else "train"].append(tok.encode(text).tolist())
    return docs


def write_texts(folder, texts):
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


def digest(folder):
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def test_folder_of_text_round_trips_through_mmap_shards(tmp_path):
    src = write_texts(tmp_path / "txt", TEXTS)
    summary = prepare(opts([src], tmp_path / "out", shard_tokens=300))
    assert read_documents(tmp_path / "out") == expected_documents(TEXTS, ByteTokenizer())
    assert summary["train"].shards > 1  # small shard_tokens: several shards, documents never split
    assert summary["val"].documents == 3


def test_text_split_by_paragraph_and_line(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n\nthree\n\n\nfour\n")
    prepare(opts([tmp_path / "a.txt"], tmp_path / "p", text_split="line", val_fraction=0.3))
    docs = read_documents(tmp_path / "p")
    decoded = [ByteTokenizer().decode(d) for d in docs["train"] + docs["val"]]
    assert sorted(decoded) == sorted(["one", "two", "three", "four"])
    prepare(opts([tmp_path / "a.txt"], tmp_path / "q", text_split="paragraph", val_fraction=0.4))
    docs = read_documents(tmp_path / "q")
    assert sorted(ByteTokenizer().decode(d) for d in docs["train"] + docs["val"]) == ["four", "one\ntwo", "three"]


def test_jsonl_and_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    import pyarrow.parquet as pq

    with open(tmp_path / "a.jsonl", "w") as f:
        for t in TEXTS[:15]:
            f.write(json.dumps({"content": t, "id": 1}) + "\n")
    pq.write_table(pa.table({"content": TEXTS[15:], "n": list(range(15))}), tmp_path / "b.parquet", row_group_size=4)
    prepare(opts([tmp_path / "a.jsonl", tmp_path / "b.parquet"], tmp_path / "out", text_field="content"))
    assert read_documents(tmp_path / "out") == expected_documents(TEXTS, ByteTokenizer())


@pytest.mark.timeout(120)
def test_same_bytes_twice_and_with_more_workers(tmp_path):
    src = write_texts(tmp_path / "txt", TEXTS * 4)
    prepare(opts([src], tmp_path / "a", workers=1))
    prepare(opts([src], tmp_path / "b", workers=2))
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    prepare(opts([src], tmp_path / "c", output="webdataset", seq_len=16, samples_per_shard=20))
    prepare(opts([src], tmp_path / "d", output="webdataset", seq_len=16, samples_per_shard=20, workers=2))
    assert digest(tmp_path / "c") == digest(tmp_path / "d")


@pytest.mark.parametrize("encoding", ["raw", "npy"])
def test_webdataset_samples_are_the_token_stream_in_windows(tmp_path, encoding):
    from data.wds_format import decode_tokens, iter_shard_samples

    src = write_texts(tmp_path / "txt", TEXTS)
    summary = prepare(opts([src], tmp_path / "w", output="webdataset", seq_len=16, samples_per_shard=10,
                           wds_encoding=encoding))
    meta = read_dataset_meta(tmp_path / "w")
    stream = np.concatenate([np.r_[d, 0] for d in expected_documents(TEXTS, ByteTokenizer())["train"]])
    samples = [decode_tokens(s, p, 17) for p in map(str, meta.files("train")) for s in iter_shard_samples(p, 0)]
    assert len(samples) == summary["train"].samples == (len(stream) - 1) // 16
    for k, sample in enumerate(samples):
        np.testing.assert_array_equal(sample, stream[16 * k : 16 * k + 17])
    assert summary["train"].shards == -(-len(samples) // 10)
    assert summary["train"].dropped_tail_tokens == len(stream) - 16 * len(samples)


def test_hf_tokenizer_json_round_trips(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["hello world", "world hello hello", "bye world"] * 4
    src = write_texts(tmp_path / "txt", texts)
    spec = f"hf:{tmp_path / 'tokenizer.json'}"
    prepare(opts([src], tmp_path / "out", tokenizer=spec, val_fraction=0.25))
    hf = build_tokenizer(spec)
    assert (hf.vocab_size, hf.eot_id) == (4, 0)
    assert read_documents(tmp_path / "out") == expected_documents(texts, hf, 0.25)
    assert read_dataset_meta(tmp_path / "out").tokenizer == spec


def test_tiktoken_without_a_cached_file_errors_instead_of_downloading(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken", reason="tiktoken not installed")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(DataError, match="would need a download"):
        build_tokenizer("tiktoken:gpt2")
    with pytest.raises(DataError, match="unknown tokenizer"):
        build_tokenizer("sentencepiece:x")


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        prepare(opts([tmp_path / "bad.jsonl"], tmp_path / "o1"))
    (tmp_path / "field.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"field\.jsonl:1: no field 'text'.*--text-field"):
        prepare(opts([tmp_path / "field.jsonl"], tmp_path / "o2"))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet"):
        prepare(opts([tmp_path / "junk.parquet"], tmp_path / "o3"))
    with pytest.raises(DataError, match="does not exist"):
        prepare(opts([tmp_path / "missing.txt"], tmp_path / "o4"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="no documents"):
        prepare(opts([tmp_path / "empty.txt"], tmp_path / "o5"))
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="val split has no tokens"):
        prepare(opts([tmp_path / "one.txt"], tmp_path / "o6"))


def test_missing_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body'\]\)"):
        prepare(opts([tmp_path / "a.parquet"], tmp_path / "o"))


def test_existing_output_needs_overwrite(tmp_path):
    src = write_texts(tmp_path / "txt", TEXTS)
    prepare(opts([src], tmp_path / "out"))
    with pytest.raises(DataError, match="--overwrite"):
        prepare(opts([src], tmp_path / "out"))
    prepare(opts([src], tmp_path / "out", overwrite=True))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.md").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        prepare(opts([src], tmp_path / "other"))
