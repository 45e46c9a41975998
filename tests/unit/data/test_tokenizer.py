"""The built-in byte tokenizer: vocabulary 256, NUL (id 0) reserved as end-of-text."""

import numpy as np
import pytest

from common.errors import DataError
from data.tokenizer import ByteTokenizer, build_tokenizer


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
