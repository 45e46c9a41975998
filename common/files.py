"""Reading folders that someone else wrote: a checkpoint, a Hugging Face model directory.

Such a folder describes itself (a checkpoint's meta.json lists its files, a sharded model's index
names its shards), and that description is as untrusted as the rest of it: a name in it may climb
out with ``..``, be absolute, or lead out through a symbolic link, and a file may be a FIFO (an
open that never returns) or a device (a read that never ends). Every name a description lists
goes through ``name_problem`` and ``member_problem`` before it is opened, and files are opened
with ``open_regular``. JSON is read with a size limit and no unbounded nesting (``read_json``):
Python's decoder raises RecursionError, not ValueError, on a document nested 100,000 deep.

The functions return or raise plain one-line reasons; callers put them in their own error type.
"""

from __future__ import annotations

import errno as errno_codes
import json
import os
import resource
import stat
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

JSON_MAX_BYTES = 64 << 20  # far above any config.json, weight index or checkpoint meta.json


def name_problem(rel: object) -> str | None:
    """Why ``rel``, a name a folder's own description lists, is not a plain relative path inside
    that folder (None when it is). Looks at the string alone."""
    if not isinstance(rel, str):
        return f"is not a string ({type(rel).__name__}), so not a file name"
    if not rel or "\0" in rel or "\\" in rel:
        return "is not a file name"
    if PurePosixPath(rel).is_absolute():
        return "is an absolute path, not a name inside the folder"
    if ".." in PurePosixPath(rel).parts:
        return "climbs out of the folder with '..'"
    return None


def member_problem(root: Path, file: Path) -> str | None:
    """Why the existing ``file`` is not a regular file inside ``root`` once symbolic links are
    followed (None when it is). A missing file raises FileNotFoundError: callers word that."""
    real = file.resolve(strict=True)
    if not real.is_relative_to(root.resolve(strict=True)):
        return f"leads out of the folder through a symbolic link (to {real})"
    return kind_problem(real)


def kind_problem(file: Path) -> str | None:
    """Why the existing ``file`` (symbolic links followed) is not a regular file, or None. Missing:
    FileNotFoundError."""
    kind = _kind(os.stat(file).st_mode)
    return None if kind == "regular file" else f"is a {kind}, not a regular file"


def open_regular(file: Path) -> BinaryIO:
    """``file`` opened for binary reading, refused (ValueError) unless it is a regular file.

    Checked before the open, so a device is never opened at all, and again on the open file (the
    name may have been swapped in between); O_NONBLOCK keeps the open of a FIFO from waiting for a
    writer.
    """
    kind = _kind(os.stat(file).st_mode)
    if kind != "regular file":
        raise ValueError(f"{file} is a {kind}, not a regular file")
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind != "regular file":
            raise ValueError(f"{file} is a {kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(file: Path, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """The JSON document in ``file``; ValueError with a one-line reason when it is not a regular
    file of at most ``max_bytes``, not UTF-8, not JSON, or nested too deeply to decode."""
    with open_regular(file) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{file} is {size:,} bytes, more than the {max_bytes:,} a JSON file here may hold")
        data = f.read(max_bytes + 1)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ValueError(f"{file} nests JSON arrays or objects too deeply to read") from None


def os_error_words(exc: OSError) -> str:
    """The error as words with its errno name and no path: 'no space left on device (ENOSPC)'.
    EFBIG (a write past the process's file-size limit, ``ulimit -f``) names the limit too."""
    code = errno_codes.errorcode.get(exc.errno or 0, "")
    if exc.errno == errno_codes.EFBIG:
        return f"{os.strerror(errno_codes.EFBIG)} (EFBIG){file_size_limit_note()}"
    reason = (exc.strerror or str(exc) or type(exc).__name__).rstrip(".")
    reason = reason[:1].lower() + reason[1:]
    return f"{reason} ({code})" if code else reason


def file_size_limit() -> int | None:
    """The process's file-size limit in bytes (``ulimit -f``), or None when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def file_size_limit_note() -> str:
    limit = file_size_limit()
    return "" if limit is None else f": the process's file-size limit (ulimit -f) is {limit:,} bytes"


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a crafted name may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"
