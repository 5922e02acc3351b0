"""What the webhook listener turns away, and how a flood of it is kept off the disk.

A :class:`Refusal` is the value a step of the listener returns instead of going on: the status
the sender hears, the reason the register keeps, and the delivery id when the sender sent one.
:class:`RefusalLimiter` lets at most ``limit`` refusal records through per bucket (a route, or
``-`` for requests that name none) per fixed window, and counts the rest by kind
(``"401 bad signature"``), so the ``webhook suppressed`` record that closes a window says what
was folded into it and how many of each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bothy.clock import from_us


@dataclass(frozen=True)
class Refusal:
    """Why a delivery is turned away: what the audit says and what the sender hears."""

    status: int
    reason: str
    answer: str
    delivery: str | None = None
    event: str = "refused"
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        return "failed" if self.status >= 500 else "refused"

    @property
    def kind(self) -> str:
        """The refusal's kind as a summary counts it: the status and the short answer."""
        return f"{self.status} {self.answer}"

    def naming(self, delivery: str | None) -> Refusal:
        """This refusal, carrying ``delivery`` unless it names one already."""
        if self.delivery is not None or delivery is None:
            return self
        return replace(self, delivery=delivery)


@dataclass
class _Window:
    started_us: int
    recorded: int = 0
    suppressed: Counter[str] = field(default_factory=Counter)


class RefusalLimiter:
    """At most ``limit`` refusal records per bucket per fixed window; the rest are counted."""

    def __init__(self, limit: int, window_us: int) -> None:
        self._limit = limit
        self._window_us = window_us
        self._windows: dict[str, _Window] = {}

    def admit(
        self, bucket: str, kind: str, now_us: int
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether to record this refusal, and the summary of a window that just rolled."""
        window = self._windows.get(bucket)
        summary = None
        if window is None or now_us - window.started_us >= self._window_us:
            if window is not None:
                summary = self._summary(window, now_us)
            window = self._windows[bucket] = _Window(now_us)
        if window.recorded < self._limit:
            window.recorded += 1
            return True, summary
        window.suppressed[kind] += 1
        return False, summary

    def drain(self, now_us: int) -> dict[str, dict[str, Any]]:
        """Summaries of every window with suppressed refusals; forget all windows."""
        summaries = {bucket: self._summary(window, now_us)
                     for bucket, window in self._windows.items()}
        self._windows.clear()
        return {bucket: summary for bucket, summary in summaries.items() if summary is not None}

    def _summary(self, window: _Window, now_us: int) -> dict[str, Any] | None:
        total = window.suppressed.total()
        if not total:
            return None
        return {"suppressed": total, "kinds": dict(window.suppressed.most_common()),
                "recorded": window.recorded,
                "since": from_us(window.started_us).isoformat(),
                "until": from_us(now_us).isoformat()}
