"""Lanes and the pool: who may start now.

A lane is a subject (``pr:42``, ``demo``): runs in one lane start one at a time, in arrival
order. The pool caps how many runs work at once on the machine (``pool.max_workers``). Both
are decided against the shared state in one writing statement that claims the slot if every
rule lets the run go (it takes the write lock before it reads), so separate ``bothy``
processes queue behind each other as one; a run that must wait has the rules read again in
one ``BEGIN IMMEDIATE`` transaction, to say which holds it.

A free slot goes to the earliest-admitted run whose lane is free, whichever process owns it
and whichever polls first: a later run that finds a slot while an earlier one is still
waiting for it waits too, so nobody is overtaken by a luckier poll.

Waiting across processes is polling with a short, growing interval: processes share no channel
but SQLite, and a poll is the claim's statement, then the rules read again to say which
holds the run (under the write lock, briefly, twice). Within one process a waiter is woken
at once when :meth:`WorkerPool.freed` says a slot or a lane came free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bothy.clock import Clock, to_us
from bothy.config import PoolConfig
from bothy.engine.procgroup import GroupRecord
from bothy.engine.state import StateDB

_POLL_FIRST_S = 0.05
_POLL_MAX_S = 0.5

# Each rule of a claim is written once, for a run whose lane and place are the SQL expressions
# ``subject_sql`` and ``seq_sql``: ``?`` placeholders where a run is asked about, the claimed
# row's own columns (``runs.subject``, ``runs.seq``) in the claim itself, where every table of a
# rule has an alias so that ``runs`` names that row.


def _ahead_in_lane(subject_sql: str, seq_sql: str) -> str:
    """A run before it in its lane, queued or running."""
    return ("SELECT run_id, status FROM runs AS a WHERE a.subject = " + subject_sql
            + " AND a.seq < " + seq_sql + " AND a.status IN ('queued', 'running')"
            " ORDER BY a.seq LIMIT 1")


def _stopping_in_lane(subject_sql: str, seq_sql: str) -> str:
    """A finished run before it in its lane whose worker is still stopping (its answer is told
    first: engine/supervisor.py): it still holds its lane and its slot, for the next run of
    a chat thread resumes the Codex thread, which codex refuses while the last one's
    app-server still has it open."""
    return ("SELECT s.run_id FROM runs AS s JOIN groups AS g ON g.run_id = s.run_id"
            " WHERE s.subject = " + subject_sql + " AND s.seq < " + seq_sql
            + " AND s.status = 'finished' AND g.role = 'worker' ORDER BY s.seq LIMIT 1")


def _earliest_ready(seq_sql: str) -> str:
    """The earliest queued run, admitted before it, that is not cancelled and has nobody ahead
    of it in its own lane: it, not the asker, is due the next free slot."""
    return ("SELECT e.run_id FROM runs AS e WHERE e.status = 'queued' AND e.seq < " + seq_sql
            + " AND e.cancel_requested_us IS NULL AND NOT EXISTS (SELECT 1 FROM runs AS b"
            " WHERE b.subject = e.subject AND b.seq < e.seq AND (b.status IN ('queued',"
            " 'running') OR EXISTS (SELECT 1 FROM groups AS h WHERE h.run_id = b.run_id"
            " AND h.role = 'worker'))) ORDER BY e.seq LIMIT 1")


# Workers busy: runs running, and finished runs whose worker is still stopping. The second
# count starts from the groups (the few live ones), not from the finished runs (every run the
# site ever had: ~12 ms at 100,000 of them, on every claim).
_BUSY = (
    "SELECT (SELECT COUNT(*) FROM runs AS c WHERE c.status = 'running') + (SELECT COUNT(*)"
    " FROM groups AS w WHERE w.role = 'worker' AND EXISTS (SELECT 1 FROM runs AS f"
    " WHERE f.run_id = w.run_id AND f.status = 'finished'))"
)
_AHEAD_IN_LANE = _ahead_in_lane("?", "?")
_STOPPING_IN_LANE = _stopping_in_lane("?", "?")
_EARLIEST_READY = _earliest_ready("?")
# The claim when every rule lets the run go: one writing statement, which takes the write lock
# before it reads (as BEGIN IMMEDIATE would), so that separate processes still claim as one.
_CLAIM = (
    "UPDATE runs SET status = 'running', started_us = ? WHERE run_id = ?"
    " AND status = 'queued' AND cancel_requested_us IS NULL"
    " AND NOT EXISTS (" + _ahead_in_lane("runs.subject", "runs.seq") + ")"
    " AND NOT EXISTS (" + _stopping_in_lane("runs.subject", "runs.seq") + ")"
    " AND (" + _BUSY + ") < ?"
    " AND NOT EXISTS (" + _earliest_ready("runs.seq") + ") RETURNING run_id"
)


@dataclass(frozen=True)
class Claimed:
    run_id: str


@dataclass(frozen=True)
class Waiting:
    """Not yet: ``reason`` says what the run waits for."""

    reason: str


@dataclass(frozen=True)
class Withdrawn:
    """The run was cancelled while it waited."""

    reason: str


class WorkerPool:
    """Starts runs in lane order within the machine's worker limit."""

    def __init__(self, db: StateDB, cfg: PoolConfig, *, clock: Clock) -> None:
        self._db = db
        self._cfg = cfg
        self._clock = clock
        self._freed = asyncio.Event()

    def freed(self) -> None:
        """A run of this process finished or was withdrawn: wake this process's waiters now."""
        self._freed.set()
        self._freed = asyncio.Event()

    async def try_claim(self, run_id: str) -> Claimed | Waiting | Withdrawn:
        """Claim a slot for the run if every rule lets it go, or say why not.

        The claim is one writing statement, a single round trip to the database (a ``bothy
        serve``'s intake waits behind what holds the connection); only a run that may not
        go yet (or is withdrawn, or already claimed) has the rules read again, in one
        ``BEGIN IMMEDIATE`` transaction, to say which one holds it.
        """
        claimed = await self._db.atomic(
            _CLAIM, (to_us(self._clock()), run_id, self._cfg.max_workers))
        if claimed:
            return Claimed(run_id)
        return await self._why_not(run_id)

    async def _why_not(self, run_id: str) -> Claimed | Waiting | Withdrawn:
        """The rules in order, each read (one committed view, under the write lock); the
        claim if, by now, none holds the run."""
        async with self._db.transaction():
            row = await self._db.fetch_one(
                "SELECT seq, subject, status, cancel_requested_us FROM runs WHERE run_id = ?",
                (run_id,),
            )
            if row is None or row["status"] == "finished":
                return Withdrawn("the run is no longer queued")
            if row["cancel_requested_us"] is not None:
                return Withdrawn("cancelled while waiting")
            if row["status"] == "running":
                return Claimed(run_id)
            ahead = await self._db.fetch_one(_AHEAD_IN_LANE, (row["subject"], row["seq"]))
            if ahead is not None:
                return Waiting(f"behind {ahead['run_id']} in lane {row['subject']}")
            stopping = await self._db.fetch_one(_STOPPING_IN_LANE, (row["subject"], row["seq"]))
            if stopping is not None:
                return Waiting(f"behind {stopping['run_id']} in lane {row['subject']}: its"
                               " worker is stopping")
            busy = await self._db.scalar(_BUSY)
            if busy >= self._cfg.max_workers:
                return Waiting(f"pool full ({busy} of {self._cfg.max_workers} workers busy)")
            earlier = await self._db.fetch_one(_EARLIEST_READY, (row["seq"],))
            if earlier is not None:
                return Waiting(f"pool slot due first to {earlier['run_id']}, admitted earlier")
            await self._db.execute(
                "UPDATE runs SET status = 'running', started_us = ? WHERE run_id = ?",
                (to_us(self._clock()), run_id),
            )
        return Claimed(run_id)

    async def wait_for_slot(
        self,
        run_id: str,
        *,
        between_tries: Callable[[], Awaitable[None]],
        on_wait: Callable[[Waiting], None],
    ) -> Claimed | Withdrawn:
        """Claim a slot, retrying until it is ours or the run is withdrawn.

        ``between_tries`` runs before each try (recovery of dead peers, keeping the
        reservation alive); ``on_wait`` hears each new reason for waiting.
        """
        interval_s = _POLL_FIRST_S
        last_reason: str | None = None
        while True:
            freed = self._freed  # taken before the try: a free during it is not missed
            await between_tries()
            decision = await self.try_claim(run_id)
            if not isinstance(decision, Waiting):
                if isinstance(decision, Withdrawn):
                    self.freed()  # whoever waited behind it may go
                return decision
            if decision.reason != last_reason:
                on_wait(decision)
                last_reason = decision.reason
            try:
                async with asyncio.timeout(interval_s):
                    await freed.wait()
                interval_s = _POLL_FIRST_S  # woken: something moved, look again soon
            except TimeoutError:
                interval_s = min(interval_s * 2, _POLL_MAX_S)

    async def attach_worker(self, run_id: str, record: GroupRecord) -> None:
        """Persist the worker's group, as soon as it is spawned, so that a later Bothy can end
        it if this one dies: on the run's row, and as the run's ``worker`` group, which stays
        until `worker stopped` is recorded (the run may be finished before its worker is:
        recovery ends a finished run's group still named there)."""
        async with self._db.transaction():
            await self._db.execute(
                "UPDATE runs SET pgid = ?, leader_pid = ?, leader_start = ? WHERE run_id = ?",
                (record.pgid, record.leader_pid, record.leader_start, run_id),
            )
            await self._db.execute(
                "INSERT INTO groups (run_id, role, pgid, leader_pid, leader_start)"
                " VALUES (?, 'worker', ?, ?, ?)",
                (run_id, record.pgid, record.leader_pid, record.leader_start),
            )

    async def worker_stopped(self, run_id: str) -> None:
        """The run's worker is stopped and recorded so: no later Bothy has it to end."""
        await self._db.atomic("DELETE FROM groups WHERE run_id = ? AND role = 'worker'",
                              (run_id,))

    async def note_model(self, run_id: str, model: str) -> None:
        """The model the run's thread actually got (the configured one may be unset)."""
        await self._db.atomic("UPDATE runs SET model = ? WHERE run_id = ?", (model, run_id))

    async def attach_group(self, run_id: str, role: str, record: GroupRecord) -> None:
        """Persist another process group of the run (an MCP server) for orphan recovery."""
        await self._db.atomic(
            "INSERT INTO groups (run_id, role, pgid, leader_pid, leader_start)"
            " VALUES (?, ?, ?, ?, ?)",
            (run_id, role, record.pgid, record.leader_pid, record.leader_start),
        )

    async def reached_worker(self, run_id: str) -> bool:
        """Whether the run ever had a worker (its group was recorded when it was spawned)."""
        row = await self._db.fetch_one("SELECT pgid FROM runs WHERE run_id = ?", (run_id,))
        return row is not None and row["pgid"] is not None

    async def request_cancel(self, run_id: str) -> bool:
        """Mark a queued or running run for cancellation; False if it already finished."""
        changed = await self._db.atomic(
            "UPDATE runs SET cancel_requested_us = COALESCE(cancel_requested_us, ?)"
            " WHERE run_id = ? AND status != 'finished' RETURNING run_id",
            (to_us(self._clock()), run_id),
        )
        return len(changed) > 0

    async def cancel_requested(self, run_id: str) -> bool:
        row = await self._db.fetch_one(
            "SELECT cancel_requested_us FROM runs WHERE run_id = ?", (run_id,)
        )
        return row is not None and row["cancel_requested_us"] is not None
