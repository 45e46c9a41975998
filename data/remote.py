"""Reading whole objects from URLs with timeouts and retries; the one place that opens a URL.

``http://`` and ``https://`` go through the standard library (``urllib``); any other scheme
(``s3://``, ``gs://``, ``memory://``, ...) through fsspec, when fsspec and the package for that
protocol are installed (a missing one is a one-line error naming it). ``file://`` and plain paths
are local files.

A read that fails (connection refused or reset, a timeout, a 5xx answer, a connection dropped
before the announced length arrived) is retried up to ``RemotePolicy.retries`` times with a
doubling pause. A retry continues where the bytes stopped: over HTTP with a ``Range`` request
(a server that ignores it and answers 200 is read from the start with the bytes already held
skipped), through fsspec with a seek. A missing object (404, FileNotFoundError) is not retried.
When every attempt fails, one ``DataError`` line names the URL, how far the read got and why.
Each ``RemoteReader`` counts the retries it needed, so a flaky source shows in the log rather
than only in the time.
"""

from __future__ import annotations

import http.client
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import DataError

CHUNK = 1 << 20


def is_url(path: str) -> bool:
    """A location to read through this module rather than the file system (``file://`` is local)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> Path:
    return Path(path[len("file://"):] if path.startswith("file://") else path)


def join(base: str, *parts: str) -> str:
    """``base`` (a URL or a path) with ``parts`` appended, '/'-separated."""
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


@dataclass(frozen=True)
class RemotePolicy:
    retries: int = 3  # attempts after the first
    timeout: float = 30.0  # seconds a connect or a read may stall
    backoff: float = 0.5  # seconds before the first retry, doubled for each next one


class _Missing(Exception):
    """The object does not exist: retrying cannot help."""


class _Transient(Exception):
    """Worth another attempt (a timeout, a reset, a 5xx, a short read)."""


@dataclass
class RemoteReader:
    """Reads URLs whole under one policy; ``retries_used`` counts the retries it needed."""

    policy: RemotePolicy = field(default_factory=RemotePolicy)
    retries_used: int = 0
    last_retry: str = ""  # why the most recent retry happened, for the log

    def fetch(self, url: str) -> bytes:
        """The whole object at ``url`` (a local path is read directly)."""
        if not is_url(url):
            try:
                return local_path(url).read_bytes()
            except FileNotFoundError:
                raise DataError(f"{url} does not exist") from None
            except OSError as e:
                raise DataError(f"cannot read {url}: {e.strerror}") from e
        parts: list[bytes] = []
        self._read(url, parts.append)
        return b"".join(parts)

    def fetch_to_file(self, url: str, dest: Path) -> Path:
        """Download ``url`` to ``dest`` atomically (a private temporary file renamed into place), so
        processes that fetch the same object at once never see each other's partial copy."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as out:
                self._read(url, out.write)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def _read(self, url: str, sink) -> None:
        progress = {"done": 0, "total": None}  # what arrived so far: a retry continues from there
        attempt = 0
        while True:
            try:
                self._attempt(url, progress, sink)
                return
            except _Missing as e:
                raise DataError(f"{url}: not found ({e}); check the URL") from None
            except _Transient as e:
                attempt += 1
                done, total = progress["done"], progress["total"]
                where = (f" at byte {done:,}" + (f" of {total:,}" if total else "")) if done else ""
                if attempt > self.policy.retries:
                    raise DataError(
                        f"{url}: unreachable or dropped after {attempt} attempt(s){where} ({e}); check the server "
                        f"or raise data.retries / data.request_timeout"
                    ) from None
                self.retries_used += 1
                self.last_retry = f"{url}{where}: {e}"
                time.sleep(self.policy.backoff * 2 ** (attempt - 1))

    def _attempt(self, url: str, progress: dict, sink) -> None:
        """Read from byte ``progress["done"]`` to the end into ``sink``, counting in ``progress``."""
        if url.startswith(("http://", "https://")):
            self._attempt_http(url, progress, sink)
        else:
            self._attempt_fsspec(url, progress, sink)

    def _attempt_http(self, url: str, progress: dict, sink) -> None:
        start = progress["done"]
        request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
        try:
            with urllib.request.urlopen(request, timeout=self.policy.timeout) as response:
                partial = response.status == 206
                skip = start if start and not partial else 0  # the server ignored the range: read past what we hold
                length = response.headers.get("Content-Length")
                if length is not None:
                    progress["total"] = int(length) + (start if partial else 0)
                while chunk := response.read(CHUNK):
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    if chunk:
                        sink(chunk)
                        progress["done"] += len(chunk)
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                raise _Missing(f"HTTP {e.code}") from None
            if e.code >= 500 or e.code == 429:
                raise _Transient(f"HTTP {e.code}") from None
            raise DataError(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", None) or e
            raise _Transient(f"{type(e).__name__}: {reason}") from None
        done, total = progress["done"], progress["total"]
        if total is not None and done < total:
            raise _Transient(f"connection closed after {done:,} of {total:,} bytes")

    def _attempt_fsspec(self, url: str, progress: dict, sink) -> None:
        fsspec = import_fsspec(url)
        try:
            with fsspec.open(url, "rb") as f:
                progress["total"] = getattr(f, "size", None)
                if progress["done"]:
                    f.seek(progress["done"])
                while chunk := f.read(CHUNK):
                    sink(chunk)
                    progress["done"] += len(chunk)
        except FileNotFoundError as e:
            raise _Missing(str(e) or "no such object") from None
        except (OSError, TimeoutError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None
        done, total = progress["done"], progress["total"]
        if total is not None and done < total:
            raise _Transient(f"stream ended after {done:,} of {total:,} bytes")


def import_fsspec(url: str):
    """fsspec, with the implementation of ``url``'s protocol importable; the one place that imports it."""
    scheme = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise DataError(f"{url}: reading {scheme}:// needs fsspec: pip install fsspec") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as e:
        raise DataError(f"{url}: fsspec cannot read {scheme}:// here ({e})") from None
    return fsspec
