"""Alerts: one place every "somebody should know" goes (SPEC §5, §7; rule 4).

An alert names the site, what it is about and why, the wake (its lane, e.g. ``pr:42``) and the
run id, and links to the chat thread it concerns when there is one::

    ! **WARNING** `acme-mini` — unverified run: still failing verification after 5 attempts
    wake `pr:42` · run `run_20261201T120000Z_a5b90382` · [the thread](https://…)

It is deduplicated (the same subject and reason within ``repeat_after_s`` is folded into the
first), posted to the configured alert route when there is one, and audited either way:
``alert sent`` when it went out, ``alert undelivered`` when there was nowhere to send it or the
route failed — "a failure nobody hears about is not handled", so the register says so. The
route is a sink given the :class:`Alert` (``bothy serve``: the connected chat adapters; any
other command: one Web API call, ``chat/oneshot.py``); it renders the link it can make.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bothy.clock import Clock, to_us
from bothy.engine.audit import AuditLog

_REPEAT_AFTER_S = 600


@dataclass(frozen=True)
class AlertThread:
    """The chat thread an alert concerns: a platform, its channel and the thread's id (Slack:
    the thread's ts; Discord: the thread's channel id)."""

    platform: str
    channel: str
    thread: str


@dataclass(frozen=True)
class Alert:
    """One alert, as its route needs it."""

    site: str
    level: str  # warning | critical
    about: str
    reason: str
    subject: str | None  # the wake's lane (``pr:42``, ``schedule:backups``, ``slack:…``)
    run_id: str | None
    thread: AlertThread | None = None

    def text(self, link: str | None = None) -> str:
        """The alert in Bothy's Markdown (each platform's formatting converts it), with the
        link to its thread when the route could make one."""
        head = f"! **{self.level.upper()}** `{self.site}` — {self.about}: {self.reason}"
        tail = []
        if self.subject:
            tail.append(f"wake `{self.subject}`")
        if self.run_id:
            tail.append(f"run `{self.run_id}`")
        if link:
            tail.append(f"[the thread]({link})")
        return head + ("\n" + " · ".join(tail) if tail else "")


AlertSink = Callable[[Alert], Awaitable[str]]  # posts the alert; returns where it went


class Alerts:
    """Raises alerts for one site."""

    def __init__(self, audit: AuditLog, *, site: str, clock: Clock,
                 repeat_after_s: int = _REPEAT_AFTER_S) -> None:
        self._audit = audit
        self._site = site
        self._clock = clock
        self._repeat_after_us = repeat_after_s * 1_000_000
        self._sink: AlertSink | None = None
        self._no_route = "none configured"
        self._last_us: dict[tuple[str, str], int] = {}

    def route_to(self, sink: AlertSink | None, *, unrouted: str = "none configured") -> None:
        """Where alerts are posted from now on (a command's one-shot Web API, or the daemon's
        chat adapters); ``unrouted`` is what ``alert undelivered`` says without a sink."""
        self._sink = sink
        self._no_route = unrouted

    async def raise_alert(
        self,
        about: str,
        reason: str,
        *,
        subject: str | None,
        run_id: str | None = None,
        level: str = "warning",
        thread: AlertThread | None = None,
    ) -> None:
        key = (subject or "-", reason)
        now_us = to_us(self._clock())
        last = self._last_us.get(key)
        details: dict[str, Any] = {"about": about, "reason": reason, "level": level}
        if last is not None and now_us - last < self._repeat_after_us:
            await self._audit.record("alert", "suppressed", "ok", subject=subject,
                                     run_id=run_id, details=details)
            return
        self._last_us[key] = now_us
        alert = Alert(self._site, level, about, reason, subject, run_id, thread)
        if self._sink is None:
            await self._audit.record("alert", "undelivered", "failed", subject=subject,
                                     run_id=run_id, details={**details,
                                                             "route": self._no_route})
            return
        try:
            where = await self._sink(alert)
        except Exception as exc:
            await self._audit.record("alert", "undelivered", "failed", subject=subject,
                                     run_id=run_id, details={**details, "route": "failed",
                                                             "error": str(exc)[:300]})
            return
        await self._audit.record("alert", "sent", "ok", subject=subject, run_id=run_id,
                                 details={**details, "route": where})
