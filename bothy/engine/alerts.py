"""Alerts: one place every "somebody should know" goes (SPEC §5, §7; rule 4).

An alert names the site, what it is about and why, the wake (its lane, e.g. ``pr:42``) and the
run id, and links to the chat thread it concerns when there is one::

    ! **WARNING** `acme-mini` — unverified run: still failing verification after 5 attempts
    wake `pr:42` · run `run_20261201T120000Z_a5b90382` · [the thread](https://…)

It is deduplicated (the same subject and reason within ``repeat_after_s`` is folded into the
first), posted to the configured alert route when there is one, and audited either way:
``alert sent`` when it went out, ``alert undelivered`` when there was nowhere to send it or the
route failed — "a failure nobody hears about is not handled", so the register says so. The
route is a sink given the :class:`Alert`; it renders the link it can make. Every command has
the one-shot Web API call (``chat/oneshot.py``, set up by ``runtime.site_alerts``);
``bothy serve`` tries its chat connection first and falls back to that call when it fails.
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
        self._sinks: list[AlertSink] = []
        self._no_route = "none configured"
        self._last_us: dict[tuple[str, str], int] = {}

    def route_to(self, sink: AlertSink | None, *, unrouted: str = "none configured") -> None:
        """Where alerts are posted from now on (a command's one-shot Web API call);
        ``unrouted`` is what ``alert undelivered`` says without a sink."""
        self._sinks = [] if sink is None else [sink]
        self._no_route = unrouted

    def add_route(self, sink: AlertSink) -> None:
        """Try ``sink`` first from now on, keeping the routes there were as fallbacks (the
        daemon's chat connection first, the one-shot Web API call if that fails)."""
        self._sinks.insert(0, sink)

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
        if not self._sinks:
            await self._audit.record("alert", "undelivered", "failed", subject=subject,
                                     run_id=run_id, details={**details,
                                                             "route": self._no_route})
            return
        errors: list[str] = []
        for sink in self._sinks:
            try:
                where = await sink(alert)
            except Exception as exc:  # a route's failure is recorded, and the next tried
                errors.append(str(exc)[:300])
                continue
            tried = {"failed_first": errors} if errors else {}
            await self._audit.record("alert", "sent", "ok", subject=subject, run_id=run_id,
                                     details={**details, "route": where, **tried})
            return
        await self._audit.record("alert", "undelivered", "failed", subject=subject,
                                 run_id=run_id, details={**details, "route": "failed",
                                                         "error": "; ".join(errors)})
