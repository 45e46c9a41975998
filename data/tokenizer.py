"""Tokenizers behind one small interface: encode text to a uint32 array, decode back.

Three kinds, chosen by a spec string:

- ``byte``: the built-in byte-level tokenizer, vocabulary 256. Id 0 (the NUL byte) is the
  end-of-text token that separates documents, so the vocabulary stays exactly 256 and a uniform
  guess costs ln(256) nats per token. NUL never occurs in source code or ordinary text; where it
  does, ``encode`` drops it so 0 can only mean "document ends here".
- ``tiktoken:<encoding>`` (e.g. ``tiktoken:gpt2``): needs the ``tiktoken`` package and the
  encoding's BPE file already in its local cache; we never let it download (clear error instead).
- ``hf:<path/to/tokenizer.json>``: a Hugging Face ``tokenizers`` file on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from common.errors import ConfigError, DataError


class Tokenizer(Protocol):
    name: str  # the spec string that rebuilds this tokenizer
    vocab_size: int
    eot_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...  # uint32 ids, no end-of-text added

    def decode(self, ids) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens; NUL (id 0) is reserved as end-of-text."""

    name: str = "byte"
    vocab_size: int = 256
    eot_id: int = 0

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(raw, dtype=np.uint8)
        if raw.find(b"\0") >= 0:
            ids = ids[ids != self.eot_id]
        return ids.astype(np.uint32)

    def decode(self, ids) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise DataError(f"byte tokenizer: ids must be in [0, 255], got range [{arr.min()}, {arr.max()}]")
        return arr[arr != self.eot_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A tiktoken encoding, loaded only from the local cache; its <|endoftext|> is the separator."""

    def __init__(self, encoding_name: str):
        try:
            import tiktoken
        except ImportError as e:
            raise DataError(
                f"tokenizer tiktoken:{encoding_name} needs the tiktoken package: pip install tiktoken"
            ) from e
        self._enc = _load_tiktoken_offline(tiktoken, encoding_name)
        self.name = f"tiktoken:{encoding_name}"
        self.vocab_size = int(self._enc.n_vocab)
        self.eot_id = int(self._enc.eot_token)

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def _load_tiktoken_offline(tiktoken, encoding_name: str):
    """Load an encoding without touching the network: tiktoken would otherwise download its file."""
    import tiktoken.load as tiktoken_load

    def refuse_download(url: str) -> bytes:
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or "<tmp>/data-gym-cache"
        raise DataError(
            f"tiktoken encoding {encoding_name!r} is not in the local cache ({cache}) and would need a "
            f"download from {url}; run tiktoken.get_encoding({encoding_name!r}) once on a machine with "
            f"network and copy the cache, or use --tokenizer byte / hf:<tokenizer.json>"
        )

    original = tiktoken_load.read_file
    tiktoken_load.read_file = refuse_download  # only the cache miss path calls read_file
    try:
        return tiktoken.get_encoding(encoding_name)
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"unknown tiktoken encoding {encoding_name!r}: {e}") from e
    finally:
        tiktoken_load.read_file = original


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``; the end-of-text token is found by its usual names."""

    EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")

    def __init__(self, path: str):
        file = Path(path)
        if not file.is_file():
            raise DataError(f"tokenizer file {path} does not exist (expected a Hugging Face tokenizer.json)")
        try:
            from tokenizers import Tokenizer as HFTok
        except ImportError as e:
            raise DataError(f"tokenizer hf:{path} needs the tokenizers package: pip install tokenizers") from e
        try:
            self._tok = HFTok.from_file(str(file))
        except Exception as e:  # the Rust side raises its own exception type
            raise DataError(f"{path} is not a valid tokenizer.json: {e}") from e
        self.name = f"hf:{file}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eot_id = self._find_eot(path)

    def _find_eot(self, path: str) -> int:
        for token in self.EOT_NAMES:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return int(tid)
        raise DataError(f"{path}: no end-of-text token found (looked for {', '.join(self.EOT_NAMES)})")

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(spec: str) -> Tokenizer:
    """``byte`` | ``tiktoken:<encoding>`` | ``hf:<path/to/tokenizer.json>``."""
    if spec == "byte":
        return ByteTokenizer()
    kind, _, arg = spec.partition(":")
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(arg)
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    raise DataError(f"unknown tokenizer {spec!r}; valid: byte, tiktoken:<encoding>, hf:<path/to/tokenizer.json>")


def build_model_tokenizer(spec: str, vocab_size: int, hint: str) -> Tokenizer:
    """The tokenizer ``spec`` for a model with ``vocab_size`` ids, refused (ConfigError) when it has
    more ids than that: its ids past the vocabulary would index outside the embedding table. It is
    not the tokenizer the model was trained with; ``hint`` says how to pass that one."""
    tokenizer = build_tokenizer(spec)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {spec} has {tokenizer.vocab_size:,} ids, more than the model's vocabulary of "
                          f"{vocab_size:,} (model.vocab_size): it is not the tokenizer this model was trained with; "
                          f"{hint}")
    return tokenizer


def token_byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes of text each id stands for (0 for end-of-text and ids beyond the tokenizer), the
    denominator of bits per byte. Exact for the byte and tiktoken tokenizers; for a Hugging Face
    tokenizer the length of the id decoded alone (a token that is part of a multi-byte character
    decodes to a replacement character, so such text is slightly over-counted)."""
    lengths = np.zeros(vocab_size, dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        lengths[: min(256, vocab_size)] = 1
    elif isinstance(tokenizer, TiktokenTokenizer):
        for i in range(min(tokenizer.vocab_size, vocab_size)):
            try:
                lengths[i] = len(tokenizer._enc.decode_single_token_bytes(i))
            except KeyError:  # ids between the ordinary and the special tokens
                lengths[i] = 0
    else:
        for i in range(min(tokenizer.vocab_size, vocab_size)):
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    if 0 <= tokenizer.eot_id < vocab_size:
        lengths[tokenizer.eot_id] = 0
    return lengths
