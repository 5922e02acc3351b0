"""Alerts: one place every "somebody should know" goes (SPEC §5, §7; rule 4).

An alert names the site and what it is about, e.g. ``! **WARNING** `acme-mini` — run:pr:42``.
It is deduplicated (the same subject and reason within ``repeat_after_s`` is folded into the
first), posted to the configured alert route when there is one, and audited either way:
``alert sent`` when it went out, ``alert undelivered`` when there was nowhere to send it or the
route failed — "a failure nobody hears about is not handled", so the register says so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from bothy.clock import Clock, to_us
from bothy.engine.audit import AuditLog

AlertSink = Callable[[str], Awaitable[str]]  # posts the text; returns where it went
_REPEAT_AFTER_S = 600


class Alerts:
    """Raises alerts for one site."""

    def __init__(self, audit: AuditLog, *, site: str, clock: Clock,
                 repeat_after_s: int = _REPEAT_AFTER_S) -> None:
        self._audit = audit
        self._site = site
        self._clock = clock
        self._repeat_after_us = repeat_after_s * 1_000_000
        self._sink: AlertSink | None = None
        self._last_us: dict[tuple[str, str], int] = {}

    def route_to(self, sink: AlertSink | None) -> None:
        """Where alerts are posted from now on (the daemon sets the chat alert channel)."""
        self._sink = sink

    async def raise_alert(
        self,
        about: str,
        reason: str,
        *,
        subject: str | None,
        run_id: str | None = None,
        level: str = "warning",
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
        text = f"! **{level.upper()}** `{self._site}` — {subject or about}: {reason}"
        if self._sink is None:
            await self._audit.record("alert", "undelivered", "failed", subject=subject,
                                     run_id=run_id, details={**details,
                                                             "route": "none configured"})
            return
        try:
            where = await self._sink(text)
        except Exception as exc:
            await self._audit.record("alert", "undelivered", "failed", subject=subject,
                                     run_id=run_id, details={**details, "route": "failed",
                                                             "error": str(exc)[:300]})
            return
        await self._audit.record("alert", "sent", "ok", subject=subject, run_id=run_id,
                                 details={**details, "route": where})
