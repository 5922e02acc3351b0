"""The gates a run passes before it starts: budget (rule 1), lanes and the pool (SPEC §3).

The cross-process tests run the real ``bothy`` CLI, several at once, against the pinned codex
binary and a scripted model that stalls, so admitted runs hold their place while the test
looks. The in-process tests drive :class:`BudgetGate` with an injected clock.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import pytest

from bothy.config import BudgetConfig, load_config
from bothy.engine.budget import Admitted, BudgetGate, Refused, Settlement, Ticket
from bothy.engine.prices import PriceTable
from bothy.engine.procgroup import process_start_time
from bothy.engine.state import StateDB
from bothy.home import BothyHome
from bothy.runtime import Runtime
from tests.fakes.model_server import ModelServer, stall, text
from tests.fakes.shell import Command, Shell, audit_records, of_run
from tests.fakes.site import FAKE_PRICE, Site

REPLY_COST = "0.0152"  # the fake model's default usage at the fake price


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


def _lines_of(site: Site, run_id: str) -> list[str]:
    """The run's audit lines, its wake's first (which has no run yet: `-`)."""
    return [record.human_line() for record in audit_records(site, of_run(run_id))]


# --- budget across processes ----------------------------------------------------------------


async def _seed_spend(site: Site, micros: int) -> None:
    """Spend ``micros`` today through the engine itself: admit, fill, settle."""
    home = BothyHome(site.home)
    cfg = load_config(home.config_path)
    async with Runtime.open(home, cfg) as rt:
        gate = rt.supervisor().budget
        ticket = Ticket("run_seed_earlier_today", "seed", "test", micros, os.getpid(),
                        process_start_time(os.getpid()), "fake-model")
        assert isinstance(await gate.admit(ticket), Admitted)
        await gate.fill(ticket.run_id, micros, tokens=1)
        await gate.settle(ticket.run_id, outcome="completed", reason=None, final_text="")


@pytest.mark.codex
@pytest.mark.timeout(120)
async def test_five_concurrent_runs_that_see_40_of_50_used_admit_three_and_refuse_two(
    server: ModelServer, tmp_path: Path
) -> None:
    """Five `bothy run`s racing for 10.00 of headroom at 3.00 each: three admitted, two refused."""
    server.script(*(stall() for _ in range(5)))
    site = Site(tmp_path, server.base_url, pool={"max_workers": 2},
                budget={"per_run_usd": "3.00", "per_day_usd": "50.00"})
    await _seed_spend(site, 40_000_000)
    async with Shell(site) as shell:
        runs = [await shell.start("run", "hold on", "--subject", f"job:{n}") for n in range(5)]
        admitted: list[tuple[Command, str]] = []
        refused: list[Command] = []
        for run in runs:
            run_id = await run.admitted()
            if run_id is None:
                refused.append(run)
            else:
                admitted.append((run, run_id))

        assert len(admitted) == 3
        for run in refused:
            done = await run.finish()
            assert done.code == 3
            outcome, run_id, rest = done.stdout.split(" ", 2)
            assert (outcome, rest) == ("refused", (
                "0.0000 usd refused at gate 'budget': would reach 52.00 usd against a 50.00"
                " ceiling (40.00 used, 9.00 already reserved, 3.00 requested)\n"))
            assert [line.split(" ", 2)[2] for line in _lines_of(site, run_id)] == [
                f"wake received ok {run.args[3]} -",
                f"run refused refused {run.args[3]} {run_id}"]

        await server.wait_for_requests(2)
        waiting = [(run, run_id) for run, run_id in admitted if await _waits_for_a_slot(run)]
        assert len(waiting) == 1, "exactly one admitted run waits for a pool slot"
        status = await shell.bothy("status")
        assert "spend today: 40.0000 usd used, 9.0000 usd reserved, ceiling 50.00 usd" in (
            status.stdout)
        queued_id = waiting[0][1]
        assert "running: 2 of 2 workers" in status.stdout
        assert f"queued: 1\n  lane {waiting[0][0].args[3]}: {queued_id}\n" in status.stdout
        assert len(server.requests) == 2, "the run waiting for a slot reached the model"

        working = [(run, run_id) for run, run_id in admitted if run_id != queued_id]
        cancel = await shell.bothy("cancel", queued_id)
        assert (cancel.code, cancel.stdout) == (0, f"cancelled {queued_id}\n")
        cancel = await shell.bothy("cancel", working[0][1])
        assert (cancel.code, cancel.stdout) == (0, f"cancelled {working[0][1]}\n")
        working[1][0].signal(signal.SIGTERM)

        for run, run_id in admitted:
            done = await run.finish()
            assert done.code == 5
            assert done.stdout.startswith(f"cancelled {run_id} 0.0000 usd ")
        status = await shell.bothy("status")
        assert "spend today: 40.0000 usd used, 0.0000 usd reserved, ceiling 50.00 usd" in (
            status.stdout)


async def _waits_for_a_slot(run: Command) -> bool:
    """Whether an admitted run says it waits for a pool slot (rather than that it started)."""
    said = await run.line(r"^bothy: (waiting: pool full \(2 of 2 workers busy\)|started run_)")
    return said.group(1).startswith("waiting")


# --- lanes and the pool -----------------------------------------------------------------------


@pytest.mark.codex
async def test_second_run_in_a_lane_waits_for_the_first_to_end(
    server: ModelServer, tmp_path: Path
) -> None:
    """A second `bothy run --subject pr:42` waits behind the first and starts only once it ended."""
    server.script(stall(), text("second, in its turn"))
    site = Site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        first = await shell.start("run", "first", "--subject", "pr:42")
        first_id = await first.admitted()
        await server.wait_for_requests(1)
        second = await shell.start("run", "second", "--subject", "pr:42")
        second_id = await second.admitted()
        await second.line(f"^bothy: waiting: behind {first_id} in lane pr:42$")
        assert len(server.requests) == 1, "the second run reached the model while the first ran"

        cancel = await shell.bothy("cancel", str(first_id))
        assert (cancel.code, cancel.stdout) == (0, f"cancelled {first_id}\n")
        assert (await first.finish()).code == 5
        done = await second.finish()
        assert (done.code, done.stdout) == (
            0, f"completed {second_id} {REPLY_COST} usd second, in its turn\n")
        assert len(server.requests) == 2

    lines = site.audit_lines()
    first_finished = lines.index(
        next(line for line in lines if f"run finished cancelled pr:42 {first_id}" in line))
    second_started = lines.index(
        next(line for line in lines if f"run started ok pr:42 {second_id}" in line))
    assert first_finished < second_started


@pytest.mark.codex
async def test_run_waits_while_the_pool_is_full(server: ModelServer, tmp_path: Path) -> None:
    """With pool.max_workers 1, a run in another lane waits for the busy worker, then runs."""
    server.script(stall(), text("my turn now"))
    site = Site(tmp_path, server.base_url, pool={"max_workers": 1})
    async with Shell(site) as shell:
        busy = await shell.start("run", "long job", "--subject", "lane:a")
        busy_id = await busy.admitted()
        await server.wait_for_requests(1)
        other = await shell.start("run", "short job", "--subject", "lane:b")
        other_id = await other.admitted()
        await other.line(r"^bothy: waiting: pool full \(1 of 1 workers busy\)$")
        assert len(server.requests) == 1, "a second worker started beyond pool.max_workers"

        assert (await shell.bothy("cancel", str(busy_id))).code == 0
        assert (await busy.finish()).code == 5
        done = await other.finish()
        assert (done.code, done.stdout) == (
            0, f"completed {other_id} {REPLY_COST} usd my turn now\n")


@pytest.mark.codex
@pytest.mark.timeout(120)
async def test_a_freed_slot_goes_to_the_earliest_admitted_waiter_across_processes(
    server: ModelServer, tmp_path: Path
) -> None:
    """Four `bothy run` processes in four lanes wait for a pool of one: they start in the
    order they were admitted, whichever polls first (issue 10 item 2)."""
    lanes = ["lane:b", "lane:c", "lane:d", "lane:e"]
    server.script(stall(), *(text(f"done in {lane}") for lane in lanes))
    site = Site(tmp_path, server.base_url, pool={"max_workers": 1})
    async with Shell(site) as shell:
        busy = await shell.start("run", "long job", "--subject", "lane:a")
        busy_id = await busy.admitted()
        await server.wait_for_requests(1)
        waiting = []
        for lane in lanes:
            waiter = await shell.start("run", f"job in {lane}", "--subject", lane)
            waiting.append((await waiter.admitted(), waiter))
            await waiter.line(r"^bothy: waiting: pool full \(1 of 1 workers busy\)$")

        assert (await shell.bothy("cancel", str(busy_id))).code == 0
        for _, waiter in waiting:
            assert (await waiter.finish()).code == 0

    started = [str(r.run_id) for r in audit_records(site, lambda r: (r.kind, r.event) == (
        "run", "started"))]
    assert started == [busy_id] + [run_id for run_id, _ in waiting]


@pytest.mark.codex
async def test_cancelling_a_queued_run_ends_it_without_a_worker(
    server: ModelServer, tmp_path: Path
) -> None:
    """`bothy cancel` of a run waiting in its lane ends it `cancelled`; no worker ever starts."""
    server.script(stall())
    site = Site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        first = await shell.start("run", "first", "--subject", "pr:7")
        first_id = await first.admitted()
        await server.wait_for_requests(1)
        queued = await shell.start("run", "second", "--subject", "pr:7")
        queued_id = await queued.admitted()
        await queued.line(f"^bothy: waiting: behind {first_id} in lane pr:7$")

        cancel = await shell.bothy("cancel", str(queued_id))
        assert (cancel.code, cancel.stdout) == (0, f"cancelled {queued_id}\n")
        done = await queued.finish()
        assert (done.code, done.stdout) == (
            5, f"cancelled {queued_id} 0.0000 usd cancelled while waiting\n")
        assert "bothy: started" not in done.stderr
        assert first.running, "cancelling the queued run touched the one ahead of it"

        assert (await shell.bothy("cancel", str(first_id))).code == 0
        assert (await first.finish()).code == 5

    events = [f"{r.kind} {r.event} {r.outcome}" for r in audit_records(
        site, of_run(str(queued_id)))]
    assert events == ["wake received ok", "run admitted ok", "run cancel-requested ok",
                      "budget settled ok", "run finished cancelled"]
    assert len(server.requests) == 1


# --- the budget gate in-process, with an injected clock -------------------------------------


class _Clock:
    """A clock a test moves by hand."""

    def __init__(self, iso: str) -> None:
        self.now = datetime.fromisoformat(iso)

    def __call__(self) -> datetime:
        return self.now

    def set(self, iso: str) -> None:
        self.now = datetime.fromisoformat(iso)


@asynccontextmanager
async def _gate(
    path: Path, clock: _Clock, *, timezone: str = "UTC", per_day_usd: str = "50.00",
    per_run_usd: str = "3.00",
) -> AsyncIterator[BudgetGate]:
    cfg = BudgetConfig(
        per_run_usd=Decimal(per_run_usd), per_day_usd=Decimal(per_day_usd),
        timezone=timezone, prices={"fake-model": FAKE_PRICE},
    )
    async with StateDB.open(path) as db:
        yield BudgetGate(db, cfg, PriceTable(cfg.prices), clock=clock)


def _ticket(usd: str, subject: str = "lane:x") -> Ticket:
    micros = int(Decimal(usd) * 1_000_000)
    return Ticket(f"run_20260115T000000Z_{secrets.token_hex(4)}", subject, "test", micros,
                  os.getpid(), process_start_time(os.getpid()), "fake-model")


async def _admit(gate: BudgetGate, usd: str) -> Admitted:
    decision = await gate.admit(_ticket(usd))
    assert isinstance(decision, Admitted), decision
    return decision


async def _spend(gate: BudgetGate, usd: str) -> None:
    """A whole run that cost ``usd``: admitted, filled, settled."""
    run = await _admit(gate, "3.00")
    await gate.fill(run.run_id, int(Decimal(usd) * 1_000_000), tokens=100)
    await gate.settle(run.run_id, outcome="completed", reason=None, final_text="")


async def _used(gate: BudgetGate) -> tuple[str, int]:
    today = await gate.today()
    return today.day, today.used_micros


async def test_day_boundary_follows_the_budget_timezone(tmp_path: Path) -> None:
    """Spend at 23:30 UTC counts for the next day in a UTC+1 zone, and for the same day in UTC."""
    clock = _Clock("2026-01-15T23:30:00+00:00")  # 00:30 on the 16th in Paris (UTC+1 in winter)
    async with _gate(tmp_path / "paris.sqlite3", clock, timezone="Europe/Paris") as paris, \
            _gate(tmp_path / "utc.sqlite3", clock) as utc:
        await _spend(paris, "1.25")
        await _spend(utc, "1.25")

        clock.set("2026-01-15T22:30:00+00:00")  # the 15th in both zones
        assert await _used(paris) == ("2026-01-15", 0)
        assert await _used(utc) == ("2026-01-15", 1_250_000)

        clock.set("2026-01-16T08:00:00+00:00")  # the 16th in both zones
        assert await _used(paris) == ("2026-01-16", 1_250_000)
        assert await _used(utc) == ("2026-01-16", 0)


async def test_live_reservation_from_yesterday_counts_today(tmp_path: Path) -> None:
    """A run admitted before midnight still holds its reservation against the new day."""
    clock = _Clock("2026-01-15T23:50:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        await _admit(gate, "3.00")
        clock.set("2026-01-16T00:10:00+00:00")
        today = await gate.today()
        assert (today.day, today.used_micros, today.reserved_micros) == ("2026-01-16", 0, 3_000_000)
        refused = await gate.admit(_ticket("48.00"))
        assert isinstance(refused, Refused)
        assert refused.message == (
            "would reach 51.00 usd against a 50.00 ceiling (0.00 used, 3.00 already reserved,"
            " 48.00 requested)")


async def test_refused_ticket_names_the_gate_and_every_figure(tmp_path: Path) -> None:
    """A ticket past the ceiling is refused at gate 'budget' with used, reserved and requested."""
    clock = _Clock("2026-09-24T14:03:11+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        await _spend(gate, "40.00")
        for _ in range(3):
            await _admit(gate, "3.00")
        refused = await gate.admit(_ticket("3.00"))
        assert isinstance(refused, Refused)
        assert refused.sentence() == (
            "refused at gate 'budget': would reach 52.00 usd against a 50.00 ceiling"
            " (40.00 used, 9.00 already reserved, 3.00 requested)")
        assert refused.figures == {"would_reach_usd": "52.00", "ceiling_usd": "50.00",
                                   "used_usd": "40.00", "reserved_usd": "9.00",
                                   "requested_usd": "3.00"}
        today = await gate.today()
        assert (today.used_micros, today.reserved_micros) == (40_000_000, 9_000_000)


async def test_two_connections_racing_the_gate_never_admit_past_the_ceiling(
    tmp_path: Path
) -> None:
    """Twenty 1.00 tickets raced through two connections (as two processes) at 40 of 50 used:
    exactly ten admitted, each naming the reservations before it; the rest refused in full."""
    clock = _Clock("2026-09-24T10:00:00+00:00")
    db = tmp_path / "bothy.sqlite3"
    async with _gate(db, clock) as one, _gate(db, clock) as other:
        await _spend(one, "40.00")
        decisions = await asyncio.gather(*(gate.admit(_ticket("1.00", f"lane:{n}"))
                                           for n in range(10) for gate in (one, other)))
        admitted = [d for d in decisions if isinstance(d, Admitted)]
        refused = [d for d in decisions if isinstance(d, Refused)]

        assert len(admitted) == 10
        # Each admission's figures are the moment it was decided: one reservation more each.
        assert sorted(a.already_reserved_micros for a in admitted) == [
            n * 1_000_000 for n in range(10)]
        assert {a.used_micros for a in admitted} == {40_000_000}
        assert {r.message for r in refused} == {
            "would reach 51.00 usd against a 50.00 ceiling (40.00 used, 10.00 already"
            " reserved, 1.00 requested)"}
        today = await other.today()
        assert (today.used_micros, today.reserved_micros) == (40_000_000, 10_000_000)


async def test_ticket_landing_exactly_on_the_ceiling_is_admitted(tmp_path: Path) -> None:
    """Money is exact: 0.10 + 0.20 used and 0.20 asked reach 0.50, not a float above it."""
    clock = _Clock("2026-09-24T10:00:00+00:00")
    db = tmp_path / "bothy.sqlite3"
    async with _gate(db, clock, per_day_usd="0.50", per_run_usd="0.50") as gate:
        for usd in ("0.10", "0.20"):
            run = await _admit(gate, "0.20")
            await gate.fill(run.run_id, int(Decimal(usd) * 1_000_000), tokens=10)
            await gate.settle(run.run_id, outcome="completed", reason=None, final_text="")
        assert isinstance(await gate.admit(_ticket("0.20")), Admitted)
        refused = await gate.admit(_ticket("0.01"))
        assert isinstance(refused, Refused)
        assert refused.message == (
            "would reach 0.51 usd against a 0.50 ceiling (0.30 used, 0.20 already reserved,"
            " 0.01 requested)")


async def test_settle_releases_the_rest_of_the_reservation(tmp_path: Path) -> None:
    """A run that cost 0.0152 of its 3.00 settles at 0.0152 and frees 2.984800 for others."""
    clock = _Clock("2026-09-24T10:00:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock, per_day_usd="5.00") as gate:
        run = await _admit(gate, "3.00")
        assert isinstance(await gate.admit(_ticket("3.00")), Refused)
        await gate.fill(run.run_id, 15_200, tokens=128)
        settlement = await gate.settle(run.run_id, outcome="completed", reason=None,
                                       final_text="BOTHY")
        assert settlement == Settlement(run.run_id, cost_micros=15_200,
                                        reserved_micros=3_000_000, released_micros=2_984_800)
        today = await gate.today()
        assert (today.used_micros, today.reserved_micros) == (15_200, 0)
        assert isinstance(await gate.admit(_ticket("3.00")), Admitted)


async def test_fill_never_counts_the_same_spend_twice(tmp_path: Path) -> None:
    """Fill takes the cumulative cost: a repeated or stale report adds nothing."""
    clock = _Clock("2026-09-24T10:00:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        run = await _admit(gate, "3.00")
        assert await gate.fill(run.run_id, 15_200, tokens=128) == 15_200
        assert await gate.fill(run.run_id, 15_200, tokens=128) == 15_200
        assert (await gate.today()).used_micros == 15_200
        assert await gate.fill(run.run_id, 30_400, tokens=256) == 30_400
        assert await gate.fill(run.run_id, 20_000, tokens=200) == 30_400  # arrived late
        today = await gate.today()
        assert (today.used_micros, today.reserved_micros) == (30_400, 3_000_000 - 30_400)
