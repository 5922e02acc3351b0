"""Whether each chat connection still hears its platform (issue 11, SPEC §5 "Chat").

A socket can look alive and hear nothing. Users of both anchors lost messages to Socket Mode
and gateway connections that reported ``connected`` while dead, and to stale extra Socket
Mode connections that Slack kept delivering to (research-next-wave.md E.3, E.5). So Bothy
does not take the library's word for it. Every tick (a quarter of the bound, at most 5 s)
:class:`Liveness` asks each adapter to probe its connection (Slack: a websocket ping) and
reads what the connection last heard (:class:`Heard`: when it connected, its last event, its
last answered ping). A connection that has heard nothing — no event and no answered ping —
for ``silent_after_s`` (``chat.slack.silent_after_s``, ``chat.discord.silent_after_s``) is:

1. audited ``chat silent`` with what it last heard, then reconnected by its adapter
   (:meth:`Watched.reconnect`: the old socket is closed before a new one opens, never two
   at once), within ``silent_after_s``;
2. audited ``chat reconnected`` when that worked; otherwise ``chat reconnect-failed``, and
   an alert is raised (deduplicated by :class:`~bothy.engine.alerts.Alerts`); it is tried
   again after a doubling delay (at most :data:`_RETRY_MAX_S`) until it works or the
   connection is heard again by itself.

What it sees is handed to ``publish`` whenever it changes (the daemon writes it into
``state/serve.json``, which ``bothy status`` and ``bothy doctor`` read): per connection its
:class:`ConnectionView` — state (``connected``, ``reconnecting``, ``unreachable``), the
times, the reconnects so far and the last problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from bothy.clock import Clock
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.errors import ChatError

_log = logging.getLogger(__name__)

_TICK_MAX_S = 5.0
_RETRY_MAX_S = 600.0


@dataclass(frozen=True)
class Heard:
    """What one connection last heard, in seconds since the epoch (None: not yet)."""

    connected_at: float | None
    last_event_at: float | None  # anything the platform sent: an event, hello, RESUMED…
    last_ping_at: float | None  # the last ping the platform answered

    def latest(self) -> float | None:
        """The last sign of life: the newest of the three."""
        known = [t for t in (self.connected_at, self.last_event_at, self.last_ping_at)
                 if t is not None]
        return max(known) if known else None


class Watched(Protocol):
    """What :class:`Liveness` needs of a chat adapter."""

    platform: str

    def heard(self) -> Heard:
        """What the current connection last heard."""

    async def probe(self) -> None:
        """Ask the platform for a sign of life now, if the protocol has one (best effort)."""

    async def reconnect(self, *, within_s: float) -> None:
        """Close the connection, then open a new one, within ``within_s``; raise ChatError
        (ChatUnavailable, ChatAuthError) when the new one cannot be had."""


@dataclass(frozen=True)
class ConnectionView:
    """One connection as ``bothy status`` shows it."""

    state: str  # connected | reconnecting | unreachable
    silent_after_s: float
    connected_at: float | None = None
    last_event_at: float | None = None
    last_ping_at: float | None = None
    reconnects: int = 0
    problem: str | None = None

    def published(self) -> dict[str, Any]:
        """The JSON form kept in ``state/serve.json`` (times in microseconds)."""
        def us(seconds: float | None) -> int | None:
            return None if seconds is None else int(seconds * 1_000_000)
        return {"state": self.state, "silent_after_s": self.silent_after_s,
                "connected_at_us": us(self.connected_at),
                "last_event_at_us": us(self.last_event_at),
                "last_ping_at_us": us(self.last_ping_at),
                "reconnects": self.reconnects, "problem": self.problem}


Publish = Callable[[Mapping[str, ConnectionView]], Awaitable[None]]


class Liveness:
    """Watches the connected chat adapters until cancelled (see the module's docstring)."""

    def __init__(
        self,
        adapters: Mapping[str, Watched],
        silent_after_s: Mapping[str, float],
        *,
        audit: AuditLog,
        alerts: Alerts,
        clock: Clock,
        publish: Publish,
    ) -> None:
        self._adapters = dict(adapters)
        self._bounds = dict(silent_after_s)
        self._audit = audit
        self._alerts = alerts
        self._clock = clock
        self._publish = publish
        self._views = {name: ConnectionView("connected", self._bounds[name])
                       for name in self._adapters}

    def views(self) -> dict[str, ConnectionView]:
        """Each connection as it stands now."""
        return dict(self._views)

    async def run(self) -> None:
        """Watch every connection, each in its own task, until cancelled."""
        async with asyncio.TaskGroup() as group:
            for name in self._adapters:
                group.create_task(self._watch(name), name=f"bothy: chat liveness {name}")

    async def _watch(self, name: str) -> None:
        adapter, bound = self._adapters[name], self._bounds[name]
        tick_s = min(bound / 4, _TICK_MAX_S)
        while True:
            await asyncio.sleep(tick_s)
            await _probe(adapter)
            heard = adapter.heard()
            await self._show(name, heard=heard)
            silent_s = self._silent_s(heard)
            if silent_s is not None and silent_s > bound:
                await self._recover(name, adapter, bound, silent_s, heard)

    def _now(self) -> float:
        return self._clock().timestamp()

    def _silent_s(self, heard: Heard) -> float | None:
        latest = heard.latest()
        return None if latest is None else self._now() - latest

    async def _recover(
        self, name: str, adapter: Watched, bound: float, silent_s: float, heard: Heard
    ) -> None:
        """Reconnect a silent connection; audit, alert and retry until it hears again."""
        subject = f"chat:{name}"
        await self._audit.record("chat", "silent", "failed", subject=subject, details={
            "platform": name, "silent_s": round(silent_s, 1), "silent_after_s": bound,
            "last_event_at": _iso(self._clock, heard.last_event_at),
            "last_ping_at": _iso(self._clock, heard.last_ping_at)})
        delay_s, attempt = bound, 0
        while True:
            attempt += 1
            await self._show(name, state="reconnecting")
            started = self._now()
            problem = await _reconnect(adapter, bound)
            if problem is None:
                view = self._views[name]
                await self._audit.record("chat", "reconnected", "ok", subject=subject, details={
                    "platform": name, "attempts": attempt,
                    "took_s": round(self._now() - started, 2)})
                await self._show(name, heard=adapter.heard(), state="connected",
                                 reconnects=view.reconnects + 1, problem=None)
                return
            await self._audit.record("chat", "reconnect-failed", "failed", subject=subject,
                                     details={"platform": name, "attempt": attempt,
                                              "reason": problem})
            await self._show(name, state="unreachable", problem=problem)
            await self._alerts.raise_alert(
                "chat", f"the {name} connection heard nothing for {silent_s:.0f} s and could"
                f" not be reconnected: {problem}", subject=subject)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _RETRY_MAX_S)
            heard = adapter.heard()
            again = self._silent_s(heard)
            if again is not None and again <= bound:  # it came back by itself
                await self._show(name, heard=heard, state="connected", problem=None)
                return

    async def _show(self, name: str, *, heard: Heard | None = None, **changes: Any) -> None:
        """Update one connection's view; publish when anything changed."""
        before = self._views[name]
        after = before
        if heard is not None:
            after = replace(after, connected_at=heard.connected_at,
                            last_event_at=heard.last_event_at, last_ping_at=heard.last_ping_at)
        after = replace(after, **changes)
        if after == before:
            return
        self._views[name] = after
        try:
            await self._publish(self.views())
        except OSError as exc:  # status shows an older picture; the watch goes on
            _log.warning("chat liveness: could not publish: %s", exc)


async def _probe(adapter: Watched) -> None:
    try:
        await adapter.probe()
    except ChatError as exc:  # a probe that cannot be sent shows as silence
        _log.debug("chat liveness: %s probe failed: %s", adapter.platform, exc)


async def _reconnect(adapter: Watched, bound: float) -> str | None:
    """None when the adapter reconnected within ``bound``; else why not."""
    try:
        # The adapter bounds itself; this outer bound only catches one that does not.
        async with asyncio.timeout(bound * 2):
            await adapter.reconnect(within_s=bound)
    except ChatError as exc:
        return str(exc)
    except TimeoutError:
        return f"not reconnected within {bound:g} s"
    return None


def _iso(clock: Clock, seconds: float | None) -> str | None:
    """A time for the register, in the clock's zone, to the second."""
    if seconds is None:
        return None
    zone = clock().tzinfo
    with contextlib.suppress(OverflowError, OSError, ValueError):
        return datetime.fromtimestamp(seconds, zone).isoformat(timespec="seconds")
    return None
