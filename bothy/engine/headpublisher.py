"""The register's head, published once a day by ``bothy serve`` (issue 10 item 5; docs/AUDIT.md).

The head (seq and hash of the last record) is anchored in the checkpoint beside the register
after each append, so records cut from the end are named; but someone able to rewrite both
files goes unseen. So the head is also published: each day an ``audit head`` record carries
the verified head, and the same seq and hash are posted to the alert channel when one is
configured — a copy kept outside the machine, which a rewritten history no longer matches
(record N of the register must still end in the hash published for it). Without an alert
channel only the record is written: a routine figure with nowhere to go is not a failure, so
it raises no ``alert undelivered``.

When is decided from the register, so restarts neither skip a day nor publish twice: 24 h
after the last ``audit head`` record, or, on a register that has none yet, 24 h after its first
record (a register older than a day is published at once). Not at a fixed hour: a daemon
started then would add a record at once, and no start of ``bothy serve`` should. A register
found broken at that moment is not published over: the alert says so (every time, routed or
not) and the next try is a day later.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path

from bothy.clock import Clock
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.auditrecord import parse_line
from bothy.engine.chaincheck import ChainCheck
from bothy.errors import BothyError
from bothy.waits import first_of

__all__ = ["HEAD_EVENT", "HEAD_KIND", "HeadPublisher", "Sleep"]

HEAD_KIND, HEAD_EVENT = "audit", "head"
EVERY = timedelta(hours=24)
_RECHECK_S = 300.0  # sleep in steps, so a suspended machine or a stepped clock is caught up
_MARKER = b'"kind":"audit","event":"head"'  # how a head record's line reads (auditrecord)
_CHUNK_BYTES = 1 << 16
_log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class HeadPublisher:
    """Publishes the verified head of ``audit`` every day until stopped.

    ``post_heads``: whether the head is posted (an alert channel is configured); ``clock`` and
    ``sleep`` are injected so a test can drive a day in an instant.
    """

    def __init__(
        self,
        audit: AuditLog,
        alerts: Alerts,
        *,
        post_heads: bool,
        clock: Clock,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._audit = audit
        self._alerts = alerts
        self._post_heads = post_heads
        self._clock = clock
        self._sleep = sleep

    async def run(self, stop: asyncio.Event) -> None:
        """Publish at each due time until ``stop`` is set."""
        due = await self.first_due()
        while await self._until(due, stop):
            await self.publish()
            due = self._clock() + EVERY

    async def first_due(self) -> datetime:
        """24 h after the last head the register holds, or after its first record."""
        since = await asyncio.to_thread(_last_head_or_first_record_at, self._audit.path)
        return (since or self._clock()) + EVERY

    async def publish(self) -> None:
        """Verify the whole chain; record its head and post it (or say the chain is broken).

        A long register is walked by a process of its own (engine/chaincheck.py), so that
        serve's event loop keeps its core while the walk takes the other."""
        try:
            check = await ChainCheck.start(self._audit.path)
            report = (await check.checked()).report
            if not report.ok:
                await self._tell(f"not published: the register is broken: {report.problem}",
                                 level="critical")
                return
            await self._audit.record(HEAD_KIND, HEAD_EVENT, "ok", details={
                "seq": report.last_seq, "hash": report.last_hash,
                "repaired_at": list(report.repaired_at)})
            if self._post_heads:
                await self._tell(f"head {report.last_seq:04d} {report.last_hash}", level="info")
        except BothyError as exc:  # the daemon stays up; the next try is a day later
            _log.warning("publishing the register's head failed: %s", exc)

    async def _tell(self, reason: str, *, level: str) -> None:
        await self._alerts.raise_alert("the register", reason, subject=None, level=level)

    async def _until(self, due: datetime, stop: asyncio.Event) -> bool:
        """Wait for ``due`` by the clock; False if ``stop`` came first."""
        while not stop.is_set():
            left_s = (due - self._clock()).total_seconds()
            if left_s <= 0:
                return True
            if await first_of(stop.wait(), self._sleep(min(left_s, _RECHECK_S))) == 0:
                return False
        return False


def _last_head_or_first_record_at(path: Path) -> datetime | None:
    return last_head_at(path) or first_record_at(path)


def first_record_at(path: Path) -> datetime | None:
    """When the register's current file began (its first record), if it has one."""
    try:
        with path.open("rb") as f:
            parsed = parse_line(f.readline().rstrip(b"\n"))
    except FileNotFoundError:
        return None
    return None if isinstance(parsed, str) else parsed.ts


def last_head_at(path: Path) -> datetime | None:
    """When the last ``audit head`` record of the register's current file was written, read
    backwards from the end (a head is at most a day old on a site that serves daily)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        end = os.fstat(fd).st_size
        carry = b""  # the start of a line whose beginning lies in an earlier chunk
        while end > 0:
            start = max(0, end - _CHUNK_BYTES)
            lines = (os.pread(fd, end - start, start) + carry).split(b"\n")
            carry = lines.pop(0) if start > 0 else b""
            for line in reversed(lines):
                if _MARKER in line:
                    parsed = parse_line(line)
                    if not isinstance(parsed, str):
                        return parsed.ts
            end = start
        return None
    finally:
        os.close(fd)
