"""``bothy serve``: the long-running process. Wires the parts; holds none of their logic.

Start-up, in order: single-instance lock → state → audit (the whole chain verified; a long
register walked beside the imports, engine/chaincheck.py) → recovery (orphaned worker groups
ended, wakes that never started queued again, wakes whose run was under way closed) →
listeners → dispatcher → schedules (a fire missed while down is queued once, then the timers
start); while ready, the register's head is published once a day (engine/headpublisher.py),
and the inbox forgets what finished over ``wakes.keep_deliveries_days`` ago, hourly
(wakes/retention.py).
Shutdown runs in reverse: stop intake (listeners, the schedule timers, then the dispatcher's
intake; a run with no worker yet withdraws at once, its wake queued again) → let the runs at a
worker finish within ``wakes.shutdown_grace_s`` → ask them to stop (they
interrupt, settle and reap their groups) → cancel what is left → disconnect chat (last: the
runs' answers and the alerts go through it) → final audit record. A second signal skips the
waits. Signal handlers only record; the main task acts.

Exit codes (see docs/RUNBOOK.md): 0 clean stop; 75 temporary (another instance holds the
lock, a port is taken); 78 configuration (raised as ConfigError before anything starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import gc
import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from bothy.atomicfile import write_atomically
from bothy.chat.base import ChatAdapter
from bothy.chat.conversation import SOURCE as CHAT_SOURCE
from bothy.chat.conversation import Conversations
from bothy.chat.liveness import ConnectionView, Liveness, Watched
from bothy.chat.router import ChatRouter
from bothy.config import ChatConfig, Config
from bothy.engine.audit import AuditLog
from bothy.engine.chaincheck import ChainCheck, Checked
from bothy.engine.headpublisher import HeadPublisher
from bothy.engine.procgroup import process_start_time
from bothy.engine.questions import QuestionBoard
from bothy.errors import AuditIntegrityError, BothyError, ConfigError
from bothy.footprint import TRIM_EVERY_S, keep_heap_trimmed
from bothy.home import BothyHome
from bothy.runtime import Runtime
from bothy.servelock import single_instance
from bothy.waits import first_of, recording_stop_signals
from bothy.wakes.dispatcher import Dispatcher
from bothy.wakes.handlers import unattended
from bothy.wakes.inbox import Inbox
from bothy.wakes.reports import Reports
from bothy.wakes.schedule_runner import ScheduleRunner
from bothy.wakes.schedules import ScheduleStore
from bothy.wakes.webhook import WebhookListener

if TYPE_CHECKING:
    import httpx

    from bothy.chat.discord import DiscordAdapter
    from bothy.chat.slack import SlackAdapter
    from bothy.engine.spare import Spare
    from bothy.wakes.poller import Poller
    from bothy.web import DeferredSite, StatusSite

_LISTEN_HOST = "127.0.0.1"  # Tailscale (serve / funnel) carries outside traffic to loopback
_STOP_WAIT_S = 30.0
_SWITCH_INTERVAL_S = 0.0005  # see Daemon.serve


class State(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    EXITED = "exited"


class Daemon:
    """One ``bothy serve`` process.

    ``adapter_options`` are extra keyword arguments for a chat adapter's constructor, by
    platform (``{"discord": {"connector": ..., "guild_ready_s": 0.1}}``): what an in-process
    caller — a test — needs to point an adapter at a fake. ``bothy serve`` passes none.
    """

    def __init__(
        self,
        home: BothyHome,
        cfg: Config,
        *,
        adapter_options: Mapping[str, Mapping[str, Any]] | None = None,
        heap_trim_every_s: float = TRIM_EVERY_S,
        chain: ChainCheck | None = None,
    ) -> None:
        self._home = home
        self._cfg = cfg
        # The register's walk before the first record: started by `bothy serve` before its
        # imports (engine/chaincheck.py); made in-process otherwise.
        self._chain = chain
        self._adapter_options = adapter_options or {}
        self._heap_trim_every_s = heap_trim_every_s
        self.state = State.STARTING
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self.ports: dict[str, int] = {}
        self.chat_state: dict[str, str] = {}
        self._alerts_routed = False  # an alert channel is configured and connected
        self._chat_heard: dict[str, dict[str, Any]] = {}
        self._web: DeferredSite | None = None

    async def serve(self) -> int:
        """Run until a stop signal; return the exit code of a clean stop."""
        _check_secrets(self._cfg)
        # Threads that finish an fsync (the inbox's segment, the register, SQLite's commit)
        # wait for the GIL before their caller can be answered; at Python's default 5 ms
        # switch interval, behind an event loop busy taking requests, that wait was most of
        # a group commit's time (bench_webhooks). The daemon's threads are all I/O. Restored
        # after, for a daemon run inside another program (the tests).
        previous_s = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        try:
            self._home.ensure()
            async with (single_instance(self._home.state_dir / "serve.lock"),
                        Runtime.open(self._home, self._cfg) as rt):
                return await self._serve(rt)
        finally:
            sys.setswitchinterval(previous_s)

    async def _serve(self, rt: Runtime) -> int:
        # The chat libraries first: while a process of its own walks a long register on the
        # other core (engine/chaincheck.py), this one imports what its start needs after.
        platforms = _chat_platforms(self._cfg.chat)
        chain = await _refuse_a_broken_register(  # both of home.audit_path, as rt.audit is
            rt.audit, self._chain or ChainCheck.in_process(self._home.audit_path))
        supervisor = rt.supervisor()
        inbox = Inbox(self._home.inbox_dir, rt.db, clock=rt.clock, audit=rt.audit)
        await rt.audit.record("serve", "starting", "ok", details={
            "pid": os.getpid(), "site": self._cfg.site,
            "chain_verified": chain.report.count, "chain_verify_ms": round(chain.walk_ms),
            "chain_waited_ms": round(chain.waited_ms), "chain_beside": chain.beside})
        recovered = await supervisor.recover()
        store = ScheduleStore(rt.db, timezone=self._cfg.budget.timezone, clock=rt.clock)
        reports = Reports(self._cfg, db=rt.db, audit=rt.audit, alerts=rt.alerts, clock=rt.clock)
        handlers = unattended(self._cfg, self._home, reports=reports, store=store,
                              audit=rt.audit)
        dispatcher = Dispatcher(self._cfg.wakes, handlers, inbox=inbox,
                                supervisor=supervisor, db=rt.db, audit=rt.audit,
                                alerts=rt.alerts, clock=rt.clock)
        wakes = await dispatcher.recover()
        listeners = await self._listen(rt, inbox, dispatcher)
        chat = await self._chat(rt, platforms, inbox, dispatcher, listeners, reports)
        await dispatcher.tell_interrupted(wakes)
        schedules = ScheduleRunner(
            store, inbox, audit=rt.audit, grace_s=self._cfg.wakes.missed_fire_grace_s,
            clock=rt.clock, on_enqueued=dispatcher.poke,
        )
        missed = await schedules.start()  # queued now, taken once the dispatcher runs below
        with recording_stop_signals(self._stop, self._hurry):
            # Published before `serve ready` is recorded: whoever reads that record and asks
            # `bothy status` next must find this serve ready, not "not running".
            self.state = State.READY
            await asyncio.to_thread(self._publish, State.READY.value)
            await rt.audit.record("serve", "ready", "ok", details={
                "ports": self.ports, "orphans_ended": len(recovered),
                "wakes_requeued": wakes.requeued, "wakes_reinserted": wakes.reinserted,
                "wakes_already_run": wakes.already_run, "schedules": len(schedules.next_fires()),
                "missed_fires_queued": missed, "chat": self.chat_state,
            })
            _collect_garbage_again()
            # Made and started last, once ready (not to slow the start, its module's import
            # included: no run is taken before the dispatcher runs below), and ended first
            # (engine/spare.py).
            spare = supervisor.keep_spare() if self._cfg.codex.spare else None
            try:
                if spare is not None:
                    spare.start()
                await self._until_stopped(rt, inbox, dispatcher, listeners, chat, schedules,
                                          spare)
            finally:
                if spare is not None:
                    await asyncio.shield(spare.close())
            await asyncio.to_thread(self._publish, None)
            if spare is not None and spare.failure is not None:
                raise spare.failure  # after a full stop: its register or state broke
            await rt.audit.record("serve", "stopped", "ok", details={"pid": os.getpid()})
        self.state = State.EXITED
        return 0

    async def _until_stopped(
        self, rt: Runtime, inbox: Inbox, dispatcher: Dispatcher,
        listeners: list[WebhookListener], chat: _Chat | None, schedules: ScheduleRunner,
        spare: Spare | None,
    ) -> None:
        """Ready (and published so) until a stop is asked; then stop in reverse start-up
        order."""
        polls_stop = asyncio.Event()
        exports_stop = asyncio.Event()
        async with asyncio.TaskGroup() as group, _http_client(self._cfg) as http:
            intake = group.create_task(dispatcher.run(), name="dispatcher")
            if chat is not None:
                group.create_task(chat.watch(rt), name="chat liveness")
            if self._cfg.otel is not None:  # every finished run's trace, to an OTLP receiver
                from bothy.traceexport import TraceExporter

                assert http is not None  # _http_client makes one when otel is set
                exporter = TraceExporter(
                    self._cfg.otel, audit=rt.audit, site=self._cfg.site, clock=rt.clock,
                    queue_path=self._home.otel_queue_path, http=http,
                    environ=os.environ)
                group.create_task(exporter.run(exports_stop), name="otel")
            for name, spec in self._cfg.pollers.items():
                from bothy.wakes.poller import Poller

                assert http is not None  # _http_client makes one when there are pollers
                one = Poller(name, spec, inbox=inbox, db=rt.db, audit=rt.audit, clock=rt.clock,
                             http=http, environ=os.environ, cwd=self._cfg.workspace,
                             on_accepted=dispatcher.poke, alerts=rt.alerts)
                group.create_task(_keep_polling(one, polls_stop, rt), name=f"poll-{name}")
            heads = HeadPublisher(rt.audit, rt.alerts, post_heads=self._alerts_routed,
                                  clock=rt.clock)
            group.create_task(heads.run(polls_stop), name="audit-head")
            keep_s = self._cfg.wakes.keep_deliveries_days * 86_400.0  # what finished, forgotten
            group.create_task(inbox.keep_pruned(keep_s, polls_stop), name="inbox-prune")
            group.create_task(schedules.keep_synced(polls_stop), name="schedule-sync")
            group.create_task(keep_heap_trimmed(polls_stop, every_s=self._heap_trim_every_s),
                              name="heap-trim")
            await self._stop.wait()
            self.state = State.DRAINING
            # First: from the signal on, no wake is taken and no worker starts (the runs that
            # wait withdraw now; their wakes run after a restart). What still arrives while
            # the doors close (a request under way, a mention) is made durable, and runs then.
            dispatcher.stop_intake()
            if spare is not None:
                await spare.close()
            for listener in listeners:
                await listener.stop()
            if self._web is not None:
                self._web.close()
            await schedules.stop()
            polls_stop.set()
            await intake
            await self._drain(dispatcher)
            exports_stop.set()  # what is still queued is sent by the next start
            if chat is not None:
                # Last: the runs ending in the drain answer in their threads, and alerts go
                # out, through it. A mention meanwhile is made durable and runs after a restart.
                await chat.stop()

    async def _listen(
        self, rt: Runtime, inbox: Inbox, dispatcher: Dispatcher
    ) -> list[WebhookListener]:
        listeners = []
        doors = [("tailnet", False, self._cfg.listen.tailnet_port)]
        if self._cfg.listen.public_port is not None:
            doors.append(("public", True, self._cfg.listen.public_port))
        pages = self._web = self._pages(rt)
        for name, public, port in doors:
            listener = WebhookListener(self._cfg.webhooks, public=public, inbox=inbox,
                                       audit=rt.audit, environ=os.environ, clock=rt.clock,
                                       on_accepted=dispatcher.poke,
                                       pages=None if public else pages)
            self.ports[name] = await listener.start(_LISTEN_HOST, port)
            listeners.append(listener)
        return listeners

    def _pages(self, rt: Runtime) -> DeferredSite | None:
        """The status pages for the tailnet door (``web.enabled``), read-only; their modules
        load on the first request for a page, not at start-up."""
        if not self._cfg.web.enabled:
            return None
        from bothy.web import DeferredSite

        started_at = rt.clock()

        def build() -> StatusSite:
            from bothy.web import StatusSite

            return StatusSite(self._home, self._cfg, started_at=started_at,
                              environ=os.environ, clock=rt.clock)

        return DeferredSite(build)

    def _publish(self, state: str | None) -> None:
        """What `bothy status` shows of this daemon: ``state/serve.json`` (gone when stopped)."""
        path = self._home.state_dir / "serve.json"
        if state is None:
            path.unlink(missing_ok=True)
            return
        record = {"pid": os.getpid(), "pid_start": process_start_time(os.getpid()),
                  "state": state, "ports": self.ports, "chat": self.chat_state,
                  "chat_heard": self._chat_heard}
        write_atomically(path, json.dumps(record).encode())

    async def _publish_chat(self, views: Mapping[str, ConnectionView]) -> None:
        """What the chat liveness watch sees, for `bothy status` (while ready)."""
        self.chat_state = {name: view.state for name, view in views.items()}
        self._chat_heard = {name: view.published() for name, view in views.items()}
        if self.state is State.READY:
            await asyncio.to_thread(self._publish, State.READY.value)

    async def _chat(
        self, rt: Runtime, platforms: Mapping[str, _Platform], inbox: Inbox,
        dispatcher: Dispatcher, listeners: list[WebhookListener], reports: Reports,
    ) -> _Chat | None:
        """Connect the configured chat platforms (after the listeners, before readiness); their
        conversations take the chat wakes, unattended runs report there, and alerts go to
        their alert channel if one is set."""
        adapters: dict[str, ChatAdapter] = {}
        watched: dict[str, Watched] = {}
        silent_after_s: dict[str, float] = {}
        for name, (make, silent_s) in platforms.items():
            adapters[name] = watched[name] = make(**self._adapter_options.get(name, {}))
            silent_after_s[name] = silent_s
        if not adapters:
            return None
        conversations = Conversations(self._cfg, adapters, db=rt.db, audit=rt.audit,
                                      clock=rt.clock)
        router = ChatRouter(self._cfg.chat, conversations, inbox=inbox,
                            board=QuestionBoard(rt.db, clock=rt.clock), db=rt.db,
                            audit=rt.audit, alerts=rt.alerts, on_accepted=dispatcher.poke,
                            reports=reports)
        try:
            # Connected side by side: discord.py alone waits out its guild-ready delay.
            started = await asyncio.gather(
                *(adapter.start(router.on_message, on_lost=router.on_lost,
                                on_press=router.on_press)
                  for adapter in adapters.values()),
                return_exceptions=True,
            )
            for name, outcome in zip(adapters, started, strict=True):
                if isinstance(outcome, BaseException):
                    raise outcome
                self.chat_state[name] = "connected"
        except BaseException:
            await _Chat(router, adapters).stop()
            for listener in listeners:
                await listener.stop()
            raise
        for name, adapter in watched.items():
            self._chat_heard[name] = ConnectionView(
                "connected", silent_after_s[name], connected_at=adapter.heard().connected_at,
            ).published()
        dispatcher.add_handler(CHAT_SOURCE, conversations)
        reports.connect(adapters)
        if any(s is not None and s.alert_channel
               for s in (self._cfg.chat.slack, self._cfg.chat.discord)):
            rt.alerts.add_route(router.post_alert)  # the one-shot Web API stays as fallback
            self._alerts_routed = True
        liveness = Liveness(watched, silent_after_s, audit=rt.audit, alerts=rt.alerts,
                            clock=rt.clock, publish=self._publish_chat)
        return _Chat(router, adapters, liveness)

    async def _drain(self, dispatcher: Dispatcher) -> None:
        if await self._drained(dispatcher, self._cfg.wakes.shutdown_grace_s):
            return
        dispatcher.stop_runs()  # runs interrupt their turns, settle and reap their groups
        await self._drained(dispatcher, _STOP_WAIT_S)
        await dispatcher.cancel_all()

    async def _drained(self, dispatcher: Dispatcher, within_s: float) -> bool:
        """Whether the in-flight wakes finish within ``within_s``; a second signal stops the
        wait at once (False)."""
        if self._hurry.is_set():
            return False
        drain = asyncio.ensure_future(dispatcher.drain(within_s))
        if await first_of(drain, self._hurry.wait()) == 0:
            return drain.result()
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain
        return False

    def stop(self) -> None:
        """Ask a running :meth:`serve` to stop, as the first SIGINT or SIGTERM does (for a
        caller running the daemon in its own loop); ``serve`` then drains and returns."""
        self._stop.set()


@contextlib.asynccontextmanager
async def _http_client(cfg: Config) -> AsyncIterator[httpx.AsyncClient | None]:
    """One client for every poller and the OTLP export; redirects are not followed (a poller
    names its URL). None for a site with neither: httpx is then never imported (start-up)."""
    if not cfg.pollers and cfg.otel is None:
        yield None
        return
    import httpx

    async with httpx.AsyncClient(follow_redirects=False) as client:
        yield client


async def _keep_polling(poller: Poller, stop: asyncio.Event, rt: Runtime) -> None:
    """A poller whose state or audit fails is recorded and stopped; the daemon stays up."""
    try:
        await poller.run(stop)
    except BothyError as exc:
        await rt.audit.record("poll", "stopped", "failed", subject=f"poll:{poller.name}",
                              details={"reason": str(exc)})


class _Chat:
    """The connected chat platforms, the router their messages go to, and the watch on
    whether each connection still hears its platform."""

    def __init__(self, router: ChatRouter, adapters: Mapping[str, ChatAdapter],
                 liveness: Liveness | None = None) -> None:
        self.router = router
        self.adapters = adapters
        self._liveness = liveness
        self._watching: asyncio.Task[None] | None = None

    async def watch(self, rt: Runtime) -> None:
        """Run the liveness watch until :meth:`stop`; a watch whose audit fails is recorded
        and ends (the daemon stays up, the connections as they are)."""
        if self._liveness is None:
            return
        self._watching = asyncio.current_task()
        try:
            await self._liveness.run()
        except* BothyError as group:
            await rt.audit.record("chat", "watch-stopped", "failed", details={
                "reason": "; ".join(str(exc) for exc in group.exceptions)[:300]})

    async def stop(self) -> None:
        """End the watch first (a reconnect in flight is cancelled and closes what it
        opened), then each connection, then the router."""
        watching, self._watching = self._watching, None
        if watching is not None and not watching.done():
            watching.cancel()
            await asyncio.wait({watching})
        for adapter in self.adapters.values():
            await adapter.stop()
        await self.router.close()


_Platform = tuple[Callable[..., "SlackAdapter | DiscordAdapter"], float]
"""A configured chat platform: its adapter, made with the platform's config and an in-process
caller's options, and after how long a silent connection counts as lost (s)."""


def _chat_platforms(chat: ChatConfig) -> dict[str, _Platform]:
    """The configured chat platforms, each library imported now (only those the config
    names: issue 18)."""
    platforms: dict[str, _Platform] = {}
    if chat.slack is not None:
        from bothy.chat.slack import SlackAdapter

        platforms["slack"] = (functools.partial(SlackAdapter, chat.slack),
                              chat.slack.silent_after_s)
    if chat.discord is not None:
        from bothy.chat.discord import DiscordAdapter

        platforms["discord"] = (functools.partial(DiscordAdapter, chat.discord),
                                chat.discord.silent_after_s)
    return platforms


def _collect_garbage_again() -> None:
    """Turn the garbage collector back on, once ``serve ready`` is recorded, if `bothy serve`
    paused it for start-up (commands/operate.py: the imports and connections leave next to
    no garbage, and collecting while they are made costs ~100 ms); a caller that never
    paused it is left as it was.

    What start-up made is frozen first: it lives as long as serve does, and the first
    collection after the pause would walk all of it (~140,000 objects, 40–80 ms of CPU here),
    and every full collection after it again. Frozen objects are still freed when nothing
    refers to them; only garbage in reference cycles among them is kept: the few hundred
    objects start-up left so, and a first chat connection's cycles once it is replaced.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _check_secrets(cfg: Config) -> None:
    for header, var in (cfg.otel.headers_env.items() if cfg.otel is not None else ()):
        if not os.environ.get(var):
            raise ConfigError(
                f"otel.headers_env: {var} (the value of the {header} header) is not set in the"
                " environment; every export would be refused", key="otel.headers_env")
    for name, route in cfg.webhooks.items():
        if not any(os.environ.get(var) for var in route.secret_env):
            names = ", ".join(route.secret_env)
            raise ConfigError(
                f"webhooks.{name}.secret_env: none of {names} is set in the environment; a"
                " route without its secret would refuse every delivery",
                key=f"webhooks.{name}.secret_env",
            )


async def _refuse_a_broken_register(audit: AuditLog, chain: ChainCheck) -> Checked:
    """The whole chain, verified before anything is appended to it (docs/AUDIT.md)."""
    checked = await chain.checked()
    report = checked.report
    if not report.ok:
        raise AuditIntegrityError(
            f"not starting: the register {audit.path} is broken: {report.problem}. Nothing was "
            "appended to it. See 'bothy audit verify'; 'bothy audit repair' keeps the broken "
            "file aside untouched and starts a new segment after the last good record",
            seq=report.first_bad_seq, line_no=report.line_no)
    return checked
