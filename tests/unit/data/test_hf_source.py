"""Hugging Face datasets as a mixture source: local JSON lines and Parquet directories streamed,
tokenized and packed on the fly (checked against packing written out here), BOS/EOS keys, a
held-out validation split, exact resume inside a mixture, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("datasets", reason="datasets not installed")

from common.errors import DataError  # noqa: E402
from data.config import DataConfig, SourceConfig  # noqa: E402
from data.loader import build_data  # noqa: E402
from tests.unit.data.mixture_data import mmap_dir  # noqa: E402

T, B = 16, 2
TRAIN = [f"document {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(23)]
VAL = [f"held out {i} " * 3 for i in range(6)]


def reference_windows(texts, bos=None, eos=0):
    """Windows of T + 1 over the documents' bytes, each with its separators, as packing defines them."""
    stream = []
    for text in texts:
        stream += ([bos] if bos is not None else []) + list(text.encode()) + ([eos] if eos is not None else [])
    return [stream[k * T : k * T + T + 1] for k in range((len(stream) - 1) // T)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("hf")
    (root / "jsonl").mkdir()
    for name, texts in (("train", TRAIN), ("validation", VAL)):
        with open(root / "jsonl" / f"{name}.jsonl", "w") as f:
            for text in texts:
                f.write(json.dumps({"text": text, "id": 1}) + "\n")
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"body": TRAIN}), root / "parquet" / "train.parquet")
    pq.write_table(pa.table({"body": VAL}), root / "parquet" / "validation.parquet")
    return root


def bundle(sources, rank=0, world=1, batch=B, vocab=256, shuffle_buffer=0, **kw):
    config = DataConfig(sources=sources, shuffle_buffer=shuffle_buffer, **kw)
    config.validate()
    return build_data(config, seq_len=T, micro_batch_size=batch, seed=11, rank=rank, world_size=world,
                      vocab_size=vocab, val_limit=50)


def rows(stream, n):
    out = []
    for _ in range(n):
        x, y = next(stream)
        assert torch.equal(x[:, 1:], y[:, :-1])
        out += [torch.cat([x[i], y[i, -1:]]).tolist() for i in range(x.shape[0])]
    return out


@pytest.mark.parametrize("kind, field", [("jsonl", "text"), ("parquet", "body")])
def test_a_local_dataset_directory_is_streamed_and_packed(corpora, kind, field):
    data = bundle([SourceConfig(path=str(corpora / kind), format="hf", name="web", text_field=field)])
    ref = reference_windows(TRAIN)
    got = rows(data.train, (2 * len(ref) + 3) // B)  # past the end of two epochs: the tail is dropped each time
    assert got == (ref * 3)[: len(got)]
    val = [torch.cat([x[i], y[i, -1:]]).tolist() for x, y in data.val_sources["web"].batches(None)
           for i in range(x.shape[0]) if y[i, 0] != -100]
    assert val == reference_windows(VAL)
    assert "hf " in data.description and data.tokenizer == "byte"


def test_bos_eos_keys_and_a_held_out_validation_split(corpora, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"<s>": 95, "</s>": 96, "<unk>": 97}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    source = SourceConfig(path=str(corpora / "jsonl"), format="hf", name="web", tokenizer=f"hf:{tmp_path / 'tok'}",
                          bos=True, eos=True, val_documents=5)
    data = bundle([source], vocab=128)
    encode = [[ord(c) - 32 for c in text] for text in TRAIN]
    stream = [t for ids in encode[5:] for t in [95, *ids, 96]]  # the first 5 documents are held out
    expected = [stream[k * T : k * T + T + 1] for k in range(6)]
    assert rows(data.train, 3) == expected
    held = [t for ids in encode[:5] for t in [95, *ids, 96]]
    val = [torch.cat([x[i], y[i, -1:]]).tolist() for x, y in data.val_sources["web"].batches(None)
           for i in range(x.shape[0]) if y[i, 0] != -100]
    assert val == [held[k * T : k * T + T + 1] for k in range((len(held) - 1) // T)]
    assert data.eot_id == 96
    no_bos = SourceConfig(path=str(corpora / "jsonl"), format="hf", bos=True)  # the byte tokenizer has none
    with pytest.raises(DataError, match="tokenizer byte has no beginning-of-sequence token; turn bos off"):
        bundle([no_bos])


@pytest.mark.timeout(180)
def test_a_mixture_with_a_streaming_source_resumes_exactly_on_two_ranks_and_on_one(corpora, tmp_path):
    local = mmap_dir(tmp_path / "local", 0, windows=9)
    meta = (local / "meta.json").read_text().replace('"tokenizer": "test"', '"tokenizer": "byte"')
    (local / "meta.json").write_text(meta.replace('"vocab_size": 65536', '"vocab_size": 256'))
    sources = [SourceConfig(path=str(corpora / "jsonl"), format="hf", name="web", weight=3),
               SourceConfig(path=str(local), name="local", weight=1)]
    kw = dict(vocab=65536, shuffle_buffer=4)  # the streaming source shuffled through a buffer, seeded per epoch
    reference = rows(bundle(sources, batch=4, **kw).train, 30)  # past an epoch of web (over 2 times)
    ranks = [bundle(sources, rank=r, world=2, **kw).train for r in range(2)]
    for _ in range(11):
        for r in ranks:
            next(r)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["readers"]["web"]["doc"] > 0
    resumed = [bundle(sources, rank=r, world=2, **kw).train for r in range(2)]
    for r in resumed:
        r.load_state_dict(state)
    got = [a + b for a, b in zip(*[[rows(r, 1) for _ in range(8)] for r in resumed])]
    assert sum(got, []) == reference[44:76]
    one = bundle(sources, batch=4, **kw).train
    one.load_state_dict(resumed[0].state_dict())
    assert rows(one, 11) == reference[76:120]


def test_bad_hf_sources_are_one_line(corpora, tmp_path):
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "train.jsonl").write_text('{"text": "short"}\n')
    cases = [
        (SourceConfig(path=str(corpora / "jsonl"), format="hf", name="w", val_split="dev"),
         r"source w: .* has no split 'dev'; its splits: train, validation"),
        (SourceConfig(path=str(corpora / "jsonl"), format="hf", name="w", text_field="body"),
         r"source w: record 0 of .* has no field 'body' \(fields: \['id', 'text'\]\); set the source's text_field"),
        (SourceConfig(path=str(tmp_path / "only"), format="hf", name="w", val_documents=1),
         r"source w: the train split of .* holds fewer than 17 tokens"),
        (SourceConfig(path=str(tmp_path / "absent"), format="hf", name="w"), r"source w: .*absent does not exist"),
    ]
    for source, message in cases:
        with pytest.raises(DataError, match=message) as info:
            bundle([source])
        assert "\n" not in str(info.value)
