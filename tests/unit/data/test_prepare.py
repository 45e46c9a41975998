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
    with pytest.raises(DataError, match="would need a download.*point TIKTOKEN_CACHE_DIR at a copy of its cache"):
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


@pytest.mark.parametrize("layout", ["lines", "records"])
def test_json_files_are_read_by_their_content(tmp_path, layout):
    """A .json file of JSON lines (the c4 files' naming) and a .json list of records are both read with
    --text-field, as the same documents a .jsonl file gives."""
    records = [{"content": t, "n": i} for i, t in enumerate(TEXTS)]
    body = "\n".join(json.dumps(r) for r in records) if layout == "lines" else json.dumps(records, indent=2)
    (tmp_path / "c4-validation.json").write_text(body + "\n")
    prepare(opts([tmp_path / "c4-validation.json"], tmp_path / "out", text_field="content"))
    assert read_documents(tmp_path / "out") == expected_documents(TEXTS, ByteTokenizer())
    (tmp_path / "one.json").write_text(json.dumps({"content": "a"}, indent=2))
    with pytest.raises(DataError, match=r"one\.json: a single JSON dict; expected JSON lines"):
        prepare(opts([tmp_path / "one.json"], tmp_path / "o2", text_field="content"))


def test_a_failed_preparation_leaves_nothing_behind(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="val split has no tokens"):
        prepare(opts([tmp_path / "one.txt"], tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # created by the run, removed with it
    (tmp_path / "kept").mkdir()
    with pytest.raises(DataError, match="val split has no samples"):
        prepare(opts([tmp_path / "one.txt"], tmp_path / "kept", output="webdataset", seq_len=4))
    assert list((tmp_path / "kept").iterdir()) == []  # an existing folder stays, empty
    src = write_texts(tmp_path / "txt", TEXTS)  # the next run needs no --overwrite
    prepare(opts([src], tmp_path / "out"))
    assert read_documents(tmp_path / "out") == expected_documents(TEXTS, ByteTokenizer())


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("output", ["mmap", "webdataset"])
def test_an_interrupted_preparation_resumes_to_the_same_bytes(tmp_path, monkeypatch, output):
    import data.prepare as prep

    src = write_texts(tmp_path / "txt", TEXTS * 6)
    shape = dict(output=output, shard_tokens=400, seq_len=16, samples_per_shard=12)
    prepare(opts([src], tmp_path / "whole", **shape))
    real = prep.encoded_documents

    def stops_after(n):
        def encoded(*args, **kwargs):
            for i, item in enumerate(real(*args, **kwargs)):
                if i == n:
                    raise KeyboardInterrupt
                yield item
        return encoded

    monkeypatch.setattr(prep, "encoded_documents", stops_after(70))
    with pytest.raises(KeyboardInterrupt):
        prepare(opts([src], tmp_path / "out", **shape))
    assert (tmp_path / "out" / prep.PARTIAL / prep.JOURNAL).is_file()
    assert not (tmp_path / "out" / "meta.json").exists()
    with pytest.raises(DataError, match="interrupted preparation .*--resume"):
        prepare(opts([src], tmp_path / "out", **shape))
    journal = json.loads((tmp_path / "out" / prep.PARTIAL / prep.JOURNAL).read_text())
    monkeypatch.setattr(prep, "encoded_documents", stops_after(50))  # a second interruption, later on
    with pytest.raises(KeyboardInterrupt):
        prepare(opts([src], tmp_path / "out", resume=True, **shape))
    assert json.loads((tmp_path / "out" / prep.PARTIAL / prep.JOURNAL).read_text())["documents"] > journal["documents"]
    monkeypatch.setattr(prep, "encoded_documents", real)
    with pytest.raises(DataError, match="other inputs or options"):
        prepare(opts([src], tmp_path / "out", resume=True, **{**shape, "seq_len": 8}))
    summary = prepare(opts([src], tmp_path / "out", resume=True, **shape))
    assert digest(tmp_path / "out") == digest(tmp_path / "whole")
    assert summary["train"].documents + summary["val"].documents == len(TEXTS) * 6


def test_the_printed_training_command_runs_on_the_prepared_data(tmp_path):
    from data.loader import build_data
    from tools.prepare_data import train_command
    from training.config import load_config

    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed")
    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(298)]  # 300 ids: more than tiny.yaml's 256
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = [" ".join(f"w{(i * 7 + k) % 298}" for k in range(200)) for i in range(20)]
    src = write_texts(tmp_path / "txt", texts)
    prepare(opts([src], tmp_path / "out", tokenizer=f"hf:{tmp_path / 'tokenizer.json'}", output="webdataset",
                 seq_len=64, samples_per_shard=50))
    command = train_command(str(tmp_path / "out"))
    assert "--model.vocab_size=384" in command and "--data.seq_len=64" in command
    _, _, _, config, *overrides = command.split()
    cfg = load_config(ROOT / config, overrides)
    data = build_data(cfg.data, seq_len=cfg.seq_len, micro_batch_size=2, seed=0, rank=0, world_size=1,
                      vocab_size=cfg.model.vocab_size)
    assert next(data.train)[0].shape == (2, 64)
    assert train_command(str(tmp_path / "out")).startswith("python train.py --config configs/tiny.yaml")
