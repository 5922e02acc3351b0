"""What the register says already ran: the guard against running a delivery twice.

The state database says which wakes were taken; the register (``audit.jsonl``) says it too, and
survives a state database restored from an older copy. :class:`RunHistory` reads the register
once, at start-up, and answers which run, if any, already ran a delivery: one whose ``wake
received`` record names it and whose run has a ``run started`` record. A wake's record names
no run (it has none yet); it carries a ``wake_id`` that the run's own records name in turn
(see :func:`bothy.engine.run.wake_id_for`). Recovery asks before queueing a payload file that
has no row (see :meth:`bothy.wakes.inbox.Inbox.recover`), and intake before recording a
delivery no job wants, which the register may already show ignored: a ``wake ignored`` names
one delivery or, from intake, a batch of them (:func:`bothy.wakes.delivery.ignored_in` reads
both).

It answers one more question of recovery: what the register decided of a wake's refused
attempt. The commit that records a refusal at admission holds `run refused` and the wake's
`wake deferred` (or `wake abandoned`) before the wake's row says so; a daemon killed between
the two leaves the row ``running``, naming a run the register shows refused. Recovery then
carries out what the register says (:meth:`RunHistory.refused_step`) rather than run it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from bothy.engine.audit import AuditLog, AuditRecord
from bothy.errors import AuditIntegrityError
from bothy.wakes.delivery import ignored_in


@dataclass(frozen=True)
class Deferred:
    """A refused attempt the register shows deferred: due again ``retry_in_s`` after it was
    recorded, for ``reason``."""

    due_at: datetime
    reason: str


@dataclass(frozen=True)
class Abandoned:
    """A refused attempt the register shows abandoned (``reason`` says after how many)."""

    reason: str


class RunHistory:
    """Deliveries the register shows were run ((route, delivery key) → the run id), or
    ignored, and what it decided of each attempt refused at a gate."""

    def __init__(self, records: Iterable[AuditRecord]) -> None:
        woken: dict[str, tuple[str, str]] = {}  # wake id (or, in older records, run id)
        self._ignored: set[tuple[str, str]] = set()
        wake_of: dict[str, str] = {}  # run id -> the wake id its records name
        started: set[str] = set()
        self._refused: dict[str, int] = {}  # run id -> the seq of its `run refused`
        # (route, delivery key, attempt) -> the seq and what the wake's refusal decided
        self._steps: dict[tuple[str, str, int], tuple[int, Deferred | Abandoned]] = {}
        for record in records:
            wake_id = record.details.get("wake_id")
            if (record.kind, record.event) in (("wake", "deferred"), ("wake", "abandoned")):
                self._step(record)
            elif (record.kind, record.event) == ("wake", "received"):
                route, key = record.details.get("route"), record.details.get("delivery")
                ident = wake_id if isinstance(wake_id, str) else record.run_id
                if isinstance(route, str) and isinstance(key, str) and ident:
                    woken[ident] = (route, key)
            elif (record.kind, record.event) == ("wake", "ignored"):  # one, or intake's batch
                self._ignored.update((d.route, d.key) for d in ignored_in(record.details))
            elif record.kind == "run" and record.run_id:
                if isinstance(wake_id, str):
                    wake_of[record.run_id] = wake_id
                if record.event == "started":
                    started.add(record.run_id)
                elif record.event == "refused":
                    self._refused[record.run_id] = record.seq
        self._ran: dict[tuple[str, str], str] = {}
        for run_id in started:
            delivery = woken.get(wake_of.get(run_id, run_id))
            if delivery is not None:
                self._ran[delivery] = run_id

    def _step(self, record: AuditRecord) -> None:
        route, key, attempt, reason = (record.details.get(name) for name in
                                       ("route", "delivery", "attempt", "reason"))
        if not (isinstance(route, str) and isinstance(key, str) and isinstance(attempt, int)
                and isinstance(reason, str)):
            return
        step: Deferred | Abandoned = Abandoned(reason)
        if record.event == "deferred":
            retry_in_s = record.details.get("retry_in_s")
            if not isinstance(retry_in_s, int | float):
                return
            step = Deferred(record.ts + timedelta(seconds=retry_in_s), reason)
        self._steps[(route, key, attempt)] = (record.seq, step)

    @classmethod
    def from_register(cls, audit: AuditLog) -> RunHistory:
        """Read the whole register (blocking: call it from a thread). A register that cannot
        be read to its end counts what it holds up to the break."""
        return cls(_readable(audit))

    def ran_as(self, route: str, key: str) -> str | None:
        """The run that already ran this delivery, or None."""
        return self._ran.get((route, key))

    def refused_step(
        self, run_id: str, route: str, key: str, attempt: int
    ) -> Deferred | Abandoned | None:
        """What the register decided of attempt ``attempt`` of a delivery, if that attempt's
        run (``run_id``, the one its claim named) was refused and the wake's `wake deferred`
        or `wake abandoned` followed; None if the register shows no such refusal."""
        refused_seq = self._refused.get(run_id)
        found = self._steps.get((route, key, attempt))
        if refused_seq is None or found is None or found[0] < refused_seq:
            return None
        return found[1]

    def ignored(self, route: str, key: str) -> bool:
        """Whether the register shows this delivery was ignored (no job wanted it)."""
        return (route, key) in self._ignored


def _readable(audit: AuditLog) -> Iterator[AuditRecord]:
    try:
        yield from audit.records()
    except AuditIntegrityError:
        return  # the chain is checked elsewhere; what was read up to the break still counts
