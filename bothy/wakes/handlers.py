"""What each source's wakes ask for: the dispatcher's table, one handler per source.

A handler takes a durable wake, builds the run it asks for and runs it through the engine
(:meth:`WakeStart.run`), or says why it asks for none (:class:`~bothy.wakes.jobs.Ignored`).
The dispatcher knows nothing of the sources: it picks the handler from its table by the
wake's source and closes the wake with what the handler returns. The unattended sources are
here, each turning a wake into a ``RunRequest | Ignored``:

- ``webhook``: a signed delivery matched to its route's job; untrusted (rule 6).
- ``poll``: something new a poller saw; untrusted.
- ``schedule``: a fire, run as the schedule was when it fired; trusted (the operator wrote it).

Nobody waits for their runs: questions decline at once (and are posted where the run's
findings go), a run refused at a gate is queued again (rule 4), and what a run found, or
how it failed, is told through :class:`~bothy.wakes.reports.Reports`. A heartbeat with a
preflight may end quiet, with no run at all (:class:`Quiet`). A chat conversation, which a
person does wait for, is ``chat/``'s (:class:`bothy.chat.conversation.Conversations`), added
to the table by the daemon.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol

from bothy.config import Config
from bothy.engine.audit import AuditLog
from bothy.engine.framing import frame, new_token
from bothy.engine.launch import build_launch
from bothy.engine.run import RunRequest, RunResult
from bothy.engine.state import RunRow
from bothy.engine.supervisor import RefusedWith, Supervisor, Told
from bothy.home import BothyHome
from bothy.money import usd_to_micros
from bothy.wakes import schedules
from bothy.wakes.delivery import POLL, Delivery
from bothy.wakes.inbox import Inbox, WakeRow
from bothy.wakes.jobs import (
    Ignored,
    decode_payload,
    match,
    render_prompt,
    render_ref,
    render_subject,
)
from bothy.wakes.reports import Reports

if TYPE_CHECKING:
    from bothy.engine.toolbox import Asker
    from bothy.wakes.preflight import PreflightSeen

WEBHOOK = "webhook"
_PREFLIGHT_SHOWN_CHARS = 8000  # of its output, in the heartbeat's prompt


@dataclass(frozen=True)
class Quiet:
    """A fire that needed no run: its heartbeat's preflight saw nothing new (audited
    ``heartbeat quiet``). The wake is done; nothing was reserved or spent."""

    reason: str


@dataclass(frozen=True)
class _Planned:
    """An unattended wake's run, and where its findings go (None: the alert channel)."""

    request: RunRequest
    report_to: str | None


class WakeStart:
    """What the dispatcher gives a wake's handler: the run id minted for this attempt and
    named by its claim (a refused id is spent), the details of the `wake received` record,
    and :meth:`run`."""

    def __init__(
        self,
        run_id: str,
        details: dict[str, Any],
        *,
        wake_id: int,
        inbox: Inbox,
        supervisor: Supervisor,
        admitted: asyncio.Event,
        refused_with: RefusedWith | None = None,
    ) -> None:
        self.run_id = run_id
        self.details = details
        self._wake_id = wake_id
        self._inbox = inbox
        self._supervisor = supervisor
        self._admitted = admitted
        self._refused_with = refused_with
        self.done = False  # the wake was closed once its run's end was told
        self.requested = False  # a run was asked for: the claim's run id is in use

    async def run(self, request: RunRequest, *, asker: Asker | None = None,
                  told: Told | None = None) -> RunResult:
        """Take ``request`` through the engine. The run id is on the wake already (its claim
        named it), so that after a crash the wake's run can be found; the admission keeps
        arrival order.

        ``told`` hears the run's end once it is recorded, before its worker is stopped (see
        :meth:`Supervisor.execute`); once it has, the wake is done (:attr:`done`): after a
        crash it is neither told again nor said to be cut short.

        A refusal at admission is recorded with what the dispatcher makes of it (the wake
        deferred or abandoned: ``refused_with``), in one commit."""
        self.requested = True
        if told is None:
            return await self._supervisor.execute(request, asker=asker, admitted=self._admitted,
                                                  refused_with=self._refused_with)

        async def told_then_done(result: RunResult) -> None:
            await told(result)
            await self._inbox.finish(self._wake_id, "done", run_id=result.run_id,
                                     note=result.outcome)
            self.done = True

        return await self._supervisor.execute(request, asker=asker, admitted=self._admitted,
                                              told=told_then_done,
                                              refused_with=self._refused_with)

    async def stopped_before_start(self) -> bool:
        """Whether Bothy is stopping and this attempt's run never reached a worker: nothing
        ran, so the dispatcher queues the wake again and it runs after the restart (a handler
        whose wake someone waits for tells them that, not the run's cancellation)."""
        return (self._supervisor.closed_to_new_workers
                and not await self._supervisor.pool.reached_worker(self.run_id))


class WakeHandler(Protocol):
    """Turns the wakes of one source into runs: the dispatcher holds one per source."""

    @property
    def retries_refused(self) -> bool:
        """A run refused at a gate is queued again (True: nobody is there to be told)."""
        ...

    async def handle(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> RunResult | Ignored | Quiet:
        """Run what ``wake`` asks for (through ``start.run``), or say why it asks for none."""
        ...


class _Unattended(abc.ABC):
    """A source whose wake becomes a plain request, run with nobody waiting for it: its
    questions and its findings are posted where its job says (``report_to``)."""

    retries_refused = True

    def __init__(self, cfg: Config, reports: Reports) -> None:
        self._cfg = cfg
        self._reports = reports

    async def handle(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> RunResult | Ignored | Quiet:
        made = await self.request(wake, delivery, start)
        if isinstance(made, Ignored | Quiet):
            return made
        questions = self._reports.asker(made.request, made.report_to)
        try:
            result = await start.run(made.request, asker=questions)
        except BaseException:
            questions.cancel()
            raise
        await questions.posted()  # a question is never posted after the run's report
        await self._reports.finished(made.request, result, made.report_to)
        return result

    async def interrupted(self, wake: WakeRow, delivery: Delivery, run: RunRow) -> None:
        """A run a crash cut short is not run again (nobody knows what it did): say so."""
        await self._reports.interrupted(run)

    @abc.abstractmethod
    async def request(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> _Planned | Ignored | Quiet:
        """The request ``wake`` makes, or why it makes none."""


class WebhookJobs(_Unattended):
    """A webhook delivery's run: its route's matching job, or why it wakes none."""

    async def request(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> _Planned | Ignored:
        route = self._cfg.webhooks.get(wake.route)
        if route is None:
            return Ignored("its route is no longer configured")
        payload = decode_payload(delivery.body)
        if payload is None:
            return Ignored("not a JSON object")
        matched = match(wake.route, route, wake.event, wake.action, payload, token=new_token())
        if isinstance(matched, Ignored):
            return matched
        job = matched.job
        return _Planned(RunRequest.for_wake(
            self._cfg, prompt=matched.prompt, subject=matched.subject, source=WEBHOOK,
            run_id=start.run_id, details=start.details, asked_usd_micros=_micros(job.max_usd),
            profile=job.profile,
            trusted=False,  # a signature authenticates the sender, not the content
            can_hold=False,  # nobody is in a thread to answer: questions decline at once
            ref=render_ref(job.ref, payload) if job.ref else None,
        ), job.report_to)


class PollJobs(_Unattended):
    """Something new a poller saw, run as untrusted input; or why it wakes nothing."""

    async def request(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> _Planned | Ignored:
        spec = self._cfg.pollers.get(wake.route)
        if spec is None:
            return Ignored("its poller is no longer configured")
        payload = decode_payload(delivery.body)
        raw = None if payload is not None else delivery.body.decode(errors="replace")
        job = spec.job
        token = new_token()
        return _Planned(RunRequest.for_wake(
            self._cfg,
            prompt=render_prompt(job, payload or {}, wake.route, "poll", token, raw=raw,
                                 what="poller"),
            subject=render_subject(job.subject, payload or {}, wake.route),
            source=POLL, run_id=start.run_id, details=start.details,
            asked_usd_micros=_micros(job.max_usd), profile=job.profile,
            trusted=False,  # whoever wrote what the poll fetched is unknown (rule 6)
            can_hold=False,
            ref=render_ref(job.ref, payload or {}) if job.ref else None,
        ), job.report_to)


class ScheduleFires(_Unattended):
    """A schedule's fire, run as the schedule was when it fired; or why it cannot run; or,
    for a heartbeat whose preflight saw nothing new, quiet."""

    def __init__(self, cfg: Config, reports: Reports, *, home: BothyHome,
                 store: schedules.ScheduleStore, audit: AuditLog) -> None:
        super().__init__(cfg, reports)
        self._home = home
        self._store = store
        self._audit = audit

    async def request(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> _Planned | Ignored | Quiet:
        try:
            schedule = schedules.Schedule.from_snapshot(delivery.body)
        except ValueError as exc:
            return Ignored(f"its schedule snapshot cannot be read: {exc}")
        seen = None
        if schedule.kind == "heartbeat" and schedule.preflight_argv:
            seen = await self._preflight(schedule, start)
            if not seen.woken:
                return Quiet(f"preflight `{' '.join(schedule.preflight_argv)}` {seen.why}")
        built = await schedules.schedule_request(schedule, self._cfg, self._home,
                                                 run_id=start.run_id, details=start.details)
        if isinstance(built, schedules.Unrunnable):
            return Ignored(built.reason)
        if seen is not None:
            built = dataclasses.replace(built, prompt=_with_preflight(built.prompt, schedule,
                                                                      seen))
        return _Planned(built, schedule.report_to)

    async def _preflight(self, schedule: schedules.Schedule, start: WakeStart) -> PreflightSeen:
        """Run the heartbeat's preflight, keep what it saw, and audit whether it woke the
        model (``heartbeat woken``) or not (``heartbeat quiet``: no run follows)."""
        assert schedule.preflight_argv is not None
        from bothy.wakes.preflight import Preflight  # (loaded by heartbeats with a preflight)

        check = Preflight(schedule.preflight_argv, cwd=self._cfg.workspace,
                          env=build_launch(self._cfg.codex).env)  # verify-cmd's environment
        seen = await check.check(await self._store.preflight_seen(schedule.name))
        await self._store.set_preflight_seen(schedule.name, seen.sha256)
        await self._audit.record(
            "heartbeat", "woken" if seen.woken else "quiet", "ok", subject=schedule.subject,
            details={**start.details, "schedule": schedule.name, "preflight": check.command,
                     "why": seen.why, "exit_code": seen.exit_code, "sha256": seen.sha256})
        return seen


def _with_preflight(prompt: str, schedule: schedules.Schedule, seen: PreflightSeen) -> str:
    """The heartbeat's prompt, told what its preflight saw (its output framed as data: the
    operator wrote the command, not what it reads)."""
    command = " ".join(schedule.preflight_argv or [])
    said = f"The preflight check `{command}` {seen.why}."
    if seen.output:
        said += "\n" + frame(seen.output, token=new_token(), source="the preflight command",
                              limit_chars=_PREFLIGHT_SHOWN_CHARS)
    instruction = schedules.HEARTBEAT_INSTRUCTION
    if prompt.endswith(instruction):  # the instruction stays the last thing it reads
        return f"{prompt.removesuffix(instruction)}{said}\n\n{instruction}"
    return f"{prompt}\n\n{said}"


def unattended(cfg: Config, home: BothyHome, *, reports: Reports,
               store: schedules.ScheduleStore, audit: AuditLog) -> dict[str, WakeHandler]:
    """The table of the sources nobody waits for, by source."""
    return {WEBHOOK: WebhookJobs(cfg, reports), POLL: PollJobs(cfg, reports),
            schedules.SOURCE: ScheduleFires(cfg, reports, home=home, store=store, audit=audit)}


def _micros(usd: Decimal | None) -> int | None:
    return usd_to_micros(usd) if usd is not None else None
