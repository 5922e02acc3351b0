"""The dispatcher: durable wakes from the inbox become runs, once each.

It takes queued wakes in arrival order, claims each one (so two daemons never run the same
wake), records ``wake received``, turns the wake into a run request — a webhook delivery
matched to its route's job (untrusted), a schedule's fire built from the schedule's snapshot
(trusted: the operator wrote it) — and hands it to the supervisor, whose lanes keep ``pr:42``
deliveries one after another. A wake refused at a gate is an event (rule 4): it is retried
later with a doubling delay, counted, and after ``wakes.max_attempts`` abandoned out loud. A
wake that matches no job (or a schedule whose SOP is gone) is recorded as ignored.

Each wake's run id is minted here and stored before the run is admitted, so that after a crash
the daemon can tell a wake whose run never started (run it) from one whose run was under way
(recovered as failed, never run twice).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from bothy.chat import router as chat_router
from bothy.chat.base import ChatMessage
from bothy.chat.router import ChatRouter
from bothy.clock import Clock, from_us, to_us
from bothy.config import Config, WebhookRoute
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.framing import new_token
from bothy.engine.run import Outcome, RunRequest, new_run_id
from bothy.engine.supervisor import Supervisor
from bothy.errors import ChatError
from bothy.home import BothyHome
from bothy.money import usd_to_micros
from bothy.waits import first_of
from bothy.wakes import poller, schedules
from bothy.wakes.inbox import Delivery, Inbox, WakeRow
from bothy.wakes.jobs import Ignored, decode_payload, match, render_prompt, render_subject

_IDLE_POLL_S = 1.0  # retries fall due without anyone poking the dispatcher


class Dispatcher:
    """Runs queued wakes; one task per wake, owned by the dispatcher's task group."""

    def __init__(
        self,
        cfg: Config,
        *,
        inbox: Inbox,
        supervisor: Supervisor,
        audit: AuditLog,
        alerts: Alerts,
        clock: Clock,
        home: BothyHome,
    ) -> None:
        self._cfg = cfg
        self._alerts = alerts
        self._home = home
        self._routes: Mapping[str, WebhookRoute] = cfg.webhooks
        self._inbox = inbox
        self._supervisor = supervisor
        self._audit = audit
        self._clock = clock
        self._poke = asyncio.Event()
        self._intake = True
        self._tasks: set[asyncio.Task[None]] = set()
        self._chat: ChatRouter | None = None

    def attach_chat(self, router: ChatRouter) -> None:
        """Chat wakes are answered through ``router``'s adapters from now on."""
        self._chat = router

    def poke(self) -> None:
        """A new wake is in the inbox: look now rather than at the next poll."""
        self._poke.set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self) -> None:
        """Take wakes until :meth:`stop_intake`; the caller owns the task this runs in."""
        while self._intake:
            for wake in await self._inbox.due(to_us(self._clock())):
                if not self._intake:
                    break
                if await self._inbox.claim(wake.id):
                    admitted = asyncio.Event()
                    task = asyncio.create_task(self._guarded(wake, admitted),
                                               name=f"wake-{wake.id}")
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    # One admission at a time, in arrival order: two deliveries for one lane
                    # must queue in the order they came, not in the order their files load.
                    await first_of(admitted.wait(), task)
            self._poke.clear()
            try:
                async with asyncio.timeout(_IDLE_POLL_S):
                    await self._poke.wait()
            except TimeoutError:
                pass

    def stop_intake(self) -> None:
        self._intake = False
        self._poke.set()

    def stop_runs(self) -> None:
        """Ask the in-flight runs to stop: they interrupt their turns, settle, reap groups."""
        self._supervisor.stopping.set()

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

    async def _guarded(self, wake: WakeRow, admitted: asyncio.Event) -> None:
        """Handle a wake; one that breaks (a corrupt payload, a bug) is closed out loud
        instead of vanishing with its task: recorded, abandoned, and raised as an alert."""
        try:
            await self._handle(wake, admitted)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure here must be heard, not lost
            reason = f"{type(exc).__name__}: {exc}"[:500]
            await self._audit.record("wake", "crashed", "failed", subject=_subject(wake),
                                     details={"delivery": wake.key, "reason": reason})
            await self._inbox.finish(wake.id, "abandoned", run_id=None,
                                     note=f"handling it failed: {reason}")
            await self._alerts.raise_alert(
                f"wake {wake.key}", f"handling it failed: {reason}", subject=_subject(wake)
            )

    async def _handle(self, wake: WakeRow, admitted: asyncio.Event) -> None:
        delivery = await self._inbox.load(wake)
        run_id = new_run_id(self._clock)  # a fresh id per attempt: a refused id is spent
        details = {"route": wake.route, "event": wake.event, "action": wake.action,
                   "delivery": wake.key, "received_at": from_us(wake.received_us).isoformat(),
                   "attempt": wake.attempts + 1}
        if wake.source == chat_router.SOURCE and self._chat is not None:
            await self._chat_wake(wake, delivery, run_id, details, admitted)
            return
        if wake.source == schedules.SOURCE:
            request = await self._scheduled(delivery, run_id, details)
        elif wake.source == poller.SOURCE:
            request = self._polled(wake, delivery, run_id, details)
        else:
            request = self._delivered(wake, delivery, run_id, details)
        if isinstance(request, str):
            await self._ignore(wake, run_id, details, request)
            return
        await self._inbox.set_run(wake.id, run_id)
        result = await self._supervisor.execute(request, admitted=admitted)
        if result.outcome is Outcome.REFUSED:
            await self._refused(wake, result.reason or "refused", details)
            return
        await self._inbox.finish(wake.id, "done", run_id=run_id, note=result.outcome)

    def _delivered(
        self, wake: WakeRow, delivery: Delivery, run_id: str, details: dict[str, Any]
    ) -> RunRequest | str:
        """A webhook delivery's run, or why it wakes none."""
        route = self._routes.get(wake.route)
        payload = decode_payload(delivery.body)
        if route is None or payload is None:
            return "its route is no longer configured" if route is None else "not a JSON object"
        matched = match(wake.route, route, wake.event, wake.action, payload, token=new_token())
        if isinstance(matched, Ignored):
            return matched.reason
        job = matched.job
        return RunRequest.for_wake(
            self._cfg, prompt=matched.prompt, subject=matched.subject, source="webhook",
            run_id=run_id, details=details, asked_usd_micros=_micros(job.max_usd),
            profile=job.profile,
            trusted=False,  # a signature authenticates the sender, not the content
            can_hold=False,  # nobody is in a thread to answer: questions decline at once
        )

    async def _chat_wake(
        self,
        wake: WakeRow,
        delivery: Delivery,
        run_id: str,
        details: dict[str, Any],
        admitted: asyncio.Event,
    ) -> None:
        """A mention: seen, answered in its thread, one run at a time per thread."""
        router = self._chat
        assert router is not None
        message, continued_from = chat_router.message_of(delivery.body)
        adapter = router.adapters.get(message.platform)
        if adapter is None:
            await self._ignore(wake, run_id, details, f"{message.platform} is not connected")
            return
        try:
            await adapter.react(message, chat_router.SEEN)
        except ChatError as exc:  # a missing reaction must not cost the thread and the answer
            await self._audit.record("chat", "react-failed", "failed", subject=wake.route,
                                     details={**details, "reason": str(exc)})
        try:
            thread = await adapter.open_thread(message)
        except ChatError as exc:
            await self._audit.record("chat", "thread-failed", "failed", subject=wake.route,
                                     details={**details, "reason": str(exc)})
            thread = message.thread
        resume = await router.codex_thread(message, thread) if continued_from is not None else None
        prompt = message.text
        if continued_from and resume is None:
            # No kept thread to resume: at least tell the run what it said last.
            prompt = (f"Earlier in this conversation you answered:\n{continued_from}\n\n"
                      f"The person now says:\n{message.text}")
        request = RunRequest.for_wake(
            self._cfg, prompt=prompt, subject=f"{message.platform}:{thread}", source="chat",
            run_id=run_id, details={**details, "user": message.user},
            profile=router.profile_for(message.platform),
            trusted=True,  # an allowed account wrote it
            can_hold=True,  # someone is in the thread to answer
            keep_thread=True, resume_thread=resume,  # the thread is one Codex conversation
        )
        await self._inbox.set_run(wake.id, run_id)
        await router.remember(message, thread, run_id)
        questions = _ChatQuestions(router, message, thread)
        try:
            result = await self._supervisor.execute(request, asker=questions,
                                                    admitted=admitted)
        except BaseException:
            questions.cancel()
            raise
        await questions.posted()
        await router.deliver(message, thread, result)
        await self._inbox.finish(wake.id, "done", run_id=run_id, note=result.outcome)

    def _polled(
        self, wake: WakeRow, delivery: Delivery, run_id: str, details: dict[str, Any]
    ) -> RunRequest | str:
        """Something new a poller saw, run as untrusted input; or why it wakes nothing."""
        spec = self._cfg.pollers.get(wake.route)
        if spec is None:
            return "its poller is no longer configured"
        payload = decode_payload(delivery.body)
        raw = None if payload is not None else delivery.body.decode(errors="replace")
        job = spec.job
        token = new_token()
        return RunRequest.for_wake(
            self._cfg,
            prompt=render_prompt(job, payload or {}, wake.route, "poll", token, raw=raw,
                                 what="poller"),
            subject=render_subject(job.subject, payload or {}, wake.route), source="poll",
            run_id=run_id, details=details, asked_usd_micros=_micros(job.max_usd),
            profile=job.profile,
            trusted=False,  # whoever wrote what the poll fetched is unknown (rule 6)
            can_hold=False,
        )

    async def _scheduled(
        self, delivery: Delivery, run_id: str, details: dict[str, Any]
    ) -> RunRequest | str:
        """A schedule's fire, run as the schedule was when it fired; or why it cannot run."""
        try:
            schedule = schedules.Schedule.from_snapshot(delivery.body)
        except ValueError as exc:
            return f"its schedule snapshot cannot be read: {exc}"
        built = await schedules.schedule_request(schedule, self._cfg, self._home,
                                                 run_id=run_id, details=details)
        return built.reason if isinstance(built, schedules.Unrunnable) else built

    async def _ignore(
        self, wake: WakeRow, run_id: str, details: dict[str, Any], reason: str
    ) -> None:
        await self._audit.record("wake", "ignored", "refused", subject=_subject(wake),
                                 run_id=None, details={**details, "reason": reason})
        await self._inbox.finish(wake.id, "ignored", run_id=None, note=reason)

    async def _refused(self, wake: WakeRow, reason: str, details: dict[str, Any]) -> None:
        wakes = self._cfg.wakes
        attempts = wake.attempts + 1
        if attempts >= wakes.max_attempts:
            note = f"abandoned after {attempts} attempts: {reason}"
            await self._inbox.finish(wake.id, "abandoned", run_id=None, note=note)
            await self._audit.record("wake", "abandoned", "failed", subject=_subject(wake),
                                     details={**details, "reason": note})
            await self._alerts.raise_alert(f"wake {wake.key}", note, subject=_subject(wake))
            return
        delay_s = min(wakes.retry_first_s * 2 ** (attempts - 1), wakes.retry_max_s)
        next_try_us = to_us(self._clock()) + int(delay_s * 1_000_000)
        await self._inbox.retry_later(wake.id, next_try_us=next_try_us,
                                      note=f"attempt {attempts} refused: {reason}")
        await self._audit.record("wake", "deferred", "pending", subject=_subject(wake),
                                 details={**details, "reason": reason, "retry_in_s": delay_s})


class _ChatQuestions:
    """A chat run's asker: each question is posted in the thread. The posts are its own: the
    run's answer waits for them (a question never lands after the answer), a cancel ends them."""

    def __init__(self, router: ChatRouter, message: ChatMessage, thread: str) -> None:
        self._router = router
        self._message = message
        self._thread = thread
        self._posts: set[asyncio.Task[None]] = set()

    def question(self, run_id: str, text: str) -> None:
        text = f"? {text}\nReply in this thread (yes or no for an approval)."
        task = asyncio.create_task(self._router.post(
            self._message.platform, self._message.channel, self._thread, text, run_id=run_id
        ))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def posted(self) -> None:
        """Wait for the posts still under way (a failed post is audited by the router)."""
        await asyncio.gather(*self._posts, return_exceptions=True)

    def cancel(self) -> None:
        for task in self._posts:
            task.cancel()


def _micros(usd: Decimal | None) -> int | None:
    return usd_to_micros(usd) if usd is not None else None


def _subject(wake: WakeRow) -> str:
    """The subject of a wake's own records: the route, ``schedule:NAME`` or ``poll:NAME``."""
    if wake.source in (schedules.SOURCE, poller.SOURCE):
        return f"{wake.source}:{wake.route}"
    return wake.route
