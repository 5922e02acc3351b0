"""Pollers (SPEC §5, "Polling"): real HTTP against a loopback feed, real commands in their groups.

What is checked is what the dispatcher will find (the queued wakes and their bodies), what the
source saw (conditional requests, 304s, the token sent) and what the operator reads (the
audit records: failures, the one alert per streak, the recovery).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from bothy.config import PollerConfig, parse_config
from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.state import StateDB
from bothy.errors import ConfigError
from bothy.wakes.delivery import Delivery
from bothy.wakes.inbox import Inbox, WakeRow
from bothy.wakes.poller import Poller, PollReport
from tests.fakes.feed import FeedServer

TOKEN = "Bearer feed-token-5f1c9a"  # a test secret that must never be audited
ENVIRON = {"FEED_TOKEN": TOKEN, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
           "LANG": "C.UTF-8", "AWS_SECRET_ACCESS_KEY": "must-not-reach-a-command"}
ITEMS = {"items": "", "id": "id"}
JOB = {"prompt": "Triage this item", "subject": "feed:{id}"}


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 9, 24, 10, 0, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class _World:
    """A state database, an audit log, an inbox and a loopback feed, shared by pollers."""

    tmp_path: Path
    db: StateDB
    audit: AuditLog
    inbox: Inbox
    http: httpx.AsyncClient
    feed: FeedServer
    clock: _Clock = field(default_factory=_Clock)
    pokes: list[None] = field(default_factory=list)

    def poller(self, name: str = "feed", *, db: StateDB | None = None,
               inbox: Inbox | None = None, **settings: Any) -> Poller:
        raw: dict[str, Any] = {"url": self.feed.url, "interval_s": 10, "new": ITEMS,
                               "job": JOB, **settings}
        if "command" in settings:
            del raw["url"]
        return Poller(name, PollerConfig.model_validate(raw), inbox=inbox or self.inbox,
                      db=db or self.db, audit=self.audit, clock=self.clock, http=self.http,
                      environ=ENVIRON, cwd=self.tmp_path,
                      on_accepted=lambda: self.pokes.append(None))

    async def wakes(self) -> list[WakeRow]:
        rows = await self.db.fetch_all("SELECT * FROM wakes ORDER BY id")
        return [WakeRow.from_row(row) for row in rows]

    async def deliveries(self) -> list[Delivery]:
        return [await self.inbox.load(wake) for wake in await self.wakes()]

    def records(self, kind: str, event: str) -> list[AuditRecord]:
        return [r for r in self.audit.records() if (r.kind, r.event) == (kind, event)]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[_World]:
    clock = _Clock()
    async with StateDB.open(tmp_path / "bothy.sqlite3") as db, FeedServer() as feed, \
            httpx.AsyncClient() as http:
        audit = AuditLog(tmp_path / "audit.jsonl", clock=clock)
        inbox = Inbox(tmp_path / "inbox", db, clock=clock, audit=audit)
        yield _World(tmp_path, db, audit, inbox, http, feed, clock)


def _is_live(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (this container's PID 1 does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --- items mode ---------------------------------------------------------------------------


async def test_items_mode_queues_one_wake_per_new_id(world: _World) -> None:
    """Each item of the list is one durable poll wake, its body the item, its key the id."""
    world.feed.items = [{"id": 101, "title": "disk 91% full"}, {"id": "b-7", "title": "cert"}]

    report = await world.poller().poll_once()

    assert report == PollReport("feed", 10.0, new=2)
    wakes = await world.wakes()
    assert [(w.source, w.route, w.key, w.event, w.action, w.status) for w in wakes] == [
        ("poll", "feed", "101", "poll", None, "queued"),
        ("poll", "feed", "b-7", "poll", None, "queued"),
    ]
    bodies = [json.loads(d.body) for d in await world.deliveries()]
    assert bodies == world.feed.items
    assert len(world.pokes) == 2


async def test_a_repeated_poll_is_conditional_and_wakes_nothing(world: _World) -> None:
    """The second poll sends If-None-Match; the 304 it gets queues nothing."""
    world.feed.items = [{"id": 1}, {"id": 2}]
    poller = world.poller()
    await poller.poll_once()

    report = await poller.poll_once()

    assert report.not_modified and report.new == 0 and report.ok
    assert world.feed.requests[1].headers["if-none-match"] == world.feed.etag()
    assert world.feed.requests[1].headers["if-modified-since"] == "Wed, 23 Sep 2026 10:00:00 GMT"
    assert world.feed.not_modified == 1
    assert len(await world.wakes()) == 2


async def test_an_unchanged_list_without_an_etag_wakes_nothing(world: _World) -> None:
    """A source that ignores conditional requests and sends the same list again wakes nothing."""
    world.feed.etags = False
    world.feed.items = [{"id": 1}, {"id": 2}]
    poller = world.poller()
    await poller.poll_once()

    report = await poller.poll_once()

    assert report.not_modified and report.new == 0
    assert world.feed.not_modified == 0
    assert len(await world.wakes()) == 2


async def test_an_item_appended_later_wakes_exactly_one_more(world: _World) -> None:
    """A changed list wakes only the ids the last list did not have."""
    world.feed.items = [{"id": 1, "state": "open"}, {"id": 2, "state": "open"}]
    poller = world.poller()
    await poller.poll_once()
    world.feed.items = [{"id": 1, "state": "closed"}, {"id": 2, "state": "open"}]
    world.feed.append({"id": 3, "state": "open"})

    report = await poller.poll_once()

    assert report.new == 1 and not report.not_modified
    assert [w.key for w in await world.wakes()] == ["1", "2", "3"]
    assert json.loads((await world.deliveries())[-1].body) == {"id": 3, "state": "open"}


async def test_the_items_path_finds_a_list_inside_the_body(world: _World) -> None:
    """items "data.alerts" reads the list there; items without a usable id are skipped."""
    world.feed.items = {"data": {"alerts": [{"ref": {"n": 5}}, {"ref": {"n": True}}, "x"]}}

    report = await world.poller(new={"items": "data.alerts", "id": "ref.n"}).poll_once()

    assert report.new == 1 and report.skipped_items == 2
    assert [w.key for w in await world.wakes()] == ["5"]


async def test_the_cursor_survives_a_restart(world: _World) -> None:
    """A new Poller on a new connection resumes from the stored ETag: a 304, then one new id."""
    world.feed.items = [{"id": 1}, {"id": 2}]
    await world.poller().poll_once()

    async with StateDB.open(world.tmp_path / "bothy.sqlite3") as db:
        restarted = world.poller(db=db, inbox=Inbox(world.inbox.root, db, clock=world.clock,
                                                     audit=world.audit))
        first = await restarted.poll_once()
        world.feed.append({"id": 3})
        second = await restarted.poll_once()

    assert first.not_modified and first.new == 0
    assert world.feed.requests[1].conditional
    assert second.new == 1
    assert [w.key for w in await world.wakes()] == ["1", "2", "3"]


async def test_a_lost_cursor_never_wakes_a_seen_item_twice(world: _World) -> None:
    """With the cursor gone (a crash before it was saved) the inbox's dedupe still holds."""
    world.feed.items = [{"id": 1}, {"id": 2}]
    await world.poller().poll_once()
    await world.db.atomic("DELETE FROM pollers")

    report = await world.poller().poll_once()

    assert not world.feed.requests[1].conditional
    assert report.new == 0 and report.ok
    assert len(await world.wakes()) == 2


async def test_pollers_with_the_same_ids_wake_separately(world: _World) -> None:
    """The poller's name is the wake's route: two pollers seeing id 1 are two wakes."""
    world.feed.items = [{"id": 1}]

    await world.poller("alpha").poll_once()
    await world.poller("beta").poll_once()

    assert [(w.route, w.key) for w in await world.wakes()] == [("alpha", "1"), ("beta", "1")]


# --- "changed" mode -----------------------------------------------------------------------


async def test_changed_mode_wakes_each_time_the_body_changes(world: _World) -> None:
    """The whole body is the payload; the same body again wakes nothing, a change (even back)
    wakes one run."""
    world.feed.etags = False
    world.feed.raw_body = b"status: ok\n"
    poller = world.poller(new="changed")

    reports = [await poller.poll_once()]
    reports.append(await poller.poll_once())
    world.feed.raw_body = b"status: degraded\n"
    reports.append(await poller.poll_once())
    world.feed.raw_body = b"status: ok\n"
    reports.append(await poller.poll_once())

    assert [r.new for r in reports] == [1, 0, 1, 1]
    assert [d.body for d in await world.deliveries()] == [
        b"status: ok\n", b"status: degraded\n", b"status: ok\n"]


# --- failures -----------------------------------------------------------------------------


async def test_failures_back_off_are_counted_and_audited(world: _World) -> None:
    """Each failed poll doubles the wait (interval × 2^n) up to max_backoff_s, and is audited."""
    world.feed.fail_with = 503
    poller = world.poller(interval_s=10, max_backoff_s=100, alert_after_failures=99)

    reports = [await poller.poll_once() for _ in range(5)]

    assert [r.next_delay_s for r in reports] == [20, 40, 80, 100, 100]
    assert [r.consecutive_failures for r in reports] == [1, 2, 3, 4, 5]
    assert {r.failure for r in reports} == {"HTTP 503 Service Unavailable"}
    failed = world.records("poll", "failed")
    assert [(r.outcome, r.subject) for r in failed] == [("failed", "poll:feed")] * 5
    assert [r.details["consecutive_failures"] for r in failed] == [1, 2, 3, 4, 5]
    assert failed[0].details["reason"] == "HTTP 503 Service Unavailable"
    assert await world.wakes() == []


async def test_an_alert_is_raised_once_per_streak_and_recovery_is_recorded(world: _World) -> None:
    """After N failures in a row one alert; a success records the recovery; a new streak alerts
    again."""
    poller = world.poller(alert_after_failures=3)
    world.feed.fail_with = 500
    first_streak = [await poller.poll_once() for _ in range(5)]
    world.feed.fail_with = None
    world.feed.items = [{"id": 1}]
    recovered = await poller.poll_once()
    world.feed.fail_with = 502
    for _ in range(3):
        await poller.poll_once()

    assert first_streak[-1].consecutive_failures == 5
    assert recovered.ok and recovered.consecutive_failures == 0 and recovered.new == 1
    assert recovered.next_delay_s == 10
    alerts = world.records("alert", "undelivered")
    assert [(a.outcome, a.subject) for a in alerts] == [("failed", "poll:feed")] * 2
    assert "3 polls failed in a row" in alerts[0].details["reason"]
    assert "HTTP 502" in alerts[1].details["reason"]
    back = world.records("poll", "recovered")
    assert [(r.outcome, r.details["after_failures"]) for r in back] == [("ok", 5)]


async def test_the_failure_streak_survives_a_restart(world: _World) -> None:
    """Failures are counted in the cursor: a restarted poller alerts at the N-th, not again."""
    world.feed.fail_with = 500
    for _ in range(2):
        await world.poller(alert_after_failures=3).poll_once()

    report = await world.poller(alert_after_failures=3).poll_once()
    await world.poller(alert_after_failures=3).poll_once()

    assert report.consecutive_failures == 3
    assert len(world.records("alert", "undelivered")) == 1


async def test_a_refused_connection_is_a_failure_not_an_exception(world: _World) -> None:
    """Nothing listening: the report says it could not connect."""
    report = await world.poller(url=f"http://127.0.0.1:{_free_port()}/feed").poll_once()

    assert report.failure is not None and report.failure.startswith("cannot connect")
    assert report.consecutive_failures == 1


async def test_a_source_that_does_not_answer_times_out(world: _World) -> None:
    """A hanging source fails the poll after timeout_s."""
    world.feed.hang = True

    report = await world.poller(timeout_s=0.2).poll_once()

    assert report.failure == "no answer within 0.2s"


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[{\"id\": 1}",  # cut short
    b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP at all
])
async def test_a_broken_answer_is_a_failure_not_an_exception(world: _World, answer: bytes) -> None:
    """Whatever httpx raises on a malformed answer becomes the poll's failure reason."""
    async def answer_then_hang_up(reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_then_hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        report = await world.poller(url=f"http://127.0.0.1:{port}/feed").poll_once()

    assert report.failure is not None and "ProtocolError" in report.failure
    assert await world.wakes() == []


async def test_a_body_that_is_not_json_fails_an_items_poll(world: _World) -> None:
    """Items mode needs JSON; HTML is a failure and advances nothing."""
    world.feed.raw_body = b"<html>maintenance</html>"
    poller = world.poller()

    report = await poller.poll_once()
    world.feed.raw_body = None
    world.feed.items = [{"id": 1}]
    fixed = await poller.poll_once()

    assert report.failure is not None and report.failure.startswith("the body is not JSON")
    assert not world.feed.requests[1].conditional  # the broken body's ETag was not kept
    assert fixed.new == 1


@pytest.mark.parametrize(("body", "reason"), [
    pytest.param(b"[" * 100_000, "the body is JSON nested deeper than 100 levels",
                 id="100000-brackets"),
    pytest.param(b"[" * 101 + b"]" * 101, "the body is JSON nested deeper than 100 levels",
                 id="101-levels"),
    pytest.param(b'[{"id": "\\ud800"}]',
                 "the body is JSON with a string that is not Unicode (a lone surrogate)",
                 id="lone-surrogate"),
])
async def test_a_body_no_later_step_can_handle_fails_and_polling_goes_on(
    world: _World, body: bytes, reason: str
) -> None:
    """A poll answer nested too deep, or holding a lone surrogate, is a failure audited with
    its reason, like any malformed answer (never a crash); the next poll works as before."""
    world.feed.raw_body = body
    poller = world.poller()

    report = await poller.poll_once()
    world.feed.raw_body = None
    world.feed.items = [{"id": 1}]
    fixed = await poller.poll_once()

    assert (report.failure, report.consecutive_failures) == (reason, 1)
    [failed] = world.records("poll", "failed")
    assert failed.details["reason"] == reason
    assert (fixed.ok, fixed.new) == (True, 1)
    assert [w.key for w in await world.wakes()] == ["1"]


async def test_an_items_path_that_is_not_a_list_fails(world: _World) -> None:
    """A path to anything but a list is a failure naming the path."""
    world.feed.items = {"data": {"alerts": {"id": 1}}}

    report = await world.poller(new={"items": "data.alerts", "id": "id"}).poll_once()

    assert report.failure == "'data.alerts' is not a JSON list (found an object)"


async def test_a_body_over_the_limit_is_refused(world: _World) -> None:
    """A body larger than max_body_bytes is a failure, not a wake."""
    world.feed.items = [{"id": n, "pad": "x" * 100} for n in range(20)]

    report = await world.poller(max_body_bytes=1024).poll_once()

    assert report.failure == "the body is larger than 1024 bytes"
    assert await world.wakes() == []


# --- secrets --------------------------------------------------------------------------------


async def test_a_header_token_is_sent_but_never_audited(world: _World) -> None:
    """headers_env sends the variable's value; failures name the header, never the value."""
    world.feed.fail_with = 401
    poller = world.poller(headers_env={"Authorization": "FEED_TOKEN"}, alert_after_failures=1)

    report = await poller.poll_once()

    assert world.feed.requests[0].headers["authorization"] == TOKEN
    assert report.failure == "HTTP 401 Unauthorized"
    assert TOKEN not in world.audit.path.read_text()
    assert len(world.records("alert", "undelivered")) == 1


async def test_a_missing_token_variable_is_a_failure_naming_it(world: _World) -> None:
    """An unset variable fails the poll before anything is sent."""
    report = await world.poller(headers_env={"X-Api-Key": "UNSET_TOKEN"}).poll_once()

    assert report.failure == "header X-Api-Key: environment variable UNSET_TOKEN is not set"
    assert world.feed.requests == []


# --- command pollers ------------------------------------------------------------------------


async def test_a_command_poller_reads_its_stdout(world: _World) -> None:
    """stdout is the body: a JSON list printed by a command wakes one run per id."""
    script = """printf '[{"id": "job-1"}, {"id": "job-2"}]'"""

    report = await world.poller(command=["sh", "-c", script]).poll_once()

    assert report.new == 2
    assert [w.key for w in await world.wakes()] == ["job-1", "job-2"]


async def test_a_command_sees_only_path_home_and_lang(world: _World) -> None:
    """The command's environment is scrubbed: no secret of the daemon's reaches it."""
    poller = world.poller(command=["sh", "-c", "env | sort"], new="changed")

    report = await poller.poll_once()

    assert report.new == 1
    [delivery] = await world.deliveries()
    names = {line.split("=", 1)[0] for line in delivery.body.decode().splitlines()}
    assert names - {"PWD", "SHLVL", "_", "OLDPWD"} == {"HOME", "LANG", "PATH"}


async def test_a_failing_command_is_a_failure_with_its_stderr(world: _World) -> None:
    """A non-zero exit fails the poll; the reason carries its code and the tail of stderr."""
    poller = world.poller(command=["sh", "-c", "echo 'gh: not logged in' >&2; exit 4"])

    report = await poller.poll_once()

    assert report.failure == "the command exited with code 4: gh: not logged in"
    assert world.records("poll", "failed")[0].details["reason"] == report.failure


async def test_a_command_that_hangs_is_stopped_with_its_group(world: _World) -> None:
    """A command past timeout_s fails the poll and its whole process group is ended."""
    marker = world.tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {marker}; wait"

    report = await world.poller(command=["sh", "-c", script], timeout_s=0.5).poll_once()

    assert report.failure == "the command did not finish within 0.5s"
    assert not _is_live(int(marker.read_text()))


async def test_a_missing_executable_is_a_failure(world: _World) -> None:
    """A command that cannot start fails the poll and says so."""
    report = await world.poller(command=["/nonexistent/feed-reader"]).poll_once()

    assert report.failure is not None and "Cannot start" in report.failure


# --- the loop -------------------------------------------------------------------------------


async def test_run_polls_every_interval_until_stopped(world: _World) -> None:
    """run() polls, waits interval_s, polls again, and returns once stop is set."""
    world.feed.items = [{"id": 1}]
    stop = asyncio.Event()
    task = asyncio.create_task(world.poller(interval_s=0.05).run(stop))

    await world.feed.wait_for_requests(3)
    stop.set()
    async with asyncio.timeout(10):
        await task

    assert len(await world.wakes()) == 1
    assert all(seen.conditional for seen in world.feed.requests[1:])


# --- configuration ----------------------------------------------------------------------------


BASE = {"site": "acme-mini", "workspace": "/srv/work",
        "budget": {"mode": "api", "per_run_usd": 0.50, "per_day_usd": 25.0}}


def _config_error(poller: dict[str, Any], **extra: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_config({**BASE, "pollers": {"feed": poller}, **extra}, path=Path("config.json"))
    return caught.value


@pytest.mark.parametrize(("poller", "key", "says"), [
    ({"url": "http://127.0.0.1:1/x", "command": ["true"], "job": JOB}, "pollers.feed",
     "exactly one of url"),
    ({"job": JOB}, "pollers.feed", "exactly one of url"),
    ({"url": "file:///etc/passwd", "job": JOB}, "pollers.feed.url", "http:// or https://"),
    ({"command": [], "job": JOB}, "pollers.feed.command", "argv list"),
    ({"url": "http://127.0.0.1:1/x", "new": "appended", "job": JOB}, "pollers.feed.new",
     'expected "changed"'),
    ({"url": "http://127.0.0.1:1/x", "new": {"items": "a b", "id": "id"}, "job": JOB},
     "pollers.feed.new", "not a dotted path"),
    ({"url": "http://127.0.0.1:1/x", "interval_s": 0.01, "job": JOB},
     "pollers.feed.interval_s", "greater than or equal to 0.05"),
    ({"url": "http://127.0.0.1:1/x", "headers_env": {"Authorization": "Bearer abc"},
      "job": JOB}, "pollers.feed.headers_env", "not an environment variable name"),
    ({"command": ["true"], "headers_env": {"X-Key": "KEY"}, "job": JOB}, "pollers.feed",
     "url pollers only"),
    ({"url": "http://127.0.0.1:1/x", "interval_s": 600, "max_backoff_s": 60, "job": JOB},
     "pollers.feed", "max_backoff_s (60.0) is shorter than interval_s (600.0)"),
    ({"url": "http://127.0.0.1:1/x"}, "pollers.feed.job", "required key is missing"),
])
def test_a_bad_poller_is_a_config_error_naming_its_key(
    poller: dict[str, Any], key: str, says: str
) -> None:
    """Each malformed poller stops the command with a message naming the key."""
    error = _config_error(poller)

    assert error.key == key
    assert says in str(error)


def test_a_poller_job_needs_a_defined_profile() -> None:
    """A job profile that is not in profiles is refused, naming the poller's job."""
    error = _config_error({"url": "http://127.0.0.1:1/x",
                           "job": {**JOB, "profile": "triage"}}, profiles={"ops": {}})

    assert error.key == "pollers"
    assert "pollers.feed.job.profile 'triage' is not defined in profiles (defined: ops)" in str(
        error)


def test_a_valid_poller_config_has_its_defaults() -> None:
    """A minimal URL poller: changed mode, 20 s timeout, alert after 3, back-off up to 1 h."""
    cfg = parse_config({**BASE, "pollers": {"feed": {"url": "https://status.example/api",
                                                     "job": JOB}}}, path=Path("config.json"))

    poller = cfg.pollers["feed"]
    assert (poller.new, poller.timeout_s, poller.alert_after_failures, poller.max_backoff_s) == (
        "changed", 20.0, 3, 3600.0)

