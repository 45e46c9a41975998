"""Tokenizers behind one small interface: encode text to a uint32 array, decode back.

Three kinds, chosen by a spec string:

- ``byte``: the built-in byte-level tokenizer, vocabulary 256. Id 0 (the NUL byte) is the
  end-of-text token that separates documents, so the vocabulary stays exactly 256 and a uniform
  guess costs ln(256) nats per token. NUL never occurs in source code or ordinary text; where it
  does, ``encode`` drops it so 0 can only mean "document ends here".
- ``tiktoken:<encoding>`` (e.g. ``tiktoken:gpt2``): needs the ``tiktoken`` package and the
  encoding's BPE file already in its local cache (``TIKTOKEN_CACHE_DIR``); we never let it
  download (clear error instead).
- ``hf:<path>``: a Hugging Face ``tokenizer.json`` on disk, or a model directory holding one (a
  Llama-3 or Qwen download, say). Its ``tokenizer_config.json``, when present, names the
  end-of-text and beginning-of-sequence tokens; otherwise they are found by their usual names.

Every tokenizer has an identity (``identity()``: name, vocabulary size, end-of-text and
beginning-of-sequence ids, and a SHA-256 of its definition), which prepared datasets and
checkpoints record, so data and a model made with different tokenizers are told apart even when
their vocabularies have the same size.
"""

from __future__ import annotations

import hashlib
import json
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
    bos_id: int | None  # beginning-of-sequence id; None: the tokenizer has none
    sha256: str  # of its definition (the same tokenizer read from another path has the same one)

    def encode(self, text: str | bytes) -> np.ndarray: ...  # uint32 ids, no end-of-text added

    def decode(self, ids) -> str: ...


def identity(tok: Tokenizer) -> dict:
    """What datasets and checkpoints record about a tokenizer (plain values)."""
    return {"name": tok.name, "vocab_size": int(tok.vocab_size), "eot_id": int(tok.eot_id),
            "bos_id": None if tok.bos_id is None else int(tok.bos_id), "sha256": tok.sha256}


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens; NUL (id 0) is reserved as end-of-text."""

    name: str = "byte"
    vocab_size: int = 256
    eot_id: int = 0
    bos_id: int | None = None  # all 256 ids are bytes or the separator: no room for one
    sha256: str = _digest(b"perfgpt byte tokenizer: ids are UTF-8 bytes, 0 is end-of-text")

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
        self.bos_id = None  # GPT-2's BPE marks documents with <|endoftext|> only
        self.sha256 = _tiktoken_digest(self._enc)

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self._enc.encode_ordinary_batch(texts)]

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def _tiktoken_digest(enc) -> str:
    """Over the merge ranks, special tokens and split pattern (private attributes of tiktoken's
    Encoding, read defensively: without them, over the name and size only)."""
    ranks = getattr(enc, "_mergeable_ranks", None)
    special = getattr(enc, "_special_tokens", {})
    if not isinstance(ranks, dict):
        return _digest(enc.name.encode(), str(enc.n_vocab).encode())
    merges = b"".join(token + rank.to_bytes(4, "little") for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    return _digest(merges, json.dumps(special, sort_keys=True).encode(), str(getattr(enc, "_pat_str", "")).encode())


def _load_tiktoken_offline(tiktoken, encoding_name: str):
    """Load an encoding without touching the network: tiktoken would otherwise download its file."""
    import tiktoken.load as tiktoken_load

    def refuse_download(url: str) -> bytes:
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or "<tmp>/data-gym-cache"
        raise DataError(
            f"tiktoken encoding {encoding_name!r} is not in the local cache ({cache}) and would need a "
            f"download from {url}; run tiktoken.get_encoding({encoding_name!r}) once on a machine with "
            f"network and point TIKTOKEN_CACHE_DIR at a copy of its cache, or use --tokenizer byte / hf:<tokenizer.json>"
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
    """A Hugging Face ``tokenizer.json`` (or a directory holding one, with its ``tokenizer_config.json``)."""

    EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
    BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")

    def __init__(self, path: str):
        given = Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        if not file.is_file():
            raise DataError(f"tokenizer file {file} does not exist (expected a Hugging Face tokenizer.json, or a "
                            f"directory holding one)")
        try:
            from tokenizers import Tokenizer as HFTok
        except ImportError as e:
            raise DataError(f"tokenizer hf:{path} needs the tokenizers package: pip install tokenizers") from e
        try:
            self._tok = HFTok.from_file(str(file))
        except Exception as e:  # the Rust side raises its own exception type
            raise DataError(f"{file} is not a valid tokenizer.json: {e}") from e
        self.name = f"hf:{path}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        named = _special_token_names(file.parent / "tokenizer_config.json")
        self.eot_id = self._find(named.get("eos_token"), self.EOT_NAMES)
        if self.eot_id is None:
            raise DataError(f"{file}: no end-of-text token found (looked for "
                            f"{', '.join(([named['eos_token']] if named.get('eos_token') else []) + list(self.EOT_NAMES))})")
        self.bos_id = self._find(named.get("bos_token"), self.BOS_NAMES)
        self.sha256 = _digest(self._tok.to_str().encode())

    def _find(self, configured: str | None, names: tuple[str, ...]) -> int | None:
        for token in ([configured] if configured else []) + list(names):
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many documents at once (the Rust side spreads them over its threads)."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _special_token_names(config: Path) -> dict[str, str]:
    """``eos_token`` / ``bos_token`` of a tokenizer_config.json (strings, or dicts with "content")."""
    if not config.is_file():
        return {}
    try:
        body = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{config} is not readable JSON ({e})") from e
    names = {}
    for key in ("eos_token", "bos_token"):
        value = body.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            names[key] = value
    return names


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text (no separators), in one call where the tokenizer batches."""
    batch = getattr(tok, "encode_batch", None)
    return batch(texts) if batch is not None else [tok.encode(t) for t in texts]


def with_separators(tok: Tokenizer, ids: np.ndarray, *, bos: bool, eos: bool) -> np.ndarray:
    """One document's ids with the beginning-of-sequence id before and the end-of-text id after,
    as asked; a BOS the tokenizer lacks is an error (checked once by ``check_separators``)."""
    parts = ([np.asarray([tok.bos_id], dtype=np.uint32)] if bos else []) + [ids.astype(np.uint32, copy=False)]
    if eos:
        parts.append(np.asarray([tok.eot_id], dtype=np.uint32))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def check_separators(tok: Tokenizer, *, bos: bool, where: str) -> None:
    if bos and tok.bos_id is None:
        raise DataError(f"{where}: tokenizer {tok.name} has no beginning-of-sequence token; turn bos off")


def build_tokenizer(spec: str) -> Tokenizer:
    """``byte`` | ``tiktoken:<encoding>`` | ``hf:<path/to/tokenizer.json or its directory>``."""
    if spec == "byte":
        return ByteTokenizer()
    kind, _, arg = spec.partition(":")
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(arg)
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    raise DataError(f"unknown tokenizer {spec!r}; valid: byte, tiktoken:<encoding>, hf:<path/to/tokenizer.json or its directory>")


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
