"""The plan's rate-limit windows, as Codex last reported them, kept in state.

Codex sends ``account/rateLimits/updated`` after each model response, filled from the
provider's ``x-codex-primary-*`` / ``x-codex-secondary-*`` headers: per window, the share
used (an integer percent), the window's length and when it resets. The update is sparse (a
window may be missing or null), so each window is kept on its own with the time it was seen,
and a window whose reset has passed counts as reset. The windows are account-wide: every
Codex client of the account moves them, not only Bothy's runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from bothy.clock import Clock, from_us, to_us
from bothy.engine.state import StateDB

WINDOW_NAMES = ("primary", "secondary")
# Rate limits of the account itself; other ids are per-model quota aliases, not the plan's.
_PLAN_LIMIT_IDS = (None, "codex")


@dataclass(frozen=True)
class Window:
    """One rate-limit window as last seen."""

    name: str
    used_percent: int
    window_mins: int | None
    resets_at: datetime | None
    seen_at: datetime

    def current(self, now: datetime) -> Window:
        """The window as it stands now: one whose reset has passed counts as reset (0 %)."""
        if self.resets_at is not None:
            return replace(self, used_percent=0, resets_at=None) if self.resets_at <= now else self
        if self.window_mins is not None and (
                to_us(self.seen_at) + self.window_mins * 60_000_000 <= to_us(now)):
            return replace(self, used_percent=0)
        return self


def windows_from_codex(params: dict[str, Any], seen_at: datetime) -> list[Window]:
    """The windows an ``account/rateLimits/updated`` carries; ``ValueError`` if malformed.

    Fields read: ``bothy/engine/contract.py``.
    """
    limits = params.get("rateLimits")
    if not isinstance(limits, dict):
        raise ValueError("rateLimits is not an object")
    if limits.get("limitId") not in _PLAN_LIMIT_IDS:
        return []
    found = []
    for name in WINDOW_NAMES:
        raw = limits.get(name)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            raise ValueError(f"rateLimits.{name} is not an object")
        used = raw.get("usedPercent")
        length = raw.get("windowDurationMins")
        resets = raw.get("resetsAt")
        if not isinstance(used, int) or isinstance(used, bool) or used < 0:
            raise ValueError(f"rateLimits.{name}.usedPercent is not a percent: {used!r}")
        for key, value in (("windowDurationMins", length), ("resetsAt", resets)):
            if value is not None and not _is_int(value):
                raise ValueError(f"rateLimits.{name}.{key} is not an integer: {value!r}")
        found.append(Window(name, used, length,
                            from_us(resets * 1_000_000) if resets is not None else None,
                            seen_at))
    return found


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class WindowStore:
    """The last window of each name seen by any run of this site."""

    def __init__(self, db: StateDB, *, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def record(self, run_id: str, params: dict[str, Any]) -> list[Window]:
        """Keep the windows of one update (a malformed one is ignored); return them."""
        try:
            windows = windows_from_codex(params, self._clock())
        except ValueError:
            return []
        if not windows:
            return []
        async with self._db.transaction():
            for window in windows:
                await self._db.execute(
                    "INSERT INTO plan_windows (name, used_percent, window_mins, resets_at_us,"
                    " seen_us, run_id) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE"
                    " SET used_percent = excluded.used_percent, window_mins ="
                    " excluded.window_mins, resets_at_us = excluded.resets_at_us,"
                    " seen_us = excluded.seen_us, run_id = excluded.run_id",
                    (window.name, window.used_percent, window.window_mins,
                     to_us(window.resets_at) if window.resets_at else None,
                     to_us(window.seen_at), run_id),
                )
        return windows

    async def load(self) -> dict[str, Window]:
        """The windows as last seen (not yet aged: see :meth:`Window.current`)."""
        rows = await self._db.fetch_all(
            "SELECT name, used_percent, window_mins, resets_at_us, seen_us FROM plan_windows"
        )
        found = {
            row["name"]: Window(
                row["name"], int(row["used_percent"]), row["window_mins"],
                from_us(row["resets_at_us"]) if row["resets_at_us"] is not None else None,
                from_us(row["seen_us"]),
            )
            for row in rows
        }
        return {name: found[name] for name in WINDOW_NAMES if name in found}
