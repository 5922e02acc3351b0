"""Who may start now (``engine/pool.py``): each rule of a pool slot's claim, one by one, with
runs admitted by the real budget gate into a real state database.

A claim is one writing statement when every rule lets the run go; a run that must wait has
the rules read again to say which holds it. These tests hold each rule in turn, so that a
rule written wrong in either place shows: the run claims when it must wait, or waits naming
the wrong reason.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from bothy.clock import utc_now
from bothy.config import BudgetConfig, PoolConfig
from bothy.engine.budget import Admitted, BudgetGate, Ticket
from bothy.engine.pool import Claimed, Waiting, WorkerPool
from bothy.engine.prices import PriceTable
from bothy.engine.procgroup import GroupRecord, process_start_time
from bothy.engine.state import StateDB
from tests.fakes.site import FAKE_PRICE


@dataclass
class _Site:
    gate: BudgetGate
    pool: WorkerPool


@asynccontextmanager
async def _site(path: Path, max_workers: int) -> AsyncIterator[_Site]:
    cfg = BudgetConfig(per_run_usd=Decimal("1.00"), per_day_usd=Decimal("50.00"),
                       prices={"fake-model": FAKE_PRICE})
    async with StateDB.open(path) as db:
        yield _Site(BudgetGate(db, cfg, PriceTable(cfg.prices), clock=utc_now),
                    WorkerPool(db, PoolConfig(max_workers=max_workers), clock=utc_now))


@pytest.fixture
async def one_worker(tmp_path: Path) -> AsyncIterator[_Site]:
    async with _site(tmp_path / "bothy.sqlite3", 1) as site:
        yield site


async def _admitted(site: _Site, subject: str) -> str:
    ticket = Ticket(f"run_20261206T000000Z_{secrets.token_hex(4)}", subject, "test", 100_000,
                    os.getpid(), process_start_time(os.getpid()), "fake-model")
    assert isinstance(await site.gate.admit(ticket), Admitted)
    return ticket.run_id


async def _finished(site: _Site, run_id: str) -> None:
    await site.gate.settle(run_id, outcome="completed", reason=None, final_text="")


_GROUP = GroupRecord(pgid=4242, leader_pid=4242, leader_start="1")


async def test_a_run_behind_another_in_its_lane_waits_naming_it(one_worker: _Site) -> None:
    """The second run of a lane waits for the first, named, until it has finished."""
    first, second = await _admitted(one_worker, "pr:1"), await _admitted(one_worker, "pr:1")
    assert await one_worker.pool.try_claim(first) == Claimed(first)
    assert await one_worker.pool.try_claim(second) == Waiting(f"behind {first} in lane pr:1")
    await _finished(one_worker, first)
    assert await one_worker.pool.try_claim(second) == Claimed(second)


async def test_a_finished_run_whose_worker_still_stops_holds_its_lane(tmp_path: Path) -> None:
    """A run told its answer while its worker stops keeps its lane: the next run of its
    thread waits, saying so, though a slot is free (a run of another lane takes it), until
    `worker stopped`."""
    async with _site(tmp_path / "bothy.sqlite3", 2) as two_workers:
        first = await _stopping(two_workers, "chat:t1")
        reply, other = (await _admitted(two_workers, "chat:t1"),
                        await _admitted(two_workers, "pr:2"))

        assert await two_workers.pool.try_claim(reply) == Waiting(
            f"behind {first} in lane chat:t1: its worker is stopping")
        assert await two_workers.pool.try_claim(other) == Claimed(other)
        await two_workers.pool.worker_stopped(first)
        assert await two_workers.pool.try_claim(reply) == Claimed(reply)


async def test_a_finished_run_whose_worker_still_stops_holds_its_slot(one_worker: _Site) -> None:
    """... and its slot: a run of another lane finds the pool full until `worker stopped`."""
    first = await _stopping(one_worker, "chat:t1")
    other = await _admitted(one_worker, "pr:2")

    assert await one_worker.pool.try_claim(other) == Waiting("pool full (1 of 1 workers busy)")
    await one_worker.pool.worker_stopped(first)
    assert await one_worker.pool.try_claim(other) == Claimed(other)


async def _stopping(site: _Site, subject: str) -> str:
    """A run that claimed its slot, had a worker, and finished; its worker not yet stopped."""
    run_id = await _admitted(site, subject)
    assert await site.pool.try_claim(run_id) == Claimed(run_id)
    await site.pool.attach_worker(run_id, _GROUP)
    await _finished(site, run_id)
    return run_id


async def test_a_free_slot_goes_to_the_earliest_admitted_run_that_may_go(
    one_worker: _Site
) -> None:
    """With the slot free, a run admitted later waits while an earlier one whose lane is free
    is still queued, naming it; the earlier one claims, and the later waits for the slot."""
    busy = await _admitted(one_worker, "pr:1")
    assert await one_worker.pool.try_claim(busy) == Claimed(busy)
    earlier, later = await _admitted(one_worker, "pr:2"), await _admitted(one_worker, "pr:3")
    await _finished(one_worker, busy)

    assert await one_worker.pool.try_claim(later) == Waiting(
        f"pool slot due first to {earlier}, admitted earlier")
    assert await one_worker.pool.try_claim(earlier) == Claimed(earlier)
    assert await one_worker.pool.try_claim(later) == Waiting("pool full (1 of 1 workers busy)")


async def test_a_run_waiting_behind_its_lane_does_not_hold_back_a_later_lane(
    tmp_path: Path
) -> None:
    """An earlier run that may not go (the run ahead in its lane works) is not due the free
    slot: a later run of a free lane takes it."""
    async with _site(tmp_path / "bothy.sqlite3", 2) as two_workers:
        busy = await _admitted(two_workers, "pr:1")
        assert await two_workers.pool.try_claim(busy) == Claimed(busy)
        behind = await _admitted(two_workers, "pr:1")
        later = await _admitted(two_workers, "pr:2")

        assert await two_workers.pool.try_claim(behind) == Waiting(f"behind {busy} in lane pr:1")
        assert await two_workers.pool.try_claim(later) == Claimed(later)
