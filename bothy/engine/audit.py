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
and seq and hash of its last record, rewritten once appends are durable: see
:mod:`bothy.engine.auditwriter`), so ``bothy run`` reads only
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
import functools
import json
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from bothy.engine.auditchain import Fault, VerifyReport
from bothy.engine.auditcheckpoint import (
    against_anchor,
    checkpoint_path_for,
    read_checkpoint,
    remove_checkpoint,
)
from bothy.engine.auditevents import EVENTS, EventTable
from bothy.engine.auditfile import FILE_MODE, exclusive_lock, lock_path_for
from bothy.engine.auditindex import RunIndex
from bothy.engine.auditrecord import (
    GENESIS_HASH,
    AuditRecord,
    canonical_details_json,
    flat_details,
    format_ts,
    head_of,
    names_json,
    parse_line,
    quote,
    stamped_before,
)
from bothy.engine.auditsegments import (
    REPAIR_EVENT,
    REPAIR_KIND,
    file_lines,
    segments_of,
    verify_file,
    verify_register,
)
from bothy.engine.auditwriter import AuditWriter, Entry
from bothy.errors import AuditIntegrityError
from bothy.fsync import fsync_directory
from bothy.groupcommit import GroupCommit

__all__ = ["GENESIS_HASH", "AuditLog", "AuditRecord", "Fault", "NewRecord", "Repair",
           "VerifyReport"]

_RECORDS_PER_COMMIT = 512  # a few hundred KB in one write
# The durable step waits for this much quiet after a run of commits: an intake committing a
# batch every few ms (serve's unwanted deliveries) did it after each, half the writer's time.
_SETTLE_AFTER_QUIET_S = 0.05
# Tokens found well-formed (whether one is depends on it alone), each with its JSON form.
_WELL_FORMED: dict[str, str] = {}
_WELL_FORMED_MAX = 512  # a run's ids come back within its few records, then never


class _Wanted(NamedTuple):  # (not a dataclass: cheaper to define at each start)
    """Which records a reader of the register asked for (:meth:`AuditLog.records`)."""

    run_id: str | None
    since: datetime | None
    kinds: frozenset[str] | None

    @property
    def by_head(self) -> bool:
        """Whether a line's head alone can rule it out."""
        return self.since is not None or self.kinds is not None

    def head(self, ts: datetime, kind: str) -> bool:
        return ((self.since is None or ts >= self.since)
                and (self.kinds is None or kind in self.kinds))

    def record(self, record: AuditRecord) -> bool:
        return ((self.run_id is None or record.run_id == self.run_id)
                and self.head(record.ts, record.kind))


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
        # The five names of records already checked (against this log's table too), each
        # set with its JSON form: a run's records come back with the same ones.
        self._names: dict[tuple[str, str, str, str | None, str | None], str] = {}
        self._lock_path = lock_path_for(path)
        self.checkpoint_path = checkpoint_path_for(path)
        self._clock = clock or _UTC_NOW
        self.index = RunIndex(path)  # by run id, kept at one hook after each durable write
        self._writer = AuditWriter(path, clock=self._clock, index=self.index)
        self._group: GroupCommit[Entry, AuditRecord] = GroupCommit(
            self._commit_in_thread, max_batch=_RECORDS_PER_COMMIT, name="audit-commit",
            idle=self._settle_in_thread, idle_after_s=_SETTLE_AFTER_QUIET_S)

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
        [record] = self._writer.commit([entry], settle=True)
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

    async def record_all(self, records: Sequence[NewRecord]) -> list[AuditRecord | Exception]:
        """``record`` for several records at once, in order, sharing commits as ``record``'s
        do, without a task for each; each one's record, or the error of the commit that
        should have held it (StateError, AuditIntegrityError), in the same order.

        Raises ValueError before anything is written if one is malformed or undeclared.
        """
        entries = [self._entry(r.kind, r.event, r.outcome, r.subject, r.run_id, r.details)
                   for r in records]
        outcomes: list[AuditRecord | Exception] = []
        for future in self._group.submit_all(entries):
            try:
                outcomes.append(await future)
            except Exception as exc:  # the commit's failure, for this record's caller
                outcomes.append(exc)
        return outcomes

    def _entry(
        self,
        kind: str,
        event: str,
        outcome: str,
        subject: str | None,
        run_id: str | None,
        details: Mapping[str, Any] | None,
    ) -> Entry:
        """The caller's half of an append: every check that does not need the file."""
        key = (kind, event, outcome, subject, run_id)
        names = self._names.get(key)
        if names is None:  # names not seen together before: check each, and the pair
            names = names_json(
                _check_token("kind", kind), _check_token("event", event),
                _check_token("outcome", outcome),
                None if subject is None else _check_token("subject", subject),
                None if run_id is None else _check_token("run_id", run_id))
            self._events.check(kind, event)
            if len(self._names) >= _WELL_FORMED_MAX:
                self._names.clear()
            self._names[key] = names
        copied, text = _canonical_details(details)
        return Entry(kind, event, outcome, subject, run_id, copied, text, names)

    async def _commit_in_thread(self, entries: list[Entry]) -> list[AuditRecord]:
        return await asyncio.to_thread(self._writer.commit_grouped, entries)

    async def _settle_in_thread(self) -> None:
        """The group commit's idle hook: the durable step its commits left pending."""
        await asyncio.to_thread(self._writer.settle)

    # -- reading ---------------------------------------------------------------------------

    def records(
        self,
        *,
        run_id: str | None = None,
        since: datetime | None = None,
        kinds: Collection[str] | None = None,
    ) -> Iterator[AuditRecord]:
        """Records in file order, optionally only one run's, those stamped at/after ``since``,
        or those of ``kinds``.

        Does not check the chain (that is ``verify``); raises AuditIntegrityError on reaching a
        line that cannot be read as a record, after yielding every record before it. A line
        whose head (seq, timestamp, kind: :func:`head_of`) already puts it outside ``since``
        or ``kinds`` is passed over without being decoded, so a reader of one recent stretch
        of a long register pays little for the rest.
        """
        if since is not None and since.tzinfo is None:
            raise ValueError(f"since must be an aware datetime, not {since!r}")
        wanted = _Wanted(run_id, since, None if kinds is None else frozenset(kinds))
        for path, stop_after in self._segments():
            yield from self._segment_records(path, stop_after, wanted)

    def _segment_records(
        self, path: Path, stop_after: int | None, wanted: _Wanted
    ) -> Iterator[AuditRecord]:
        last_seq = 0
        # A reader of a recent stretch of the current file passes over what came before by
        # the stamp's bytes alone (a kept segment's reader needs each line's seq).
        cutoff = (format_ts(wanted.since).encode("ascii")
                  if wanted.since is not None and stop_after is None
                  else None)
        for line_no, raw in file_lines(path, self._lock_path):
            if stop_after is not None and last_seq >= stop_after:
                return  # the rest of a kept segment was set aside by the repair
            if not raw.endswith(b"\n"):
                raise AuditIntegrityError(
                    f"Cannot read {path}: line {line_no} is truncated", line_no=line_no
                )
            if cutoff is not None and stamped_before(raw, cutoff):
                continue
            head = head_of(raw) if wanted.by_head else None
            if head is not None and not wanted.head(head[1], head[2]):
                if stop_after is not None and head[0] > stop_after:
                    return
                last_seq = head[0]
                continue
            parsed = parse_line(raw[:-1])
            if isinstance(parsed, str):
                raise AuditIntegrityError(
                    f"Cannot read {path}: line {line_no} {parsed}", line_no=line_no
                )
            if stop_after is not None and parsed.seq > stop_after:
                return
            last_seq = parsed.seq
            if wanted.record(parsed):
                yield parsed

    def verify(self) -> VerifyReport:
        """Check the whole chain, across repaired segments, and name the first problem.

        Never raises for a bad chain. ``repaired_at`` names every repair: a repaired register
        verifies, but never as if nothing had happened.
        """
        return verify_register(self.path)

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

    def _verify_segments(self) -> VerifyReport:
        """The whole chain, read by the caller holding the writers' lock."""
        return verify_file(self.path, None, None, 0)

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
        with self._writer.thread_lock, exclusive_lock(self._lock_path):
            self._writer.settle_locked()
            # Records cut from the end (a register cut back to a record boundary, or replaced
            # by an older copy) are a break like any other: compared with the anchored head.
            report = against_anchor(self._verify_segments(),
                                    read_checkpoint(self.checkpoint_path), self.checkpoint_path)
            if report.ok:
                return None
            stamp = self._writer.now().strftime("%Y%m%dT%H%M%S.%fZ")
            kept = self.path.with_name(f"{self.path.name}.broken-{stamp}")
            if not self.path.exists():  # every record lost, the file too: keep it empty
                self.path.touch(mode=FILE_MODE)
            os.rename(self.path, kept)  # the broken file itself, byte for byte
            fsync_directory(self.path.parent)
            remove_checkpoint(self.checkpoint_path)
            self._writer.forget_pending()
            details = {"kept": kept.name, "last_good_seq": report.last_seq,
                       "last_good_hash": report.last_hash, "problem": report.problem}
            entry = self._entry(REPAIR_KIND, REPAIR_EVENT, "ok", None, None, details)
            [record] = self._writer.append_locked([entry],
                                                  after=(report.last_seq, report.last_hash))
            self._writer.settle_locked()
        return Repair(kept=kept, record=record, problem=report.problem)


class NewRecord(NamedTuple):
    """One record for :meth:`AuditLog.record_all`: ``record``'s arguments."""

    kind: str
    event: str
    outcome: str
    subject: str | None = None
    run_id: str | None = None
    details: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Repair:
    """What ``bothy audit repair`` did: the file kept aside and the record starting the new one."""

    kept: Path
    record: AuditRecord
    problem: str


# -- input checks ----------------------------------------------------------------------------


def _check_token(name: str, value: str) -> str:
    """``value`` as a JSON string, once it is found a well-formed token (ValueError if not)."""
    if type(value) is str:
        quoted = _WELL_FORMED.get(value)
        if quoted is not None:
            return quoted  # seen before (kinds, events, a run's id and subject come back)
    # isprintable() is False for every whitespace character except the plain space, and for
    # control characters (which could smuggle terminal escapes into the human form).
    if not isinstance(value, str) or not value or " " in value or not value.isprintable():
        raise ValueError(f"audit {name} must be a non-empty single token, got {value!r}")
    if len(_WELL_FORMED) >= _WELL_FORMED_MAX:
        _WELL_FORMED.clear()
    quoted = _WELL_FORMED[value] = quote(value)
    return quoted


def _canonical_details(details: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """A private copy of ``details`` with keys sorted at every level, as it will be stored,
    and its canonical JSON (the bytes the record's body will hold)."""
    if details is None:
        return {}, "{}"
    if type(details) is not dict and not isinstance(details, Mapping):  # (dict: no ABC check)
        raise ValueError(f"audit details must be a JSON object, got {type(details).__name__}")
    flat = flat_details(details)
    if flat is not None:  # most records: text keys, plain values (a copy is the sorted dict)
        return flat
    try:
        text = canonical_details_json(details)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"audit details must be JSON-serialisable: {exc}") from exc
    copied: dict[str, Any] = json.loads(text)
    return copied, text


_UTC_NOW: Callable[[], datetime] = functools.partial(datetime.now, UTC)  # (no Python frame)
