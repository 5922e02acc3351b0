"""The inbox (rule 3, "fsync, then acknowledge"): durable wakes on a real disk and a real database.

A crash is simulated by leaving the disk as a crash would leave it: a payload file whose row
was never inserted, a temporary file that never got its name.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bothy.clock import to_us
from bothy.engine.audit import AuditLog
from bothy.engine.state import StateDB
from bothy.errors import InboxError
from bothy.wakes.delivery import Delivery, encode_payload_file, ignored_in, payload_name
from bothy.wakes.history import RunHistory
from bothy.wakes.inbox import Accepted, Duplicate, Inbox, WakeRow

T0 = datetime(2026, 9, 24, 10, 14, 2, 118734, tzinfo=UTC)
DAY_US = 86_400 * 1_000_000


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def _delivery(key: str = "guid-1:hook-1", *, body: bytes = b'{"action":"opened","number":42}',
              event: str = "pull_request", action: str | None = "opened",
              received_at: datetime = T0, route: str = "github") -> Delivery:
    return Delivery(route=route, key=key, event=event, action=action,
                    headers={"x-github-event": event, "user-agent": "GitHub-Hookshot/a1b2"},
                    body=body, received_at=received_at)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[StateDB]:
    async with StateDB.open(tmp_path / "bothy.sqlite3") as opened:
        yield opened


def _audit(tmp_path: Path) -> AuditLog:
    return AuditLog(tmp_path / "audit.jsonl")


@pytest.fixture
def inbox(tmp_path: Path, db: StateDB) -> Inbox:
    return Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))


async def _rows(db: StateDB) -> list[WakeRow]:
    return [WakeRow.from_row(r) for r in await db.fetch_all("SELECT * FROM wakes ORDER BY id")]


def _ignored(tmp_path: Path) -> list[str]:
    """The deliveries the register closes as ignored, one entry per delivery a `wake ignored`
    names (either form), in register order."""
    return [d.key for r in _audit(tmp_path).records() if (r.kind, r.event) == ("wake", "ignored")
            for d in ignored_in(r.details)]


def _names(inbox: Inbox) -> list[str]:
    return sorted(p.name for p in inbox.root.iterdir())


# -- accept ----------------------------------------------------------------------------------


async def test_accepted_delivery_is_a_line_of_a_private_segment_and_a_queued_row(
    inbox: Inbox, db: StateDB
) -> None:
    """accept returns only once its line (in a 0600 segment, in a 0700 dir) and its queued row
    both exist, the row naming where the line is."""
    outcome = await inbox.accept(_delivery())

    assert isinstance(outcome, Accepted)
    [row] = await _rows(db)
    assert (row.id, row.status, row.attempts, row.run_id, row.file, row.payload_at) == (
        outcome.wake_id, "queued", 0, None, "wakes-000001.seg", 0)
    assert row.received_us == row.next_try_us == to_us(T0)
    assert _names(inbox) == [row.file]
    line = (inbox.root / row.file).read_bytes()
    assert line == encode_payload_file(_delivery()) + b"\n" and row.payload_bytes == len(line)
    assert stat.S_IMODE((inbox.root / row.file).stat().st_mode) == 0o600
    assert stat.S_IMODE(inbox.root.stat().st_mode) == 0o700


async def test_second_copy_of_a_delivery_is_a_duplicate_of_the_first(inbox: Inbox,
                                                                     db: StateDB) -> None:
    """The same route and key again is a Duplicate naming the first wake; nothing is added."""
    first = await inbox.accept(_delivery())
    again = await inbox.accept(_delivery())

    assert isinstance(first, Accepted)
    assert again == Duplicate(first.wake_id)
    assert len(await _rows(db)) == 1
    assert len(_names(inbox)) == 1


async def test_same_key_on_another_route_is_another_delivery(inbox: Inbox, db: StateDB) -> None:
    """Dedupe is per route: two routes may use the same delivery id."""
    await inbox.accept(_delivery(route="github"))
    other = await inbox.accept(_delivery(route="deploys"))

    assert isinstance(other, Accepted)
    assert len(await _rows(db)) == 2


async def test_many_simultaneous_deliveries_are_each_accepted_once(inbox: Inbox,
                                                                   db: StateDB) -> None:
    """Fifty deliveries at once (committed in groups) each get their own wake, in one piece."""
    outcomes = await asyncio.gather(*(inbox.accept(_delivery(f"guid-{n}:h")) for n in range(50)))

    assert all(isinstance(o, Accepted) for o in outcomes)
    assert len({o.wake_id for o in outcomes if isinstance(o, Accepted)}) == 50
    rows = await _rows(db)
    assert len(rows) == 50
    assert _names(inbox) == ["wakes-000001.seg"]  # one segment, a line each
    assert len((inbox.root / "wakes-000001.seg").read_bytes().splitlines()) == 50
    assert [await inbox.load(row) for row in rows] == [
        _delivery(f"guid-{n}:h") for n in range(50)]


async def test_inbox_that_cannot_be_a_directory_raises_and_queues_nothing(
    tmp_path: Path, db: StateDB
) -> None:
    """When the payload cannot be made durable accept raises InboxError and no row is written."""
    (tmp_path / "inbox").write_text("a file where the inbox should be\n")
    inbox = Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))

    with pytest.raises(InboxError, match="Cannot make delivery 'guid-1:hook-1'"):
        await inbox.accept(_delivery())

    assert await _rows(db) == []


async def test_file_whose_row_is_missing_is_queued_by_the_senders_retry(inbox: Inbox,
                                                                        db: StateDB) -> None:
    """If the first attempt stopped after the file (answered 503), the retry queues it."""
    await inbox.accept(_delivery())
    await db.execute("DELETE FROM wakes")

    retried = await inbox.accept(_delivery())

    assert isinstance(retried, Accepted)
    assert len(await _rows(db)) == 1


# -- load ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b'{"title": "caf\xc3\xa9 \xe2\x80\x94 \\u0000 \\"quoted\\"",\r\n  "n": 1}\n',
    b"\xff\xfe not UTF-8 \x00\x01\x80",
    b"",
], ids=["utf8-with-escapes", "binary", "empty"])
async def test_load_gives_back_the_body_byte_for_byte(inbox: Inbox, db: StateDB,
                                                      body: bytes) -> None:
    """What the signature covered is what the dispatcher reads, whatever its bytes."""
    sent = _delivery(body=body, action=None)
    await inbox.accept(sent)
    [row] = await _rows(db)

    loaded = await inbox.load(row)

    assert loaded == sent


@pytest.mark.parametrize("value", ["plain", "café ☕ \u2028 line\nbreak", "bytes \udcff kept"],
                         ids=["ascii", "unicode", "undecodable"])
async def test_load_gives_back_each_header_as_received(inbox: Inbox, db: StateDB,
                                                       value: str) -> None:
    """A header's value comes back as the listener read it: non-ASCII text, and the lone
    surrogate aiohttp makes of a byte that is not UTF-8."""
    sent = Delivery(route="github", key="guid-1:hook-1", event="push", action=None,
                    headers={"x-github-event": "push", "x-odd": value}, body=b"{}",
                    received_at=T0)
    await inbox.accept(sent)
    [row] = await _rows(db)

    loaded = await inbox.load(row)

    assert loaded == sent


async def test_load_of_a_damaged_payload_raises_inbox_error(inbox: Inbox, db: StateDB) -> None:
    """A payload file that is not what accept wrote is reported, not half-read."""
    await inbox.accept(_delivery())
    [row] = await _rows(db)
    (inbox.root / row.file).write_bytes(b'{"version": 1, "route": "gith')

    with pytest.raises(InboxError, match="is damaged"):
        await inbox.load(row)


# -- recover ---------------------------------------------------------------------------------


async def test_recover_gives_one_row_to_a_file_left_without_one(inbox: Inbox,
                                                                db: StateDB) -> None:
    """A crash between the file and the row: recover queues it once, and only once."""
    crashed = _delivery("guid-crash:h", received_at=T0 - timedelta(minutes=5))
    inbox.root.mkdir(mode=0o700)
    (inbox.root / payload_name("github", crashed.key)).write_bytes(encode_payload_file(crashed))
    await inbox.accept(_delivery("guid-ok:h"))

    assert len(await inbox.recover()) == 1
    assert len(await inbox.recover()) == 0

    rows = await _rows(db)
    assert sorted(r.key for r in rows) == ["guid-crash:h", "guid-ok:h"]
    due = await inbox.due(to_us(T0))
    assert [w.key for w in due] == ["guid-crash:h", "guid-ok:h"]  # arrival order, not row order
    assert await inbox.load(due[0]) == crashed


async def test_recover_after_a_lost_row_restores_exactly_one(inbox: Inbox, db: StateDB) -> None:
    """Deleting a wake's row (as if the commit never happened) and recovering restores one row."""
    await inbox.accept(_delivery())
    await db.execute("DELETE FROM wakes")

    assert len(await inbox.recover()) == 1

    [row] = await _rows(db)
    assert (row.key, row.status) == ("guid-1:hook-1", "queued")


async def test_recover_skips_temporary_and_damaged_files(inbox: Inbox, db: StateDB) -> None:
    """A temporary file (crash before its name) or an unreadable payload is not queued."""
    inbox.root.mkdir(mode=0o700)
    (inbox.root / ".tmp-0123456789abcdef").write_bytes(encode_payload_file(_delivery("a:h")))
    (inbox.root / payload_name("github", "b:h")).write_bytes(b"garbage")

    assert len(await inbox.recover()) == 0
    assert await _rows(db) == []


async def test_recover_of_an_inbox_that_does_not_exist_yet_finds_nothing(inbox: Inbox) -> None:
    """A fresh home has no inbox directory; recovering it is not an error."""
    assert len(await inbox.recover()) == 0


async def test_recover_closes_a_file_the_register_shows_already_ran(
    inbox: Inbox, db: StateDB
) -> None:
    """After a state database restored from an older copy, a delivery the register shows ran
    gets its row back closed, with that run, and is not queued to run again."""
    await inbox.accept(_delivery("guid-ran:h"))
    await inbox.accept(_delivery("guid-new:h"))
    await db.execute("DELETE FROM wakes")  # the restored copy predates both rows
    ran = {("github", "guid-ran:h"): "run_20260924T101402Z_0000abcd"}

    reinserted = await inbox.recover(lambda route, key: ran.get((route, key)))

    assert sorted((r.key, r.ran_as) for r in reinserted) == [
        ("guid-new:h", None), ("guid-ran:h", "run_20260924T101402Z_0000abcd")]
    assert [w.key for w in await inbox.due(to_us(T0) + 1)] == ["guid-new:h"]
    closed = {r.key: r for r in await _rows(db)}["guid-ran:h"]
    assert (closed.status, closed.run_id) == ("done", "run_20260924T101402Z_0000abcd")


# -- the dispatcher's side -------------------------------------------------------------------


async def test_due_lists_queued_wakes_whose_time_has_come_in_arrival_order(
    inbox: Inbox, db: StateDB
) -> None:
    """due is the queued wakes with next_try_us <= now, oldest delivery first, up to limit."""
    for n in range(3):
        await inbox.accept(_delivery(f"k{n}:h", received_at=T0 + timedelta(seconds=n)))
    _, second, _ = await inbox.due(to_us(T0) + 10_000_000)
    assert await inbox.claim(second.id)
    await inbox.retry_later(second.id, next_try_us=to_us(T0) + 60_000_000, note="refused")

    assert [w.key for w in await inbox.due(to_us(T0) + 10_000_000)] == ["k0:h", "k2:h"]
    assert [w.key for w in await inbox.due(to_us(T0) + 60_000_000)] == ["k0:h", "k1:h", "k2:h"]
    assert [w.key for w in await inbox.due(to_us(T0) + 60_000_000, limit=1)] == ["k0:h"]
    assert await inbox.due(to_us(T0) - 1) == []


async def test_claim_is_exclusive_across_connections(tmp_path: Path, inbox: Inbox) -> None:
    """Two daemons (two connections) claiming one wake: exactly one gets it."""
    outcome = await inbox.accept(_delivery())
    assert isinstance(outcome, Accepted)
    async with StateDB.open(tmp_path / "bothy.sqlite3") as other_db:
        other = Inbox(inbox.root, other_db, clock=_Clock(), audit=_audit(tmp_path))

        claims = await asyncio.gather(inbox.claim(outcome.wake_id), other.claim(outcome.wake_id),
                                      inbox.claim(outcome.wake_id))

    assert sorted(claims) == [False, False, True]
    [running] = await inbox.in_flight()
    assert (running.id, running.status) == (outcome.wake_id, "running")


async def test_retry_later_counts_attempts_and_forgets_the_spent_run(inbox: Inbox) -> None:
    """Each retry puts the wake back in the queue, adds one attempt and clears its run id."""
    outcome = await inbox.accept(_delivery())
    assert isinstance(outcome, Accepted)
    wake_id = outcome.wake_id

    counts = []
    for n in range(3):
        assert await inbox.claim(wake_id, f"run_20260924T101402Z_0000000{n}")
        [running] = await inbox.in_flight()
        assert running.run_id == f"run_20260924T101402Z_0000000{n}"
        counts.append(await inbox.retry_later(wake_id, next_try_us=n, note=f"attempt {n + 1}"))

    assert counts == [1, 2, 3]
    [wake] = await inbox.due(to_us(T0))
    assert (wake.status, wake.attempts, wake.run_id, wake.note) == ("queued", 3, None, "attempt 3")
    with pytest.raises(InboxError, match="not running"):
        await inbox.retry_later(wake_id, next_try_us=0, note="again")


async def test_finish_closes_a_wake_once(inbox: Inbox, db: StateDB) -> None:
    """A wake finishes once, as done, ignored or abandoned; a second finish is an error."""
    outcome = await inbox.accept(_delivery())
    assert isinstance(outcome, Accepted)
    assert await inbox.claim(outcome.wake_id, "run_20260924T101402Z_8d41e7b2")

    await inbox.finish(outcome.wake_id, "done", run_id=None, note="completed")

    [row] = await _rows(db)
    assert (row.status, row.run_id, row.note, row.finished_us) == (
        "done", "run_20260924T101402Z_8d41e7b2", "completed", to_us(T0))
    assert await inbox.in_flight() == []
    assert not await inbox.claim(outcome.wake_id)
    with pytest.raises(InboxError, match="not queued or running"):
        await inbox.finish(outcome.wake_id, "abandoned", run_id=None, note="again")
    with pytest.raises(ValueError, match="not 'completed'"):
        await inbox.finish(outcome.wake_id, "completed", run_id=None, note=None)


async def test_a_wake_closed_without_a_run_forgets_the_run_id_its_claim_named(
    inbox: Inbox, db: StateDB
) -> None:
    """A wake its handler ignored names no run: the id minted at its claim was never used."""
    outcome = await inbox.accept(_delivery())
    assert isinstance(outcome, Accepted)
    assert await inbox.claim(outcome.wake_id, "run_20260924T101402Z_8d41e7b2")

    await inbox.finish(outcome.wake_id, "ignored", run_id=None, note="no job", ran=False)

    [row] = await _rows(db)
    assert (row.status, row.run_id, row.note) == ("ignored", None, "no job")


# -- prune -----------------------------------------------------------------------------------


async def test_prune_forgets_a_segment_once_every_wake_in_it_is_old_and_finished(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """A segment goes with its rows once all its wakes are old and finished; one holding a
    queued wake stays, and so does the one being appended to; an older Bothy's own payload
    files and temporary files go as before."""
    old = T0 - timedelta(days=8)
    first, second = (Inbox(inbox.root, db, clock=_Clock(), audit=_audit(tmp_path))
                     for _ in range(2))  # earlier processes: a segment each
    for n in range(2):
        await first.accept(_delivery(f"old-done-{n}:h", received_at=old))
    await second.accept(_delivery("old-queued:h", received_at=old))
    await second.accept(_delivery("new-done:h"))
    await inbox.accept(_delivery("current-done:h", received_at=old))
    legacy = _delivery("legacy-done:h", received_at=old)
    (inbox.root / payload_name("github", legacy.key)).write_bytes(encode_payload_file(legacy))
    await db.execute(
        "INSERT INTO wakes (source, route, key, event, status, next_try_us, received_us, file)"
        " VALUES ('webhook', 'github', 'legacy-done:h', 'pull_request', 'queued', 0, ?, ?)",
        (to_us(old), payload_name("github", legacy.key)))
    rows = {r.key: r for r in await _rows(db)}
    for key in ("old-done-0:h", "old-done-1:h", "current-done:h", "legacy-done:h"):
        await first.finish(rows[key].id, "done", run_id=None, note=None)
    await db.execute("UPDATE wakes SET finished_us = ? WHERE finished_us IS NOT NULL",
                     (to_us(old),))  # they finished eight days ago
    await inbox.finish(rows["new-done:h"].id, "done", run_id=None, note=None)
    stale_temp = inbox.root / ".tmp-stale"
    stale_temp.write_bytes(b"half")
    os.utime(stale_temp, (old.timestamp(), old.timestamp()))

    pruned = await inbox.prune(to_us(T0) - 7 * DAY_US)

    assert pruned == 3
    assert sorted(r.key for r in await _rows(db)) == [
        "current-done:h", "new-done:h", "old-queued:h"]
    assert _names(inbox) == ["wakes-000002.seg", "wakes-000003.seg"]
    again = await inbox.accept(_delivery("old-done-0:h"))
    assert isinstance(again, Accepted)  # forgotten: a redelivery now would be new
    [pruned_record] = [r for r in _audit(tmp_path).records() if r.event == "pruned"]
    assert (pruned_record.kind, pruned_record.details["wakes"],
            pruned_record.details["segments"]) == ("wake", 3, ["wakes-000001.seg"])


async def test_a_wake_received_long_ago_but_finished_lately_is_kept_its_full_retention(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """The retention counts from when a wake finished, as `wakes.keep_deliveries_days` says:
    one received ten days ago that finished yesterday stays."""
    first = Inbox(inbox.root, db, clock=_Clock(), audit=_audit(tmp_path))
    late = await first.accept(_delivery("late:h", received_at=T0 - timedelta(days=10)))
    assert isinstance(late, Accepted) and await first.claim(late.wake_id)
    await first.finish(late.wake_id, "done", run_id=None, note=None)  # at T0
    await inbox.accept(_delivery("newer:h"))  # a later segment: the first is not the highest

    assert await inbox.prune(to_us(T0) - 7 * DAY_US) == 0
    assert await inbox.prune(to_us(T0 + timedelta(days=8)) - 7 * DAY_US) == 1
    assert [r.key for r in await _rows(db)] == ["newer:h"]


async def test_a_segment_number_is_never_used_twice_after_a_prune(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """The highest-numbered segment stays, even when all of it is old and finished and no
    process writes to it, so that the next one gets a new number (a state database restored
    from an older copy must never find its rows' segment holding other lines)."""
    clock = _Clock()
    for n in range(2):  # two earlier processes, a segment each, all finished long ago
        earlier = Inbox(inbox.root, db, clock=clock, audit=_audit(tmp_path))
        done = await earlier.accept(_delivery(f"old-{n}:h", received_at=T0))
        assert isinstance(done, Accepted) and await earlier.claim(done.wake_id)
        await earlier.finish(done.wake_id, "done", run_id=None, note=None)

    assert await inbox.prune(to_us(T0 + timedelta(days=8)) - 7 * DAY_US) == 1
    assert _names(inbox) == ["wakes-000002.seg"]
    await inbox.accept(_delivery("new:h", received_at=T0 + timedelta(days=8)))
    assert _names(inbox) == ["wakes-000002.seg", "wakes-000003.seg"]
    assert {r.key: r.file for r in await _rows(db)} == {"old-1:h": "wakes-000002.seg",
                                                        "new:h": "wakes-000003.seg"}




async def test_finished_wakes_are_pruned_so_the_inbox_stays_bounded_however_long_it_runs(
    tmp_path: Path, db: StateDB
) -> None:
    """Sixty days of deliveries that finish, pruned daily keeping seven days (as `bothy serve`
    does, hourly): the inbox never holds more than about eight days of segments and rows, and
    what it holds is the newest."""
    clock = _Clock()
    inbox = Inbox(tmp_path / "inbox", db, clock=clock, audit=_audit(tmp_path))
    held: list[tuple[int, int]] = []
    for day in range(60):
        clock.now = T0 + timedelta(days=day)
        for n in range(10):
            outcome = await inbox.accept(_delivery(f"d{day}-{n}:h", received_at=clock.now))
            assert isinstance(outcome, Accepted) and await inbox.claim(outcome.wake_id)
            await inbox.finish(outcome.wake_id, "done", run_id=None, note=None)
        await inbox.prune(to_us(clock.now) - 7 * DAY_US)
        held.append((len(_names(inbox)), len(await _rows(db))))

    assert max(segments for segments, _ in held) <= 9
    assert max(rows for _, rows in held) <= 9 * 10
    assert held[-1] == held[30]  # steady, not growing
    assert min(r.received_us for r in await _rows(db)) >= to_us(T0 + timedelta(days=59 - 8))


async def test_a_prune_the_state_database_refuses_is_an_inbox_error_and_the_next_finishes_it(
    tmp_path: Path, db: StateDB
) -> None:
    """A prune whose rows cannot be deleted (the database refuses) says so as InboxError, the
    caller's to log (`bothy serve` tries again in an hour); the next one forgets those rows,
    although their segment went the first time."""
    clock = _Clock()
    first = Inbox(tmp_path / "inbox", db, clock=clock, audit=_audit(tmp_path))
    done = await first.accept(_delivery("old:h"))
    assert isinstance(done, Accepted) and await first.claim(done.wake_id)
    await first.finish(done.wake_id, "done", run_id=None, note=None)
    clock.now = T0 + timedelta(days=8)
    inbox = Inbox(tmp_path / "inbox", db, clock=clock, audit=_audit(tmp_path))
    await inbox.accept(_delivery("new:h", received_at=clock.now))
    await db.execute("CREATE TRIGGER refuse BEFORE DELETE ON wakes"
                     " BEGIN SELECT RAISE(ABORT, 'the disk is full'); END")

    with pytest.raises(InboxError, match="the disk is full"):
        await inbox.prune(to_us(clock.now) - 7 * DAY_US)
    await db.execute("DROP TRIGGER refuse")
    pruned = await inbox.prune(to_us(clock.now) - 7 * DAY_US)

    assert pruned == 1
    assert [r.key for r in await _rows(db)] == ["new:h"]
    assert _names(inbox) == ["wakes-000002.seg"]


async def test_a_delivery_refused_503_after_its_wake_ignored_is_recorded_once_when_retried(
    tmp_path: Path, db: StateDB
) -> None:
    """The state database refuses the rows after `wake ignored` was recorded: the sender hears
    InboxError (503); its retry, in the same process or after a restart that reads the
    register, gets its row, closed ignored, and no second record."""
    inbox = Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))
    await db.execute("CREATE TRIGGER refuse BEFORE INSERT ON wakes"
                     " BEGIN SELECT RAISE(ABORT, 'the disk is full'); END")
    for key in ("same-process:h", "after-restart:h"):
        with pytest.raises(InboxError, match="the disk is full"):
            await inbox.accept(_delivery(key), ignored="no job matches")
    await db.execute("DROP TRIGGER refuse")

    again = await inbox.accept(_delivery("same-process:h"), ignored="no job matches")
    restarted = Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))
    history = RunHistory.from_register(_audit(tmp_path))
    await restarted.recover(history.ran_as, history.ignored)
    after = await restarted.accept(_delivery("after-restart:h"), ignored="no job matches")

    assert isinstance(again, Accepted) and again.ignored == "no job matches"
    assert isinstance(after, Accepted) and after.ignored == "no job matches"
    assert {r.key: r.status for r in await _rows(db)} == {"same-process:h": "ignored",
                                                           "after-restart:h": "ignored"}
    assert sorted(_ignored(tmp_path)) == ["after-restart:h", "same-process:h"]


# -- group commit, ignored at intake, a failing disk -------------------------------------------


async def test_a_delivery_no_job_wants_is_closed_ignored_and_recorded_keeping_no_payload(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """accept(..., ignored=reason) records `wake ignored` (intake's batch form, naming the
    delivery and its reason) and closes its row at once; it keeps no payload: no segment is
    written, the row names none, and reading it back says why."""
    outcome = await inbox.accept(_delivery(), ignored="no job of route 'github' matches")

    assert isinstance(outcome, Accepted) and outcome.ignored is not None
    [row] = await _rows(db)
    assert (row.status, row.note) == ("ignored", "no job of route 'github' matches")
    assert (row.file, row.payload_at, row.payload_bytes) == ("", None, None)
    assert not inbox.root.exists() or _names(inbox) == []  # no line, no segment
    assert await inbox.due(to_us(T0) + 1) == []
    with pytest.raises(InboxError, match="keeps no payload: it was closed ignored at intake"):
        await inbox.load(row)
    [record] = _audit(tmp_path).records()
    assert record.human_line().split()[2:] == ["wake", "ignored", "refused", "github", "-"]
    assert record.details == {"route": "github", "count": 1, "deliveries": [{
        "delivery": "guid-1:hook-1", "event": "pull_request", "action": "opened",
        "received_at": T0.isoformat(), "attempt": 1,
        "reason": "no job of route 'github' matches"}]}


async def test_a_burst_no_job_wants_is_recorded_in_batches_naming_each_delivery_once(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """Deliveries no job wants that arrive together share `wake ignored` records, one per
    route and at most a hundred deliveries, each delivery named exactly once with its own
    reason; deliveries that may run, in the same batches, keep their lines."""
    unwanted = [(_delivery(f"skip-{n}:h", route="github" if n % 3 else "other"),
                 "author association NONE is not allowed" if n % 2 else "no job matches")
                for n in range(450)]
    wanted = [_delivery(f"want-{n}:h") for n in range(5)]

    await asyncio.gather(*(inbox.accept(d, ignored=why) for d, why in unwanted),
                         *(inbox.accept(d) for d in wanted))

    records = [r for r in _audit(tmp_path).records() if r.event == "ignored"]
    assert len(records) < len(unwanted) / 50  # in batches, not one each
    assert all(r.details["count"] == len(r.details["deliveries"]) <= 100
               and r.subject == r.details["route"] for r in records)
    named = [(d.route, d.key, d.reason) for r in records for d in ignored_in(r.details)]
    assert sorted(named) == sorted((d.route, d.key, why) for d, why in unwanted)
    rows = await _rows(db)
    assert {r.key for r in rows if r.file == ""} == {d.key for d, _ in unwanted}
    assert [r.key for r in rows if r.status == "queued"] == [d.key for d in wanted]
    queued = [r for r in rows if r.status == "queued"]
    assert [await inbox.load(r) for r in queued] == wanted
    lines = b"".join((inbox.root / name).read_bytes() for name in _names(inbox))
    assert lines.count(b"\n") == len(wanted) and b"skip-" not in lines


async def test_a_line_whose_row_never_came_is_closed_by_what_the_register_shows(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """A crash after the records but before the rows: recovery queues the line of what may
    run, and closes as ignored a line the register shows ignored one at a time (the
    dispatcher's form, or intake's before batches); a delivery intake closed ignored left no
    line and is not restored, and its retry gets its row, not a second `wake ignored`."""
    await inbox.accept(_delivery("wanted:h"))
    await inbox.accept(_delivery("dispatched:h"))
    await _audit(tmp_path).record("wake", "ignored", "refused", subject="github", details={
        "route": "github", "delivery": "dispatched:h", "reason": "no job matches"})
    await inbox.accept(_delivery("unwanted:h"), ignored="no job matches")
    await db.execute("DELETE FROM wakes")
    history = RunHistory.from_register(_audit(tmp_path))
    restarted = Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))

    restored = await restarted.recover(history.ran_as, history.ignored)
    again = await restarted.accept(_delivery("unwanted:h"), ignored="no job matches")

    assert [(r.key, r.ignored) for r in restored] == [("wanted:h", False),
                                                      ("dispatched:h", True)]
    assert isinstance(again, Accepted) and again.ignored == "no job matches"
    assert {r.key: r.status for r in await _rows(db)} == {
        "wanted:h": "queued", "dispatched:h": "ignored", "unwanted:h": "ignored"}
    assert _ignored(tmp_path) == ["dispatched:h", "unwanted:h"]
    assert await restarted.recover(history.ran_as, history.ignored) == []


async def test_a_batch_whose_fsync_fails_is_refused_whole_and_the_next_starts_a_new_segment(
    tmp_path: Path, inbox: Inbox, db: StateDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deliveries committed together when the segment's fsync fails all hear InboxError, none
    is queued; once the disk is back, they are accepted in a fresh segment."""
    await inbox.accept(_delivery("before:h"))
    trigger = tmp_path / "fsync-fails"
    trigger.write_text(str(inbox.root))
    monkeypatch.setenv("BOTHY_FAULT_FSYNC", str(trigger))

    failed = await asyncio.gather(*(inbox.accept(_delivery(f"during-{n}:h")) for n in range(5)),
                                  return_exceptions=True)

    assert all(isinstance(f, InboxError) and "Input/output error" in str(f) for f in failed)
    assert [r.key for r in await _rows(db)] == ["before:h"]
    trigger.unlink()
    again = await asyncio.gather(*(inbox.accept(_delivery(f"during-{n}:h")) for n in range(5)))
    assert all(isinstance(a, Accepted) for a in again)
    rows = await _rows(db)
    assert {r.file for r in rows if r.key != "before:h"} == {"wakes-000002.seg"}
    assert await inbox.recover() == []  # what failed was cut back: nothing comes back


async def test_a_delivery_no_job_wants_in_a_batch_whose_fsync_fails_is_recorded_once_retried(
    tmp_path: Path, db: StateDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`wake ignored` is recorded once its batch's segment is fsynced: when that fsync (of a
    delivery that may run beside it) fails, both hear InboxError (503) and the register names
    no delivery that was answered 503; the unwanted one's retry, in the same process or after
    a restart that reads the register, gets its row, closed ignored, and one record. Alone,
    an unwanted delivery needs no segment: the failing disk does not refuse it."""
    inbox = Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))
    await inbox.accept(_delivery("before:h"))  # the segment exists: its fsync is what fails
    trigger = tmp_path / "fsync-fails"
    trigger.write_text(str(inbox.root))
    monkeypatch.setenv("BOTHY_FAULT_FSYNC", str(trigger))
    for key in ("same-process:h", "after-restart:h"):
        failed = await asyncio.gather(
            inbox.accept(_delivery(f"wanted-{key}")),
            inbox.accept(_delivery(key), ignored="no job matches"), return_exceptions=True)
        assert all(isinstance(f, InboxError) and "Input/output error" in str(f) for f in failed)
    assert _ignored(tmp_path) == []  # refused 503: nothing said of them
    alone = await inbox.accept(_delivery("alone:h"), ignored="no job matches")
    trigger.unlink()

    again = await inbox.accept(_delivery("same-process:h"), ignored="no job matches")
    restarted = Inbox(tmp_path / "inbox", db, clock=_Clock(), audit=_audit(tmp_path))
    history = RunHistory.from_register(_audit(tmp_path))
    await restarted.recover(history.ran_as, history.ignored)
    after = await restarted.accept(_delivery("after-restart:h"), ignored="no job matches")

    assert isinstance(alone, Accepted) and alone.ignored == "no job matches"
    assert isinstance(again, Accepted) and again.ignored == "no job matches"
    assert isinstance(after, Accepted) and after.ignored == "no job matches"
    assert {r.key: r.status for r in await _rows(db)} == {
        "before:h": "queued", "alone:h": "ignored", "same-process:h": "ignored",
        "after-restart:h": "ignored"}
    assert sorted(_ignored(tmp_path)) == ["after-restart:h", "alone:h", "same-process:h"]


async def test_a_delivery_no_job_wants_sent_again_while_its_first_copy_commits_is_recorded_once(
    tmp_path: Path, inbox: Inbox, db: StateDB
) -> None:
    """Every unwanted delivery is sent by two of sixteen senders at about the same time (a
    retry racing its first attempt): however the copies fall into the group commit's
    batches, each delivery has one row, closed ignored, and one `wake ignored`."""
    deliveries, senders = 160, 16

    async def sender(me: int) -> list[Accepted | Duplicate]:
        mine = [n for n in range(deliveries) if me in (n % senders, (n + 1) % senders)]
        return [await inbox.accept(_delivery(f"guid-{n}:h"), ignored="no job matches")
                for n in mine]

    sent = await asyncio.gather(*(sender(me) for me in range(senders)))

    outcomes = [o for per_sender in sent for o in per_sender]
    assert sum(isinstance(o, Accepted) for o in outcomes) == deliveries
    rows = await _rows(db)
    assert (len(rows), {r.status for r in rows}) == (deliveries, {"ignored"})
    recorded = sorted(_ignored(tmp_path))
    assert recorded == sorted(f"guid-{n}:h" for n in range(deliveries))
