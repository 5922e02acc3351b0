"""Recovery: what a Bothy process that died left behind is found, ended and audited.

A run row names its owner (pid and start time) and its worker's process group (pgid, leader
pid and start time). When the owner is no longer that process, the run is an orphan: its group
is ended by :func:`~bothy.engine.procgroup.end_orphan_group` (which never signals a recycled
pid) and the run is closed as ``failed``. Its reservation is *kept* until it expires (the
``crashed`` flag): nobody knows what the worker spent after the last measurement. A run that
was still queued when its owner died had spent nothing; it is closed and releases at once.

Several processes may sweep at once; the ``UPDATE ... WHERE status != 'finished'`` that closes
a run decides which of them records it.

A run's worker is also named by the run's ``worker`` row in ``groups`` until `worker stopped` is
recorded. A chat run is settled, and its answer told, before its worker is stopped
(``engine/supervisor.py``), so its owner may die with the run finished and the worker not yet
stopped: the sweep ends such
a group too and records its `worker stopped` (``by``: the later Bothy); the run stays as it
finished.

A spare app-server (``engine/spare.py``) no run took is recorded in the ``spares`` table with
the ``bothy serve`` that started it as its owner; when that owner is gone, its group is ended
the same way and the row deleted (``spare recovered``; the ``DELETE`` decides who records it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bothy.clock import Clock, to_us
from bothy.engine.audit import AuditLog
from bothy.engine.procgroup import GroupRecord, OrphanOutcome, end_orphan_group
from bothy.engine.proctable import same_process
from bothy.engine.state import RunRow, StateDB


@dataclass(frozen=True)
class Recovered:
    run_id: str
    subject: str
    was: str
    group: str


def owner_alive(row: RunRow) -> bool:
    """The run's owner is still the process that admitted it (not a recycled pid)."""
    return row.owner_start is not None and same_process(row.owner_pid, row.owner_start)


def settled_by_owner(row: RunRow) -> bool:
    """The run was finished by the Bothy that ran it (settled, its end recorded), not closed
    by a sweep after that Bothy died (``crashed``, or never started)."""
    return row.status == "finished" and not row.crashed and row.started_us is not None


class Recovery:
    """Sweeps the state for runs whose owner died."""

    def __init__(self, db: StateDB, audit: AuditLog, *, clock: Clock, grace_s: float) -> None:
        self._db = db
        self._audit = audit
        self._clock = clock
        self._grace_s = grace_s
        self.spares_ended: list[int] = []  # the pgids of dead serves' spares the sweep ended
        self.workers_ended: list[str] = []  # finished runs whose workers the sweep ended

    async def orphans(self) -> list[RunRow]:
        rows = await self._db.runs_with_status("queued", "running")
        return [row for row in rows if not owner_alive(row)]

    async def sweep(self) -> list[Recovered]:
        recovered = []
        for row in await self.orphans():
            group = await self._end_group(row)
            if await self._close(row, group):
                recovered.append(Recovered(row.run_id, row.subject, row.status, group))
        self.workers_ended = await self._end_stopping_workers()
        self.spares_ended = await self._end_spares()
        return recovered

    async def _end_stopping_workers(self) -> list[str]:
        """End the workers of finished runs whose owner died before recording them stopped,
        and record each once (`worker stopped`); the runs whose workers this sweep ended."""
        ended = []
        for group in await self._db.fetch_all(
            "SELECT g.run_id, g.pgid, g.leader_pid, g.leader_start, r.subject, r.owner_pid,"
            " r.owner_start FROM groups g JOIN runs r USING (run_id)"
            " WHERE g.role = 'worker' AND r.status = 'finished'"
        ):
            async def stopped(outcome: OrphanOutcome, group: Any = group) -> None:
                await self._audit.record(
                    "worker", "stopped", "ok", subject=group["subject"], run_id=group["run_id"],
                    details={"how": outcome.describe(), "exit_code": None,
                             "by": "a later bothy: the one that ran it died after the"
                                   f" run finished (pid {group['owner_pid']})"})

            if await self._end_orphaned(
                    group, "DELETE FROM groups WHERE run_id = ? AND role = 'worker'",
                    (group["run_id"],), stopped):
                ended.append(str(group["run_id"]))
        return ended

    async def _end_spares(self) -> list[int]:
        """End the spare app-servers whose ``bothy serve`` died, and record each once; the
        pgids this sweep ended."""
        ended = []
        for spare in await self._db.fetch_all("SELECT * FROM spares"):
            async def recovered(outcome: OrphanOutcome, spare: Any = spare) -> None:
                await self._audit.record("spare", "recovered", "ok", details={
                    "owner_pid": spare["owner_pid"], "pgid": spare["pgid"],
                    "group": outcome.describe()})

            if await self._end_orphaned(
                    spare, "DELETE FROM spares WHERE pgid = ? AND leader_start = ?",
                    (spare["pgid"], spare["leader_start"]), recovered):
                ended.append(int(spare["pgid"]))
        return ended

    async def _end_orphaned(
        self, row: Any, forget: str, keys: tuple[Any, ...],
        say: Callable[[OrphanOutcome], Awaitable[None]],
    ) -> bool:
        """End the group ``row`` names (pgid, leader, owner) if its owner is gone, then forget
        the row (``forget`` with ``keys``) and ``say`` so, in one transaction: the record is
        written before the row goes, so a record refused (a broken register) keeps the row for
        the next sweep rather than forgetting a group nobody recorded, and the DELETE decides
        which sweep records it. Whether this sweep did."""
        if row["owner_start"] is not None and same_process(row["owner_pid"], row["owner_start"]):
            return False  # its owner lives and ends it itself
        record = GroupRecord(row["pgid"], row["leader_pid"], row["leader_start"])
        outcome = await end_orphan_group(record, grace_s=self._grace_s)
        if outcome.survivors:
            return False  # still recorded: the next sweep tries again
        async with self._db.transaction():
            changed = await self._db.execute(forget, keys)
            if changed:
                await say(outcome)
        return bool(changed)

    async def _end_group(self, row: RunRow) -> str:
        """End the worker's group and every other group the run recorded (MCP servers)."""
        records = []
        if row.pgid is not None and row.leader_pid is not None and row.leader_start is not None:
            records.append(GroupRecord(row.pgid, row.leader_pid, row.leader_start))
        for extra in await self._db.fetch_all(
            "SELECT pgid, leader_pid, leader_start FROM groups WHERE run_id = ?"
            " AND role != 'worker'", (row.run_id,)  # the worker's is the row's own
        ):
            records.append(GroupRecord(extra["pgid"], extra["leader_pid"], extra["leader_start"]))
        if not records:
            return "none"
        outcomes = [await end_orphan_group(record, grace_s=self._grace_s) for record in records]
        return "; ".join(outcome.describe() for outcome in outcomes)

    async def _close(self, row: RunRow, group: str) -> bool:
        crashed = 1 if row.status == "running" else 0
        reason = (
            f"its bothy process (pid {row.owner_pid}) died while the run was {row.status};"
            f" worker group: {group}"
        )
        async with self._db.transaction():
            changed = await self._db.execute(
                "UPDATE runs SET status = 'finished', outcome = 'failed', reason = ?,"
                " crashed = ?, finished_us = ? WHERE run_id = ? AND status != 'finished'",
                (reason, crashed, to_us(self._clock()), row.run_id),
            )
            await self._db.execute(  # ended above with the run's other groups
                "DELETE FROM groups WHERE run_id = ? AND role = 'worker'", (row.run_id,))
        if changed:
            await self._audit.record(
                "run",
                "recovered",
                "failed",
                subject=row.subject,
                run_id=row.run_id,
                details={
                    "was": row.status,
                    "owner_pid": row.owner_pid,
                    "pgid": row.pgid,
                    "group": group,
                    "reservation": "held until it expires" if crashed else "released",
                },
            )
        return bool(changed)
