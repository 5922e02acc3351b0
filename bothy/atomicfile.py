"""Replacing a small file so that a crash leaves the old content or the new, never half.

Write a uniquely named temporary file beside it (0600, in a 0700 directory), fsync it, rename
it over the target, then fsync the directory so the new name itself survives a power loss
(contracts.md §7). Both fsyncs are :mod:`bothy.fsync`'s (F_FULLFSYNC on macOS). Standard
library only: `bothy status` uses it and must start fast.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from bothy.fsync import fsync, fsync_directory

_FILE_MODE = 0o600
_DIR_MODE = 0o700


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably (blocking: call it from a thread in a coroutine)."""
    path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        fsync_directory(path.parent)
