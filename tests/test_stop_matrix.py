"""The stop-and-crash matrix (issue 10): SIGTERM, and SIGKILL, of a real ``bothy serve`` at
each point of a delivery's life, then a restart; counted from the register.

Each case starts a daemon with a pool of one worker, brings deliveries to the point under test
(answered in a burst; received but not yet admitted; with the model, mid-turn; waiting in its
lane behind it; waiting for the pool slot; just started; during the drain; during the stop
stage), signals the daemon, waits for it to end, starts a second daemon on the same home and
waits until every delivery that was answered 200 has either reached a worker or been closed
out loud. Then, from the register and the state database:

- 0 lost: every delivery answered 200 has a ``run started`` (under any of its attempts' run
  ids, found through the ``wake received`` records that name it) or a record closing it out
  loud (``wake interrupted``, ``wake abandoned``, ``wake crashed``);
- 0 run twice: no delivery has two ``run started``;
- 0 codex left: every worker group any run started is empty;
- the chain is intact (``bothy audit verify``) and no run is left queued or running in state;
- reservations settled or expiring: what `bothy status` reads as reserved is only what a
  SIGKILLed run held, named by its `run recovered` record and lapsing within
  ``budget.reservation_expiry_s`` of it.

The points, and what holds a delivery there long enough to signal:

- ``received``: budget mode ``plan`` on a fresh site: the first run is admitted to learn the
  rate-limit windows and held mid-turn; a second delivery is received (``wake received``) and
  waits behind it to be admitted; a third is in the inbox, not yet taken;
- ``held``: one run mid-turn, one waiting in its lane behind it, one waiting for the slot;
- ``drain``: as ``held``, then SIGTERM: the waiting runs withdraw at once, their wakes queued
  again; the signal under test comes within the grace, the run mid-turn still at its worker;
- ``stop-stage``: as ``held`` with each run tied to a Cairn task, then SIGTERM: the grace
  passes, the waiting runs withdraw, the run mid-turn is stopped, and the signal under test
  comes while it ends (its note to Cairn, made slow, is under way).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from bothy.engine.audit import AuditRecord
from bothy.engine.procgroup import live_members
from bothy.home import BothyHome
from bothy.status import collect_status, status_view
from tests.fakes import github
from tests.fakes.cairn import FakeCairn
from tests.fakes.model_server import ModelServer, RateLimits, RateLimitWindow, stall, text
from tests.fakes.shell import DEADLINE_S, Shell, audit_records, started_group, until
from tests.fakes.site import Site
from tests.test_serve import (
    SECRET,
    Serving,
    accepting,
    delivery_of,
    queued,
    records,
    serve_site,
    start_serve,
    until_count,
)

GRACE_S = 0.5
SETTLE_S = 20.0  # how long the second daemon may take to bring every delivery to an end
OUT_LOUD = ("interrupted", "abandoned", "crashed")


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", SECRET)


# --- bringing deliveries to a point -------------------------------------------------------


@dataclass
class Reached:
    """The deliveries answered 200 so far, and requests still being sent (a burst)."""

    answered: set[str]
    sending: asyncio.Future[object] | None = None
    waiting: set[str] = field(default_factory=set)  # admitted, no worker yet at the signal


async def _burst(site: Site, serving: Serving, server: ModelServer) -> Reached:
    """Eight deliveries at once; the signal goes as soon as three have been answered."""
    answered: set[str] = set()
    three = asyncio.Event()

    async def one(number: int) -> None:
        try:
            answer = await serving.deliver(github.pull_request_opened(number))
        except httpx.HTTPError:  # the daemon died under it: not answered, not counted
            return
        if answer.status_code == 200:
            answered.add(f"{answer.json()['delivery']}:{github.HOOK_ID}")
        if len(answered) >= 3:
            three.set()

    sending: asyncio.Future[object] = asyncio.ensure_future(
        asyncio.gather(*(one(n) for n in range(1, 9))))
    waiter: asyncio.Future[object] = asyncio.ensure_future(three.wait())
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.wait({waiter, sending}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return Reached(answered, sending)


async def _held(site: Site, serving: Serving, server: ModelServer) -> Reached:
    """One run mid-turn with the model (pr:1), a second delivery for pr:1 waiting in its lane,
    and one for pr:2 waiting for the pool's only slot."""
    working = await queued(serving, github.pull_request_opened(1))
    async with asyncio.timeout(DEADLINE_S):
        await server.stalled.wait()
    waiting = {await queued(serving, github.pull_request_opened(1, title="A second push")),
               await queued(serving, github.pull_request_opened(2))}
    await until_count(site, "run", "admitted", "ok", 3)
    return Reached({working, *waiting}, waiting=waiting)


async def _just_started(site: Site, serving: Serving, server: ModelServer) -> Reached:
    """The signal goes the moment the run's worker has started."""
    keys = {await queued(serving, github.pull_request_opened(1))}
    await until_count(site, "run", "started", "ok", 1)
    return Reached(keys)


async def _received(site: Site, serving: Serving, server: ModelServer) -> Reached:
    """Budget mode plan, no window known: pr:1 learns them, held mid-turn; pr:2 is received
    and waits to be admitted behind it; pr:3 waits in the inbox, not yet taken."""
    working = await queued(serving, github.pull_request_opened(1))
    async with asyncio.timeout(DEADLINE_S):
        await server.stalled.wait()
    behind = await queued(serving, github.pull_request_opened(2))
    await until_count(site, "wake", "received", "ok", 2)
    untaken = await queued(serving, github.pull_request_opened(3))
    assert len(records(site, "run", "admitted")) == 1  # pr:2 received, not admitted
    return Reached({working, behind, untaken}, waiting={behind})


async def _in_the_drain(site: Site, serving: Serving, server: ModelServer) -> Reached:
    """As `_held`, then SIGTERM: the signal under test comes while the daemon drains (the
    grace is long here). The waiting runs withdrew at the first signal, their wakes queued
    again; the run mid-turn keeps its worker: nothing has been asked to stop yet."""
    reached = await _held(site, serving, server)
    serving.command.signal(signal.SIGTERM)
    await until(lambda: not accepting(serving.port), "the listener closed on SIGTERM")
    await until_count(site, "wake", "requeued", "pending", len(reached.waiting))
    assert {str(r.details["delivery"]) for r in records(site, "wake", "requeued")} \
        == reached.waiting
    assert records(site, "run", "finished", "ok") == []  # the held run still works
    assert records(site, "worker", "stopped") == []
    assert records(site, "serve", "stopped") == []  # still within the grace
    return reached


async def _in_the_stop_stage(site: Site, serving: Serving, server: ModelServer) -> Reached:
    """As `_held`, then SIGTERM; the grace passes, the waiting runs withdraw and are queued
    again, and the signal under test comes while the run that was mid-turn ends."""
    reached = await _held(site, serving, server)
    serving.command.signal(signal.SIGTERM)
    await until_count(site, "wake", "requeued", "pending", len(reached.waiting))
    cairn = FakeCairn(site.root / "cairn")
    await until(lambda: "note" in cairn.verbs(), "the stopped run's note to Cairn under way")
    assert records(site, "serve", "stopped") == []
    return reached


def _cairn_slow_to_note(root: Path) -> dict[str, Any]:
    """Each run tied to its task (ACME-N for pr:N); the note at a run's end takes seconds."""
    cairn = FakeCairn(root / "cairn")
    for n in (1, 2):
        cairn.add(f"ACME-{n}")
    cairn.slow("note", 4)
    return {"job": {"ref": "ACME-{pull_request.number}"},
            "cairn": {"command": cairn.command, "timeout_s": 8.0}}


def _cairn_quick(root: Path) -> None:
    FakeCairn(root / "cairn").slow("note", 0)


LEARNING = RateLimits(primary=RateLimitWindow(10, 300, 4_102_444_800))  # resets in 2100


@dataclass(frozen=True)
class Point:
    """How a case reaches its point, and what the site needs for it."""

    reach: Callable[[Site, Serving, ModelServer], Awaitable[Reached]]
    grace_s: float = GRACE_S
    site: Callable[[Path], dict[str, Any]] = lambda root: {}
    before_restart: Callable[[Path], None] = lambda root: None
    rate_limits: RateLimits | None = None  # on the model's replies (plan mode learns them)


POINTS: dict[str, Point] = {
    "burst": Point(_burst),
    "received": Point(_received, site=lambda root: {"budget": {"mode": "plan"}},
                      rate_limits=LEARNING),
    "held": Point(_held),
    "just-started": Point(_just_started),
    # A grace longer than any wait of the test's: what `_in_the_drain` sees came at the
    # signal, not at the grace's end.
    "drain": Point(_in_the_drain, grace_s=120.0),
    "stop-stage": Point(_in_the_stop_stage, site=_cairn_slow_to_note,
                        before_restart=_cairn_quick),
}


# --- the matrix ---------------------------------------------------------------------------


@pytest.mark.codex
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("point", sorted(POINTS))
async def test_a_stop_or_crash_at_any_point_loses_nothing_and_runs_nothing_twice(
    server: ModelServer, tmp_path: Path, point: str, signum: signal.Signals
) -> None:
    """SIGTERM or SIGKILL at `point`, then a restart: every delivery answered 200 runs once or
    is closed out loud, none runs twice, no codex is left, the chain is intact."""
    at = POINTS[point]
    site = serve_site(tmp_path, server, pool={"max_workers": 1},
                      wakes={"shutdown_grace_s": at.grace_s}, **at.site(tmp_path))
    replies = [text(f"Reviewed ({n}).", rate_limits=at.rate_limits) for n in range(12)]
    # A burst's first model call may come after the signal: a stall there would hold a run
    # of the second daemon. Every other point signals only once a stall is held (or cannot
    # matter: a run that just started is never run again).
    server.script(*replies if point == "burst" else [stall(), *replies])
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        reached = await at.reach(site, serving, server)
        serving.command.signal(signum)
        await serving.command.finish(timeout_s=DEADLINE_S)
        if reached.sending is not None:
            await reached.sending
        answered = reached.answered
        at.before_restart(tmp_path)

        restarted = await start_serve(shell)
        with contextlib.suppress(AssertionError):  # the counts below say which were lost
            await until(lambda: not _unresolved(site, answered), "every delivery resolved",
                        timeout_s=SETTLE_S)
        await until(lambda: _all_finished(site), "no run left in progress", timeout_s=SETTLE_S)
        restarted.command.signal(signal.SIGTERM)
        stopped = await restarted.command.finish(timeout_s=DEADLINE_S)
        assert stopped.code == 0, stopped.stderr
        verified = await shell.bothy("audit", "verify")

    assert answered, "no delivery was answered before the signal"
    assert _unresolved(site, answered) == set(), "lost: answered 200, never run nor closed"
    assert [key for key, n in _starts(site).items() if n > 1] == [], "run twice"
    for run in records(site, "run", "started"):
        group = started_group(site, str(run.run_id))
        assert live_members(group.pgid) == [], f"{run.run_id}'s codex outlived the restart"
    assert verified.code == 0, verified.stdout + verified.stderr
    assert _in_progress(site) == []
    _assert_reservations_settled_or_expiring(site)
    # What had no worker at the signal is queued again, out loud, and no new worker started
    # after it: the first daemon's only worker is the one that was with the model.
    requeued = {str(r.details["delivery"]) for r in records(site, "wake", "requeued")}
    assert reached.waiting <= requeued
    if reached.waiting:
        assert len(_first_life(site, "run", "started")) == 1


def _first_life(site: Site, kind: str, event: str) -> list[AuditRecord]:
    """The ``kind event`` records the first daemon wrote (before the second started)."""
    lines = audit_records(site)
    second = [i for i, r in enumerate(lines) if (r.kind, r.event) == ("serve", "starting")][1]
    return [r for r in lines[:second] if (r.kind, r.event) == (kind, event)]


def _starts(site: Site) -> Counter[str]:
    """Delivery key → how many of its runs reached a worker."""
    woke = delivery_of(site)
    return Counter(woke[str(r.run_id)] for r in records(site, "run", "started")
                   if str(r.run_id) in woke)


def _unresolved(site: Site, answered: set[str]) -> set[str]:
    closed = {str(r.details.get("delivery")) for event in OUT_LOUD
              for r in records(site, "wake", event)}
    return answered - set(_starts(site)) - closed


def _in_progress(site: Site) -> list[tuple[str, str]]:
    db = sqlite3.connect(f"file:{site.home / 'state' / 'bothy.sqlite3'}?mode=ro", uri=True)
    try:
        return [(str(run_id), str(status)) for run_id, status in db.execute(
            "SELECT run_id, status FROM runs WHERE status != 'finished'")]
    finally:
        db.close()


def _all_finished(site: Site) -> bool:
    return _in_progress(site) == []


def _assert_reservations_settled_or_expiring(site: Site) -> None:
    """Read as `bothy status` reads the state: nothing running or queued, and all that is
    still reserved (dollars or plan percent) held by runs a SIGKILL left, each lapsing within
    ``budget.reservation_expiry_s`` of its `run recovered` record."""
    home = BothyHome(site.home)
    report = collect_status(home, status_view(home))
    assert (report["running"], report["queued"]) == ([], {}), report
    recovered = {str(r.run_id): r.ts for r in records(site, "run", "recovered")}
    held = report["held_by_crashed_runs"]
    assert {h["run_id"] for h in held} <= set(recovered), (held, recovered)
    expiry = timedelta(seconds=int(site.config["budget"].get("reservation_expiry_s", 3600)))
    for h in held:
        lapses = datetime.fromisoformat(h["expires_at"])
        assert lapses <= recovered[h["run_id"]] + expiry + timedelta(minutes=1), h
    assert report["reserved_usd"] == f"{sum(float(h['held_usd']) for h in held):.4f}", report
    if not held:
        assert report["plan"]["reserved_percent"] == 0, report["plan"]


# --- a slot that frees during the grace (docs/RUNBOOK.md, SIGTERM) -------------------------


@pytest.mark.codex
@pytest.mark.timeout(120)
async def test_a_slot_freed_in_the_grace_starts_no_worker_and_the_waiting_runs_run_after(
    server: ModelServer, tmp_path: Path
) -> None:
    """SIGTERM with one run mid-turn and two waiting (one in its lane, one for the pool's
    only slot): the waiting runs withdraw at the signal, their wakes queued again; the run
    mid-turn finishes within the grace, and the slot it frees starts no worker. After the
    restart each waiting delivery runs once."""
    site = serve_site(tmp_path, server, pool={"max_workers": 1},
                      wakes={"shutdown_grace_s": 15.0})
    answer = asyncio.Event()
    server.script(text("Reviewed (1).", after=answer),
                  *(text(f"Reviewed ({n}).") for n in range(2, 8)))
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        working = await queued(serving, github.pull_request_opened(1))
        await server.wait_for_requests(1, timeout_s=DEADLINE_S)  # with the model
        waiting = {await queued(serving, github.pull_request_opened(1, title="A second push")),
                   await queued(serving, github.pull_request_opened(2))}
        await until_count(site, "run", "admitted", "ok", 3)
        serving.command.signal(signal.SIGTERM)
        await until(lambda: not accepting(serving.port), "the listener closed on SIGTERM")
        answer.set()  # the run mid-turn ends within the grace: its slot frees
        stopped = await serving.command.finish(timeout_s=DEADLINE_S)
        served_out = records(site, "serve", "stopped")
        started_before = len(records(site, "run", "started"))
        finished_before = records(site, "run", "finished")
        shown = await shell.bothy("status")  # between the stop and the restart

        restarted = await start_serve(shell)
        await until(lambda: set(_starts(site)) >= {working, *waiting},
                    "the waiting deliveries run after the restart", timeout_s=SETTLE_S)
        await until(lambda: _all_finished(site), "no run left in progress", timeout_s=SETTLE_S)
        assert await restarted.stop() == 0

    assert stopped.code == 0, stopped.stderr
    assert len(served_out) == 1
    assert started_before == 1, "a waiting run started a worker after the signal"
    ended = sorted((r.outcome, delivery_of(site)[str(r.run_id)]) for r in finished_before)
    assert ended == sorted([("ok", working), *(("cancelled", key) for key in waiting)])
    requeued = records(site, "wake", "requeued")
    assert sorted(str(r.details["delivery"]) for r in requeued) == sorted(waiting)
    assert records(site, "wake", "interrupted") == []
    assert _starts(site) == Counter({working: 1, **dict.fromkeys(waiting, 1)})
    assert _in_progress(site) == []
    # The operator asking in between is told they run at the next start, not at the epoch.
    assert shown.code == 0, shown.stderr
    told = sorted(line.split()[2] for line in shown.stdout.splitlines()
                  if " next try as soon as bothy serve takes it: bothy stopped before" in line)
    assert told == sorted(waiting), shown.stdout


# --- a state database restored from an older copy (item 10) --------------------------------


@pytest.mark.codex
async def test_a_restored_older_state_database_runs_no_delivery_twice(
    server: ModelServer, tmp_path: Path
) -> None:
    """Restoring a copy of the state database from before a delivery: the delivery's file gets
    its row back closed (the register shows it ran), audited `wake reinserted` and counted in
    `serve ready`, and it does not run again."""
    site = serve_site(tmp_path, server)
    server.script(text("Reviewed (1)."), text("Reviewed (2)."), text("Reviewed (3)."))
    state = site.home / "state"
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(1))
        await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0
        backup = {path.name: path.read_bytes() for path in state.glob("bothy.sqlite3*")}

        serving = await start_serve(shell)
        later = await queued(serving, github.pull_request_opened(2))
        [_, ran] = await until_count(site, "run", "finished", "ok", 2)
        assert await serving.stop() == 0
        for path in state.glob("bothy.sqlite3*"):
            path.unlink()
        for name, data in backup.items():
            (state / name).write_bytes(data)

        serving = await start_serve(shell)
        ready = records(site, "serve", "ready")[-1]
        await queued(serving, github.pull_request_opened(3))
        await until_count(site, "run", "finished", "ok", 3)
        assert await serving.stop() == 0

    assert (ready.details["wakes_reinserted"], ready.details["wakes_already_run"]) == (0, 1)
    [reinserted] = records(site, "wake", "reinserted")
    assert (reinserted.details["delivery"], reinserted.run_id) == (later, ran.run_id)
    assert str(reinserted.details["then"]).startswith("closed")
    assert _starts(site)[later] == 1
    assert len(records(site, "run", "started")) == 3 and server.unscripted == 0
