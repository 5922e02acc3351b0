"""The register's head published daily (issue 10 item 5): an `audit head` record carrying the
verified head's seq and hash, posted to the alert channel when one is configured.

The timing is driven with an injected clock (a day passes in an instant); the post is proven
through a real `bothy serve` with the real slack-bolt against the fake Slack.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.headpublisher import HeadPublisher
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_chaincheck import (
    held,
    long_register,
    needs_two_cores,
    opened_the_lock,
    walkers,
)
from tests.test_serve import free_port, start_serve

POSTED = re.compile(r"head (\d{4}) ([0-9a-f]{64})")


class Days:
    """A clock that a sleep moves forward at once, and the site's alert channel as a list."""

    def __init__(self, start: datetime, *, stop_after_posts: int = 0,
                 stop_at: datetime | None = None) -> None:
        self.now = start
        self.stop = asyncio.Event()
        self.posts: list[str] = []
        self._stop_after_posts = stop_after_posts
        self._stop_at = stop_at

    def clock(self) -> datetime:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
        if self._stop_at is not None and self.now >= self._stop_at:
            self.stop.set()

    async def post(self, alert: Any) -> str:
        # Until notify's Alert lands on main a sink is handed the text; after, the Alert.
        self.posts.append(alert if isinstance(alert, str) else alert.text())
        if len(self.posts) == self._stop_after_posts:
            self.stop.set()
        return "CALERTS"


def _publisher(log: AuditLog, days: Days, *, routed: bool) -> HeadPublisher:
    alerts = Alerts(log, site="acme-mini", clock=days.clock)
    if routed:
        alerts.route_to(days.post)
    return HeadPublisher(log, alerts, post_heads=routed, clock=days.clock, sleep=days.sleep)


def _heads(log: AuditLog) -> list[AuditRecord]:
    return [r for r in log.records() if (r.kind, r.event) == ("audit", "head")]


def _hash_of(log: AuditLog, seq: int) -> str:
    return next(r.hash for r in log.records() if r.seq == seq)


async def test_a_register_without_a_head_is_published_a_day_after_it_began_then_daily(
    tmp_path: Path,
) -> None:
    """First 24 h after the register's first record, then every 24 h; the record and the
    post carry the verified head: the record before it."""
    began = datetime(2026, 12, 1, 20, 30, tzinfo=UTC)
    days = Days(began, stop_after_posts=2)
    log = AuditLog(tmp_path / "audit.jsonl", clock=days.clock)
    for n in range(2):
        log.append("sop", "saved", "ok", details={"n": n})

    async with asyncio.timeout(10):
        await _publisher(log, days, routed=True).run(days.stop)

    first, second = _heads(log)
    assert (first.ts, second.ts) == (began + timedelta(hours=24), began + timedelta(hours=48))
    assert (first.seq, first.details["seq"], first.details["hash"]) == (3, 2, _hash_of(log, 2))
    assert (second.seq, second.details["seq"]) == (5, 4)  # after the first post's `alert sent`
    assert [POSTED.search(text).groups() for text in days.posts] == [  # type: ignore[union-attr]
        ("0002", _hash_of(log, 2)), ("0004", _hash_of(log, 4))]
    assert days.posts[0] == f"! **INFO** `acme-mini` — the register: head 0002 {_hash_of(log, 2)}"
    assert [(r.kind, r.event) for r in log.records()][2:] == [
        ("audit", "head"), ("alert", "sent"), ("audit", "head"), ("alert", "sent")]


async def test_the_next_head_is_due_a_day_after_the_last_one_the_register_holds(
    tmp_path: Path,
) -> None:
    """A restart reads the register: 20 h after the last head, the next is 4 h away."""
    start = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    days = Days(start - timedelta(hours=20), stop_after_posts=1)
    log = AuditLog(tmp_path / "audit.jsonl", clock=days.clock)
    log.append("audit", "head", "ok", details={"seq": 0, "hash": "0" * 64})
    days.now = start
    log.append("serve", "starting", "ok")

    async with asyncio.timeout(10):
        await _publisher(log, days, routed=True).run(days.stop)

    assert [r.ts for r in _heads(log)] == [start - timedelta(hours=20), start + timedelta(hours=4)]


async def test_a_register_older_than_a_day_without_a_head_is_published_at_once(
    tmp_path: Path,
) -> None:
    """A site that ran before heads were published: the first one comes at the start."""
    start = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    days = Days(start - timedelta(days=30), stop_after_posts=1)
    log = AuditLog(tmp_path / "audit.jsonl", clock=days.clock)
    log.append("sop", "saved", "ok")
    days.now = start

    async with asyncio.timeout(10):
        await _publisher(log, days, routed=True).run(days.stop)

    assert [r.ts for r in _heads(log)] == [start]


async def test_without_an_alert_channel_only_the_record_is_written(tmp_path: Path) -> None:
    """No route: the daily record, and no `alert undelivered` noise beside it."""
    start = datetime(2026, 12, 1, 20, 30, tzinfo=UTC)
    days = Days(start, stop_at=start + timedelta(hours=25))
    log = AuditLog(tmp_path / "audit.jsonl", clock=days.clock)
    log.append("serve", "starting", "ok")

    async with asyncio.timeout(10):
        await _publisher(log, days, routed=False).run(days.stop)

    assert [(r.kind, r.event, r.details.get("seq")) for r in log.records()] == [
        ("serve", "starting", None), ("audit", "head", 1)]
    assert days.posts == []


async def test_a_register_broken_at_the_due_time_is_not_published_over(tmp_path: Path) -> None:
    """An edit found at publication: no `audit head` record, a critical alert naming it."""
    days = Days(datetime(2026, 12, 1, 20, 30, tzinfo=UTC), stop_after_posts=1)
    log = AuditLog(tmp_path / "audit.jsonl", clock=days.clock)
    for n in range(3):
        log.append("sop", "saved", "ok", details={"n": n})
    log.path.write_bytes(log.path.read_bytes().replace(b'"n":1', b'"n":17', 1))

    async with asyncio.timeout(10):
        await _publisher(log, days, routed=True).run(days.stop)

    assert days.posts == ["! **CRITICAL** `acme-mini` — the register: not published: the"
                          " register is broken: record 0002 was altered: its hash does not"
                          " match its content (line 2)"]
    assert b'"event":"head"' not in log.path.read_bytes()


@needs_two_cores
async def test_a_long_registers_head_is_verified_by_a_process_of_its_own(
    tmp_path: Path,
) -> None:
    """The daily walk of a long register runs beside serve, not on its event loop's core: a
    child walks it (held here mid-walk on the writers' lock), and the head it verified is
    the one recorded and posted."""
    start = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    days = Days(start - timedelta(days=30), stop_after_posts=1)
    log = AuditLog(tmp_path / "audit.jsonl", clock=days.clock)
    long_register(log.path)
    days.now = start

    with held(log.path):
        publishing = asyncio.ensure_future(_publisher(log, days, routed=True).run(days.stop))
        await until(lambda: len(walkers()) == 1 and opened_the_lock(walkers()[0]),
                    "a walker waiting on the lock")
    async with asyncio.timeout(10):
        await publishing

    [head] = _heads(log)
    assert (head.details["seq"], head.details["hash"]) == (6, _hash_of(log, 6))
    assert days.posts == [f"! **INFO** `acme-mini` — the register: head 0006 {_hash_of(log, 6)}"]
    assert not walkers()


# --- through a real `bothy serve` ------------------------------------------------------------


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


@pytest.mark.codex
async def test_serve_posts_the_head_to_the_alert_channel_as_audit_head_prints_it(
    tmp_path: Path, slack: FakeSlack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A day after the last published head, `bothy serve` records the head and posts it in
    the alert channel; the register cut back to the posted seq gives that same `bothy audit
    head`, and the whole register still verifies."""
    slack_environment(monkeypatch)
    site = Site(tmp_path, "http://127.0.0.1:9/v1", listen={"tailnet_port": free_port()},
                chat={"slack": {"api_url": slack.api_url, "allowed_users": ["UOPERATOR"],
                                "alert_channel": "CALERTS"}})
    yesterday = datetime.now(UTC) - timedelta(hours=25)
    AuditLog(site.audit_path, clock=lambda: yesterday).append(
        "audit", "head", "ok", details={"seq": 0, "hash": "0" * 64})

    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: any(p.channel == "CALERTS" for p in slack.posts), "the head posted")
        assert await serving.stop() == 0
        [post] = [p.text for p in slack.posts if p.channel == "CALERTS"]
        found = POSTED.search(post)
        assert found is not None, post
        seq, digest = int(found[1]), found[2]
        [published] = [r for r in audit_records(site, lambda r: (r.kind, r.event) == (
            "audit", "head")) if r.seq > 1]
        assert (published.details["seq"], published.details["hash"]) == (seq, digest)
        assert published.seq == seq + 1  # the head published is the record just before

        cut = Site(tmp_path / "as-published", "http://127.0.0.1:9/v1")
        cut.audit_path.parent.mkdir(parents=True)
        lines = site.audit_path.read_bytes().splitlines(keepends=True)
        cut.audit_path.write_bytes(b"".join(lines[:seq]))
        head = await cut.bothy("audit", "head")
        verified = await shell.bothy("audit", "verify")

    assert head.stdout == f"head {seq:04d} {digest}\n", head.stdout + head.stderr
    assert verified.code == 0, verified.stdout
    alerts = audit_records(site, lambda r: r.kind == "alert")
    assert [(r.event, r.details["route"]) for r in alerts] == [("sent", "slack:CALERTS")]
