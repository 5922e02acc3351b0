"""The register: a hash-chained, append-only audit log (SPEC §2, rule 3 "fsync, then acknowledge").

This module is the writer (and the reader of the file): :class:`AuditLog`. One record and its
canonical line — the bytes the hash covers — are :mod:`bothy.engine.auditrecord`; checking a
whole chain is :mod:`bothy.engine.auditchain`; the human form is :mod:`bothy.engine.auditformat`;
which kinds of record exist is :mod:`bothy.engine.auditevents`, enforced on every append.

Writers in several processes take an exclusive ``flock`` on ``<path>.lock`` for each append;
the record is written in one ``write`` and fsynced before ``append`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bothy.engine.auditchain import Fault, VerifyReport, verify_lines
from bothy.engine.auditevents import EVENTS, EventTable
from bothy.engine.auditrecord import (
    GENESIS_HASH,
    AuditRecord,
    body_of,
    format_ts,
    parse_line,
    serialise_body,
    with_hash,
)
from bothy.errors import AuditIntegrityError, StateError
from bothy.fsync import fsync, fsync_directory

__all__ = ["GENESIS_HASH", "AuditLog", "AuditRecord", "Fault", "VerifyReport"]

_TAIL_CHUNK_BYTES = 4096
_FILE_MODE = 0o600
_DIR_MODE = 0o700


class AuditLog:
    """The append-only, hash-chained register at ``path``; safe across threads and processes.

    ``clock`` returns the aware datetime stamped on each record (default: now, in UTC);
    ``events`` is the table of (kind, event) pairs it accepts (default: Bothy's own).
    """

    def __init__(
        self,
        path: Path,
        *,
        clock: Callable[[], datetime] | None = None,
        events: EventTable = EVENTS,
    ) -> None:
        self.path = path
        self._events = events
        self._lock_path = path.with_name(path.name + ".lock")
        self._clock = clock or _utc_now
        self._thread_lock = threading.Lock()
        # Tail cached between appends; trusted only while the file is the one it describes.
        self._tail: _Tail | None = None

    # -- writing ---------------------------------------------------------------------------

    def append(
        self,
        kind: str,
        event: str,
        outcome: str,
        *,
        subject: str | None = None,
        run_id: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> AuditRecord:
        """Write one record, fsync it, and only then return it.

        Raises ValueError for a malformed field or an undeclared (kind, event) pair (our own
        code wrote it: a programming error),
        AuditIntegrityError if the last record on disk is truncated or corrupt (a broken chain
        is never extended), StateError if the file cannot be written.
        """
        for name, value in (("kind", kind), ("event", event), ("outcome", outcome)):
            _check_token(name, value)
        for name, optional in (("subject", subject), ("run_id", run_id)):
            if optional is not None:
                _check_token(name, optional)
        self._events.check(kind, event)
        canonical_details = _canonical_details(details)
        try:
            created_dirs = _make_parent_dirs(self.path.parent)
        except OSError as exc:
            raise StateError(f"Cannot create the directory of {self.path}: {exc}") from exc
        with self._thread_lock, _exclusive_lock(self._lock_path):
            record = self._append_locked(kind, event, outcome, subject, run_id, canonical_details)
            if record.seq == 1 or created_dirs:
                # Inside the lock, so no other writer acknowledges a record in a file whose
                # name is not yet durable.
                _fsync_new_entries(self.path, created_dirs)
        return record

    async def record(
        self,
        kind: str,
        event: str,
        outcome: str,
        *,
        subject: str | None = None,
        run_id: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> AuditRecord:
        """``append`` in a worker thread, so a coroutine never blocks on the lock or fsync.

        Cancelling the awaiting coroutine does not stop a write already under way.
        """
        return await asyncio.to_thread(
            self.append, kind, event, outcome, subject=subject, run_id=run_id, details=details
        )

    def _append_locked(
        self,
        kind: str,
        event: str,
        outcome: str,
        subject: str | None,
        run_id: str | None,
        details: dict[str, Any],
    ) -> AuditRecord:
        try:
            fd = _open_for_append(self.path)
        except OSError as exc:
            raise StateError(f"Cannot open audit log {self.path}: {exc.strerror}") from exc
        try:
            tail = self._current_tail(fd)
            ts = self._now()
            body = serialise_body(
                seq=tail.seq + 1,
                ts=format_ts(ts),
                kind=kind,
                event=event,
                outcome=outcome,
                subject=subject,
                run_id=run_id,
                details=details,
                prev=tail.hash,
            )
            digest = hashlib.sha256(body).hexdigest()
            self._write_durably(fd, with_hash(body, digest) + b"\n", tail.seq + 1)
            self._tail = _Tail(identity=_identity(os.fstat(fd)), seq=tail.seq + 1, hash=digest)
        finally:
            os.close(fd)
        return AuditRecord(
            seq=tail.seq + 1,
            ts=ts,
            kind=kind,
            event=event,
            outcome=outcome,
            subject=subject,
            run_id=run_id,
            details=details,
            prev=tail.hash,
            hash=digest,
        )

    def _now(self) -> datetime:
        ts = self._clock()
        if ts.tzinfo is None or ts.utcoffset() is None:
            raise ValueError(f"The audit clock returned a naive datetime: {ts!r}")
        return ts.astimezone(UTC)

    def _current_tail(self, fd: int) -> _Tail:
        """The last record's seq and hash, from the cache if the file has not moved since."""
        st = os.fstat(fd)
        cached = self._tail
        if cached is not None and cached.identity == _identity(st):
            return cached
        self._tail = None
        seq, digest = _read_tail(fd, st.st_size, self.path)
        return _Tail(identity=_identity(st), seq=seq, hash=digest)

    def _write_durably(self, fd: int, line: bytes, seq: int) -> None:
        size_before = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
            if written != len(line):
                # Take the partial line back rather than leave a truncated record behind.
                os.ftruncate(fd, size_before)
                raise OSError(0, f"short write ({written} of {len(line)} bytes)")
            fsync(fd)
        except OSError as exc:
            # After a failed fsync the line may or may not reach the disk; the chain stays
            # intact either way, and the caller must treat the event as not recorded.
            self._tail = None
            raise StateError(
                f"Cannot append record {seq:04d} to audit log {self.path}: {exc.strerror or exc}"
            ) from exc

    # -- reading ---------------------------------------------------------------------------

    def records(
        self, *, run_id: str | None = None, since: datetime | None = None
    ) -> Iterator[AuditRecord]:
        """Records in file order, optionally only one run's or those stamped at/after ``since``.

        Does not check the chain (that is ``verify``); raises AuditIntegrityError on reaching a
        line that cannot be read as a record, after yielding every record before it.
        """
        if since is not None and since.tzinfo is None:
            raise ValueError(f"since must be an aware datetime, not {since!r}")
        for line_no, raw in self._lines():
            if not raw.endswith(b"\n"):
                raise AuditIntegrityError(
                    f"Cannot read {self.path}: line {line_no} is truncated", line_no=line_no
                )
            parsed = parse_line(raw[:-1])
            if isinstance(parsed, str):
                raise AuditIntegrityError(
                    f"Cannot read {self.path}: line {line_no} {parsed}", line_no=line_no
                )
            if run_id is not None and parsed.run_id != run_id:
                continue
            if since is not None and parsed.ts < since:
                continue
            yield parsed

    def verify(self) -> VerifyReport:
        """Check the whole chain and name the first problem; never raises for a bad chain."""
        return verify_lines(self._lines)

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """Numbered lines, as far as the file reached when no writer was mid-append.

        Reading stops at the size seen under the writers' lock, so an append in progress
        is never mistaken for a truncated record.
        """
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return
        with f:
            size = _settled_size(self._lock_path, f.fileno())
            offset = 0
            for line_no, line in enumerate(f, start=1):
                if offset + len(line) > size:
                    if offset < size:
                        yield line_no, line[: size - offset]
                    return
                offset += len(line)
                yield line_no, line


# -- input checks ----------------------------------------------------------------------------


def _check_token(name: str, value: str) -> None:
    # isprintable() is False for every whitespace character except the plain space, and for
    # control characters (which could smuggle terminal escapes into the human form).
    if not isinstance(value, str) or not value or " " in value or not value.isprintable():
        raise ValueError(f"audit {name} must be a non-empty single token, got {value!r}")


def _canonical_details(details: Mapping[str, Any] | None) -> dict[str, Any]:
    """A private copy of ``details`` with keys sorted at every level, as it will be stored."""
    if details is None:
        return {}
    if not isinstance(details, Mapping):
        raise ValueError(f"audit details must be a JSON object, got {type(details).__name__}")
    try:
        text = json.dumps(dict(details), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"audit details must be JSON-serialisable: {exc}") from exc
    copied: dict[str, Any] = json.loads(text)
    return copied


# -- files -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tail:
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
    seq: int
    hash: str


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read_tail(fd: int, size: int, path: Path) -> tuple[int, str]:
    """The seq and hash of the last record, reading backwards from the end of the file."""
    if size == 0:
        return 0, GENESIS_HASH
    if os.pread(fd, 1, size - 1) != b"\n":
        raise AuditIntegrityError(
            f"Refusing to append to audit log {path}: its last record is truncated "
            "(the file does not end with a newline); run 'bothy audit verify'"
        )
    line = _last_line(fd, size)
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


def _last_line(fd: int, size: int) -> bytes:
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


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the sidecar lock file: one writer at a time, any process.

    The lock file is opened afresh each time, so a forked child never shares our lock.
    """
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
    except OSError as exc:
        raise StateError(f"Cannot open audit lock {lock_path}: {exc.strerror}") from exc
    try:
        if os.fstat(fd).st_mode & 0o777 != _FILE_MODE:
            os.fchmod(fd, _FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _settled_size(lock_path: Path, fd: int) -> int:
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


def _open_for_append(path: Path) -> int:
    """Open for appending and reading the tail, creating the file mode 0600 if absent."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    except FileExistsError:
        return os.open(path, flags)
    os.fchmod(fd, _FILE_MODE)  # exact mode, whatever the umask
    return fd


def _make_parent_dirs(directory: Path) -> list[Path]:
    """Create missing directories mode 0700; returns those created (shallowest first)."""
    missing: list[Path] = []
    for candidate in (directory, *directory.parents):
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


def _fsync_new_entries(path: Path, created_dirs: list[Path]) -> None:
    """Make new names durable: fsync of a file does not persist its directory entry."""
    for directory in {path.parent, *(d.parent for d in created_dirs)}:
        fsync_directory(directory)


def _utc_now() -> datetime:
    return datetime.now(UTC)
