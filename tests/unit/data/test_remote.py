"""Remote sources against a real HTTP server started in a thread (http.server, not a mock of the
client): whole reads, retries that continue where a dropped connection stopped (with and without
Range support), stalls, missing objects, unreachable hosts, and a mixture read over HTTP that
equals the same mixture read from disk."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from common.errors import DataError
from data.config import DataConfig, SourceConfig
from data.loader import build_data
from data.remote import RemotePolicy, RemoteReader
from tests.unit.data.mixture_data import VOCAB, T, mmap_dir, wds_dir

FAST = RemotePolicy(retries=2, timeout=5.0, backoff=0.01)


class FlakyHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files, with Range support when the server says so, dropping or stalling the first
    ``server.drops[name]`` / ``server.stalls[name]`` responses for a file name part-way."""

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        server = self.server
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        ranged = self.headers.get("Range")
        if server.ranges and ranged and ranged.startswith("bytes="):
            start = int(ranged[len("bytes="):].split("-")[0])
        server.requests.append((path.name, start if ranged else None))
        body = data[start:]
        if server.stalls.get(path.name, 0) > 0:
            server.stalls[path.name] -= 1
            time.sleep(server.stall_s)
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        drop = server.drops.get(path.name, 0)
        if drop > 0 or path.name in server.always_drop:
            server.drops[path.name] = drop - 1
            self.wfile.write(body[: max(1, len(body) // 2)])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the body ends short of its Content-Length
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def serve():
    servers = []

    def start(root: Path, *, ranges: bool = True, drops: dict | None = None, always_drop=(), stalls=None,
              stall_s: float = 0.0):
        def handler(*args, **kwargs):
            return FlakyHandler(*args, directory=str(root), **kwargs)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.ranges, server.drops, server.always_drop = ranges, dict(drops or {}), set(always_drop)
        server.stalls, server.stall_s, server.requests = dict(stalls or {}), stall_s, []
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def blob(tmp_path):
    (tmp_path / "site").mkdir()
    data = bytes(range(256)) * 4000  # ~1 MB: several reads of the response
    (tmp_path / "site" / "blob.bin").write_bytes(data)
    return tmp_path / "site", data


@pytest.mark.parametrize("ranges", [True, False])
def test_a_dropped_connection_is_retried_from_where_it_stopped(serve, blob, ranges):
    root, data = blob
    server, url = serve(root, ranges=ranges, drops={"blob.bin": 1})
    reader = RemoteReader(FAST)
    assert reader.fetch(f"{url}/blob.bin") == data
    assert reader.retries_used == 1 and "blob.bin" in reader.last_retry
    first, second = server.requests
    assert first == ("blob.bin", None)
    if ranges:  # the retry asked only for the rest, from a byte the first answer had reached
        assert 0 < second[1] < len(data)
    else:  # the server ignored Range: the reader skipped what it already held
        assert second[0] == "blob.bin" and len(server.requests) == 2


def test_a_stalled_response_times_out_and_is_retried(serve, blob):
    root, data = blob
    server, url = serve(root, stalls={"blob.bin": 1}, stall_s=3.0)
    reader = RemoteReader(RemotePolicy(retries=1, timeout=0.5, backoff=0.01))
    assert reader.fetch(f"{url}/blob.bin") == data
    assert reader.retries_used == 1 and "timed out" in reader.last_retry.lower()


def test_a_connection_that_always_drops_is_one_line_naming_the_url(serve, blob):
    root, data = blob
    server, url = serve(root, always_drop={"blob.bin"})
    with pytest.raises(DataError, match=rf"{url}/blob.bin: unreachable or dropped after 3 attempt\(s\) at byte "
                                        rf"[\d,]+ of {len(data):,}") as info:
        RemoteReader(FAST).fetch(f"{url}/blob.bin")
    assert "\n" not in str(info.value) and len(server.requests) == 3


def test_missing_objects_are_not_retried_and_closed_ports_are_named(serve, blob):
    root, _ = blob
    server, url = serve(root)
    with pytest.raises(DataError, match=rf"{url}/nope.bin: not found \(HTTP 404\)"):
        RemoteReader(FAST).fetch(f"{url}/nope.bin")
    assert len(server.requests) == 0  # 404 before any body: one request, not retried
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(DataError, match=rf"http://127.0.0.1:{closed}/x: unreachable or dropped after 3 "
                                            rf"attempt\(s\) \(URLError: .*refused"):
            RemoteReader(FAST).fetch(f"http://127.0.0.1:{closed}/x")


def test_fsspec_urls_read_through_fsspec(blob):
    fsspec = pytest.importorskip("fsspec")
    _, data = blob
    fs = fsspec.filesystem("memory")
    fs.pipe("/perfgpt-test/blob.bin", data)
    try:
        assert RemoteReader(FAST).fetch("memory://perfgpt-test/blob.bin") == data
        with pytest.raises(DataError, match="memory://perfgpt-test/none.bin: not found"):
            RemoteReader(FAST).fetch("memory://perfgpt-test/none.bin")
    finally:
        fs.rm("/perfgpt-test", recursive=True)


def firsts(stream, n):
    out = []
    for _ in range(n):
        x, y = next(stream)
        assert torch.equal(x[:, 1:], y[:, :-1])
        out.append(x.clone())
    return out


def test_a_mixture_read_over_http_with_dropped_shards_equals_the_local_one(serve, tmp_path, caplog):
    site = tmp_path / "site"
    mmap_dir(site / "web", 0, windows=40, shards=3)
    wds_dir(site / "code", 5000, samples=30, per_shard=6)
    server, url = serve(site, drops={"train-000001.bin": 1, "shard-000002.tar": 2})

    def mixture(root: str, cache: Path) -> DataConfig:
        sources = [SourceConfig(path=f"{root}/web", name="web", weight=2),
                   SourceConfig(path=f"{root}/code", name="code", format="webdataset", weight=1)]
        return DataConfig(sources=sources, shuffle_buffer=0, cache_dir=str(cache), retries=2, request_timeout=5.0)

    def batches(config):
        data = build_data(config, seq_len=T, micro_batch_size=3, seed=3, rank=0, world_size=1, vocab_size=VOCAB)
        return firsts(data.train, 40), [x for x, _ in data.val_sources["code"].batches(6)]

    local = batches(mixture(str(site), tmp_path / "cache-local"))
    with caplog.at_level(logging.WARNING, logger="perfgpt"):
        remote = batches(mixture(url, tmp_path / "cache"))
    assert all(torch.equal(a, b) for a, b in zip(local[0] + local[1], remote[0] + remote[1]))
    # both flaky files were read (all of their samples are needed), each after its retries, and said so
    retried = [r.getMessage() for r in caplog.records if "retr" in r.getMessage()]
    assert any("train-000001.bin after 1 retry" in m for m in retried)
    assert any("shard-000002.tar after 2 retries" in m for m in retried)
    # remote mmap shards were cached once and memory-mapped from there
    assert len(list((tmp_path / "cache" / "remote").rglob("train-00000*.bin"))) == 3
    names = [name for name, _ in server.requests]
    assert names.count("train-000000.bin") == 1


def test_an_unreachable_source_stops_before_any_batch(serve, tmp_path):
    site = tmp_path / "site"
    mmap_dir(site / "web", 0, windows=10)
    server, url = serve(site)
    config = DataConfig(sources=[SourceConfig(path=f"{url}/missing", name="web")], retries=0)
    with pytest.raises(DataError, match=rf"{url}/missing/meta.json: not found"):
        build_data(config, seq_len=T, micro_batch_size=2, seed=0, rank=0, world_size=1, vocab_size=VOCAB)
