"""Data integrity: damaged WebDataset shards, corrupt mmap tokens, invalid UTF-8, no import cycle.

Each test here failed before its fix: a damaged tar silently ended its shard early, a flipped
token byte trained unnoticed under the default checks, and prepare_data replaced invalid UTF-8
without a word.
"""

import ast
import gc
import importlib.util
import logging
import multiprocessing
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from common.errors import DataError
from data.bundle import IGNORE_INDEX
from data.config import DataConfig
from data.loader import build_data
from data.prepare import PrepareOptions, Utf8Report, decode_utf8, prepare
from data.shards import HEADER, HEADER_V1, TokenShard, read_dataset_meta, read_header, write_meta
from data.tokenizer import ByteTokenizer
from data.wds_format import TokenSampleWriter

ROOT = Path(__file__).resolve().parents[3]

# ------------------------------------------------------------------- WebDataset shard counts

VOCAB, EOT, T, B = 65536, 65535, 8, 2
needs_wds = pytest.mark.skipif(importlib.util.find_spec("webdataset") is None, reason="webdataset not installed")


def make_wds(root: Path, samples: int = 40, val_samples: int = 12, per_shard: int = 10) -> Path:
    """Sample k of a split starts with token k*T, so its first token identifies it."""
    splits = {}
    for split, n in (("train", samples), ("val", val_samples)):
        w = TokenSampleWriter(root / split, seq_len=T, vocab_size=VOCAB, samples_per_shard=per_shard)
        w.add_document(np.arange(n * T), EOT)  # + EOT: exactly n windows
        splits[split], _ = w.close()
    write_meta(root, format="webdataset", tokenizer="test", vocab_size=VOCAB, eot_id=EOT, splits=splits,
               seq_len=T, encoding="raw")
    return root


def wds_bundle(root, rank=0, world_size=1, **cfg):
    config = DataConfig(format="webdataset", path=str(root), shuffle_buffer=0, shuffle_shards=False, **cfg)
    return build_data(config, seq_len=T, micro_batch_size=B, seed=0, rank=rank, world_size=world_size,
                      vocab_size=VOCAB)


def sample_ids(stream, n_batches: int) -> list[int]:
    return [int(v) // T for _ in range(n_batches) for v in next(stream)[0][:, 0]]


def damage_tar(path: Path, key: int, kind: str) -> None:
    """Damage the tar at the first member of sample ``key`` (a 512-byte member boundary)."""
    with tarfile.open(path) as tar:
        at = min(m.offset for m in tar.getmembers() if m.name.startswith(f"{key:010d}."))
    assert at % 512 == 0 and at > 0
    raw = bytearray(path.read_bytes())
    if kind == "header":
        raw[at : at + 512] = b"\x5a" * 512  # the header block's bytes overwritten mid-file
        path.write_bytes(bytes(raw))
    else:
        path.write_bytes(bytes(raw[:at]))  # cut exactly at the member boundary


KINDS = ["header", "cut"]


@needs_wds
@pytest.mark.parametrize("kind", KINDS)
def test_wds_damaged_train_shard_is_an_error_naming_it(tmp_path, kind):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10)  # shard 1 holds samples 10..19
    damage_tar(root / "train" / "shard-000001.tar", 13, kind)
    stream = wds_bundle(root).train
    with pytest.raises(DataError) as err:
        sample_ids(stream, 20)  # one epoch
    message = str(err.value)
    assert "shard-000001.tar" in message and "3 readable sample(s), meta.json records 10" in message
    assert "on_bad_shard=skip" in message and "\n" not in message


@needs_wds
@pytest.mark.parametrize("kind", KINDS)
def test_wds_damaged_train_shard_is_skipped_and_counted(tmp_path, kind, caplog):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10)
    damage_tar(root / "train" / "shard-000001.tar", 13, kind)
    stream = wds_bundle(root, on_bad_shard="skip").train
    with caplog.at_level(logging.WARNING, logger="perfgpt.data"):
        ids = sample_ids(stream, 16)  # 32 samples: past shard 1 and into shard 2
    assert ids[:16] == list(range(13)) + [20, 21, 22]  # what shard 1 lost never appears
    assert stream.state_dict()["skipped"] == 1
    assert "shard-000001.tar" in caplog.text and "meta.json records 10" in caplog.text


@needs_wds
@pytest.mark.parametrize("kind", KINDS)
def test_wds_damaged_val_shard_is_an_error(tmp_path, kind):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10, val_samples=40)
    damage_tar(root / "val" / "shard-000001.tar", 13, kind)
    val = wds_bundle(root).val
    with pytest.raises(DataError, match=r"val/shard-000001\.tar: WebDataset shard holds 3 readable sample"):
        list(val.batches(100))


@needs_wds
@pytest.mark.parametrize("kind", KINDS)
def test_wds_damaged_val_shard_is_skipped_alike_on_every_rank(tmp_path, kind, caplog):
    root = make_wds(tmp_path / "w", samples=40, per_shard=10, val_samples=40)
    damage_tar(root / "val" / "shard-000001.tar", 13, kind)
    got, batches = [], []
    with caplog.at_level(logging.WARNING, logger="perfgpt.data"):
        for rank in range(2):
            val = wds_bundle(root, rank=rank, world_size=2, on_bad_shard="skip").val
            rows = [(x[i], y[i]) for x, y in val.batches(100) for i in range(len(x))]
            batches.append(len(rows))
            got.append([int(x[0]) // T for x, y in rows if y[0] != IGNORE_INDEX])
            assert list(val.skipped) == [str(root / "val" / "shard-000001.tar")]
    # samples 13..19 are lost: the set is the 33 that remain, shared 17 + 16, and both ranks run
    # the same batches (rank 1's last row is padding)
    assert batches[0] == batches[1] and (len(got[0]), len(got[1])) == (17, 16)
    assert sorted(got[0] + got[1]) == list(range(13)) + list(range(20, 40))
    assert "val/shard-000001.tar" in caplog.text


# ------------------------------------------------------------------ lazy CRC of mmap shards

TEXTS = [f"document {i}: " + "lorem ipsum dolor " * (i % 5 + 2) for i in range(40)]
CHUNK = 64  # tokens per CRC chunk, so a small dataset has many chunks


def prepared(tmp_path, **kw) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(TEXTS):
        (src / f"{i:03d}.txt").write_text(text)
    out = tmp_path / "data"
    kw.setdefault("shard_tokens", 1000)  # several train shards
    prepare(PrepareOptions(inputs=[str(src)], out_dir=str(out), progress=False, chunk_tokens=CHUNK, **kw))
    return out


def flip_token_byte(path: Path, token: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 2 * token] ^= 0x01  # the id stays inside the byte vocab: only a CRC can tell
    path.write_bytes(bytes(raw))


def mmap_bundle(root, **cfg):
    config = DataConfig(format="mmap", path=str(root), sampling="sequential", **cfg)
    return build_data(config, seq_len=T, micro_batch_size=B, seed=0, rank=0, world_size=1, vocab_size=256)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_flipped_token_byte_is_caught_when_its_chunk_is_first_read(tmp_path, workers):
    root = prepared(tmp_path)
    shard_path = root / "train-000000.bin"
    clean = np.asarray(TokenShard(shard_path).tokens).astype(np.int64)
    flip_token_byte(shard_path, 5 * CHUNK + 10)  # chunk 5: tokens 320..383
    children = set(multiprocessing.active_children())
    data = mmap_bundle(root, num_workers=workers)  # defaults otherwise: verify=lazy
    assert "verify=lazy" in data.description
    # Window i spans tokens [8i, 8i + 9); windows 0..37 end before token 320 and read fine.
    for g in range(19):
        x, y = next(data.train)
        starts = [T * (2 * g), T * (2 * g + 1)]
        assert x.tolist() == [clean[s : s + T].tolist() for s in starts]
    with pytest.raises(DataError) as err:
        next(data.train)  # windows 38 and 39: 39 reaches token 320
    message = str(err.value)
    assert str(shard_path) in message and "token chunk 5" in message and "CRC" in message
    assert "\n" not in message  # one line, also when a worker raised it
    # The error stopped the worker, though pytest's ExceptionInfo keeps the loader's frames alive.
    assert set(multiprocessing.active_children()) == children


def test_a_dropped_stream_stops_its_workers(tmp_path):
    children = set(multiprocessing.active_children())
    data = mmap_bundle(prepared(tmp_path), num_workers=2)
    next(data.train)
    assert len(set(multiprocessing.active_children()) - children) == 2
    del data
    gc.collect()
    assert set(multiprocessing.active_children()) == children  # nothing (an exit hook) keeps them alive


def test_validation_reads_are_checked_too(tmp_path):
    root = prepared(tmp_path)
    flip_token_byte(root / "val-000000.bin", 3)
    with pytest.raises(DataError, match=r"val-000000\.bin: token chunk 0 .*fails its CRC check"):
        list(mmap_bundle(root).val.batches(1))


def test_verify_modes_are_named_and_behave(tmp_path):
    root = prepared(tmp_path)
    flip_token_byte(root / "train-000000.bin", 10)
    header = mmap_bundle(root, verify="header")
    assert "verify=header" in header.description
    next(header.train)  # header mode reads the corrupt window: what the mode promises, no more
    with pytest.raises(DataError, match=r"train-000000\.bin: token chunk 0 .*CRC"):
        mmap_bundle(root, verify="full")
    skipped = mmap_bundle(root, verify="full", on_bad_shard="skip")
    assert "verify=full" in skipped.description and "SKIPPED 1 bad shard" in skipped.description
    assert len(read_dataset_meta(root).files("train")) > 1 and "train-000000.bin" in skipped.skipped_shards[0]


def as_version_1(path: Path) -> None:
    """Rewrite a version-2 shard the way the version-1 writer laid it out (no chunk table)."""
    h = read_header(path)
    raw = path.read_bytes()
    body = raw[HEADER.size : h.chunk_table_at()]
    head = HEADER_V1.pack(b"PGPTTOK\0", 1, h.itemsize, h.token_count, h.doc_count, h.vocab_size, h.max_token_id,
                          h.crc32)
    path.write_bytes(head + body)


def test_version_1_shards_still_read_and_are_checked_whole(tmp_path):
    root = prepared(tmp_path)
    for name in ("train-000000.bin", "val-000000.bin"):
        as_version_1(root / name)
    good = mmap_bundle(root)
    assert "2 version-1 shard(s) such as train-000000.bin" in good.description
    assert TokenShard(root / "train-000000.bin").header.version == 1
    next(good.train)
    list(good.val.batches(2))
    flip_token_byte(root / "train-000000.bin", 7 * CHUNK)  # far from the first window
    with pytest.raises(DataError, match=r"train-000000\.bin: token data \(version-1 shard"):
        next(mmap_bundle(root).train)


def test_header_bytes_are_covered_by_a_crc(tmp_path):
    root = prepared(tmp_path)
    path = root / "train-000000.bin"
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0x01  # inside max_token_id: size and magic still pass
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train-000000\.bin: corrupt header \(fails its CRC check\)"):
        mmap_bundle(root)


def test_chunk_crcs_cover_documents_across_chunk_boundaries(tmp_path):
    root = prepared(tmp_path)
    shard = TokenShard(root / "train-000000.bin")
    tokens = np.asarray(shard.tokens)
    assert shard.header.chunk_count == -(-len(tokens) // CHUNK) > 5
    for c in range(shard.header.chunk_count):
        assert int(shard.chunk_crcs[c]) == zlib.crc32(tokens[c * CHUNK : (c + 1) * CHUNK].tobytes())
    shard.verify()


def test_default_corpus_is_written_in_the_new_format(tmp_path):
    data = build_data(DataConfig(cache_dir=str(tmp_path), default_corpus_max_mb=0.2, val_fraction=0.2),
                      seq_len=16, micro_batch_size=2, seed=0, rank=0, world_size=1, vocab_size=256)
    assert "verify=lazy" in data.description and "version-1" not in data.description
    meta = read_dataset_meta(next(tmp_path.iterdir()))
    assert all(TokenShard(p).header.version == 2 for s in ("train", "val") for p in meta.files(s))


# --------------------------------------------------------------- invalid UTF-8 in prepare_data

BAD_TEXT = b"caf\xe9 ok\n\nsecond \xff\xfe paragraph\n"  # latin-1 e-acute at byte 3, then two bad bytes


def utf8_inputs(tmp_path) -> list[Path]:
    (tmp_path / "in").mkdir()
    good = [tmp_path / "in" / f"good{i}.txt" for i in range(12)]
    for i, p in enumerate(good):
        p.write_text(f"plain document {i}\n")
    bad = tmp_path / "in" / "bad.txt"
    bad.write_bytes(BAD_TEXT)
    jsonl = tmp_path / "in" / "rows.jsonl"
    jsonl.write_bytes(b'{"text": "row one"}\n{"text": "row \xc3 two"}\n')
    return [*good, bad, jsonl]


def test_invalid_utf8_is_replaced_counted_and_reported(tmp_path):
    inputs = utf8_inputs(tmp_path)
    report = Utf8Report()
    prepare(PrepareOptions(inputs=[str(p) for p in inputs], out_dir=str(tmp_path / "o"), progress=False,
                           val_fraction=0.1), report)
    assert report.replacements == 4 and report.places == 2  # e9, ff, fe in bad.txt; c3 in row 2
    assert report.examples[0] == f"{inputs[-2]} (byte 3, 3 replaced)"
    assert report.examples[1] == f"{inputs[-1]}:2 (byte 34, 1 replaced)"  # file offset of the bad byte
    assert "replaced 4 invalid UTF-8 sequence(s)" in report.summary()
    meta = read_dataset_meta(tmp_path / "o")
    docs = []
    for split in ("train", "val"):
        for path in meta.files(split):
            shard = TokenShard(path)
            docs += [ByteTokenizer().decode(shard.document(i)) for i in range(shard.header.doc_count)]
    assert BAD_TEXT.decode(errors="replace") in docs and "row \ufffd two" in docs


def test_invalid_utf8_without_a_report_is_logged(tmp_path, caplog):
    inputs = utf8_inputs(tmp_path)
    with caplog.at_level(logging.WARNING, logger="perfgpt.data"):
        prepare(PrepareOptions(inputs=[str(p) for p in inputs], out_dir=str(tmp_path / "o"), progress=False))
    assert "replaced 4 invalid UTF-8 sequence(s)" in caplog.text and "bad.txt" in caplog.text


def test_decode_matches_python_replace_and_finds_the_first_offset():
    for raw in (b"", b"ascii", "héllo".encode(), b"a\x80b", b"\xf0\x9f\x98", b"ok\xed\xa0\x80z\xff"):
        text, count, first = decode_utf8(raw)
        assert text == raw.decode("utf-8", errors="replace")
        assert count == len(text) - len(raw.decode("utf-8", errors="ignore")) and (first >= 0) == bool(count)
    assert decode_utf8(b"ab\xffcd")[2] == 2


def test_jsonl_error_names_the_line_and_file_offset(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "row one"}\n{"text": "row \xc3 two"}\n')
    opts = PrepareOptions(inputs=[str(path)], out_dir=str(tmp_path / "o"), progress=False, on_invalid_utf8="error")
    with pytest.raises(DataError, match=r"rows\.jsonl:2: invalid UTF-8 at byte offset 34;"):
        prepare(opts)
    with pytest.raises(DataError, match="invalid-UTF-8 policy 'drop'"):
        prepare(PrepareOptions(inputs=[str(path)], out_dir=str(tmp_path / "p"), on_invalid_utf8="drop"))


# ----------------------------------------------------------------- the loader modules import no cycle

PROJECT_PACKAGES = ("data", "model", "training", "parallel", "kernels", "analysis", "tools")


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(module, inside a function) for every import of the project's own packages."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module:
                names = [child.module]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            else:
                names = []
            found.extend((n, in_function) for n in names if n.split(".")[0] in PROJECT_PACKAGES)
            visit(child, nested)

    visit(tree, False)
    return found


def test_data_modules_import_each_other_at_the_top_without_a_cycle():
    graph = {}
    for path in sorted((ROOT / "data").glob("*.py")):
        imports = _imports(ast.parse(path.read_text()))
        inside = [m for m, in_function in imports if in_function]
        assert not inside, f"{path.name} imports {inside} inside a function"
        graph[f"data.{path.stem}"] = {m for m, _ in imports if m.startswith("data.")}
    assert "data.loader" not in graph["data.webdataset_loader"]
    assert {"data.bundle", "data.webdataset_loader"} <= graph["data.loader"]

    def reach(start, seen):
        for nxt in graph.get(start, ()):
            if nxt not in seen:
                seen.add(nxt)
                reach(nxt, seen)
        return seen

    for module in graph:
        assert module not in reach(module, set()), f"{module} imports itself through a cycle"


def test_loader_still_exports_the_stream_pieces():
    import data.bundle
    import data.loader

    for name in ("DataBundle", "TrainStream", "ValSource", "seed_worker", "split_windows", "STATE_VERSION"):
        assert getattr(data.loader, name) is getattr(data.bundle, name)
