"""Wakes: what makes Bothy start a run without being asked in chat (SPEC §5).

The flow: a listener (``webhook``) checks a delivery, a ``poller`` finds something new, or a
schedule fires (``schedule_runner``), and it is made durable in the ``inbox``; the
``dispatcher`` takes durable wakes from there and hands each to its source's handler
(``handlers``), which turns it into a run.

The names in ``__all__`` are its surface: what the other packages use, importable from the
package itself (``from bothy.wakes import X``), each loaded on first use (:mod:`bothy.surface`).
"""

from __future__ import annotations

from typing import Any

from bothy.surface import surface_attribute

_SURFACE = {
    "Dispatcher": "bothy.wakes.dispatcher",
    "Quiet": "bothy.wakes.handlers",
    "WakeStart": "bothy.wakes.handlers",
    "unattended": "bothy.wakes.handlers",
    "Accepted": "bothy.wakes.inbox",
    "Delivery": "bothy.wakes.delivery",
    "Duplicate": "bothy.wakes.inbox",
    "Inbox": "bothy.wakes.inbox",
    "WakeRow": "bothy.wakes.inbox",
    "Ignored": "bothy.wakes.jobs",
    "PollReport": "bothy.wakes.poller",
    "Poller": "bothy.wakes.poller",
    "Preflight": "bothy.wakes.preflight",
    "Reports": "bothy.wakes.reports",
    "ScheduleRunner": "bothy.wakes.schedule_runner",
    "Schedule": "bothy.wakes.schedules",
    "ScheduleStore": "bothy.wakes.schedules",
    "Unrunnable": "bothy.wakes.schedules",
    "cron_trigger": "bothy.wakes.schedules",
    "next_fire": "bothy.wakes.schedules",
    "schedule_name_problem": "bothy.wakes.schedules",
    "schedule_request": "bothy.wakes.schedules",
    "WebhookListener": "bothy.wakes.webhook",
}
__all__ = [
    "Accepted", "Delivery", "Dispatcher", "Duplicate", "Ignored", "Inbox", "PollReport",
    "Poller", "Preflight", "Quiet", "Reports", "Schedule", "ScheduleRunner", "ScheduleStore",
    "Unrunnable", "WakeRow",
    "WakeStart", "WebhookListener", "cron_trigger", "next_fire", "schedule_name_problem",
    "schedule_request", "unattended",
]


def __getattr__(name: str) -> Any:
    """Load a name of the surface from its module on first use (PEP 562)."""
    return surface_attribute(__name__, _SURFACE, name)

