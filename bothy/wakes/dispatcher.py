"""The dispatcher: durable wakes from the inbox become runs, once each.

It takes queued wakes in arrival order, claims each one (so two daemons never run the same
wake), and hands it to the handler of its source (``wakes/handlers.py``; a chat
conversation's is ``chat/``'s), which runs what it asks for through the supervisor or says why
it asks for nothing. The supervisor's lanes keep ``pr:42`` deliveries one after another;
admissions happen one at a time, in arrival order. A wake refused at a gate, that nobody
waits for, is an event (rule 4): it is retried later with a doubling delay, counted, and
after ``wakes.max_attempts`` abandoned out loud. A wake that asks for no run is recorded as
ignored.

Each wake's run id is minted here and stored before the run is admitted, so that after a crash
:meth:`Dispatcher.recover` can tell a wake whose run never started (run it) from one whose run
was under way (closed as interrupted, never run twice; its handler may tell whoever waits).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from bothy.clock import Clock, from_us, to_us
from bothy.config import WakesConfig
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog, NewRecord
from bothy.engine.budget import Refused
from bothy.engine.recovery import settled_by_owner
from bothy.engine.run import Outcome, new_run_id
from bothy.engine.state import RunRow, StateDB
from bothy.engine.supervisor import Supervisor
from bothy.waits import first_of
from bothy.wakes import schedules
from bothy.wakes.delivery import POLL, Delivery, wake_details
from bothy.wakes.handlers import Quiet, WakeHandler, WakeStart
from bothy.wakes.history import Abandoned, Deferred, RunHistory, history_since
from bothy.wakes.inbox import Inbox, Reinserted, WakeRow
from bothy.wakes.jobs import Ignored
from bothy.wakes.unindexed import Unindexed

_IDLE_POLL_S = 1.0  # retries fall due without anyone poking the dispatcher
_DUE_PER_LOOK = 50  # wakes taken from one look at the queue


@dataclass(frozen=True)
class Interrupted:
    """A wake whose run was under way when a previous daemon died."""

    wake: WakeRow
    run: RunRow


@dataclass
class Recovered:
    """What :meth:`Dispatcher.recover` found: wakes queued again, runs cut short."""

    requeued: int = 0
    interrupted: list[Interrupted] = field(default_factory=list)
    reinserted: int = 0  # payloads that had no row: queued to run
    already_run: int = 0  # of those, closed: the register shows they ran, or were ignored


@runtime_checkable
class TellsInterrupted(Protocol):
    """A handler that tells somebody of a run a crash cut short (a chat thread; the alert
    channel for an unattended run)."""

    async def interrupted(self, wake: WakeRow, delivery: Delivery, run: RunRow) -> None: ...


class Dispatcher:
    """Runs queued wakes; one task per wake, owned by the dispatcher's task group."""

    def __init__(
        self,
        cfg: WakesConfig,
        handlers: dict[str, WakeHandler],
        *,
        inbox: Inbox,
        supervisor: Supervisor,
        db: StateDB,
        audit: AuditLog,
        alerts: Alerts,
        clock: Clock,
    ) -> None:
        self._cfg = cfg
        self._handlers = dict(handlers)
        self._inbox = inbox
        self._supervisor = supervisor
        self._db = db
        self._audit = audit
        self._alerts = alerts
        self._clock = clock
        self._poke = asyncio.Event()
        self._intake = True
        self._intake_closed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def add_handler(self, source: str, handler: WakeHandler) -> None:
        """Wakes of ``source`` are handled by ``handler`` from now on (a chat connected)."""
        self._handlers[source] = handler

    def poke(self) -> None:
        """A new wake is in the inbox: look now rather than at the next poll."""
        self._poke.set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def recover(self) -> Recovered:
        """At start-up, before intake: give a row to each payload file without one (closed
        if the register shows it ran, else queued); then, of the wakes a dead daemon left
        ``running``, finish those the register shows refused as it recorded (deferred until
        the time it said, or abandoned and alerted: its `wake deferred` or `wake abandoned`
        was committed before the row could say so), requeue those whose run never started,
        and close those whose run was under way (returned, so that whoever waits can be
        told). All of it audited."""
        payloads = await self._inbox.unindexed()
        in_flight = await self._inbox.in_flight()
        history = await self._history(payloads, in_flight)
        found = Recovered()
        # Intake keeps the ignored deliveries alone: the rest of the history goes with this call.
        for restored in await self._inbox.recover(history.ran_as,
                                                  history.ignored_deliveries.holds,
                                                  found=payloads):
            await self._reinserted(restored)
            closed = restored.ran_as is not None or restored.ignored
            found.reinserted += not closed
            found.already_run += closed
        for wake in in_flight:  # a payload given its row above is never running
            step = (history.refused_step(wake.run_id, wake.route, wake.key, wake.attempts + 1)
                    if wake.run_id else None)
            if step is not None:  # refused, recorded, and stopped before its row said so
                await self._carry_out(wake, step)
                continue
            row = await self._db.run(wake.run_id) if wake.run_id else None
            if row is None or row.started_us is None:
                # Never admitted, or admitted but still waiting for a slot (the sweep closed
                # that run id, spending nothing): the wake never ran, so it runs now.
                stage = "admitted" if row is None else "given a worker slot"
                await self._requeue(wake, wake.run_id, f"bothy stopped before its run was {stage}")
                found.requeued += 1
                continue
            note = (f"bothy stopped after its run finished, before it was told; run {row.outcome}"
                    if settled_by_owner(row) else
                    f"bothy stopped while its run was {row.status}; run {row.outcome or 'failed'}")
            await self._inbox.finish(wake.id, "done", run_id=row.run_id, note=note)
            await self._audit.record("wake", "interrupted", "failed", subject=row.subject,
                                     run_id=row.run_id, details={"delivery": wake.key,
                                                                 "note": note})
            found.interrupted.append(Interrupted(wake, row))
        return found

    async def _history(self, payloads: list[Unindexed], in_flight: list[WakeRow]) -> RunHistory:
        """What the register says of the payloads without a row and the wakes left running:
        read from a recent stretch (bothy/wakes/history.py), and, for a payload that stretch
        cannot decide, from the whole register (a line a redelivery left is stamped at its
        own arrival, later than the first delivery's records)."""
        since = history_since(self._clock(), self._cfg.keep_deliveries_days,
                              [delivery.received_at for delivery, _, _ in payloads]
                              + [from_us(wake.received_us) for wake in in_flight])
        asked = ({(delivery.route, delivery.key) for delivery, _, _ in payloads}
                 | {(wake.route, wake.key) for wake in in_flight})
        history = await asyncio.to_thread(RunHistory.from_register, self._audit, since=since,
                                          deliveries=asked)
        undecided = {(delivery.route, delivery.key) for delivery, _, _ in payloads
                     if not history.knows(delivery.route, delivery.key)}
        if undecided:
            history.learn(await asyncio.to_thread(
                RunHistory.from_register, self._audit, deliveries=undecided,
                every_ignored=False))
        return history

    async def _carry_out(self, wake: WakeRow, step: Deferred | Abandoned) -> None:
        """Do to a wake's row what the register already decided of its refused attempt:
        queued again when its `wake deferred` said (not a fresh delay, and not recorded
        twice), or closed abandoned and alerted, as :meth:`_refused` would have."""
        if isinstance(step, Abandoned):
            await self._abandon(wake, step.reason)
            return
        await self._inbox.retry_later(wake.id, next_try_us=to_us(step.due_at),
                                      note=_deferred_note(wake.attempts + 1, step.reason))

    async def _abandon(self, wake: WakeRow, note: str) -> None:
        """Close a refused wake abandoned (its row keeps the refused run's id), out loud."""
        await self._inbox.finish(wake.id, "abandoned", run_id=None, note=note)
        await self._alerts.raise_alert(f"wake {wake.key}", note, subject=_subject(wake))

    async def _reinserted(self, wake: Reinserted) -> None:
        details: dict[str, Any] = {"route": wake.route, "delivery": wake.key,
                                   "source": wake.source, "file": wake.file}
        if wake.ran_as is not None:
            details["then"] = f"closed: the register shows {wake.ran_as} ran it already"
        elif wake.ignored:
            details["then"] = "closed: the register shows it was ignored"
        else:
            details["then"] = "queued: no row and no run of it in the register"
        await self._audit.record("wake", "reinserted", "ok", subject=wake.route,
                                 run_id=wake.ran_as, details=details)

    async def _requeue(self, wake: WakeRow, run_id: str | None, note: str) -> None:
        """Queue a wake whose run never reached a worker again, to run as soon as it can."""
        await self._inbox.retry_later(wake.id, next_try_us=0, note=note)
        await self._audit.record("wake", "requeued", "pending", subject=_subject(wake),
                                 run_id=run_id, details={"delivery": wake.key, "reason": note})

    async def tell_interrupted(self, recovered: Recovered) -> None:
        """Let each interrupted wake's handler tell whoever waited for its run."""
        for cut in recovered.interrupted:
            handler = self._handlers.get(cut.wake.source)
            if isinstance(handler, TellsInterrupted):
                await handler.interrupted(cut.wake, await self._inbox.load(cut.wake), cut.run)

    async def run(self) -> None:
        """Take wakes until :meth:`stop_intake`; the caller owns the task this runs in."""
        while self._intake:
            # Cleared before looking, not after: a poke that comes while the wakes below are
            # taken is for a wake this look may have missed, and must not be lost.
            self._poke.clear()
            due = await self._inbox.due(to_us(self._clock()), limit=_DUE_PER_LOOK)
            for wake in due:
                if not self._intake:
                    break
                # A fresh run id per attempt (a refused id is spent), named by the claim.
                run_id = new_run_id(self._clock)
                if await self._inbox.claim(wake.id, run_id):
                    admitted = asyncio.Event()
                    task = asyncio.create_task(self._guarded(wake, run_id, admitted),
                                               name=f"wake-{wake.id}")
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    # One admission at a time, in arrival order: two deliveries for one lane
                    # must queue in the order they came, not in the order their files load.
                    # A stop does not wait for it: an admission that waits on a run in flight
                    # (plan mode's learner) comes only once the stop has stopped that run.
                    await first_of(admitted.wait(), task, self._intake_closed.wait())
            if len(due) == _DUE_PER_LOOK:
                continue  # more may be due already: look again now, not at the next poke
            try:
                async with asyncio.timeout(_IDLE_POLL_S):
                    await self._poke.wait()
            except TimeoutError:
                pass

    def stop_intake(self) -> None:
        """Take no more wakes, and start no more workers: a run still waiting for a slot or
        in its lane withdraws now, and its wake is queued again (see ``_handle``) to run once
        after the restart; the runs at a worker keep the grace to finish."""
        self._intake = False
        self._intake_closed.set()
        self._poke.set()
        self._supervisor.close_to_new_workers()

    def stop_runs(self) -> None:
        """Ask the in-flight runs to stop: they interrupt their turns, settle, reap groups."""
        self._supervisor.stopping.set()
        self._supervisor.pool.freed()  # waiters look now, and withdraw

    async def drain(self, grace_s: float) -> bool:
        """Wait for in-flight wakes to finish; True if they all did within ``grace_s``."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
        return not pending

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _guarded(self, wake: WakeRow, run_id: str, admitted: asyncio.Event) -> None:
        """Handle a wake; one that breaks (a corrupt payload, a bug) is closed out loud
        instead of vanishing with its task: recorded, abandoned, and raised as an alert. Its
        row keeps the run id its claim named only if a run was asked for under it."""
        start: WakeStart | None = None
        try:
            start, retry = self._start(wake, run_id, admitted)
            await self._handle(wake, start, retry)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure here must be heard, not lost
            reason = f"{type(exc).__name__}: {exc}"[:500]
            await self._audit.record("wake", "crashed", "failed", subject=_subject(wake),
                                     details={"delivery": wake.key, "reason": reason})
            await self._inbox.finish(wake.id, "abandoned", run_id=None,
                                     note=f"handling it failed: {reason}",
                                     ran=start is not None and start.requested)
            await self._alerts.raise_alert(
                f"wake {wake.key}", f"handling it failed: {reason}", subject=_subject(wake)
            )

    def _start(
        self, wake: WakeRow, run_id: str, admitted: asyncio.Event
    ) -> tuple[WakeStart, _Retry | None]:
        """What the wake's handler is given, and what a refusal will make of the wake."""
        handler = self._handlers.get(wake.source)
        details = _details(wake)
        retry = _Retry(self._cfg, wake, details) if handler and handler.retries_refused else None
        start = WakeStart(run_id, details, wake_id=wake.id,
                          inbox=self._inbox, supervisor=self._supervisor, admitted=admitted,
                          refused_with=retry.records if retry is not None else None)
        return start, retry

    async def _handle(self, wake: WakeRow, start: WakeStart, retry: _Retry | None) -> None:
        delivery = await self._inbox.load(wake)
        handler = self._handlers.get(wake.source)
        if handler is None:
            await self._ignore(wake, start, f"no {wake.source} wakes are taken here: that"
                                            " part is not configured")
            return
        ended = await handler.handle(wake, delivery, start)
        if start.done:  # closed as soon as its run's end was told
            return
        if isinstance(ended, Ignored):
            await self._ignore(wake, start, ended.reason)
        elif isinstance(ended, Quiet):  # its handler audited why; nothing ran
            await self._inbox.finish(wake.id, "done", run_id=None, note=ended.reason,
                                     ran=False)
        elif ended.outcome is Outcome.REFUSED and retry is not None:
            await self._refused(wake, ended.reason or "refused", retry)
        elif await start.stopped_before_start():
            # Stopped before its run had a worker: nothing ran, so it runs after the restart.
            await self._requeue(wake, start.run_id, "bothy stopped before its run started")
        else:
            await self._inbox.finish(wake.id, "done", run_id=start.run_id, note=ended.outcome)

    async def _ignore(self, wake: WakeRow, start: WakeStart, reason: str) -> None:
        await self._audit.record("wake", "ignored", "refused", subject=_subject(wake),
                                 run_id=None, details={**start.details, "reason": reason})
        await self._inbox.finish(wake.id, "ignored", run_id=None, note=reason, ran=False)

    async def _refused(self, wake: WakeRow, reason: str, retry: _Retry) -> None:
        """A wake refused at a gate: recorded deferred (or abandoned), unless its refusal's
        commit held that already, then queued again for later (or closed, and alerted)."""
        if not retry.recorded:  # refused after admission (a task someone holds)
            kind, event, outcome, subject, _, details = retry.record_for(reason)
            await self._audit.record(kind, event, outcome, subject=subject, details=details)
        if retry.abandons:
            await self._abandon(wake, retry.abandon_note(reason))
            return
        next_try_us = to_us(self._clock()) + int(retry.delay_s * 1_000_000)
        await self._inbox.retry_later(wake.id, next_try_us=next_try_us,
                                      note=_deferred_note(retry.attempts, reason))


class _Retry:
    """What a refusal at a gate makes of a wake nobody waits for (rule 4): deferred, to be
    tried again after a delay that doubles with each attempt, or, at ``wakes.max_attempts``,
    abandoned out loud. Its record is made for the refusal's own commit (``records``, the
    supervisor's ``refused_with``), or, for a refusal after admission, by the dispatcher."""

    def __init__(self, cfg: WakesConfig, wake: WakeRow, details: dict[str, Any]) -> None:
        self.attempts = wake.attempts + 1
        self.abandons = self.attempts >= cfg.max_attempts
        self.delay_s = min(cfg.retry_first_s * 2 ** (self.attempts - 1), cfg.retry_max_s)
        self.recorded = False
        self._subject = _subject(wake)
        self._details = details

    def abandon_note(self, reason: str) -> str:
        return f"abandoned after {self.attempts} attempts: {reason}"

    def records(self, refusal: Refused) -> list[NewRecord]:
        """The wake's record of ``refusal``: `wake deferred`, or `wake abandoned`."""
        self.recorded = True
        return [self.record_for(refusal.sentence())]

    def record_for(self, reason: str) -> NewRecord:
        if self.abandons:
            return NewRecord("wake", "abandoned", "failed", subject=self._subject,
                             details={**self._details, "reason": self.abandon_note(reason)})
        return NewRecord("wake", "deferred", "pending", subject=self._subject,
                         details={**self._details, "reason": reason,
                                  "retry_in_s": self.delay_s})


def _deferred_note(attempt: int, reason: str) -> str:
    """The row's note of a wake deferred at a gate."""
    return f"attempt {attempt} refused: {reason}"


def _details(wake: WakeRow) -> dict[str, Any]:
    """What the `wake received` record says of the wake."""
    return wake_details(wake.route, wake.event, wake.action, wake.key, wake.received_us,
                        wake.attempts + 1)


def _subject(wake: WakeRow) -> str:
    """The subject of a wake's own records: the route, ``schedule:NAME`` or ``poll:NAME``."""
    if wake.source in (schedules.SOURCE, POLL):
        return f"{wake.source}:{wake.route}"
    return wake.route
