"""Gate decisions with 8 concurrent processes: decisions/s, and zero overspend.

Each process admits tickets against one shared state database (the real BudgetGate, the real
BEGIN IMMEDIATE transactions), fills each admitted run with its full cost and settles it. The
ceiling is small enough that most tickets are refused, so the race is real. Afterwards the
ledger's total must not exceed the ceiling.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import shutil
import time
from decimal import Decimal
from pathlib import Path

from bench._util import scratch

PROCESSES = 8
TICKETS_PER_PROCESS = 150
PER_RUN_USD = Decimal("3.00")
PER_DAY_USD = Decimal("50.00")


def _cfg():  # type: ignore[no-untyped-def]
    from bothy.config import BudgetConfig

    return BudgetConfig(per_run_usd=PER_RUN_USD, per_day_usd=PER_DAY_USD,
                        reservation_expiry_s=3600)


async def _decide(db_path: Path, worker: int, go: float) -> tuple[int, int]:
    from bothy.clock import utc_now
    from bothy.engine.budget import Admitted, BudgetGate, Ticket
    from bothy.engine.prices import PriceTable
    from bothy.engine.state import StateDB

    admitted = refused = 0
    async with StateDB.open(db_path) as db:
        gate = BudgetGate(db, _cfg(), PriceTable({}), clock=utc_now)
        await asyncio.sleep(max(0.0, go - time.time()))
        for n in range(TICKETS_PER_PROCESS):
            run_id = f"run_bench_{worker}_{n}"
            ticket = Ticket(run_id, f"lane{worker}", "bench", gate.per_run_micros, worker, "x")
            decision = await gate.admit(ticket)
            if isinstance(decision, Admitted):
                admitted += 1
                # Spend all of it, so the ceiling is really reached, then settle.
                await gate.fill(run_id, gate.per_run_micros, 100)
                await gate.settle(run_id, outcome="completed", reason=None, final_text="")
            else:
                refused += 1
    return admitted, refused


def _child(db_path: Path, worker: int, go: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(asyncio.run(_decide(db_path, worker, go)))


async def _prepare(db_path: Path) -> None:
    from bothy.engine.state import StateDB

    async with StateDB.open(db_path):
        pass


async def _total_spent(db_path: Path) -> int:
    from bothy.engine.state import StateDB

    async with StateDB.open(db_path) as db:
        return await db.scalar("SELECT SUM(micros) FROM spend")


def main() -> None:
    root = scratch("gates-")
    db_path = root / "state.sqlite3"
    asyncio.run(_prepare(db_path))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    go = time.time() + 1.5  # every child is up before any decides
    children = [ctx.Process(target=_child, args=(db_path, n, go, out)) for n in range(PROCESSES)]
    for child in children:
        child.start()
    results = [out.get(timeout=300) for _ in children]
    elapsed = time.time() - go
    for child in children:
        child.join()
    decisions = PROCESSES * TICKETS_PER_PROCESS
    admitted = sum(a for a, _ in results)
    spent = asyncio.run(_total_spent(db_path))
    ceiling = int(PER_DAY_USD * 1_000_000)
    print(f"   gate decisions, {PROCESSES} processes: {decisions / elapsed:,.0f} decisions/s"
          " (admit, and for each admitted run a fill and a settlement; no target set)")
    print(f"   admitted {admitted}, refused {decisions - admitted}; spent {spent / 1e6:.2f} usd"
          f" of a {ceiling / 1e6:.2f} ceiling: overspend {max(spent - ceiling, 0) / 1e6:.2f} usd"
          f" ({'none' if spent <= ceiling else 'OVERSPENT'})")
    shutil.rmtree(root, ignore_errors=True)
