"""The register: a hash-chained, append-only audit log (SPEC §2, rule 3 "fsync, then acknowledge").

File format: JSON Lines, one record per line, ASCII only, no insignificant whitespace::

    {"seq":1,"ts":"2026-09-24T10:14:02.118734+00:00","kind":"wake","event":"received",
     "outcome":"ok","subject":"pr:42","run_id":null,"details":{},"prev":"000…000",
     "hash":"<64 hex>"}

(one line on disk). Canonical form: the *body* is the record without ``hash``, serialised with
the top-level keys in the order above, keys inside ``details`` sorted, ``separators=(",", ":")``
and ``ensure_ascii=True``. ``hash`` is the sha256 hex digest of the body's bytes, and the line
on disk is the body with ``,"hash":"<digest>"`` spliced in before its closing brace. So a
verifier recovers the exact hashed bytes by cutting the fixed-width 75-byte hash field off the
end of the line and putting the ``}`` back: it never re-serialises, which keeps verification
fast and independent of how any JSON library formats floats or orders keys. Re-serialising
with the rules above gives the same bytes, so other tools can verify the chain too.

Why the hash covers ``prev``: each record's digest then commits to the digest before it, and
so, transitively, to every earlier record. Editing, deleting, inserting or reordering any
record breaks every link after it unless the rest of the chain is rewritten too; a record
can't be silently dropped or moved, only the whole tail re-forged (which an anchored copy of
a recent hash, e.g. in a chat alert, would expose).

Writers in several processes take an exclusive ``flock`` on ``<path>.lock`` for each append;
the record is written in one ``write`` and fsynced before ``append`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bothy.errors import AuditIntegrityError, StateError

GENESIS_HASH = "0" * 64
"""The ``prev`` of record 1: there is no record before it."""

_FIELDS = ("seq", "ts", "kind", "event", "outcome", "subject", "run_id", "details", "prev")
_HASH_PREFIX = b',"hash":"'
_HASH_FIELD_LEN = len(_HASH_PREFIX) + 64 + len(b'"}')  # 75 bytes at the end of every line
_HASH_FIELD = re.compile(rb',"hash":"([0-9a-f]{64})"\}')
_DECODER = json.JSONDecoder()
_TAIL_CHUNK_BYTES = 4096
_FILE_MODE = 0o600
_DIR_MODE = 0o700


@dataclass(frozen=True)
class AuditRecord:
    """One entry of the register, as written to disk (``hash`` covers everything else)."""

    seq: int
    ts: datetime
    kind: str
    event: str
    outcome: str
    subject: str | None
    run_id: str | None
    details: Mapping[str, Any] = field(hash=False)
    prev: str
    hash: str

    def human_line(self) -> str:
        """The greppable one-line form of SPEC §2: seq, ts, kind, event, outcome, subject, run."""
        return (
            f"{self.seq:04d} {_format_ts(self.ts)} {self.kind} {self.event} {self.outcome} "
            f"{self.subject or '-'} {self.run_id or '-'}"
        )

    def to_json(self) -> str:
        """The record as one line of canonical JSON, hash included (``bothy audit --json``)."""
        body = _serialise_body(
            seq=self.seq,
            ts=_format_ts(self.ts),
            kind=self.kind,
            event=self.event,
            outcome=self.outcome,
            subject=self.subject,
            run_id=self.run_id,
            details=self.details,
            prev=self.prev,
        )
        return _with_hash(body, self.hash).decode("ascii")


class Fault(enum.StrEnum):
    """What kind of damage ``verify`` found first."""

    ALTERED = "altered"
    MISSING = "missing"
    REORDERED = "reordered"
    TRUNCATED = "truncated"
    UNPARSABLE = "unparsable"


@dataclass(frozen=True)
class VerifyReport:
    """The verdict on a whole chain. ``ok`` with ``count`` 0 for an empty or absent file."""

    ok: bool
    count: int
    first_bad_seq: int | None = None
    line_no: int | None = None
    problem: str = ""
    fault: Fault | None = None

    def describe(self) -> str:
        """One sentence for ``bothy doctor`` and ``bothy audit verify``."""
        if self.ok:
            return f"audit chain intact ({self.count} records verified)"
        return f"audit chain broken after {self.count} good records: {self.problem}"


class AuditLog:
    """The append-only, hash-chained register at ``path``; safe across threads and processes.

    ``clock`` returns the aware datetime stamped on each record (default: now, in UTC).
    """

    def __init__(self, path: Path, *, clock: Callable[[], datetime] | None = None) -> None:
        self.path = path
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

        Raises ValueError for a malformed field (our own code wrote it: a programming error),
        AuditIntegrityError if the last record on disk is truncated or corrupt (a broken chain
        is never extended), StateError if the file cannot be written.
        """
        for name, value in (("kind", kind), ("event", event), ("outcome", outcome)):
            _check_token(name, value)
        for name, optional in (("subject", subject), ("run_id", run_id)):
            if optional is not None:
                _check_token(name, optional)
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
            body = _serialise_body(
                seq=tail.seq + 1,
                ts=_format_ts(ts),
                kind=kind,
                event=event,
                outcome=outcome,
                subject=subject,
                run_id=run_id,
                details=details,
                prev=tail.hash,
            )
            digest = hashlib.sha256(body).hexdigest()
            self._write_durably(fd, _with_hash(body, digest) + b"\n", tail.seq + 1)
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
            _fsync_file(fd)
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
            parsed = _parse_line(raw[:-1])
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
        checker = _ChainChecker()
        for line_no, raw in self._lines():
            finding = checker.feed(line_no, raw)
            if finding is not None:
                if finding.fault is Fault.MISSING:
                    finding = _tell_missing_from_reordered(finding, self._lines())
                return finding.report(checker.count)
        return VerifyReport(ok=True, count=checker.count)

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


# -- the chain check ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Finding:
    fault: Fault
    line_no: int
    seq: int | None
    problem: str
    # For a seq gap: the first seq we expected, so the rest of the file can be searched for it.
    expected_seq: int | None = None
    found_seq: int | None = None

    def report(self, count: int) -> VerifyReport:
        return VerifyReport(
            ok=False,
            count=count,
            first_bad_seq=self.seq,
            line_no=self.line_no,
            problem=self.problem,
            fault=self.fault,
        )


class _ChainChecker:
    """Feeds on lines in order; returns the first finding. ``count`` = records verified."""

    def __init__(self) -> None:
        self.count = 0
        self._last_seq = 0
        self._last_hash = GENESIS_HASH

    def feed(self, line_no: int, raw: bytes) -> _Finding | None:
        expected = self._last_seq + 1
        if not raw.endswith(b"\n"):
            return _Finding(
                Fault.TRUNCATED,
                line_no,
                expected,
                f"line {line_no} is truncated: record {expected:04d} was cut off mid-write "
                "(no end of line)",
            )
        line = raw[:-1]
        fields = _parse_fields(line)
        if isinstance(fields, str):
            return _Finding(Fault.UNPARSABLE, line_no, expected, f"line {line_no} {fields}")
        seq: int = fields["seq"]
        digest: str = fields["hash"]
        if hashlib.sha256(_body_of(line)).hexdigest() != digest:
            return _Finding(
                Fault.ALTERED,
                line_no,
                seq,
                f"record {seq:04d} was altered: its hash does not match its content "
                f"(line {line_no})",
            )
        if seq != expected:
            return self._out_of_sequence(line_no, seq, expected)
        if fields["prev"] != self._last_hash:
            return _Finding(Fault.REORDERED, line_no, seq, _broken_link_problem(seq, line_no))
        self.count += 1
        self._last_seq = seq
        self._last_hash = digest
        return None

    def _out_of_sequence(self, line_no: int, seq: int, expected: int) -> _Finding:
        if seq < expected:
            return _Finding(
                Fault.REORDERED,
                line_no,
                seq,
                f"record {seq:04d} is out of order at line {line_no}: "
                f"it follows {self._last_seq:04d}",
            )
        # A gap: records were deleted, or moved further down. The caller looks ahead to decide.
        return _Finding(
            Fault.MISSING,
            line_no,
            expected,
            _missing_problem(expected, seq),
            expected_seq=expected,
            found_seq=seq,
        )


def _tell_missing_from_reordered(gap: _Finding, lines: Iterator[tuple[int, bytes]]) -> _Finding:
    """A seq gap is a reordering if the expected record turns up further down the file."""
    assert gap.expected_seq is not None and gap.found_seq is not None
    for line_no, raw in lines:
        if line_no <= gap.line_no:
            continue
        fields = _parse_fields(raw.rstrip(b"\n"))
        if not isinstance(fields, str) and fields["seq"] == gap.expected_seq:
            return _Finding(
                Fault.REORDERED,
                gap.line_no,
                gap.found_seq,
                f"record {gap.found_seq:04d} is out of order at line {gap.line_no}: "
                f"{gap.expected_seq:04d} belongs there and appears later, at line {line_no}",
            )
    return gap


def _missing_problem(expected: int, found: int) -> str:
    last = found - 1
    what = (
        f"record {expected:04d} is missing"
        if expected == last
        else f"records {expected:04d}–{last:04d} are missing"
    )
    if expected == 1:
        return f"{what}: the log starts at {found:04d}"
    return f"{what}: {expected - 1:04d} is followed by {found:04d}"


def _broken_link_problem(seq: int, line_no: int) -> str:
    if seq == 1:
        return "record 0001 does not start the chain: its prev is not the genesis hash (line 1)"
    return (
        f"record {seq:04d} does not follow {seq - 1:04d} (line {line_no}): its prev is not "
        f"the hash of {seq - 1:04d}, so records were reordered, spliced or re-hashed"
    )


# -- one line ------------------------------------------------------------------------------


def _parse_line(line: bytes) -> AuditRecord | str:
    """A line (without its newline) as a record, or why it is not one (a phrase).

    Checks the shape only: whether the hash matches the content is the caller's question.
    """
    fields = _parse_fields(line)
    if isinstance(fields, str):
        return fields
    return AuditRecord(**fields)


def _parse_fields(line: bytes) -> dict[str, Any] | str:
    """The fields of a line (``ts`` as an aware datetime), or why it is not a record.

    The fast path of ``verify``: one regex match, one C-level JSON decode, a few type checks.
    """
    if not line:
        return "is empty"
    start = len(line) - _HASH_FIELD_LEN
    suffix = _HASH_FIELD.fullmatch(line, start) if start > 0 else None
    if suffix is None:
        return "is unparsable: it does not end with a hash field"
    try:
        text = _body_of(line).decode("ascii")
        fields, end = _DECODER.raw_decode(text)
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for non-ASCII bytes
        return f"is unparsable: {exc}"
    if end != len(text) or type(fields) is not dict or tuple(fields) != _FIELDS:
        return "is unparsable: its fields are not " + ", ".join(_FIELDS) + ", hash"
    problem = _field_type_problem(fields)
    if problem:
        return f"is unparsable: {problem}"
    try:
        fields["ts"] = datetime.fromisoformat(fields["ts"])
    except ValueError:
        return f"is unparsable: ts is not an ISO-8601 timestamp: {fields['ts']!r}"
    if fields["ts"].tzinfo is None:
        return "is unparsable: ts has no UTC offset"
    fields["hash"] = suffix[1].decode("ascii")
    return fields


def _field_type_problem(body: dict[str, Any]) -> str:
    seq = body["seq"]
    if type(seq) is not int or seq < 1:
        return f"seq is not a positive integer: {seq!r}"
    for name in ("ts", "kind", "event", "outcome", "prev"):
        if type(body[name]) is not str:
            return f"{name} is not a string"
    for name in ("subject", "run_id"):
        if body[name] is not None and type(body[name]) is not str:
            return f"{name} is neither a string nor null"
    if type(body["details"]) is not dict:
        return "details is not an object"
    return ""


def _body_of(line: bytes) -> bytes:
    """The hashed bytes: the line with its trailing hash field cut off and the brace restored."""
    return line[:-_HASH_FIELD_LEN] + b"}"


def _with_hash(body: bytes, digest: str) -> bytes:
    return body[:-1] + _HASH_PREFIX + digest.encode("ascii") + b'"}'


def _serialise_body(
    *,
    seq: int,
    ts: str,
    kind: str,
    event: str,
    outcome: str,
    subject: str | None,
    run_id: str | None,
    details: Mapping[str, Any],
    prev: str,
) -> bytes:
    """The canonical body: fixed key order, sorted details keys, compact, ASCII only."""
    scalars = zip(_FIELDS[:7], (seq, ts, kind, event, outcome, subject, run_id), strict=True)
    # json.dumps escapes every non-ASCII character by default (ensure_ascii=True).
    parts = [f'"{name}":{json.dumps(value)}' for name, value in scalars]
    details_json = json.dumps(
        dict(details), ensure_ascii=True, separators=(",", ":"), sort_keys=True, allow_nan=False
    )
    parts.append(f'"details":{details_json}')
    parts.append(f'"prev":{json.dumps(prev)}')
    return ("{" + ",".join(parts) + "}").encode("ascii")


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
    parsed = _parse_line(line)
    if isinstance(parsed, str):
        raise AuditIntegrityError(
            f"Refusing to append to audit log {path}: its last line {parsed}; "
            "run 'bothy audit verify'"
        )
    if hashlib.sha256(_body_of(line)).hexdigest() != parsed.hash:
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


def _fsync_file(fd: int) -> None:
    if sys.platform == "darwin":
        # macOS fsync() leaves data in the drive's cache; F_FULLFSYNC asks the drive to flush.
        # Some filesystems (network, FAT) refuse it, and then fsync is the best there is.
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def _fsync_new_entries(path: Path, created_dirs: list[Path]) -> None:
    """Make new names durable: fsync of a file does not persist its directory entry."""
    for directory in {path.parent, *(d.parent for d in created_dirs)}:
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _format_ts(ts: datetime) -> str:
    return ts.astimezone(UTC).isoformat(timespec="microseconds")


def _utc_now() -> datetime:
    return datetime.now(UTC)
