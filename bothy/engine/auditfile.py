"""The register's file on disk: the writers' lock, opening it to append, and its last record.

Writers in several processes take an exclusive ``flock`` on the sidecar ``<path>.lock`` for
each commit; readers take it shared to find a size at a record boundary
(:func:`settled_size`). The last record's seq and hash (:class:`Tail`) are what the next
record links to; :func:`read_tail` reads them backwards from the end of the file and refuses a
truncated or altered last line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.auditrecord import GENESIS_HASH, body_of, parse_line
from bothy.errors import AuditIntegrityError, StateError
from bothy.fsync import fsync_directory

__all__ = ["FILE_MODE", "Tail", "exclusive_lock", "fsync_new_entries", "identity",
           "last_line", "lock_path_for", "make_parent_dirs", "open_for_append", "read_tail",
           "settled_size"]

FILE_MODE = 0o600
_DIR_MODE = 0o700
_TAIL_CHUNK_BYTES = 4096


@dataclass(frozen=True)
class Tail:
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
    seq: int
    hash: str


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_tail(fd: int, size: int, path: Path) -> tuple[int, str]:
    """The seq and hash of the last record, reading backwards from the end of the file."""
    if size == 0:
        return 0, GENESIS_HASH
    if os.pread(fd, 1, size - 1) != b"\n":
        raise AuditIntegrityError(
            f"Refusing to append to audit log {path}: its last record is truncated "
            "(the file does not end with a newline); run 'bothy audit verify'"
        )
    line = last_line(fd, size)
    parsed = parse_line(line)
    if isinstance(parsed, str):
        raise AuditIntegrityError(
            f"Refusing to append to audit log {path}: its last line {parsed}; "
            "run 'bothy audit verify'"
        )
    if hashlib.sha256(body_of(line)).hexdigest() != parsed.hash:
        raise AuditIntegrityError(
            f"Refusing to append to audit log {path}: its last record {parsed.seq:04d} was "
            "altered (its hash does not match its content); run 'bothy audit verify'",
            seq=parsed.seq,
        )
    return parsed.seq, parsed.hash


def last_line(fd: int, size: int) -> bytes:
    """The bytes of the final line (which ends at ``size - 1``), without its newline."""
    end = size - 1
    start = end
    tail = b""  # always the file's bytes [start, end)
    while start > 0:
        read_from = max(0, start - _TAIL_CHUNK_BYTES)
        tail = os.pread(fd, start - read_from, read_from) + tail
        start = read_from
        cut = tail.rfind(b"\n")
        if cut != -1:
            return tail[cut + 1 :]
    return tail


def lock_path_for(register: Path) -> Path:
    """The sidecar lock file the writers of ``register`` take (``<register>.lock``)."""
    return register.with_name(register.name + ".lock")


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the sidecar lock file: one writer at a time, any process.

    The lock file is opened afresh each time, so a forked child never shares our lock.
    """
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        raise StateError(f"Cannot open audit lock {lock_path}: {exc.strerror}") from exc
    try:
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def settled_size(lock_path: Path, fd: int) -> int:
    """The file's size at a moment when no writer holds the lock (a record boundary)."""
    try:
        lock_fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (never written here), or not ours to open: nobody to wait for
        return os.fstat(fd).st_size
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_SH)
        return os.fstat(fd).st_size
    finally:
        os.close(lock_fd)


def open_for_append(path: Path) -> tuple[int, bool]:
    """Open for appending and reading the tail, creating the file mode 0600 if absent; and
    whether it was created (its name is not durable until its directory is fsynced)."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC
    try:
        return os.open(path, flags), False  # the usual case: the register exists
    except FileNotFoundError:
        pass
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:  # another writer created it just now
        return os.open(path, flags), False
    os.fchmod(fd, FILE_MODE)  # exact mode, whatever the umask
    return fd, True


def make_parent_dirs(directory: Path) -> list[Path]:
    """Create missing directories mode 0700; returns those created (shallowest first)."""
    missing: list[Path] = []
    for candidate in itertools.chain((directory,), directory.parents):  # lazily: mostly one
        if candidate.exists():
            break
        missing.append(candidate)
    created: list[Path] = []
    for new_dir in reversed(missing):
        try:
            new_dir.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            continue
        new_dir.chmod(_DIR_MODE)
        created.append(new_dir)
    return created


def fsync_new_entries(path: Path, created_dirs: Sequence[Path]) -> None:
    """Make new names durable: fsync of a file does not persist its directory entry."""
    for directory in {path.parent, *(d.parent for d in created_dirs)}:
        fsync_directory(directory)


