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

It reads a recent stretch of the register, not all of it (:func:`history_since`): what it
answers concerns deliveries received since then, and their records are not older than their
arrival (a redelivery's leftover line aside: :meth:`RunHistory.learn`). Start-up and memory
then stay the same on a site whose register has grown for years. Of what it read, intake
keeps only the ignored deliveries, 16 bytes each (:mod:`bothy.wakes.digestset`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.auditindex import wake_id_for
from bothy.errors import AuditIntegrityError
from bothy.wakes.delivery import ignored_in
from bothy.wakes.digestset import DigestSet, DigestSetBuilder


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
    ignored, and what it decided of each attempt refused at a gate.

    ``deliveries``: the (route, key) pairs whose runs and refusals recovery asks about (None:
    every one). The others' records are passed over, not kept: on a busy site they are tens
    of thousands a week, and recovery has a handful to decide. Every ignored delivery is
    kept, for intake (:attr:`ignored_deliveries`), unless ``every_ignored`` is False: then
    only those asked about."""

    def __init__(
        self, records: Iterable[AuditRecord], *,
        deliveries: Collection[tuple[str, str]] | None = None, every_ignored: bool = True,
    ) -> None:
        def asked(route: str, key: str) -> bool:
            return deliveries is None or (route, key) in deliveries

        self._learnt_ignored: list[DigestSet] = []  # from reads further back (learn)

        woken: dict[str, tuple[str, str]] = {}  # wake id (or, in older records, run id)
        ignored = DigestSetBuilder()
        wake_of: dict[str, str] = {}  # run id -> the wake id its records name
        started: set[str] = set()
        self._refused: dict[str, int] = {}  # run id -> the seq of its `run refused`
        # (route, delivery key, attempt) -> the seq and what the wake's refusal decided
        self._steps: dict[tuple[str, str, int], tuple[int, Deferred | Abandoned]] = {}
        for record in records:
            wake_id = record.details.get("wake_id")
            if (record.kind, record.event) in (("wake", "deferred"), ("wake", "abandoned")):
                self._step(record, asked)
            elif (record.kind, record.event) == ("wake", "received"):
                route, key = record.details.get("route"), record.details.get("delivery")
                ident = wake_id if isinstance(wake_id, str) else record.run_id
                if isinstance(route, str) and isinstance(key, str) and ident and asked(route, key):
                    woken[ident] = (route, key)
            elif (record.kind, record.event) == ("wake", "ignored"):  # one, or intake's batch
                for closed in ignored_in(record.details):
                    if every_ignored or asked(closed.route, closed.key):
                        ignored.add(closed.route, closed.key)
            # A run's records follow its wake's `wake received` (one commit holds both). Not
            # every one names the wake, whose id is the run's own stamp (wake_id_for).
            elif (record.kind == "run" and record.run_id
                  and (wake_id_for(record.run_id) in woken or wake_id in woken
                       or record.run_id in woken)):
                if isinstance(wake_id, str):
                    wake_of[record.run_id] = wake_id
                if record.event == "started":
                    started.add(record.run_id)
                elif record.event == "refused":
                    self._refused[record.run_id] = record.seq
        # What intake keeps (as long as `bothy serve` runs) of all this: 16 bytes a delivery.
        self.ignored_deliveries: DigestSet = ignored.build()
        self._ran: dict[tuple[str, str], str] = {}
        for run_id in started:
            delivery = woken.get(wake_of.get(run_id, run_id))
            if delivery is not None:
                self._ran[delivery] = run_id

    def _step(self, record: AuditRecord, asked: Callable[[str, str], bool]) -> None:
        route, key, attempt, reason = (record.details.get(name) for name in
                                       ("route", "delivery", "attempt", "reason"))
        if not (isinstance(route, str) and isinstance(key, str) and isinstance(attempt, int)
                and isinstance(reason, str) and asked(route, key)):
            return
        step: Deferred | Abandoned = Abandoned(reason)
        if record.event == "deferred":
            retry_in_s = record.details.get("retry_in_s")
            if not isinstance(retry_in_s, int | float):
                return
            step = Deferred(record.ts + timedelta(seconds=retry_in_s), reason)
        self._steps[(route, key, attempt)] = (record.seq, step)

    @classmethod
    def from_register(
        cls, audit: AuditLog, *, since: datetime | None = None,
        deliveries: Collection[tuple[str, str]] | None = None, every_ignored: bool = True,
    ) -> RunHistory:
        """Read the register's records stamped at or after ``since`` (all of them if None;
        blocking: call it from a thread). A register that cannot be read to its end counts
        what it holds up to the break."""
        # With no delivery asked about, no run's records can matter: only `wake` lines are read.
        kinds = _WAKES if deliveries is not None and not deliveries else _WAKES_AND_RUNS
        return cls(_readable(audit, since, kinds), deliveries=deliveries,
                   every_ignored=every_ignored)

    def knows(self, route: str, key: str) -> bool:
        """Whether the register shows this delivery ran or was ignored."""
        return self.ran_as(route, key) is not None or self.ignored(route, key)

    def learn(self, earlier: RunHistory) -> None:
        """Take in what a read further back found (of the deliveries it was asked about):
        its runs, and its ignored deliveries (not intake's: those stay this read's)."""
        for delivery, run_id in earlier._ran.items():
            self._ran.setdefault(delivery, run_id)
        self._learnt_ignored.append(earlier.ignored_deliveries)

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
        return self.ignored_deliveries.holds(route, key) or any(
            learnt.holds(route, key) for learnt in self._learnt_ignored)


def history_since(now: datetime, keep_days: int, received: Iterable[datetime]) -> datetime:
    """Where recovery's read of the register starts: ``keep_days`` (the inbox's own memory
    of what it finished, ``wakes.keep_deliveries_days``) before ``now``, or before the
    earliest arrival among ``received`` (the wakes recovery has to decide: payloads without
    a row, wakes a dead daemon left running) if that is earlier. A day more on either,
    for a clock set back in between.

    A delivery's records all come after its arrival, with one exception: a payload line can
    be a redelivery's, stamped at its own arrival, after the first delivery's records (it got
    no row: the first one had its own, since gone with its segment or an older copy of the
    state database). What this stretch says nothing of about a payload is looked for in the
    whole register (:meth:`learn`; bothy/wakes/dispatcher.py). Intake's guard against a
    second ``wake ignored`` reaches as far back as the inbox's own rows do (a delivery older
    than that is new to the inbox either way)."""
    earliest = min([now - timedelta(days=keep_days), *received])
    return earliest - _CLOCK_SLACK


_CLOCK_SLACK = timedelta(days=1)


# What RunHistory reads; the rest is passed over undecoded.
_WAKES, _WAKES_AND_RUNS = ("wake",), ("wake", "run")


def _readable(
    audit: AuditLog, since: datetime | None, kinds: tuple[str, ...]
) -> Iterator[AuditRecord]:
    try:
        yield from audit.records(since=since, kinds=kinds)
    except AuditIntegrityError:
        return  # the chain is checked elsewhere; what was read up to the break still counts
