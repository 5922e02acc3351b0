"""Schedules and SOPs (SPEC §5 "Cron"; issue 4): cron wakes kept in the state database.

In process, with a clock the test moves: the store, the missed-fire rule (once, never a
burst; not at all past the grace), the timers following the table, the run a fire asks for.
Through the real CLI (``python -m bothy``) against a throwaway site: ``schedule add|list|rm|run``,
``sop list|show|set``, every bad input answered 64, and — with the real codex against the
scripted model — a heartbeat's ``NO_REPLY``, a procedure verified, a heartbeat refused at the
budget ceiling, and a fire missed while ``bothy serve`` was down, run once by the daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bothy.clock import from_us, to_us
from bothy.config import Config, load_config, parse_config
from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.budget import Admitted, Ticket
from bothy.engine.procgroup import process_start_time
from bothy.engine.run import RunRequest
from bothy.engine.state import StateDB
from bothy.engine.verification import Verification
from bothy.errors import UsageError
from bothy.home import BothyHome
from bothy.runtime import Runtime
from bothy.wakes.delivery import Delivery, decode_payload_file, encode_payload_file
from bothy.wakes.inbox import Accepted, Duplicate, Inbox, WakeRow
from bothy.wakes.schedule_runner import ScheduleRunner
from bothy.wakes.schedules import (
    HEARTBEAT_INSTRUCTION,
    Schedule,
    ScheduleStore,
    Unrunnable,
    cron_trigger,
    schedule_request,
)
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import Shell, audit_records, of_run, runs_of_wakes, until
from tests.fakes.site import Completed, Site

T0 = datetime(2026, 9, 24, 2, 0, tzinfo=UTC)
NOWHERE = "http://127.0.0.1:9/v1"  # a model nobody reaches: for commands that start no run


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


@dataclass
class _Parts:
    """A store, an inbox and an audit log over one state database, on a moved clock."""

    db: StateDB
    store: ScheduleStore
    inbox: Inbox
    audit: AuditLog
    clock: _Clock
    pokes: list[None] = field(default_factory=list)

    def runner(self, *, grace_s: int = 3600) -> ScheduleRunner:
        return ScheduleRunner(self.store, self.inbox, audit=self.audit, grace_s=grace_s,
                              clock=self.clock, on_enqueued=lambda: self.pokes.append(None))

    async def wakes(self) -> list[WakeRow]:
        rows = await self.db.fetch_all("SELECT * FROM wakes ORDER BY id")
        return [WakeRow.from_row(row) for row in rows]

    def records(self, kind: str, event: str) -> list[AuditRecord]:
        return [r for r in self.audit.records() if (r.kind, r.event) == (kind, event)]


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[_Parts]:
    clock = _Clock()
    async with StateDB.open(tmp_path / "bothy.sqlite3") as db:
        audit = AuditLog(tmp_path / "audit.jsonl", clock=clock)
        yield _Parts(db, ScheduleStore(db, timezone="UTC", clock=clock),
                     Inbox(tmp_path / "inbox", db, clock=clock, audit=audit), audit, clock)


# --- the store --------------------------------------------------------------------------------


async def test_a_schedule_is_kept_with_its_next_fire_in_the_budget_zone(tmp_path: Path) -> None:
    """An added schedule is read back as written, created now, its next fire in the zone."""
    clock = _Clock()
    async with StateDB.open(tmp_path / "bothy.sqlite3") as db:
        store = ScheduleStore(db, timezone="Europe/Paris", clock=clock)
        added = await store.add(Schedule("nightly", "0  3 * * *", "sop", sop="backup",
                                         verify_argv=["make", "check"], max_usd_micros=250_000))

        assert added == Schedule(
            "nightly", "0 3 * * *", "sop", sop="backup", verify_argv=["make", "check"],
            max_usd_micros=250_000, created_us=to_us(T0), last_fire_us=None,
            # 03:00 in Paris in September is 01:00 UTC: the next is tomorrow's.
            next_fire_us=to_us(datetime(2026, 9, 25, 1, 0, tzinfo=UTC)))
        assert await store.get("nightly") == added
        assert await store.all() == [added]


async def test_a_taken_name_is_not_added_again(parts: _Parts) -> None:
    """Adding a name already taken returns None and leaves the first schedule as it was."""
    first = await parts.store.add(Schedule("hb", "*/30 * * * *", "heartbeat"))

    assert await parts.store.add(Schedule("hb", "0 3 * * *", "prompt", prompt="x")) is None
    assert await parts.store.all() == [first]


async def test_a_removed_schedule_is_gone_and_a_second_removal_says_so(parts: _Parts) -> None:
    """remove is True once, then False; the schedule is no longer listed."""
    await parts.store.add(Schedule("hb", "*/30 * * * *", "heartbeat"))

    assert await parts.store.remove("hb") is True
    assert await parts.store.remove("hb") is False
    assert await parts.store.all() == []


@pytest.mark.parametrize(("cron", "message"), [
    ("0 3 * *", "--cron '0 3 * *' has 4 fields; expected five fields"),
    ("61 3 * * *", "--cron '61 3 * * *' is not a valid crontab expression"),
    ("0 3 * * 1-5", "--cron '0 3 * * 1-5': write the day of week as names (mon-fri, sun)"),
])
def test_a_bad_cron_is_a_usage_error_naming_it(cron: str, message: str) -> None:
    """A cron Bothy cannot honour (or would read differently from crontab) is named and refused."""
    with pytest.raises(UsageError) as refused:
        cron_trigger(cron, "UTC")
    assert str(refused.value).startswith(message)


def test_days_of_week_by_name_mean_what_crontab_means() -> None:
    """`mon-fri` fires on Monday to Friday (2026-09-26 is a Saturday)."""
    trigger = cron_trigger("0 9 * * mon-fri", "UTC")
    friday = datetime(2026, 9, 25, 10, 0, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, friday) == datetime(2026, 9, 28, 9, 0, tzinfo=UTC)


# --- missed fires -----------------------------------------------------------------------------


async def test_a_schedule_missed_during_downtime_fires_once(parts: _Parts) -> None:
    """Five ten-minute slots missed while down are one wake, for the latest slot, at start."""
    await parts.store.add(Schedule("tick", "*/10 * * * *", "heartbeat"))
    parts.clock.advance(minutes=55)  # 02:10, 02:20, 02:30, 02:40 and 02:50 pass unseen

    runner = parts.runner()
    queued = await runner.start()
    await runner.stop()

    assert queued == 1
    [wake] = await parts.wakes()
    assert (wake.source, wake.route, wake.key, wake.event, wake.action, wake.status) == (
        "schedule", "tick", "2026-09-24T02:50:00+00:00", "schedule", "heartbeat", "queued")
    assert (await parts.store.get("tick")) == Schedule(
        "tick", "*/10 * * * *", "heartbeat", created_us=to_us(T0),
        last_fire_us=to_us(datetime(2026, 9, 24, 2, 50, tzinfo=UTC)),
        next_fire_us=to_us(datetime(2026, 9, 24, 3, 0, tzinfo=UTC)))
    [fired] = parts.records("schedule", "fired")
    assert (fired.outcome, fired.subject, fired.details) == ("ok", "schedule:tick", {
        "fire_time": "2026-09-24T02:50:00+00:00", "late_s": 300.0, "wake": wake.id})
    assert len(parts.pokes) == 1


async def test_a_restart_after_the_catch_up_fires_nothing_more(parts: _Parts) -> None:
    """A second start with no new slot since the last fire queues nothing."""
    await parts.store.add(Schedule("tick", "*/10 * * * *", "heartbeat"))
    parts.clock.advance(minutes=55)
    first = parts.runner()
    await first.start()
    await first.stop()
    parts.clock.advance(minutes=5)  # 03:00 is due now: one more, not a replay of the rest

    second = parts.runner()
    queued = await second.start()
    again = parts.runner()
    requeued = await again.start()
    await second.stop()
    await again.stop()

    assert (queued, requeued) == (1, 0)
    assert [wake.key for wake in await parts.wakes()] == [
        "2026-09-24T02:50:00+00:00", "2026-09-24T03:00:00+00:00"]


async def test_a_fire_missed_by_more_than_the_grace_is_skipped_and_audited(
    parts: _Parts,
) -> None:
    """A 01:00 slot seen at 03:30 with an hour's grace does not run; the skip is audited."""
    parts.clock.now = datetime(2026, 9, 24, 0, 0, tzinfo=UTC)
    await parts.store.add(Schedule("backup", "0 1 * * *", "prompt", prompt="back up"))
    parts.clock.now = datetime(2026, 9, 24, 3, 30, tzinfo=UTC)

    runner = parts.runner(grace_s=3600)
    queued = await runner.start()
    await runner.stop()

    assert queued == 0
    assert await parts.wakes() == []
    [missed] = parts.records("schedule", "missed")
    assert (missed.outcome, missed.subject, missed.details["fire_time"]) == (
        "refused", "schedule:backup", "2026-09-24T01:00:00+00:00")
    assert "more than wakes.missed_fire_grace_s (3600 s) ago" in str(missed.details["reason"])
    assert parts.pokes == []


async def test_a_slot_before_the_schedule_existed_is_not_a_missed_fire(parts: _Parts) -> None:
    """A schedule added at 02:05 for 02:00 daily has missed nothing at 02:30."""
    parts.clock.advance(minutes=5)
    await parts.store.add(Schedule("daily", "0 2 * * *", "heartbeat"))
    parts.clock.advance(minutes=25)

    runner = parts.runner()
    assert await runner.start() == 0
    await runner.stop()
    assert parts.records("schedule", "missed") == []


async def test_one_slot_enqueued_twice_is_one_wake(parts: _Parts) -> None:
    """A slot fired again (a lost last-fire mark, as after a crash) is a duplicate, not a run."""
    await parts.store.add(Schedule("tick", "*/10 * * * *", "heartbeat"))
    parts.clock.advance(minutes=15)
    runner = parts.runner()

    assert await runner.fire_due("tick") is True
    assert await runner.fire_due("tick") is False  # nothing new is due
    async with parts.db.transaction():
        await parts.db.execute("UPDATE schedules SET last_fire_us = NULL")
    assert await runner.fire_due("tick") is False

    assert [wake.key for wake in await parts.wakes()] == ["2026-09-24T02:10:00+00:00"]
    schedule = await parts.store.get("tick")
    assert schedule is not None and schedule.last_fire_us == to_us(T0 + timedelta(minutes=10))


async def test_timers_follow_the_table(parts: _Parts) -> None:
    """Each schedule gets an APScheduler timer at its next slot; a sync adds and drops timers."""
    await parts.store.add(Schedule("nightly", "0 3 * * *", "heartbeat"))
    runner = parts.runner()
    await runner.start()
    try:
        [nightly] = runner.next_fires().values()
        assert nightly is not None and (nightly.hour, nightly.minute) == (3, 0)
        assert nightly > datetime.now(UTC)

        await parts.store.add(Schedule("hourly", "15 * * * *", "heartbeat"))
        await parts.store.remove("nightly")
        await runner.sync()

        [(name, hourly)] = runner.next_fires().items()
        assert name == "hourly" and hourly is not None and hourly.minute == 15
    finally:
        await runner.stop()
    assert await runner.fire_due("hourly") is False  # a stopped runner fires nothing


async def test_a_schedule_added_to_an_empty_table_gets_its_timer_from_the_periodic_sync(
    parts: _Parts,
) -> None:
    """A runner started with no schedule has no timer; one added later (``bothy schedule add``
    from another shell) gets its timer at the next periodic sync, which ends at the stop."""
    runner = parts.runner()
    assert await runner.start() == 0
    assert runner.next_fires() == {}
    stop = asyncio.Event()
    syncing = asyncio.create_task(runner.keep_synced(stop, every_s=0.01))
    try:
        await parts.store.add(Schedule("nightly", "0 3 * * *", "heartbeat"))
        await until(lambda: "nightly" in runner.next_fires(), "the sync gave nightly a timer",
                    timeout_s=10)
        nightly = runner.next_fires()["nightly"]
        assert nightly is not None and (nightly.hour, nightly.minute) == (3, 0)
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await syncing
        await runner.stop()


async def test_a_sync_that_cannot_read_the_table_is_logged_and_the_syncing_goes_on(
    parts: _Parts, caplog: pytest.LogCaptureFixture,
) -> None:
    """A row the sync cannot read (edited by hand) fails that sync only: it is logged, the
    periodic sync keeps running inside serve, and once the row is fixed the next one
    gives the table's schedules their timers."""
    runner = parts.runner()
    assert await runner.start() == 0
    await parts.store.add(Schedule("nightly", "0 3 * * *", "heartbeat"))
    async with parts.db.transaction():
        await parts.db.execute(
            "UPDATE schedules SET verify_argv = 'not json' WHERE name = 'nightly'")
    stop = asyncio.Event()
    syncing = asyncio.create_task(runner.keep_synced(stop, every_s=0.01))
    try:
        await until(lambda: "cannot sync the timers" in caplog.text, "the failed sync logged",
                    timeout_s=10)
        assert not syncing.done()
        async with parts.db.transaction():
            await parts.db.execute("UPDATE schedules SET verify_argv = NULL")
        await until(lambda: "nightly" in runner.next_fires(), "the next sync gave its timer",
                    timeout_s=10)
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await syncing
        await runner.stop()


# --- the inbox carries scheduled wakes ----------------------------------------------------------


def _delivery(source: str) -> Delivery:
    return Delivery(route="nightly", key="2026-09-24T03:00:00+00:00", event="schedule",
                    action="heartbeat", headers={}, body=b"{}", received_at=T0, source=source)


async def test_a_schedule_and_a_webhook_route_of_one_name_are_two_wakes(parts: _Parts) -> None:
    """A wake's source is part of its identity: one route and key from two sources, two wakes."""
    hooked = await parts.inbox.accept(_delivery("webhook"))
    fired = await parts.inbox.accept(_delivery("schedule"))

    assert isinstance(hooked, Accepted) and isinstance(fired, Accepted)
    rows = await parts.wakes()
    assert [row.source for row in rows] == ["webhook", "schedule"]
    assert rows[0].payload_at != rows[1].payload_at  # two lines, one each
    assert [(await parts.inbox.load(row)).source for row in rows] == ["webhook", "schedule"]
    assert await parts.inbox.accept(_delivery("schedule")) == Duplicate(fired.wake_id)


def test_a_payload_file_from_before_sources_reads_as_a_webhook() -> None:
    """A payload written without a source (before schedules) is read back as a webhook's."""
    document = json.loads(encode_payload_file(_delivery("schedule")))
    del document["source"]

    assert decode_payload_file(json.dumps(document).encode()).source == "webhook"


# --- what a fire asks for ---------------------------------------------------------------------


def _config(root: Path, **extra: Any) -> Config:
    raw = {"site": "t", "workspace": str(root),
           "budget": {"per_run_usd": "0.50", "per_day_usd": "5.00"}, **extra}
    return parse_config(raw, path=root / "config.json")


async def test_a_heartbeat_carries_the_checklist_and_the_no_reply_instruction(
    tmp_path: Path,
) -> None:
    """A heartbeat's run: the checklist, the NO_REPLY instruction, trusted, nobody to ask."""
    home = BothyHome(tmp_path)
    home.checklist_path.write_text("- disk usage under 90%\n- backups are fresh\n")
    beat = Schedule("hb", "*/30 * * * *", "heartbeat", verify_regex="^NO_REPLY$")

    request = await schedule_request(beat, _config(tmp_path), home, run_id="run_x",
                                     details={"delivery": "k"})

    assert isinstance(request, RunRequest)
    assert "- disk usage under 90%\n- backups are fresh" in request.prompt
    assert request.prompt.endswith(f"\n\n{HEARTBEAT_INSTRUCTION}")
    assert HEARTBEAT_INSTRUCTION == "If nothing needs attention, reply exactly NO_REPLY."
    assert (request.subject, request.source, request.trusted, request.can_hold) == (
        "schedule:hb", "schedule", True, False)
    assert (request.run_id, request.max_usd_micros, request.profile) == ("run_x", 500_000, None)
    assert request.verify == Verification(regex="^NO_REPLY$")
    assert request.wake_details == {"schedule": "hb", "kind": "heartbeat", "delivery": "k"}


async def test_a_procedure_schedule_carries_its_sop_and_cannot_run_once_it_is_gone(
    tmp_path: Path,
) -> None:
    """An SOP schedule's prompt is the procedure's text; with the SOP deleted it is unrunnable."""
    home = BothyHome(tmp_path)
    home.sops_dir.mkdir()
    (home.sops_dir / "backup.md").write_text("# Nightly backup\n1. Run restic.\n")
    job = Schedule("nightly", "0 3 * * *", "sop", sop="backup", max_usd_micros=900_000,
                   verify_argv=["restic", "check"])
    cfg = _config(tmp_path)

    request = await schedule_request(job, cfg, home, run_id="run_x", details={})
    (home.sops_dir / "backup.md").unlink()
    gone = await schedule_request(job, cfg, home, run_id="run_y", details={})

    assert isinstance(request, RunRequest)
    assert request.prompt.endswith("(SOP backup).\n\n# Nightly backup\n1. Run restic.\n")
    assert request.max_usd_micros == 500_000  # never above budget.per_run_usd
    assert request.verify == Verification(argv=["restic", "check"])
    assert gone == Unrunnable(f"its SOP 'backup' no longer exists in {home.sops_dir}")


async def test_a_schedule_whose_profile_left_the_config_cannot_run(tmp_path: Path) -> None:
    """A schedule naming a profile no longer configured is unrunnable, saying which."""
    job = Schedule("p", "0 3 * * *", "prompt", prompt="hello", profile="gone")

    built = await schedule_request(job, _config(tmp_path), BothyHome(tmp_path), run_id="r",
                                   details={})

    assert built == Unrunnable("its profile 'gone' is no longer configured")


# --- the CLI ----------------------------------------------------------------------------------


def _site(root: Path, base_url: str = NOWHERE, **overrides: Any) -> Site:
    return Site(root, base_url, **overrides)


async def _bothy_with_stdin(site: Site, data: bytes, *args: str) -> Completed:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bothy", *args, env=site.env(), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(30):
        stdout, stderr = await process.communicate(data)
    assert process.returncode is not None
    return Completed(process.returncode, stdout.decode(), stderr.decode())


@pytest.mark.codex
async def test_schedule_add_list_rm_through_the_cli(tmp_path: Path) -> None:
    """add prints the next fire in the budget zone; list and status show it; rm removes it."""
    site = _site(tmp_path, budget={"timezone": "Europe/Paris"})
    (site.home / "sops").mkdir()
    (site.home / "sops" / "backup.md").write_text("# Backup\n")

    added = await site.bothy("schedule", "add", "nightly", "--cron", "0 3 * * *",
                             "--sop", "backup", "--verify-cmd", "restic check --read-data",
                             "--max-usd", "0.25")
    beat = await site.bothy("schedule", "add", "hb", "--cron", "*/30 * * * *", "--heartbeat")
    listed = await site.bothy("schedule", "list")
    status = await site.bothy("status")

    assert (added.code, beat.code) == (0, 0), (added.stderr, beat.stderr)
    assert added.stdout.startswith("added nightly: sop:backup at '0 3 * * *' (Europe/Paris),"
                                   " next fire 20")
    assert added.stdout.rstrip().endswith(("T03:00+02:00", "T03:00+01:00")), added.stdout
    hb_line, nightly_line = listed.stdout.splitlines()
    assert hb_line.startswith("hb       */30 * * * *  heartbeat   next 20")
    assert nightly_line.startswith("nightly  0 3 * * *     sop:backup  next 20")
    assert "T03:00+0" in nightly_line
    assert "schedules: 2\n  hb  */30 * * * *  heartbeat  next 20" in status.stdout
    assert "\n  nightly  0 3 * * *  sop:backup  next 20" in status.stdout
    assert "T03:00+0" in status.stdout

    removed = await site.bothy("schedule", "rm", "nightly")
    after = await site.bothy("schedule", "list")
    assert (removed.code, removed.stdout) == (0, "removed nightly\n")
    assert [line.split()[0] for line in after.stdout.splitlines()] == ["hb"]
    events = [(r.kind, r.event, r.subject) for r in audit_records(site)]
    assert events == [("schedule", "added", "schedule:nightly"),
                      ("schedule", "added", "schedule:hb"),
                      ("schedule", "removed", "schedule:nightly")]
    [first] = audit_records(site)[:1]
    assert first.details["verify_argv"] == ["restic", "check", "--read-data"]
    assert first.details["max_usd_micros"] == 250_000


@pytest.mark.parametrize(("args", "message"), [
    (["schedule", "add", "x", "--cron", "0 3 * *", "--heartbeat"],
     "bothy: --cron '0 3 * *' has 4 fields; expected five fields, minute hour day-of-month"),
    (["schedule", "add", "x", "--cron", "0 3 * * 0", "--heartbeat"],
     "bothy: --cron '0 3 * * 0': write the day of week as names (mon-fri, sun), not numbers"),
    (["schedule", "add", "x", "--cron", "0 25 * * *", "--heartbeat"],
     "bothy: --cron '0 25 * * *' is not a valid crontab expression"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--sop", "nope"],
     "bothy: --sop nope: there is no SOP 'nope' in "),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--prompt", "hi", "--heartbeat"],
     "bothy: error: argument --heartbeat: not allowed with argument --prompt"),
    (["schedule", "add", "x", "--cron", "0 3 * * *"],
     "bothy: error: one of the arguments --prompt --sop --heartbeat --dream is required"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--prompt", "  "],
     "bothy: --prompt is empty"),
    (["schedule", "add", "no/way", "--cron", "0 3 * * *", "--heartbeat"],
     "bothy: 'no/way' is not a schedule name"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--verify-regex", "("],
     "bothy: --verify-regex '(' is not a regular expression"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--verify-cmd", "'open"],
     "bothy: --verify-cmd \"'open\" cannot be split like a shell line"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--max-usd", "5"],
     "bothy: --max-usd 5 is more than budget.per_run_usd (0.50)"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--profile", "ops"],
     "bothy: --profile 'ops' is not a configured profile"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--report-to", "slack:C0OPS"],
     "bothy: --report-to 'slack:C0OPS' names slack, but chat.slack is not configured"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--report-to", "#ops"],
     "bothy: --report-to '#ops' is not a report target: expected slack:CHANNEL or"
     " discord:CHANNEL"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--report-to", "slack:ops"],
     "bothy: --report-to 'slack:ops': 'ops' is not a Slack channel id such as C0OPS"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--prompt", "hi", "--preflight-cmd", "true"],
     "bothy: --preflight-cmd goes with --heartbeat"),
    (["schedule", "add", "x", "--cron", "0 3 * * *", "--heartbeat", "--preflight-cmd", " "],
     "bothy: --preflight-cmd is empty: give the check to run first"),
    (["schedule", "rm", "ghost"], "bothy: there is no schedule 'ghost' (see bothy schedule list)"),
    (["schedule", "run", "ghost"], "bothy: there is no schedule 'ghost'"),
    (["sop", "show", "ghost"], "bothy: there is no SOP 'ghost' (see bothy sop list)"),
    (["sop", "set", "../etc", "--file", "/dev/null"], "bothy: '../etc' is not an SOP name"),
    (["sop", "set", "a"], "bothy: give the SOP's text with --file FILE, or '-'"),
    (["sop", "set", "a", "--file", "/nonexistent/sop.md"],
     "bothy: --file /nonexistent/sop.md cannot be read: No such file or directory"),
])
@pytest.mark.codex
async def test_bad_input_exits_64_saying_what_to_do(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """Each bad schedule or SOP command exits 64 with a message naming the fault."""
    site = _site(tmp_path)

    done = await site.bothy(*args)

    assert done.code == 64, (done.stdout, done.stderr)
    assert message in done.stderr, done.stderr
    assert done.stdout == ""


@pytest.mark.codex
async def test_a_name_already_scheduled_is_refused_with_the_way_to_replace_it(
    tmp_path: Path,
) -> None:
    """A second `schedule add` of one name exits 64 and says to remove the first."""
    site = _site(tmp_path)
    assert (await site.bothy("schedule", "add", "hb", "--cron", "0 * * * *",
                             "--heartbeat")).code == 0

    again = await site.bothy("schedule", "add", "hb", "--cron", "5 * * * *", "--heartbeat")

    assert (again.code, again.stderr) == (64, "bothy: there is already a schedule 'hb': remove"
                                          " it first (bothy schedule rm hb) to replace it\n")


@pytest.mark.codex
async def test_sop_set_show_list_through_the_cli(tmp_path: Path) -> None:
    """An SOP set from a file or stdin is kept 0600, shown byte for byte, listed by title."""
    site = _site(tmp_path)
    source = tmp_path / "backup.md"
    source.write_text("# Nightly backup\n\n1. Run `restic backup`.\n")

    from_file = await site.bothy("sop", "set", "backup", "--file", str(source))
    from_stdin = await _bothy_with_stdin(site, b"Check the disks.\n", "sop", "set", "disks", "-")
    shown = await site.bothy("sop", "show", "backup")
    listed = await site.bothy("sop", "list")

    assert (from_file.code, from_file.stdout) == (0, "saved SOP backup (42 bytes)\n")
    assert (from_stdin.code, from_stdin.stdout) == (0, "saved SOP disks (17 bytes)\n")
    assert shown.stdout == source.read_text()
    assert listed.stdout == ("backup  42 bytes  Nightly backup\n"
                             "disks  17 bytes  Check the disks.\n")
    sops = site.home / "sops"
    assert sorted(p.name for p in sops.iterdir()) == ["backup.md", "disks.md"]  # no temp left
    assert stat.S_IMODE((sops / "backup.md").stat().st_mode) == 0o600
    assert stat.S_IMODE(sops.stat().st_mode) == 0o700
    saved = [r for r in audit_records(site) if (r.kind, r.event) == ("sop", "saved")]
    assert [(r.subject, r.details["bytes"]) for r in saved] == [("sop:backup", 42),
                                                              ("sop:disks", 17)]


@pytest.mark.codex
async def test_an_sop_over_the_size_cap_is_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    """An SOP over 64 KiB exits 64 naming its size and the limit; the old text stays."""
    site = _site(tmp_path)
    await _bothy_with_stdin(site, b"v1\n", "sop", "set", "big", "-")

    done = await _bothy_with_stdin(site, b"x" * 70_000, "sop", "set", "big", "-")

    assert done.code == 64
    assert done.stderr == ("bothy: SOP 'big' is 70,000 bytes; the limit is 65,536 (it is read"
                           " whole into every prompt that carries it): shorten it, or split it"
                           " into several SOPs\n")
    assert (site.home / "sops" / "big.md").read_text() == "v1\n"


# --- schedule run: through the supervisor, in the foreground ----------------------------------


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


def _prompts(request: dict[str, Any]) -> list[str]:
    """The user texts of one model request."""
    return [part.get("text", "") for item in request["input"] if item.get("role") == "user"
            for part in item.get("content", []) if isinstance(part, dict)]


@pytest.mark.codex
async def test_a_heartbeat_answering_no_reply_prints_nothing_after_usd(
    server: ModelServer, tmp_path: Path
) -> None:
    """`schedule run` of a heartbeat answered NO_REPLY prints the run line with no answer."""
    site = _site(tmp_path, server.base_url)
    (site.home / "checklist.md").write_text("- the nightly backup finished\n")
    await site.bothy("schedule", "add", "hb", "--cron", "*/30 * * * *", "--heartbeat")
    server.script(text("NO_REPLY"))

    done = await site.bothy("schedule", "run", "hb")

    assert done.code == 0, done.stderr
    outcome, run_id, usd, unit, *rest = done.stdout.split(" ")
    assert (outcome, unit, rest) == ("completed", "usd\n", [])
    assert done.stdout == f"completed {run_id} {usd} usd\n"
    [sent] = [t for t in _prompts(server.requests[0]) if "Scheduled heartbeat" in t]
    assert "- the nightly backup finished" in sent
    assert sent.endswith("If nothing needs attention, reply exactly NO_REPLY.")
    received = [r for r in audit_records(site) if (r.kind, r.event) == ("wake", "received")]
    assert [(r.subject, r.run_id, r.details["source"], r.details["trusted"])
            for r in received] == [("schedule:hb", None, "schedule", True)]
    assert runs_of_wakes(site) == {received[0].details["wake_id"]: run_id}


@pytest.mark.codex
async def test_a_procedure_run_now_is_verified_by_its_regex(
    server: ModelServer, tmp_path: Path
) -> None:
    """`schedule run` of an SOP job sends the procedure, and its --verify-regex verifies it."""
    site = _site(tmp_path, server.base_url)
    await _bothy_with_stdin(site, b"Step 1: say DONE when done.\n", "sop", "set", "say", "-")
    await site.bothy("schedule", "add", "say", "--cron", "0 3 * * *", "--sop", "say",
                     "--verify-regex", "^DONE$")
    server.script(text("DONE"))

    done = await site.bothy("schedule", "run", "say")

    assert done.code == 0, done.stderr
    outcome, run_id, _usd, rest = done.stdout.split(" ", 3)
    assert (outcome, rest) == ("verified", "usd DONE\n")
    assert any("Step 1: say DONE when done." in t for t in _prompts(server.requests[0]))
    events = [(r.kind, r.event, r.outcome) for r in audit_records(site) if r.run_id == run_id]
    assert ("run", "verified", "ok") in events and events[-1] == ("run", "finished", "verified")


async def _spend_the_day(site: Site) -> None:
    """Spend the whole day's ceiling through the engine itself: admit, fill, settle."""
    home = BothyHome(site.home)
    cfg = load_config(home.config_path)
    micros = 25_000_000
    async with Runtime.open(home, cfg) as rt:
        gate = rt.supervisor().budget
        ticket = Ticket("run_seed_earlier_today", "seed", "test", micros, os.getpid(),
                        process_start_time(os.getpid()), "fake-model")
        assert isinstance(await gate.admit(ticket), Admitted)
        await gate.fill(ticket.run_id, micros, tokens=1)
        await gate.settle(ticket.run_id, outcome="completed", reason=None, final_text="")


@pytest.mark.codex
async def test_a_heartbeat_at_the_budget_ceiling_is_refused_and_audited(tmp_path: Path) -> None:
    """With the day's 25.00 spent, a heartbeat run now is refused at the budget gate (exit 3)."""
    site = _site(tmp_path)
    await site.bothy("schedule", "add", "hb", "--cron", "*/30 * * * *", "--heartbeat")
    await _spend_the_day(site)

    done = await site.bothy("schedule", "run", "hb")

    assert done.code == 3
    outcome, run_id, rest = done.stdout.split(" ", 2)
    assert (outcome, rest) == ("refused", "0.0000 usd refused at gate 'budget': would reach"
                               " 25.50 usd against a 25.00 ceiling (25.00 used, 0.00 already"
                               " reserved, 0.50 requested)\n")
    lines = [r.human_line().split(" ", 2)[2] for r in audit_records(site, of_run(run_id))]
    assert lines == ["wake received ok schedule:hb -",
                     f"run refused refused schedule:hb {run_id}"]


# --- bothy serve ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve_site(root: Path, base_url: str, **wakes: Any) -> Site:
    return _site(root, base_url, listen={"tailnet_port": _free_port()},
                 wakes={"shutdown_grace_s": 5.0, **wakes})


def _backdate(site: Site, name: str, created: datetime) -> None:
    """Make schedule ``name`` older, as if it had been added before bothy serve went down."""
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    try:
        with db:
            db.execute("UPDATE schedules SET created_us = ? WHERE name = ?",
                       (to_us(created), name))
    finally:
        db.close()


def _records(site: Site, kind: str, event: str, outcome: str | None = None) -> list[AuditRecord]:
    return audit_records(site, lambda r: (r.kind, r.event) == (kind, event)
                         and (outcome is None or r.outcome == outcome))


async def _serve_until(shell: Shell, kind: str, event: str, outcome: str) -> AuditRecord:
    """Start `bothy serve`, wait for one `kind event outcome` record, SIGTERM; serve exits 0."""
    site = shell.site
    serve = await shell.start("serve")
    await until(lambda: bool(_records(site, kind, event, outcome)) or not serve.running,
                f"a `{kind} {event} {outcome}` record from bothy serve")
    serve.signal(signal.SIGTERM)
    done = await serve.finish()
    assert done.code == 0, done.stderr
    [found] = _records(site, kind, event, outcome)
    return found


def _slot_half_an_hour_ago() -> tuple[str, datetime]:
    """A cron firing at this minute of every hour, and its latest slot (about 30 min ago).

    Its next slot is half an hour away, so no timer fires while the test runs: the only fire
    is the catch-up at start — deterministic, and no waiting for a minute to turn.
    """
    now = datetime.now(UTC)
    slot = (now - timedelta(minutes=30)).replace(second=0, microsecond=0)
    return f"{slot.minute} * * * *", slot


@pytest.mark.codex
async def test_a_fire_missed_while_serve_was_down_runs_once_when_it_starts(
    server: ModelServer, tmp_path: Path
) -> None:
    """A schedule added two hours before `bothy serve` starts fires once, for its latest slot,
    and its run is audited from the fire to the finish, trusted, in lane schedule:NAME."""
    site = _serve_site(tmp_path, server.base_url)
    cron, slot = _slot_half_an_hour_ago()
    await site.bothy("schedule", "add", "tick", "--cron", cron, "--prompt",
                     "Say TICKED and nothing else.")
    _backdate(site, "tick", datetime.now(UTC) - timedelta(hours=2))  # two slots missed
    server.script(text("TICKED"))

    async with Shell(site) as shell:
        finished = await _serve_until(shell, "run", "finished", "ok")

    run_id = finished.run_id
    key = slot.isoformat()
    [fired] = _records(site, "schedule", "fired")
    assert (fired.subject, fired.details["fire_time"]) == ("schedule:tick", key)
    [ready] = _records(site, "serve", "ready")
    assert (ready.details["schedules"], ready.details["missed_fires_queued"]) == (1, 1)
    [received] = _records(site, "wake", "received")
    assert (received.subject, received.run_id) == ("schedule:tick", None)
    assert runs_of_wakes(site) == {received.details["wake_id"]: run_id}
    assert {k: received.details[k] for k in ("source", "trusted", "route", "delivery", "action",
                                             "attempt")} == {
        "source": "schedule", "trusted": True, "route": "tick", "delivery": key,
        "action": "prompt", "attempt": 1}
    assert any(t == "Say TICKED and nothing else." for t in _prompts(server.requests[0]))
    lines = [line.split(" ", 2)[2] for line in site.audit_lines() if line.endswith(str(run_id))]
    assert lines[-2:] == [f"run finished ok schedule:tick {run_id}",  # and no chat to tell:
                          f"report undelivered failed schedule:tick {run_id}"]
    assert len(server.requests) == 1
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    try:
        wakes = db.execute("SELECT source, route, key, status, run_id FROM wakes").fetchall()
        last = db.execute("SELECT last_fire_us FROM schedules").fetchone()[0]
    finally:
        db.close()
    assert wakes == [("schedule", "tick", key, "done", run_id)]
    assert from_us(last) == slot


@pytest.mark.codex
async def test_a_heartbeat_refused_at_the_ceiling_in_serve_is_abandoned_with_an_alert(
    tmp_path: Path,
) -> None:
    """In `bothy serve`, a heartbeat fired at the ceiling is refused, audited and (with one try
    allowed) abandoned with an alert record — never retried forever."""
    site = _serve_site(tmp_path, NOWHERE, max_attempts=1)
    cron, _ = _slot_half_an_hour_ago()
    await site.bothy("schedule", "add", "hb", "--cron", cron, "--heartbeat")
    _backdate(site, "hb", datetime.now(UTC) - timedelta(hours=2))
    await _spend_the_day(site)

    async with Shell(site) as shell:
        alert = await _serve_until(shell, "alert", "undelivered", "failed")

    [refused] = _records(site, "run", "refused")
    assert (refused.subject, refused.details["gate"]) == ("schedule:hb", "budget")
    [abandoned] = _records(site, "wake", "abandoned", "failed")
    assert abandoned.subject == alert.subject == "schedule:hb"
    assert str(abandoned.details["reason"]).startswith(
        "abandoned after 1 attempts: refused at gate 'budget'")
    assert _records(site, "run", "started") == []
