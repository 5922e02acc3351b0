"""The register: a hash-chained, append-only audit log (SPEC §2, rule 3 "fsync, then acknowledge").

This module is the writer (and the reader of the file): :class:`AuditLog`. One record and its
canonical line — the bytes the hash covers — are :mod:`bothy.engine.auditrecord`; checking a
whole chain is :mod:`bothy.engine.auditchain`; the human form is :mod:`bothy.engine.auditformat`;
which kinds of record exist is :mod:`bothy.engine.auditevents`, enforced on every append. The
file itself (its lock, its last record) is :mod:`bothy.engine.auditfile`, the checkpoint
:mod:`bothy.engine.auditcheckpoint`, the segments of a repaired register
:mod:`bothy.engine.auditsegments`.

Writers in several processes take an exclusive ``flock`` on ``<path>.lock`` for each commit;
the records are written in one ``write`` and fsynced before ``append`` (or ``record``)
returns. Records a process's coroutines ``record`` while a commit is under way share the next
one: one write, one fsync, seq in the order they were submitted (:mod:`bothy.groupcommit`).

Nothing is appended to a broken chain. A process's first append verifies the chain from the
*checkpoint* kept beside the register (``<path>.checkpoint``: the file's identity, the offset
and seq and hash of its last record, rewritten after each append), so ``bothy run`` reads only
what other processes appended since; without a checkpoint that still describes the file, the
whole chain is verified. ``bothy serve``, ``audit verify`` and ``doctor`` always verify the
whole chain (:meth:`AuditLog.verify`).

Segments: ``bothy audit repair`` (:meth:`AuditLog.repair`) keeps a broken register aside
untouched (``<path>.broken-<stamp>``) and starts a new file whose first record, ``audit
repaired``, names the kept file and its last good seq and hash, and links to that hash. Reading
and verifying follow those links back, so the register reads as one chain across segments,
and every verdict after a repair says where it was repaired.
"""

from __future__ import annotations

import asyncio
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
from bothy.engine.auditcheckpoint import (
    against_anchor,
    read_checkpoint,
    remove_checkpoint,
    write_checkpoint,
)
from bothy.engine.auditevents import EVENTS, EventTable
from bothy.engine.auditfile import (
    Tail,
    exclusive_lock,
    fsync_new_entries,
    identity,
    make_parent_dirs,
    open_for_append,
    read_tail,
)
from bothy.engine.auditindex import RunIndex
from bothy.engine.auditrecord import (
    GENESIS_HASH,
    AuditRecord,
    canonical_details_json,
    format_ts,
    parse_line,
    serialise_body,
    with_hash,
)
from bothy.engine.auditsegments import (
    REPAIR_EVENT,
    REPAIR_KIND,
    file_lines,
    lines_from,
    segments_of,
    verify_file,
)
from bothy.errors import AuditIntegrityError, StateError
from bothy.fsync import fsync, fsync_directory
from bothy.groupcommit import GroupCommit

__all__ = ["GENESIS_HASH", "AuditLog", "AuditRecord", "Fault", "Repair", "VerifyReport"]

_RECORDS_PER_COMMIT = 512  # a few hundred KB in one write


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
        self.checkpoint_path = path.with_name(path.name + ".checkpoint")
        self._clock = clock or _utc_now
        self._thread_lock = threading.Lock()
        self.index = RunIndex(path)  # by run id, kept at one hook after each durable write
        # Tail cached between appends; trusted only while the file is the one it describes.
        self._tail: Tail | None = None
        self._group: GroupCommit[_Entry, AuditRecord] = GroupCommit(
            self._commit_in_thread, max_batch=_RECORDS_PER_COMMIT, name="audit-commit")

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
        """Write one record, fsync it, and only then return it (blocking; a batch of one).

        Raises ValueError for a malformed field or an undeclared (kind, event) pair (our own
        code wrote it: a programming error),
        AuditIntegrityError if the last record on disk is truncated or corrupt (a broken chain
        is never extended), StateError if the file cannot be written.
        """
        entry = self._entry(kind, event, outcome, subject, run_id, details)
        [record] = self._commit([entry])
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
        """``append`` for a coroutine: it never blocks the loop, and records that arrive
        together share one write and one fsync (group commit), each returned only once the
        fsync covering it is done.

        Cancelling the awaiting coroutine does not stop a write already under way.
        """
        entry = self._entry(kind, event, outcome, subject, run_id, details)
        return await self._group.submit(entry)

    def _entry(
        self,
        kind: str,
        event: str,
        outcome: str,
        subject: str | None,
        run_id: str | None,
        details: Mapping[str, Any] | None,
    ) -> _Entry:
        """The caller's half of an append: every check that does not need the file."""
        for name, value in (("kind", kind), ("event", event), ("outcome", outcome)):
            _check_token(name, value)
        for name, optional in (("subject", subject), ("run_id", run_id)):
            if optional is not None:
                _check_token(name, optional)
        self._events.check(kind, event)
        copied, text = _canonical_details(details)
        return _Entry(kind, event, outcome, subject, run_id, copied, text)

    async def _commit_in_thread(self, entries: list[_Entry]) -> list[AuditRecord]:
        return await asyncio.to_thread(self._commit, entries)

    def _commit(self, entries: list[_Entry]) -> list[AuditRecord]:
        """Append ``entries`` in order, in one write and one fsync, under both locks."""
        try:
            created_dirs = make_parent_dirs(self.path.parent)
        except OSError as exc:
            raise StateError(f"Cannot create the directory of {self.path}: {exc}") from exc
        with self._thread_lock, exclusive_lock(self._lock_path):
            records = self._append_locked(entries)
            if records[0].seq == 1 or created_dirs:
                # Inside the lock, so no other writer acknowledges a record in a file whose
                # name is not yet durable.
                fsync_new_entries(self.path, created_dirs)
        return records

    def _append_locked(
        self, entries: list[_Entry], *, after: tuple[int, str] | None = None
    ) -> list[AuditRecord]:
        """Chain ``entries`` after the last record (or ``after``: the (seq, hash) a new
        segment's first record follows, for a repair), write them at once, fsync."""
        try:
            fd = open_for_append(self.path)
        except OSError as exc:
            raise StateError(f"Cannot open audit log {self.path}: {exc.strerror}") from exc
        try:
            if after is None:
                tail = self._current_tail(fd)
            else:
                tail = Tail(identity=identity(os.fstat(fd)), seq=after[0], hash=after[1])
            records, lines = self._chained(entries, tail)
            self._write_durably(fd, b"".join(lines), records[0].seq, records[-1].seq)
            written = os.fstat(fd)
            self._tail = Tail(identity=identity(written), seq=records[-1].seq,
                               hash=records[-1].hash)
            self._durable(records, lines, written)
        finally:
            os.close(fd)
        return records

    def _chained(
        self, entries: list[_Entry], tail: Tail
    ) -> tuple[list[AuditRecord], list[bytes]]:
        """Seq and hash for each entry, in order: each record links to the one before it."""
        records: list[AuditRecord] = []
        lines: list[bytes] = []
        seq, prev = tail.seq, tail.hash
        for entry in entries:
            seq += 1
            ts = self._now()
            body = serialise_body(
                seq=seq, ts=format_ts(ts), kind=entry.kind, event=entry.event,
                outcome=entry.outcome, subject=entry.subject, run_id=entry.run_id,
                details=entry.details, prev=prev, details_json=entry.details_json,
            )
            digest = hashlib.sha256(body).hexdigest()
            lines.append(with_hash(body, digest) + b"\n")
            records.append(AuditRecord(
                seq=seq, ts=ts, kind=entry.kind, event=entry.event, outcome=entry.outcome,
                subject=entry.subject, run_id=entry.run_id, details=entry.details, prev=prev,
                hash=digest,
            ))
            prev = digest
        return records, lines

    def _durable(
        self, records: list[AuditRecord], lines: list[bytes], written: os.stat_result
    ) -> None:
        """The one step that sees records once they are on disk, before any caller hears of
        them: the checkpoint (the head anchored), and the index by run id (its one hook,
        which never raises), so that neither is ever ahead of the file."""
        last = records[-1]
        write_checkpoint(self.checkpoint_path, written, last.seq, last.hash)
        offset = written.st_size - sum(len(line) for line in lines)
        placed = []
        for record, line in zip(records, lines, strict=True):
            placed.append((offset, record))
            offset += len(line)
        self.index.note(written, placed)

    def _now(self) -> datetime:
        ts = self._clock()
        if ts.tzinfo is None or ts.utcoffset() is None:
            raise ValueError(f"The audit clock returned a naive datetime: {ts!r}")
        return ts.astimezone(UTC)

    def _current_tail(self, fd: int) -> Tail:
        """The last record's seq and hash, from the cache if the file has not moved since."""
        st = os.fstat(fd)
        cached = self._tail
        if cached is not None and cached.identity == identity(st):
            return cached
        self._tail = None
        seq, digest = self._verified_tail(fd, st)
        return Tail(identity=identity(st), seq=seq, hash=digest)

    def _verified_tail(self, fd: int, st: os.stat_result) -> tuple[int, str]:
        """The last record's seq and hash, once the chain up to it verifies (under the lock).

        From the checkpoint when it still describes this file (same file, its record still
        at its offset): only what was appended since is read. Otherwise the whole chain.
        """
        seq, digest = read_tail(fd, st.st_size, self.path)  # a broken last line, named first
        point = read_checkpoint(self.checkpoint_path)
        report: VerifyReport | None = None
        if point is not None and point.describes(fd, st):
            report = verify_lines(
                lambda: lines_from(fd, point.offset, st.st_size),
                start_seq=point.seq, start_hash=point.hash,
            )
        if report is None or not report.ok:
            report = against_anchor(self._verify_segments(settle=False), point,
                                     self.checkpoint_path)
        if not report.ok:
            raise AuditIntegrityError(
                f"Refusing to append to audit log {self.path}: the chain is broken: "
                f"{report.problem}; run 'bothy audit verify', then 'bothy audit repair'",
                seq=report.first_bad_seq, line_no=report.line_no,
            )
        return seq, digest

    def _write_durably(self, fd: int, data: bytes, first_seq: int, last_seq: int) -> None:
        size_before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                # Take the partial lines back rather than leave a truncated record behind.
                os.ftruncate(fd, size_before)
                raise OSError(0, f"short write ({written} of {len(data)} bytes)")
            fsync(fd)
        except OSError as exc:
            # After a failed fsync the lines may or may not reach the disk; the chain stays
            # intact either way, and the callers must treat the events as not recorded.
            self._tail = None
            what = (f"record {first_seq:04d}" if first_seq == last_seq
                    else f"records {first_seq:04d}–{last_seq:04d}")
            raise StateError(
                f"Cannot append {what} to audit log {self.path}: {exc.strerror or exc}"
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
        for path, stop_after in self._segments():
            yield from self._segment_records(path, stop_after, run_id, since)

    def _segment_records(
        self, path: Path, stop_after: int | None, run_id: str | None, since: datetime | None
    ) -> Iterator[AuditRecord]:
        last_seq = 0
        for line_no, raw in file_lines(path, self._lock_path):
            if stop_after is not None and last_seq >= stop_after:
                return  # the rest of a kept segment was set aside by the repair
            if not raw.endswith(b"\n"):
                raise AuditIntegrityError(
                    f"Cannot read {path}: line {line_no} is truncated", line_no=line_no
                )
            parsed = parse_line(raw[:-1])
            if isinstance(parsed, str):
                raise AuditIntegrityError(
                    f"Cannot read {path}: line {line_no} {parsed}", line_no=line_no
                )
            if stop_after is not None and parsed.seq > stop_after:
                return
            last_seq = parsed.seq
            if run_id is not None and parsed.run_id != run_id:
                continue
            if since is not None and parsed.ts < since:
                continue
            yield parsed

    def verify(self) -> VerifyReport:
        """Check the whole chain, across repaired segments, and name the first problem.

        Never raises for a bad chain. ``repaired_at`` names every repair: a repaired register
        verifies, but never as if nothing had happened.
        """
        report = self._verify_segments(settle=True)
        return against_anchor(report, read_checkpoint(self.checkpoint_path),
                               self.checkpoint_path)

    def anchored_head(self) -> tuple[int, str] | None:
        """The seq and hash of the last record appended by a writer that had verified the
        chain up to it (the checkpoint), while the checkpoint still describes the register;
        None otherwise. Cheap: a short read at the checkpoint's offset, no walk of the chain
        (the status pages show it on every load)."""
        point = read_checkpoint(self.checkpoint_path)
        if point is None:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return (point.seq, point.hash) if point.describes(fd, os.fstat(fd)) else None
        finally:
            os.close(fd)

    def _verify_segments(self, *, settle: bool) -> VerifyReport:
        return verify_file(self.path, self._lock_path if settle else None, None, 0)

    def segments(self) -> list[tuple[Path, int | None]]:
        """The register's files oldest first, each with the last seq of it that counts (a
        kept segment counts up to its last good record; the current file, ``None``, wholly)."""
        return self._segments()

    def _segments(self) -> list[tuple[Path, int | None]]:
        return segments_of(self.path)

    # -- repairing ---------------------------------------------------------------------------

    def repair(self) -> Repair | None:
        """Keep a broken register aside untouched and start a new segment after its last good
        record; None if the chain verifies (nothing to repair).

        The caller makes sure no ``bothy serve`` runs; other writers wait on the lock.
        """
        with self._thread_lock, exclusive_lock(self._lock_path):
            report = self._verify_segments(settle=False)
            if report.ok:
                return None
            stamp = self._now().strftime("%Y%m%dT%H%M%S.%fZ")
            kept = self.path.with_name(f"{self.path.name}.broken-{stamp}")
            os.rename(self.path, kept)  # the broken file itself, byte for byte
            fsync_directory(self.path.parent)
            remove_checkpoint(self.checkpoint_path)
            details = {"kept": kept.name, "last_good_seq": report.last_seq,
                       "last_good_hash": report.last_hash, "problem": report.problem}
            [record] = self._append_locked(
                [_Entry(REPAIR_KIND, REPAIR_EVENT, "ok", None, None, *_canonical_details(details))],
                after=(report.last_seq, report.last_hash))
            fsync_new_entries(self.path, [])
        return Repair(kept=kept, record=record, problem=report.problem)


@dataclass(frozen=True)
class Repair:
    """What ``bothy audit repair`` did: the file kept aside and the record starting the new one."""

    kept: Path
    record: AuditRecord
    problem: str


# -- input checks ----------------------------------------------------------------------------


def _check_token(name: str, value: str) -> None:
    # isprintable() is False for every whitespace character except the plain space, and for
    # control characters (which could smuggle terminal escapes into the human form).
    if not isinstance(value, str) or not value or " " in value or not value.isprintable():
        raise ValueError(f"audit {name} must be a non-empty single token, got {value!r}")


def _canonical_details(details: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """A private copy of ``details`` with keys sorted at every level, as it will be stored,
    and its canonical JSON (the bytes the record's body will hold)."""
    if details is None:
        return {}, "{}"
    if not isinstance(details, Mapping):
        raise ValueError(f"audit details must be a JSON object, got {type(details).__name__}")
    try:
        text = canonical_details_json(details)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"audit details must be JSON-serialisable: {exc}") from exc
    copied: dict[str, Any] = json.loads(text)
    return copied, text


@dataclass(frozen=True)
class _Entry:
    """A record checked and waiting for its place in the chain (seq, ts, prev, hash)."""

    kind: str
    event: str
    outcome: str
    subject: str | None
    run_id: str | None
    details: dict[str, Any]
    details_json: str


def _utc_now() -> datetime:
    return datetime.now(UTC)
