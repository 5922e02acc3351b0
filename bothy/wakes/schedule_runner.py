"""Firing schedules inside ``bothy serve``: :class:`ScheduleRunner` (SPEC §5).

Each fire is a durable wake. :class:`ScheduleRunner` puts it in the inbox (source
``schedule``, route the schedule's name, key the fire time in UTC ISO-8601, body a JSON
snapshot of the schedule), records the fire in ``last_fire_us`` and pokes the dispatcher,
which runs it through the gates like any wake: refused, it is retried with backoff and
abandoned after ``wakes.max_attempts`` (rule 4). The key makes a fire idempotent: one slot
enqueued twice (the timer and a catch-up racing, a crash between the inbox and
``last_fire_us``) is one wake.

Missed fires: whenever the runner looks (at start, on each timer, on each sync), it enqueues
the *latest* slot after ``max(last fire, created, now - wakes.missed_fire_grace_s)`` and at or
before now — one wake however many slots passed, never a burst. A slot older than the grace
is not run (a 03:00 backup should not start at 14:00 because the machine was off all
morning); at start, that skip is audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from bothy.clock import Clock, to_us
from bothy.engine.audit import AuditLog
from bothy.errors import BothyError, InboxError, UsageError
from bothy.wakes.delivery import Delivery
from bothy.wakes.inbox import Accepted, Inbox
from bothy.wakes.schedules import (
    SOURCE,
    Schedule,
    ScheduleStore,
    cron_trigger,
    due_fire,
    next_fire,
    skipped_fire,
)

__all__ = ["ScheduleRunner"]

_SYNC_EVERY_S = 30  # schedules added or removed while bothy serve runs are picked up this fast

_log = logging.getLogger(__name__)


class ScheduleRunner:
    """Fires schedules into the inbox from an APScheduler ``AsyncIOScheduler`` (bothy serve).

    One CronTrigger job per schedule (coalesced, one instance at a time) fires it on time; a
    sync every 30 s (:meth:`keep_synced`) adds, replaces and removes jobs as the table changes
    (``bothy schedule add`` from another shell) and enqueues any slot a timer missed. Every
    fire takes one lock and re-reads the schedule's last fire, so a slot is enqueued once.
    The scheduler is made with the first schedule: a site without any never imports
    APScheduler (~1.5 MB and ~25 ms of serve's start, issue 18).
    """

    def __init__(
        self,
        store: ScheduleStore,
        inbox: Inbox,
        *,
        audit: AuditLog,
        grace_s: int,
        clock: Clock,
        on_enqueued: Callable[[], None],
    ) -> None:
        self._store = store
        self._inbox = inbox
        self._audit = audit
        self._grace_s = grace_s
        self._clock = clock
        self._on_enqueued = on_enqueued
        self._lock = asyncio.Lock()
        self._crons: dict[str, str] = {}  # the cron each registered job was built from
        self._stopped = False
        self._scheduler: Any = None

    async def start(self) -> int:
        """Catch up on missed fires, then start the timers. Returns how many were enqueued."""
        async with self._lock:
            for schedule in await self._store.all():
                await self._audit_skipped(schedule)
            return await self._sync()

    async def keep_synced(self, stop: asyncio.Event, *, every_s: float = _SYNC_EVERY_S) -> None:
        """Sync every ``every_s`` until ``stop`` is set (``bothy serve``). A sync that fails
        (the state database or the register refusing, a row it cannot read) is logged and
        tried again next time, as APScheduler's own interval job was: a background chore
        never takes the daemon down with it."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_s):
                    await stop.wait()
            if stop.is_set():
                return
            try:
                await self.sync()
            except BothyError as exc:
                _log.error("schedules: cannot sync the timers with the table (tried again in"
                           " %g s): %s", every_s, exc)
            except Exception:  # what else it may meet (sqlite3, a bad row): logged, not fatal
                _log.exception("schedules: cannot sync the timers with the table (tried again"
                               " in %g s)", every_s)

    async def stop(self) -> None:
        """Stop the timers. A fire under way finishes first; none starts after this."""
        async with self._lock:
            self._stopped = True
            if self._scheduler is not None and self._scheduler.running:
                self._scheduler.shutdown(wait=False)

    def next_fires(self) -> dict[str, datetime | None]:
        """The next fire of each schedule's timer, as APScheduler holds it."""
        if self._scheduler is None:
            return {}
        return {job.id.removeprefix("schedule:"): job.next_run_time
                for job in self._scheduler.get_jobs() if job.id.startswith("schedule:")}

    async def sync(self) -> int:
        """Bring the timers in line with the table; enqueue due slots. Returns how many."""
        async with self._lock:
            return 0 if self._stopped else await self._sync()

    async def fire_due(self, name: str) -> bool:
        """Enqueue the due slot of schedule ``name``, if it has one; True if a wake was queued."""
        async with self._lock:
            if self._stopped:
                return False
            schedule = await self._store.get(name)
            return schedule is not None and await self._fire_due(schedule)

    async def _sync(self) -> int:
        schedules = await self._store.all()
        names = {schedule.name for schedule in schedules}
        for gone in set(self._crons) - names:
            self._scheduler.remove_job(f"schedule:{gone}")
            del self._crons[gone]
        enqueued = 0
        for schedule in schedules:
            if self._crons.get(schedule.name) != schedule.cron:
                self._register(schedule)
            if await self._fire_due(schedule):
                enqueued += 1
            else:
                await self._refresh_next_fire(schedule)
        return enqueued

    async def _refresh_next_fire(self, schedule: Schedule) -> None:
        """Keep ``next_fire_us`` true for `bothy status` (it moves on without firing after a
        skipped slot, or when the budget's time zone changes)."""
        try:
            trigger = cron_trigger(schedule.cron, self._store.timezone)
        except UsageError:
            return
        upcoming = next_fire(trigger, self._clock())
        upcoming_us = to_us(upcoming) if upcoming is not None else None
        if upcoming_us != schedule.next_fire_us:
            await self._store.set_next_fire(schedule.name, upcoming_us)

    def _register(self, schedule: Schedule) -> None:
        try:
            trigger = cron_trigger(schedule.cron, self._store.timezone)
        except UsageError as exc:  # written by hand into the table: say so, keep the rest
            _log.error("schedule %s cannot be timed: %s", schedule.name, exc)
            return
        self._timers().add_job(
            self.fire_due, trigger, args=[schedule.name], id=f"schedule:{schedule.name}",
            replace_existing=True, coalesce=True, max_instances=1,
            misfire_grace_time=self._grace_s,
        )
        self._crons[schedule.name] = schedule.cron

    def _timers(self) -> Any:
        """The running scheduler, made and started on first use (with the first schedule)."""
        if self._scheduler is None:
            # APScheduler 3 ships no type hints (no py.typed): its objects are Any here.
            from apscheduler.schedulers.asyncio import (  # type: ignore[import-untyped]
                AsyncIOScheduler,
            )

            self._scheduler = AsyncIOScheduler(timezone=ZoneInfo(self._store.timezone))
            self._scheduler.start()
        return self._scheduler

    async def _fire_due(self, schedule: Schedule) -> bool:
        """Step by step: find the slot, make its wake durable, mark it fired, poke."""
        try:
            trigger = cron_trigger(schedule.cron, self._store.timezone)
        except UsageError:
            return False
        now = self._clock()
        slot = due_fire(schedule, trigger, now=now, grace_s=self._grace_s)
        if slot is None:
            return False
        key = slot.astimezone(UTC).isoformat()  # one instant, one key, whatever the zone
        delivery = Delivery(source=SOURCE, route=schedule.name, key=key,
                            event="schedule", action=schedule.kind, headers={},
                            body=schedule.snapshot(), received_at=now)
        details = {"fire_time": key, "late_s": round((now - slot).total_seconds(), 3)}
        try:
            outcome = await self._inbox.accept(delivery)
        except InboxError as exc:  # the slot stays due: the next sync tries again
            await self._audit.record("schedule", "fired", "failed", subject=schedule.subject,
                                     details={**details, "reason": str(exc)})
            return False
        upcoming = next_fire(trigger, now)
        await self._store.fired(schedule.name, to_us(slot),
                                to_us(upcoming) if upcoming is not None else None)
        if not isinstance(outcome, Accepted):
            return False  # enqueued before a crash kept last_fire_us from moving
        await self._audit.record("schedule", "fired", "ok", subject=schedule.subject,
                                 details={**details, "wake": outcome.wake_id})
        self._on_enqueued()
        return True

    async def _audit_skipped(self, schedule: Schedule) -> None:
        try:
            trigger = cron_trigger(schedule.cron, self._store.timezone)
        except UsageError:
            return
        now = self._clock()
        slot = skipped_fire(schedule, trigger, now=now, grace_s=self._grace_s)
        if slot is None or due_fire(schedule, trigger, now=now, grace_s=self._grace_s):
            return
        reason = (f"bothy serve was not running at its fire time, more than"
                  f" wakes.missed_fire_grace_s ({self._grace_s} s) ago: it is not run late")
        await self._audit.record("schedule", "missed", "refused", subject=schedule.subject,
                                 details={"fire_time": slot.astimezone(UTC).isoformat(),
                                          "reason": reason})
