"""How records become durable in the register: :class:`AuditWriter`.

A commit takes the writers' locks (a thread lock, then the ``flock`` every process shares),
chains its entries after the last record in the order they were submitted (seq order is
chain order), writes their lines in one ``write`` and fsyncs once. Only then does anything
else see the records: the callers, and the *durable step* — the checkpoint rewritten (the
head anchored) and the index by run id noted.

The durable step is allowed to be behind the file, never ahead of it (a crash between the
fsync and the step leaves it behind already: the next writer then verifies a little more from
the checkpoint, and a reader of the index catches it up). Done after every commit it cost
about as much CPU as the rest of the commit here (two more files' metadata in the journal, an
SQLite transaction), so a group commit of several records (a burst) leaves it *pending*: the
next commit does it for all of them once ``_DURABLE_EVERY_RECORDS`` are pending, and
:meth:`AuditWriter.settle` — the group commit's idle hook, run once nobody has waited for a
little while (``_SETTLE_AFTER_QUIET_S`` in :mod:`bothy.engine.audit`) — does it for
what is left. A blocking ``append``, and a group commit of one record, settle at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from hashlib import sha256
from pathlib import Path
from typing import Any, NamedTuple

from bothy.engine.auditchain import VerifyReport, verify_lines
from bothy.engine.auditcheckpoint import (
    against_anchor,
    checkpoint_path_for,
    read_checkpoint,
    write_checkpoint,
)
from bothy.engine.auditfile import (
    Tail,
    exclusive_lock,
    fsync_new_entries,
    identity,
    lock_path_for,
    make_parent_dirs,
    open_for_append,
    read_tail,
)
from bothy.engine.auditindex import RunIndex
from bothy.engine.auditrecord import (
    AuditRecord,
    format_ts,
    new_record,
    serialise_chained,
)
from bothy.engine.auditsegments import lines_from, verify_file
from bothy.errors import AuditIntegrityError, StateError
from bothy.fsync import fsync

__all__ = ["AuditWriter", "Entry"]

_HASH_PREFIX = b',"hash":"'  # a line is its body with this, the digest and _LINE_END
_LINE_END = b'"}\n'
_DURABLE_EVERY_RECORDS = 1024  # at most this far behind under load (a few hundred KB)


class Entry(NamedTuple):  # (a NamedTuple: one is made per record, at a third of the cost)
    """A record checked and waiting for its place in the chain (seq, ts, prev, hash)."""

    kind: str
    event: str
    outcome: str
    subject: str | None
    run_id: str | None
    details: dict[str, Any]
    details_json: str
    names_json: str  # kind … run_id as the body holds them (auditrecord.names_json)


@dataclass(frozen=True)
class _Written:
    """A commit on disk whose durable step may still be to do."""

    stat: os.stat_result  # the file just after its write
    placed: list[tuple[int, AuditRecord]]  # each record with the offset of its line


class AuditWriter:
    """Appends to the register at ``path``; safe across threads and processes."""

    def __init__(self, path: Path, *, clock: Callable[[], datetime], index: RunIndex) -> None:
        self.path = path
        self.lock_path = lock_path_for(path)
        self.checkpoint_path = checkpoint_path_for(path)
        self.index = index
        self._clock = clock
        self.thread_lock = threading.Lock()
        # Tail cached between appends; trusted only while the file is the one it describes.
        self._tail: Tail | None = None
        self._pending: list[_Written] = []  # fsynced, durable step still to do
        self._pending_records = 0

    def commit(self, entries: list[Entry], *, settle: bool) -> list[AuditRecord]:
        """Append ``entries`` in order, in one write and one fsync, under both locks; the
        durable step now if ``settle``, else perhaps left pending (see the module)."""
        try:
            created_dirs = make_parent_dirs(self.path.parent)
        except OSError as exc:
            raise StateError(f"Cannot create the directory of {self.path}: {exc}") from exc
        with self.thread_lock, exclusive_lock(self.lock_path):
            records = self.append_locked(entries, new_names=tuple(created_dirs))
            if settle or self._pending_records >= _DURABLE_EVERY_RECORDS:
                self.settle_locked()
        return records

    def commit_grouped(self, entries: list[Entry]) -> list[AuditRecord]:
        """``commit`` for a group commit's batch: a record alone settles at once, as a
        blocking append does (a process that writes one and exits leaves nothing pending);
        a burst leaves it to the idle hook."""
        return self.commit(entries, settle=len(entries) == 1)

    def settle(self) -> None:
        """Do the durable step of every commit that left it pending (never raises for it)."""
        if not self._pending:
            return
        with self.thread_lock, exclusive_lock(self.lock_path):
            self.settle_locked()

    def forget_pending(self) -> None:
        """Drop the pending durable step: the file it describes was just set aside (repair).
        Called under both locks."""
        self._pending, self._pending_records = [], 0

    def append_locked(
        self, entries: list[Entry], *, after: tuple[int, str] | None = None,
        new_names: tuple[Path, ...] = (),
    ) -> list[AuditRecord]:
        """Chain ``entries`` after the last record (or ``after``: the (seq, hash) a new
        segment's first record follows, for a repair), write them at once and fsync, under
        both locks; the durable step is left pending. ``new_names``: directories just
        created, made durable (with a new file's name) before anyone hears of the records."""
        try:
            fd, created = open_for_append(self.path)
        except OSError as exc:
            raise StateError(f"Cannot open audit log {self.path}: {exc.strerror}") from exc
        try:
            if after is None:
                tail = self._current_tail(fd)
            else:
                tail = Tail(identity=identity(os.fstat(fd)), seq=after[0], hash=after[1])
            records, lines = self._chained(entries, tail)
            self._write_durably(fd, b"".join(lines), tail.identity[2], records[0].seq,
                                records[-1].seq)
            if created or records[0].seq == 1 or new_names:
                # Under the lock, so no other writer acknowledges a record in a file whose
                # name is not yet durable.
                fsync_new_entries(self.path, new_names)
            written = os.fstat(fd)
        finally:
            os.close(fd)
        self._tail = Tail(identity=identity(written), seq=records[-1].seq,
                          hash=records[-1].hash)
        offset, placed = tail.identity[2], []
        for record, line in zip(records, lines, strict=True):
            placed.append((offset, record))
            offset += len(line)
        self._pending.append(_Written(written, placed))
        self._pending_records += len(placed)
        return records

    def settle_locked(self) -> None:
        """The one step that sees records once they are on disk: the checkpoint (the head
        anchored) and the index by run id (its one hook, which never raises), so that
        neither is ever ahead of the file. Under both locks."""
        pending = self._pending
        self.forget_pending()
        if not pending:
            return
        last = pending[-1]
        try:
            now = identity(os.stat(self.path))
        except OSError:
            now = None
        if now == identity(last.stat):
            # Only while nobody appended since: a later writer's checkpoint is newer.
            head = last.placed[-1][1]
            write_checkpoint(self.checkpoint_path, last.stat, head.seq, head.hash)
        for run in _contiguous(pending):
            self.index.note(run.stat, run.placed)

    def _chained(
        self, entries: list[Entry], tail: Tail
    ) -> tuple[list[AuditRecord], list[bytes]]:
        """Seq and hash for each entry, in order: each record links to the one before it.

        Run for every record under the writers' lock: the lookups are hoisted and the steps
        spelled out (the bytes are :func:`serialise_chained`'s and :func:`with_hash`'s)."""
        records: list[AuditRecord] = []
        lines: list[bytes] = []
        seq, prev = tail.seq, tail.hash
        clock, utc, add_record, add_line = self._clock, UTC, records.append, lines.append
        for entry in entries:
            seq += 1
            ts = clock()
            if ts.tzinfo is not utc:
                ts = self._in_utc(ts)
            body = serialise_chained(seq, ts.isoformat() if ts.microsecond else format_ts(ts),
                                     entry.names_json, entry.details_json, prev)
            digest = sha256(body).hexdigest()
            add_line(body[:-1] + _HASH_PREFIX + digest.encode("ascii") + _LINE_END)
            add_record(new_record(seq, ts, entry.kind, entry.event, entry.outcome,
                                  entry.subject, entry.run_id, entry.details, prev, digest))
            prev = digest
        return records, lines

    def now(self) -> datetime:
        """The clock's time in UTC (a naive one is a programming error)."""
        ts = self._clock()
        return ts if ts.tzinfo is UTC else self._in_utc(ts)

    @staticmethod
    def _in_utc(ts: datetime) -> datetime:
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
            report = against_anchor(verify_file(self.path, None, None, 0), point,
                                    self.checkpoint_path)
        if not report.ok:
            raise AuditIntegrityError(
                f"Refusing to append to audit log {self.path}: the chain is broken: "
                f"{report.problem}; run 'bothy audit verify', then 'bothy audit repair'",
                seq=report.first_bad_seq, line_no=report.line_no,
            )
        return seq, digest

    def _write_durably(
        self, fd: int, data: bytes, size_before: int, first_seq: int, last_seq: int
    ) -> None:
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


def _contiguous(pending: list[_Written]) -> list[_Written]:
    """Pending commits as runs that follow each other in one file (another process's records
    between two of them start a new run), each with the file's stat after its last commit."""
    runs: list[_Written] = []
    for written in pending:
        last = runs[-1] if runs else None
        if last is not None and _same_file(last.stat, written.stat) \
                and written.placed[0][0] == last.stat.st_size:
            last.placed.extend(written.placed)
            runs[-1] = _Written(written.stat, last.placed)
        else:
            runs.append(_Written(written.stat, list(written.placed)))
    return runs


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
