"""Every kind of record the register holds, declared once.

A record is named by its ``kind`` and ``event`` (``run admitted``, ``wake deferred``). Each pair
Bothy writes is declared in :data:`EVENTS`, and :class:`~bothy.engine.audit.AuditLog` refuses
to append one that is not: an undeclared event is a bug in Bothy (a typo, or an event added
without saying what it means), never something to write and explain later. ``docs/AUDIT.md``
says what each one means and carries; a test keeps the two in step.

Whoever adds an event adds it here and to ``docs/AUDIT.md`` in the same change.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

__all__ = ["EVENTS", "EventTable"]


class EventTable:
    """The (kind, event) pairs a register accepts."""

    def __init__(self, events: Mapping[str, tuple[str, ...]]) -> None:
        self._pairs = frozenset((kind, event) for kind, names in events.items() for event in names)

    def check(self, kind: str, event: str) -> None:
        """Raise ValueError (a programming error) for a pair this table does not declare."""
        if (kind, event) not in self._pairs:
            raise ValueError(
                f"audit event '{kind} {event}' is not declared: add it to"
                " bothy.engine.auditevents.EVENTS and to docs/AUDIT.md"
            )

    def including(self, events: Mapping[str, tuple[str, ...]]) -> EventTable:
        """This table and ``events`` (a test of the file format may name events of its own)."""
        merged: dict[str, tuple[str, ...]] = {}
        for kind, event in self._pairs:
            merged[kind] = (*merged.get(kind, ()), event)
        for kind, names in events.items():
            merged[kind] = (*merged.get(kind, ()), *names)
        return EventTable(merged)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(sorted(self._pairs))

    def __contains__(self, pair: object) -> bool:
        return pair in self._pairs


EVENTS = EventTable({
    # A wake reaching Bothy, and what became of it before or instead of a run.
    "wake": ("received", "ignored", "deferred", "abandoned", "interrupted", "crashed",
             "requeued", "reinserted", "pruned"),
    # A run's life: gates, worker, end; its recovery by a later Bothy; a job's own check.
    "run": ("admitted", "refused", "started", "finished", "cancel-requested", "recovered",
            "verified", "verification-failed", "question"),
    "turn": ("started",),
    "worker": ("stopped",),
    # The app-server bothy serve starts ahead of the next run (engine/spare.py): ready, ended
    # without a run (stop, death, a changed CODEX_HOME, a failed start), ended by a later Bothy.
    "spare": ("started", "ended", "recovered"),
    "budget": ("settled",),
    "plan": ("window",),  # budget mode plan, no rate-limit window known yet
    # Tools and the people asked about them.
    "tool": ("allowed", "refused", "ran"),
    "question": ("answered", "timed_out", "stopped", "declined"),  # asked: `run question`
    "answer": ("received", "ignored", "late"),
    "mcp": ("failed",),
    # A run's trace sent to an OTLP receiver by `bothy serve` (config `otel`): given up; or
    # the exporter itself stuck (its queue file, the register), once per streak.
    "trace": ("abandoned", "stalled"),
    # The register itself: a broken one set aside by `bothy audit repair`; the head that
    # `bothy serve` publishes daily.
    "audit": ("repaired", "head"),
    # Somebody should know.
    "alert": ("sent", "undelivered", "suppressed"),
    # What an unattended run found (or asked), posted where its job says (wakes/reports.py).
    "report": ("sent", "undelivered"),
    # A heartbeat's preflight: the model woken, or a quiet fire with no run.
    "heartbeat": ("woken", "quiet"),
    # The daemon and its doors.
    "serve": ("starting", "ready", "stopped"),
    "webhook": ("refused", "suppressed", "ping", "misconfigured"),
    "poll": ("failed", "recovered", "stopped"),
    "schedule": ("added", "removed", "fired", "missed"),
    "sop": ("saved",),
    # Chat platforms and conversations.
    "chat": ("refused", "react-failed", "thread-failed", "post-failed", "lost",
             # A connection that heard nothing (bothy/chat/liveness.py).
             "silent", "reconnected", "reconnect-failed", "watch-stopped"),
    "thread": ("resume-failed",),
    # Approval buttons (chat/buttons.py): presses that did not count, and message updates.
    "button": ("forged", "refused", "stale", "repeated", "stopped", "update-failed"),
    # A profile's memory: loaded into a run, used by its tools, pruned, restored by hand.
    "memory": ("loaded", "written", "refused", "read", "applied", "pruned", "left-out",
               "restored"),
    # A run's task in Cairn (docs/CAIRN.md).
    "cairn": ("claimed", "claim_failed", "briefed", "brief_failed", "noted", "note_failed",
              "released", "release_failed", "ref_refused"),
})
"""What Bothy records today (docs/AUDIT.md, "What is recorded today")."""
