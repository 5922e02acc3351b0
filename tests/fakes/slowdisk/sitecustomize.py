"""A disk slow to make one kind of record durable, for a real ``bothy serve`` subprocess.

A disk whose fsync takes its time cannot be had here on demand, so this stands in for one: put
this directory on the serve's ``PYTHONPATH`` (Python imports ``sitecustomize`` as it starts)
and name, in ``FAKE_SLOW_FSYNC_MARK``, bytes that the last 4 KiB of a file hold while the
record to hold is the one being made durable, and, in ``FAKE_SLOW_FSYNC_WHILE``, a file: each
``os.fsync`` of such a file waits while that file exists, after creating ``<it>.holding`` to
say so. The write itself is done (readers may see the line); only its fsync, and so the
caller's await, is held. Nothing of Bothy is replaced: only the OS call every durable write in
Bothy goes through (bothy/fsync.py). A file opened write-only is read back through
``/proc/self/fd`` (Linux).
"""

from __future__ import annotations

import os
import time

_MARK = os.environ.get("FAKE_SLOW_FSYNC_MARK", "").encode()
_WHILE = os.environ.get("FAKE_SLOW_FSYNC_WHILE", "")
_TAIL_BYTES = 4096
_POLL_S = 0.01


def _tail(fd: int) -> bytes:
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - _TAIL_BYTES)
        try:
            return os.pread(fd, _TAIL_BYTES, start)
        except OSError:  # opened write-only (a file replaced atomically): read it by its name
            with open(f"/proc/self/fd/{fd}", "rb") as again:  # (Linux)
                again.seek(start)
                return again.read(_TAIL_BYTES)
    except OSError:  # not a file we can read back (a directory, a pipe)
        return b""


def _install() -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.exists(_WHILE) and _MARK in _tail(fd):
            with open(f"{_WHILE}.holding", "w"):
                pass
            while os.path.exists(_WHILE):  # a slow disk: this thread waits, as in fsync(2)
                time.sleep(_POLL_S)
        real_fsync(fd)

    os.fsync = fsync


if _MARK and _WHILE:
    _install()
