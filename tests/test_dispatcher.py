"""The dispatcher never loses a wake silently: one it cannot handle is closed out loud."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

import pytest

from bothy.chat.conversation import SOURCE as CHAT_SOURCE
from bothy.chat.conversation import Conversations
from bothy.config import parse_config
from bothy.engine.audit import AuditLog
from bothy.engine.budget import Admitted, BudgetGate, Ticket
from bothy.engine.procgroup import process_start_time
from bothy.home import BothyHome
from bothy.runtime import Runtime
from bothy.wakes.delivery import Delivery
from bothy.wakes.dispatcher import Dispatcher
from bothy.wakes.handlers import unattended
from bothy.wakes.inbox import Inbox
from bothy.wakes.reports import Reports
from bothy.wakes.schedules import ScheduleStore
from tests.fakes import github
from tests.fakes.codex import codex_binary
from tests.fakes.shell import until


@pytest.mark.codex
async def test_a_wake_that_cannot_be_handled_is_abandoned_audited_and_raised(
    tmp_path: Path,
) -> None:
    """A chat wake whose payload is corrupt: `wake crashed`, abandoned, an alert — no hang;
    its row names no run (none was asked for under the id its claim named)."""
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
        rows = await rt.db.fetch_all("SELECT status, note, run_id FROM wakes")
    assert [(row["status"], row["note"].split(":")[0], row["run_id"]) for row in rows] == [
        ("abandoned", "handling it failed", None)]
    events = [(r.kind, r.event, r.outcome) for r in AuditLog(home.audit_path).records()]
    assert ("wake", "crashed", "failed") in events
    assert ("alert", "undelivered", "failed") in events


@pytest.mark.codex
async def test_a_backlog_longer_than_one_look_is_worked_through_without_waiting_for_a_poke(
    tmp_path: Path,
) -> None:
    """120 wakes queued, all refused at the budget: each is deferred once, in arrival order,
    and the dispatcher takes the next look at once rather than at its idle poll."""
    home = BothyHome(tmp_path / "home")
    (tmp_path / "work").mkdir()
    cfg = parse_config({"site": "t", "workspace": str(tmp_path / "work"),
                        "budget": {"per_run_usd": 0.5, "per_day_usd": 1},
                        "codex": {"command": [str(codex_binary()), "app-server"]},
                        "webhooks": {"github": {"path": "/hooks/github", "secret_env": ["S"],
                                                "jobs": [{"event": "pull_request",
                                                          "prompt": "Review it."}]}}},
                       path=home.config_path)
    count = 120
    async with Runtime.open(home, cfg) as rt:
        inbox = Inbox(home.inbox_dir, rt.db, clock=rt.clock, audit=rt.audit)
        reports = Reports(cfg, db=rt.db, audit=rt.audit, alerts=rt.alerts, clock=rt.clock)
        store = ScheduleStore(rt.db, timezone=cfg.budget.timezone, clock=rt.clock)
        handlers = unattended(cfg, home, reports=reports, store=store, audit=rt.audit)
        supervisor = rt.supervisor()
        dispatcher = Dispatcher(cfg.wakes, handlers, inbox=inbox, supervisor=supervisor,
                                db=rt.db, audit=rt.audit, alerts=rt.alerts, clock=rt.clock)
        await _spend(supervisor.budget, 800_000)
        for n in range(count):
            await inbox.accept(Delivery(
                source="webhook", route="github", key=f"delivery-{n:03d}",
                event="pull_request", action="opened", headers={},
                body=github.encode(github.pull_request_opened(number=n)),
                received_at=rt.clock()))
        running = asyncio.create_task(dispatcher.run())  # never poked
        try:
            await until(lambda: sum(r.event == "deferred"
                                    for r in AuditLog(home.audit_path).records()) == count,
                        f"{count} wakes deferred")
        finally:
            dispatcher.stop_intake()
            await running
        rows = await rt.db.fetch_all("SELECT status, attempts, run_id FROM wakes")
    assert {(row["status"], row["attempts"], row["run_id"]) for row in rows} == {
        ("queued", 1, None)}
    records = list(AuditLog(home.audit_path).records())
    lines = [(r.kind, r.event) for r in records if r.kind in ("wake", "run")]
    assert lines == [("wake", "received"), ("run", "refused"), ("wake", "deferred")] * count
    deferred = [r for r in records if r.event == "deferred"]
    assert [r.details["delivery"] for r in deferred] == [f"delivery-{n:03d}"
                                                         for n in range(count)]
    refused = {r.details["message"] for r in records if r.event == "refused"}
    assert refused == {"would reach 1.30 usd against a 1.00 ceiling (0.80 used, 0.00 already"
                       " reserved, 0.50 requested)"}
    # The look after the first 50 came at once, not at the idle poll (1 s) that nobody poked.
    gaps = [(later.ts - earlier.ts).total_seconds()
            for earlier, later in itertools.pairwise(deferred)]
    assert max(gaps) < 0.5, gaps


async def _spend(gate: BudgetGate, micros: int) -> None:
    """A run earlier today that cost ``micros``: admitted, filled, settled."""
    ticket = Ticket("run_20260101T000000Z_5eed5eed", "seed", "test", 500_000, os.getpid(),
                    process_start_time(os.getpid()))
    assert isinstance(await gate.admit(ticket), Admitted)
    await gate.fill(ticket.run_id, micros, tokens=1)
    await gate.settle(ticket.run_id, outcome="completed", reason=None, final_text="")
