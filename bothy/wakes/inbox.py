"""The inbox: wakes made durable before anyone is told they arrived (SPEC §5, rule 3).

A delivery is one line of an append-only segment file under ``$BOTHY_HOME/inbox/``
(:mod:`bothy.wakes.segments`; 0600 files in a 0700 directory), indexed by one row of the
``wakes`` table in the state database naming its segment, offset and length. A delivery no
job wants keeps no line: nothing will ever run it, so only its row (``file``
:data:`~bothy.wakes.retention.NO_PAYLOAD`, no offset: to know it again) and its ``wake
ignored`` are kept. A wake's source (``webhook``, ``schedule``, ``chat``…) is part of its
identity: the same route and key from two sources are two wakes. ``accept`` makes a delivery
durable in this order and returns only after the last step (contracts.md §7):

1. a delivery already known (a row with its source, route and key) is a duplicate and gets
   no row: the INSERT of step 4 finds it, or, for one no job wants, a lookup before step 3;
2. append the payloads of the deliveries that may run to the segment in one write and fsync
   it (and the directory, for a new segment); a batch of only deliveries no job wants writes
   and fsyncs no segment;
3. for the deliveries no job wants (the listener says so: ``accept(..., ignored=reason)``),
   record ``wake ignored`` in the register once step 2 is durable (the known deliveries
   are looked up while it goes on): one record per route and up to
   :data:`~bothy.wakes.delivery.IGNORED_PER_RECORD` deliveries, naming each with its
   reason, fsynced before step 4;
4. insert the rows in one statement (its own transaction; WAL with synchronous=FULL, so the
   commit is fsynced): ``queued``, or already closed ``ignored`` with the reason.

Steps 1–4 are a *group commit* (:mod:`bothy.groupcommit`, the mechanism the register shares):
every delivery that arrives while a commit is under way waits for the next one, which covers
them all with one segment fsync, one batch of register records and one SQLite transaction.
Each caller still returns only after the commit holding its row, so nothing is acknowledged
early; if any step fails, every delivery of the batch hears it (InboxError: the sender is
answered 503 and retries).

So a 200 follows every fsync that covers its delivery: of its line and its row for one
that may run; of its ``wake ignored`` and its row for one no job wants. A batch that fails
before its records (its segment's fsync failed) records none: a delivery answered 503 leaves
no ``wake ignored``.

A crash between 2 and 4 leaves lines without rows. The rows of a segment always cover a
prefix of it (batches append, and then commit their rows, in the same order; a row without
a line names none), so :meth:`Inbox.recover`, run at start-up, reads each segment only past
the last line a row names, and gives those lines rows — closed if the register shows they
already ran, or were ignored (by the dispatcher). A state database restored from an older
copy names less of each segment, and recovery reads the rest the same way. A crash between
3 and 4 leaves ``wake ignored`` records whose deliveries have no row and no line: nothing
was answered, the sender sends them again, and each retry gets its row and no second
record (intake asks :class:`~bothy.wakes.history.RunHistory`, read at start-up, through
``recover``'s ``ignored_as``). A delivery no job wants that was never sent again is known by
its record alone.

Deliveries stored by an older Bothy, one file each (``<sha256(route NUL key)>.json``), are
still read, recovered and pruned as they were; nothing writes new ones.

Whether a delivery is new is decided by the row, not the payload: a delivery whose first
attempt failed (answered 503) is queued by the sender's retry.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bothy.clock import Clock, from_us, to_us
from bothy.engine.audit import AuditLog, NewRecord
from bothy.engine.state import StateDB
from bothy.errors import BothyError, InboxError
from bothy.groupcommit import GroupCommit
from bothy.wakes.delivery import (
    IGNORED_PER_RECORD,
    Delivery,
    decode_payload_file,
    encode_payload_file,
    ignored_batch_details,
)
from bothy.wakes.retention import FINISHED, NO_PAYLOAD, Retention
from bothy.wakes.segments import Segments, Span
from bothy.wakes.unindexed import Unindexed, read_payload_file, unindexed

_ROWS_PER_COMMIT = 500  # a group commit's rows; 13 variables each: 6,500 per statement
_LINGER_S = 0.001  # senders answered by one commit come back within it (see groupcommit)
# One batch's segment fsync while the one before records what was ignored and commits its
# rows: the CPU of taking the next requests and a commit's fsyncs overlap instead of queueing
# one behind the other (three in flight made the batches smaller, and slower, here).
_IN_FLIGHT = 2

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """The delivery is durable as wake ``wake_id``: queued, or, when ``ignored`` gives the
    reason, already closed as ignored (no job wants it) and recorded so."""

    wake_id: int
    ignored: str | None = None


@dataclass(frozen=True)
class Duplicate:
    """The delivery was seen before and is not queued again (``wake_id`` None if forgotten)."""

    wake_id: int | None


@dataclass(frozen=True)
class Reinserted:
    """A payload that had no row and got one at start-up; ``ran_as`` the run that the
    register shows already ran it, ``ignored`` whether it shows it was ignored (either way
    the wake is closed, not queued)."""

    wake_id: int
    source: str
    route: str
    key: str
    file: str
    ran_as: str | None
    ignored: bool = False


@dataclass(frozen=True)
class WakeRow:
    """One row of the ``wakes`` table. ``file`` is the payload's segment (or, for one stored
    by an older Bothy, its own file) in the inbox directory, or ``NO_PAYLOAD`` for one closed
    ignored at intake (it keeps none); ``payload_at`` and ``payload_bytes`` where its line is
    in the segment (None for a file of its own, or no payload)."""

    id: int
    source: str
    route: str
    key: str
    event: str
    action: str | None
    status: str
    attempts: int
    next_try_us: int
    received_us: int
    run_id: str | None
    file: str
    note: str | None
    finished_us: int | None = None
    payload_at: int | None = None
    payload_bytes: int | None = None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> WakeRow:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class _Taken:
    """A delivery handed to the group commit, with the listener's verdict if no job wants it."""

    delivery: Delivery
    ignored: str | None


class Inbox:
    """Durable wakes: the segments under ``root`` and their rows in ``db``; what was ignored
    at intake is recorded in ``audit``."""

    def __init__(self, root: Path, db: StateDB, *, clock: Clock, audit: AuditLog) -> None:
        self.root = root
        self._db = db
        self._clock = clock
        self._audit = audit
        self._segments = Segments(root, now_s=lambda: clock().timestamp())
        self._retention = Retention(root, db, self._segments, clock=clock)
        self._group: GroupCommit[_Taken, Accepted | Duplicate] = GroupCommit(
            self._commit, max_batch=_ROWS_PER_COMMIT, name="inbox-commit",
            linger_s=_LINGER_S, in_flight=_IN_FLIGHT)
        # Three steps of a commit are taken in batch order, each batch queueing for all as it
        # starts: segment appends; the register's records (after the batch's append); the rows
        # (after the batch's own append and records), so the rows still cover a prefix of the
        # segment, and a batch decides what to record once the one before has recorded.
        self._appends = _Turns()
        self._records = _Turns()
        self._inserts = _Turns()
        # Deliveries whose `wake ignored` is in the register but which have no row (their
        # batch failed after the record, and was answered 503), and what the register showed
        # ignored at start-up: the sender's retry gets its row, not a second record.
        self._recorded: set[tuple[str, str, str]] = set()
        # What the last batches' rows took out of _recorded: a batch in flight beside them may
        # have looked for known deliveries before those rows were in.
        self._inserted: deque[set[tuple[str, str, str]]] = deque(maxlen=_IN_FLIGHT)
        self._ignored_before: Callable[[str, str], bool] = _never

    # -- intake ----------------------------------------------------------------------------

    async def accept(
        self, delivery: Delivery, *, ignored: str | None = None
    ) -> Accepted | Duplicate:
        """Make ``delivery`` durable (see the module docstring); ``ignored``: the reason no
        job wants it, to close it as ignored at once (recorded ``wake ignored``).

        Raises InboxError when it cannot be made durable; the delivery is then not queued
        and the sender should be told to retry (503).
        """
        try:
            return await self._group.submit(_Taken(delivery, ignored))
        except InboxError:
            raise
        except Exception as exc:  # every failure of the commit is this delivery's 503
            if not isinstance(exc, OSError | sqlite3.Error | BothyError):
                _log.exception("inbox: the group commit failed")
            raise InboxError(
                f"Cannot make delivery {delivery.key!r} of route {delivery.route!r} durable in"
                f" {self.root}: {_why(exc)}"
            ) from exc

    async def _commit(self, batch: list[_Taken]) -> list[Accepted | Duplicate]:
        """Steps 1–4 for a whole batch: one segment fsync of the lines of what may run (none
        when nothing may), the register's records of what was ignored (one commit of theirs),
        one INSERT.

        Known deliveries are found by the INSERT itself (ON CONFLICT: no row), and only then
        looked up for their wake id; in a batch holding deliveries no job wants, they are
        looked up beside the segment's write and fsync, and what is left of those is recorded
        once the batch's lines are durable: a delivery answered 503 (its batch's fsync failed)
        leaves no `wake ignored` naming it. A known delivery that may run has its line written
        for nothing: it gets no row, and recovery, meeting it past a segment's rows, gives it
        none (its row is there) or closes it by what the register shows.
        """
        # Up to _IN_FLIGHT commits are under way; each takes its turns in the order it started.
        appending, recording, inserting = (
            self._appends.queue(), self._records.queue(), self._inserts.queue())
        try:
            first: dict[tuple[str, str, str], _Taken] = {}
            for taken in batch:
                first.setdefault(_ident(taken.delivery), taken)
            # Only what may run keeps its payload: nothing will ever read one closed ignored.
            kept = [t for t in first.values() if t.ignored is None]
            lines = [encode_payload_file(t.delivery) + b"\n" for t in kept]
            if any(t.ignored is not None for t in first.values()):
                append = asyncio.ensure_future(self._append(appending, lines))
                appended, looked_up = await asyncio.gather(
                    append, self._known_then_record(recording, first, append),
                    return_exceptions=True)  # both done before the batch goes on or fails
                for outcome in (appended, looked_up):
                    if isinstance(outcome, BaseException):
                        raise outcome
                assert not isinstance(appended, BaseException)  # (for mypy: raised above)
                assert not isinstance(looked_up, BaseException)
                spans, known = appended, looked_up
            else:  # the INSERT finds the known ones (ON CONFLICT), and they are looked up then
                recording.release()
                spans, known = await self._append(appending, lines), {}
            where = dict(zip((_ident(t.delivery) for t in kept), spans, strict=True))
            fresh = [(taken, where.get(ident)) for ident, taken in first.items()
                     if ident not in known]
            async with inserting:
                ids = await self._insert(fresh) if fresh else {}
                inserted = {_ident(t.delivery) for t, _ in fresh}
                self._recorded -= inserted
                self._inserted.append(inserted)
                raced = [t.delivery for t, _ in fresh if _ident(t.delivery) not in ids]
                if raced:  # another connection's row came first: that one counts
                    known |= await self._known(raced)
        finally:  # a failed batch lets the next ones take their turns
            appending.release()
            recording.release()
            inserting.release()
        outcomes: list[Accepted | Duplicate] = []
        for taken in batch:
            ident = _ident(taken.delivery)
            if first[ident] is taken and ident in ids:
                outcomes.append(Accepted(ids[ident], taken.ignored))
            else:
                outcomes.append(Duplicate(known.get(ident, ids.get(ident))))
        return outcomes

    async def _append(self, turn: _Turn, lines: list[bytes]) -> list[Span]:
        """The batch's lines, written and fsynced in its turn; a batch of none (all of it
        closed ignored) touches no segment."""
        async with turn:
            if not lines:
                return []
            return await asyncio.to_thread(self._segments.append, lines)

    async def _known_then_record(
        self, turn: _Turn, first: dict[tuple[str, str, str], _Taken],
        append: asyncio.Future[list[Span]],
    ) -> dict[tuple[str, str, str], int]:
        """Which of the batch are known, then, in its turn and once the batch's lines are
        durable (``append``), ``wake ignored`` for the rest no job wants (a known one must not
        be recorded again); return the known ones' wake ids. A batch whose append failed is
        answered 503 and records nothing.

        The turn: a copy of one of them in the batch before is recorded (or has failed to
        be) before this batch decides; and one whose row that batch has just inserted, after
        this batch looked, is still found (``_inserted``).
        """
        known = await self._known([t.delivery for t in first.values()])
        async with turn:
            await asyncio.wait({append})
            if append.cancelled() or append.exception() is not None:
                return known  # (the batch fails with the append's exception)
            await self._record_ignored([t for ident, t in first.items()
                                        if t.ignored is not None and ident not in known])
        return known

    async def _known(self, deliveries: list[Delivery]) -> dict[tuple[str, str, str], int]:
        """The wake id of each delivery that already has a row."""
        idents = list(dict.fromkeys(_ident(d) for d in deliveries))
        # A join, not "(source, route, key) IN (VALUES …)": SQLite scans the whole table for
        # that, and searches the unique index for this.
        rows = await self._db.fetch_all(
            "SELECT w.id, w.source, w.route, w.key FROM (VALUES "
            + ",".join("(?, ?, ?)" for _ in idents) + ") AS v JOIN wakes AS w"
            " ON w.source = v.column1 AND w.route = v.column2 AND w.key = v.column3",
            tuple(value for ident in idents for value in ident),
        )
        return {(row["source"], row["route"], row["key"]): int(row["id"]) for row in rows}

    async def _record_ignored(self, ignored: list[_Taken]) -> None:
        """``wake ignored`` for the deliveries no job wants, before their rows say so: one
        record per route and :data:`~bothy.wakes.delivery.IGNORED_PER_RECORD` deliveries,
        naming each with its reason. A crash between leaves the records and no row (and no
        payload line): the sender, answered nothing, sends it again, and its retry gets its
        row without a second record (``_ignored_before``: the register read at start-up). One
        the register already holds (an earlier attempt failed after it, or before its batch
        was durable: it was answered 503, or not at all) is not recorded again."""
        todo = [t for t in ignored if _ident(t.delivery) not in self._recorded
                and not any(_ident(t.delivery) in rows for rows in self._inserted)
                and not self._ignored_before(t.delivery.route, t.delivery.key)]
        if not todo:
            return
        by_route: dict[str, list[_Taken]] = {}
        for taken in todo:
            by_route.setdefault(taken.delivery.route, []).append(taken)
        records: list[NewRecord] = []
        covers: list[list[_Taken]] = []  # the deliveries each record closes
        for route, takens in by_route.items():
            for start in range(0, len(takens), IGNORED_PER_RECORD):
                chunk = takens[start:start + IGNORED_PER_RECORD]
                details = ignored_batch_details(route, [(t.delivery, t.ignored or "")
                                                        for t in chunk])
                records.append(NewRecord("wake", "ignored", "refused", subject=route,
                                         details=details))
                covers.append(chunk)
        # One submission of the batch's records (no task for each: a commit of theirs).
        written = await self._audit.record_all(records)
        for takens, outcome in zip(covers, written, strict=True):
            if not isinstance(outcome, Exception):
                self._recorded.update(_ident(t.delivery) for t in takens)
        for outcome in written:
            if isinstance(outcome, Exception):
                raise outcome

    async def _insert(
        self, items: Sequence[tuple[_Taken, Span | None]], *, file: str | None = None
    ) -> dict[tuple[str, str, str], int]:
        """Insert-if-absent the rows of ``items`` in one statement (its own transaction);
        return the ids of those inserted.

        One statement, because each is a round trip to SQLite's thread, and under load a
        round trip costs more than the rows: BEGIN, INSERT, COMMIT took three times as long.
        """
        params: list[object] = []
        closed_us = to_us(self._clock())  # the batch's ignored rows close together
        for taken, span in items:
            delivery = taken.delivery
            received_us = to_us(delivery.received_at)
            closed = taken.ignored is not None
            params += [delivery.source, delivery.route, delivery.key, delivery.event,
                       delivery.action, "ignored" if closed else "queued", received_us,
                       received_us, _place(span, file),
                       span.offset if span is not None else None,
                       span.length if span is not None else None, taken.ignored,
                       closed_us if closed else None]
        rows = await self._db.atomic(
            "INSERT INTO wakes (source, route, key, event, action, status, attempts,"
            " next_try_us, received_us, file, payload_at, payload_bytes, note, finished_us)"
            " VALUES " + ",".join("(?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?)" for _ in items)
            + " ON CONFLICT (source, route, key) DO NOTHING RETURNING id, source, route, key",
            tuple(params),
        )
        return {(row["source"], row["route"], row["key"]): int(row["id"]) for row in rows}

    async def recover(
        self,
        ran_as: Callable[[str, str], str | None] | None = None,
        ignored_as: Callable[[str, str], bool] | None = None,
        *,
        found: list[Unindexed] | None = None,
    ) -> list[Reinserted]:
        """Give a row to every payload that has none, and say what each became.

        A payload without a row is a crash between the segment's fsync and the rows, or a
        state database restored from an older copy. ``ran_as(route, key)`` names the run the
        register shows already ran that delivery, ``ignored_as(route, key)`` whether it shows
        it was ignored: such a wake is recorded closed (``done`` with that run, or
        ``ignored``), never queued to run again. Every other one is queued. Run it at
        start-up, before the listeners. A payload that cannot be read back is left where it
        is, and logged. Intake keeps ``ignored_as`` too: a delivery the register shows ignored
        (its batch failed after the record, before a crash) is not recorded a second time.
        ``found``: what :meth:`unindexed` returned, if the caller looked first.
        """
        if ignored_as is not None:
            self._ignored_before = ignored_as
        if found is None:
            found = await self.unindexed()
        reinserted = []
        for delivery, span, file in found:
            try:
                ids = await self._insert([(_Taken(delivery, None), span)], file=file)
            except sqlite3.Error as exc:
                raise InboxError(f"Cannot record recovered wake {file}: {exc}") from exc
            wake_id = ids.get(_ident(delivery))
            if wake_id is None:
                continue  # a row was there after all (a copy seen twice)
            run_id = ran_as(delivery.route, delivery.key) if ran_as is not None else None
            ignored = (run_id is None and ignored_as is not None
                       and ignored_as(delivery.route, delivery.key))
            if run_id is not None:
                await self.finish(wake_id, "done", run_id=run_id,
                                  note=f"restored from its payload; the register shows {run_id}"
                                  " ran it already")
            elif ignored:
                await self.finish(wake_id, "ignored", run_id=None,
                                  note="restored from its payload; the register shows it was"
                                  " ignored")
            reinserted.append(Reinserted(wake_id, delivery.source, delivery.route,
                                         delivery.key, file, run_id, ignored))
        return reinserted

    async def unindexed(self) -> list[Unindexed]:
        """The payloads without a row (:mod:`bothy.wakes.unindexed`), each with its line (None
        for a file of an older Bothy) and file: what :meth:`recover` gives rows."""
        return await unindexed(self.root, self._db, self._segments)

    # -- the dispatcher's side -------------------------------------------------------------

    async def due(self, now_us: int, limit: int = 50) -> list[WakeRow]:
        """Queued wakes whose time has come, in arrival order."""
        rows = await self._db.fetch_all(
            "SELECT * FROM wakes WHERE status = 'queued' AND next_try_us <= ?"
            " ORDER BY received_us, id LIMIT ?",
            (now_us, limit),
        )
        return [WakeRow.from_row(row) for row in rows]

    async def load(self, wake: WakeRow) -> Delivery:
        """The delivery of ``wake``, read back from its segment (or file); its body byte for
        byte."""
        if wake.file == NO_PAYLOAD:
            raise InboxError(f"Wake {wake.id} ({wake.route} {wake.key}) keeps no payload: it"
                             " was closed ignored at intake")
        if wake.payload_at is None or wake.payload_bytes is None:
            return await read_payload_file(self.root, wake.file)
        span = Span(wake.file, wake.payload_at, wake.payload_bytes)
        where = f"{self.root / wake.file} at offset {wake.payload_at}"
        try:
            line = await asyncio.to_thread(self._segments.read, span)
        except OSError as exc:
            raise InboxError(f"Cannot read wake payload {where}: {exc}") from exc
        except ValueError as exc:
            raise InboxError(f"Wake payload {where} is damaged: {exc}") from exc
        try:
            return decode_payload_file(line)
        except ValueError as exc:
            raise InboxError(f"Wake payload {where} is damaged: {exc}") from exc

    async def claim(self, wake_id: int, run_id: str | None = None) -> bool:
        """Take a queued wake (queued → running), naming the run minted for this attempt
        (before the run is admitted: after a crash, the wake's run can be found); False if it
        was not queued (someone has it).

        Each change of a wake's row here is one statement, its own transaction (``atomic``):
        one round trip to the database, so that intake's rows wait less behind it.
        """
        changed = await self._db.atomic(
            "UPDATE wakes SET status = 'running', run_id = ?"
            " WHERE id = ? AND status = 'queued' RETURNING id",
            (run_id, wake_id),
        )
        return len(changed) == 1

    async def finish(
        self, wake_id: int, status: str, *, run_id: str | None, note: str | None,
        ran: bool = True,
    ) -> None:
        """Close a queued or running wake as ``done``, ``ignored`` or ``abandoned``.

        ``run_id`` None keeps the run already recorded, if any; ``ran`` False forgets it (the
        attempt asked for no run: the id its claim named was never used).
        """
        if status not in FINISHED:
            raise ValueError(f"a wake finishes as one of {', '.join(FINISHED)}, not {status!r}")
        changed = await self._db.atomic(
            "UPDATE wakes SET status = ?, run_id = CASE WHEN ? THEN COALESCE(?, run_id) END,"
            " note = ?, finished_us = ?"
            " WHERE id = ? AND status IN ('queued', 'running') RETURNING id",
            (status, ran, run_id, note, to_us(self._clock()), wake_id),
        )
        if len(changed) != 1:
            raise InboxError(f"Cannot finish wake {wake_id} as {status}: it is not queued or"
                             " running")

    async def retry_later(self, wake_id: int, *, next_try_us: int, note: str) -> int:
        """Put a running wake back in the queue (running → queued); return its attempts so far.

        The run id is cleared: the next attempt mints its own, and a crash before it does
        must not be mistaken for a run under way.
        """
        rows = await self._db.atomic(
            "UPDATE wakes SET status = 'queued', attempts = attempts + 1, next_try_us = ?,"
            " note = ?, run_id = NULL WHERE id = ? AND status = 'running' RETURNING attempts",
            (next_try_us, note, wake_id),
        )
        if not rows:
            raise InboxError(f"Cannot retry wake {wake_id} later: it is not running")
        return int(rows[0][0])

    async def in_flight(self) -> list[WakeRow]:
        """Wakes marked running: after a crash, those a dead daemon had taken."""
        rows = await self._db.fetch_all(
            "SELECT * FROM wakes WHERE status = 'running' ORDER BY received_us, id")
        return [WakeRow.from_row(row) for row in rows]

    async def prune(self, older_than_us: int) -> int:
        """Forget wakes finished before ``older_than_us``, with their payloads
        (:meth:`bothy.wakes.retention.Retention.prune` says what goes), recorded ``wake
        pruned`` when anything went; returns how many wakes.

        Intake waits meanwhile (milliseconds, once an hour from ``bothy serve``): a segment is
        judged by its rows only once every batch appended to it has its rows.
        """
        appending, recording, inserting = (
            self._appends.queue(), self._records.queue(), self._inserts.queue())
        recording.release()  # (records go on: the rows are what a prune waits for)
        try:
            async with appending:  # no batch appends while the segments are judged ...
                async with inserting:  # ... and every earlier one has its rows
                    pass
                pruned = await self._retention.prune(older_than_us)
        finally:
            appending.release()
            inserting.release()
        if pruned.wakes or pruned.segments:
            await self._audit.record("wake", "pruned", "ok", details={
                "wakes": pruned.wakes, "segments": pruned.segments,
                "finished_before": from_us(older_than_us).isoformat()})
        return pruned.wakes

    async def keep_pruned(self, keep_s: float, stop: asyncio.Event) -> None:
        """Prune what finished more than ``keep_s`` ago now, then every hour, until ``stop``
        (``bothy serve``); a failure is logged and tried again at the next hour."""
        await self._retention.keep_pruned(self.prune, keep_s, stop)


class _Turns:
    """One step of the commit, taken one batch at a time in the order the batches queued for
    it (each queues, without waiting, as it starts): a turn's ``done`` is set once its batch
    and every one before it have let the step go."""

    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def queue(self) -> _Turn:
        turn = _Turn(self._last, asyncio.get_running_loop().create_future())
        self._last = turn.done
        return turn


class _Turn:
    """A batch's place in one step: ``async with`` waits for the batches before it, and lets
    the step go on leaving; ``release`` lets it go without taking it (a batch that failed
    first). Letting go twice is once."""

    def __init__(self, before: asyncio.Future[None] | None, done: asyncio.Future[None]) -> None:
        self._before = before
        self.done = done

    async def __aenter__(self) -> None:
        if self._before is not None and not self._before.done():
            await asyncio.shield(self._before)  # a cancelled waiter leaves it to the next

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        if self.done.done():
            return
        if self._before is None or self._before.done():
            self.done.set_result(None)
        else:  # never ahead of the batches before it
            self._before.add_done_callback(self._after)

    def _after(self, before: asyncio.Future[None]) -> None:
        if not self.done.done():
            self.done.set_result(None)


def _place(span: Span | None, file: str | None) -> str:
    """A row's ``file``: its line's segment, an older Bothy's file of its own, or, for one
    closed ignored at intake, :data:`NO_PAYLOAD` (no segment, no offset)."""
    if span is not None:
        return span.segment
    return file if file is not None else NO_PAYLOAD


def _ident(delivery: Delivery) -> tuple[str, str, str]:
    return (delivery.source, delivery.route, delivery.key)


def _never(route: str, key: str) -> bool:
    return False


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc) or type(exc).__name__
