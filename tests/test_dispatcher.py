"""The dispatcher never loses a wake silently: one it cannot handle is closed out loud."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bothy.chat.conversation import SOURCE as CHAT_SOURCE
from bothy.chat.conversation import Conversations
from bothy.config import parse_config
from bothy.engine.audit import AuditLog
from bothy.home import BothyHome
from bothy.runtime import Runtime
from bothy.wakes.delivery import Delivery
from bothy.wakes.dispatcher import Dispatcher
from bothy.wakes.handlers import unattended
from bothy.wakes.inbox import Inbox
from bothy.wakes.reports import Reports
from bothy.wakes.schedules import ScheduleStore
from tests.fakes.codex import codex_binary
from tests.fakes.shell import until


@pytest.mark.codex
async def test_a_wake_that_cannot_be_handled_is_abandoned_audited_and_raised(
    tmp_path: Path,
) -> None:
    """A chat wake whose payload is corrupt: `wake crashed`, abandoned, an alert — no hang."""
    home = BothyHome(tmp_path / "home")
    (tmp_path / "work").mkdir()
    cfg = parse_config({"site": "t", "workspace": str(tmp_path / "work"),
                        "budget": {"per_run_usd": 0.5, "per_day_usd": 5},
                        "codex": {"command": [str(codex_binary()), "app-server"]}},
                       path=home.config_path)
    async with Runtime.open(home, cfg) as rt:
        inbox = Inbox(home.inbox_dir, rt.db, clock=rt.clock, audit=rt.audit)
        reports = Reports(cfg, db=rt.db, audit=rt.audit, alerts=rt.alerts, clock=rt.clock)
        store = ScheduleStore(rt.db, timezone=cfg.budget.timezone, clock=rt.clock)
        handlers = unattended(cfg, home, reports=reports, store=store, audit=rt.audit)
        dispatcher = Dispatcher(cfg.wakes, handlers, inbox=inbox,
                                supervisor=rt.supervisor(), db=rt.db, audit=rt.audit,
                                alerts=rt.alerts, clock=rt.clock)
        dispatcher.add_handler(CHAT_SOURCE, Conversations(cfg, {}, db=rt.db, audit=rt.audit,
                                                          clock=rt.clock))
        await inbox.accept(Delivery(source="chat", route="slack", key="CWORK:1.0",
                                    event="mention", action=None, headers={},
                                    body=b"{not json", received_at=rt.clock()))
        running = asyncio.create_task(dispatcher.run())
        try:
            await until(lambda: any(r.event == "crashed"
                                    for r in AuditLog(home.audit_path).records()),
                        "the wake recorded as crashed")
            assert await dispatcher.drain(5)
        finally:
            dispatcher.stop_intake()
            await running
        rows = await rt.db.fetch_all("SELECT status, note FROM wakes")
    assert [(row["status"], row["note"].split(":")[0]) for row in rows] == [
        ("abandoned", "handling it failed")]
    events = [(r.kind, r.event, r.outcome) for r in AuditLog(home.audit_path).records()]
    assert ("wake", "crashed", "failed") in events
    assert ("alert", "undelivered", "failed") in events
