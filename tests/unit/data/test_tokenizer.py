"""Tokenizers: the built-in byte tokenizer (vocabulary 256, NUL reserved as end-of-text), Hugging Face
tokenizer directories with their special tokens, and every tokenizer's identity."""

import json

import numpy as np
import pytest

from common.errors import DataError
from data.tokenizer import ByteTokenizer, build_tokenizer, check_separators, identity, with_separators


def test_utf8_round_trip_and_ids_are_the_bytes():
    tok = build_tokenizer("byte")
    text = "déjà vu → λx.x  # ok\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint32 and ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eot_id) == (256, 0)


def test_nul_is_dropped_so_zero_only_marks_document_ends():
    tok = ByteTokenizer()
    assert tok.encode(b"a\0b\0").tolist() == [ord("a"), ord("b")]
    assert tok.decode([ord("a"), 0, ord("b")]) == "ab"


def test_decode_rejects_ids_outside_a_byte():
    with pytest.raises(DataError, match=r"ids must be in \[0, 255\]"):
        ByteTokenizer().decode([65, 300])


def test_missing_hf_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"nope\.json does not exist"):
        build_tokenizer(f"hf:{tmp_path / 'nope.json'}")


def hf_tokenizer_dir(root, vocab, config=None):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_hf_tokenizer_directory_names_its_special_tokens_and_has_an_identity(tmp_path):
    vocab = {"[UNK]": 0, "<s>": 1, "<|end_of_text|>": 2, "<|eot_id|>": 3, "hello": 4}
    llama_like = hf_tokenizer_dir(tmp_path / "a", vocab, {"bos_token": "<s>", "eos_token": {"content": "<|eot_id|>"}})
    tok = build_tokenizer(f"hf:{llama_like}")
    assert (tok.vocab_size, tok.eot_id, tok.bos_id) == (5, 3, 1)  # the config's eos wins over the usual names
    plain = hf_tokenizer_dir(tmp_path / "b", vocab)  # no config: found by their usual names
    assert (build_tokenizer(f"hf:{plain}").eot_id, build_tokenizer(f"hf:{plain}").bos_id) == (2, 1)
    same = build_tokenizer(f"hf:{plain / 'tokenizer.json'}")  # the file itself, another spec string
    other = build_tokenizer(f"hf:{hf_tokenizer_dir(tmp_path / 'c', vocab | {'world': 5})}")
    assert identity(same)["sha256"] == identity(tok)["sha256"] != identity(other)["sha256"]
    assert identity(ByteTokenizer())["bos_id"] is None


def test_with_separators_and_a_missing_bos(tmp_path):
    tok = build_tokenizer(f"hf:{hf_tokenizer_dir(tmp_path / 't', {'[UNK]': 0, '<s>': 1, '</s>': 2, 'a': 3})}")
    ids = np.asarray([3, 3], dtype=np.uint32)
    assert with_separators(tok, ids, bos=True, eos=True).tolist() == [1, 3, 3, 2]
    assert with_separators(tok, ids, bos=False, eos=False).tolist() == [3, 3]
    with pytest.raises(DataError, match="tokenizer byte has no beginning-of-sequence token"):
        check_separators(ByteTokenizer(), bos=True, where="--bos")
