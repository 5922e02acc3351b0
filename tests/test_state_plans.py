"""An aged site's admissions stay as quick as a new one's: the statements every admission,
claim and `bothy status` run look up the few open runs through an index, never by reading
every run the site ever had (issue 18: at 100,000 finished runs, a reservation sum and a
busy count that read them all took ~13 ms each, on every admission, and grew with the site).

Counted, not timed: SQLite's progress handler counts the virtual-machine steps a statement
takes, on the real schema made by :class:`~bothy.engine.state.StateDB`, with a site's few open
runs (queued, running, one cut short by a crash, a worker still stopping) beside 50 finished
runs, then beside 5,000. The count must not grow with the finished runs.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from bothy import status
from bothy.engine import budget, plan, pool
from bothy.engine.state import StateDB

# Every statement of the admission path that reads open runs, and `bothy status`'s.
STATEMENTS = {
    "budget figures": budget._FIGURES,
    "pool busy": pool._BUSY,
    "pool claim": pool._CLAIM,
    "plan reserved": plan._RESERVED_PERCENT,
    "plan learners": plan._LEARNERS,
    "status live runs": status._LIVE_RUNS,
    "status plan reserved": status._PLAN_RESERVED,
}
_STEPS_PER_TICK = 10


def _site(path: Path, finished: int) -> sqlite3.Connection:
    """A state database with ``finished`` finished runs and a site's few open ones."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN")
    runs = [(f"run_20260601T000000Z_{n:08x}", f"pr:{n % 50}", "finished", 0)
            for n in range(finished)]
    runs += [("run_20261206T000000Z_queued00", "pr:1", "queued", 0),
             ("run_20261206T000000Z_running0", "pr:2", "running", 0),
             ("run_20261206T000000Z_crashed0", "pr:3", "finished", 1),
             ("run_20261206T000000Z_stopping", "pr:4", "finished", 0)]
    db.executemany(
        "INSERT INTO runs (run_id, subject, source, status, crashed, reserved_micros,"
        " admitted_us, expires_us, owner_pid) VALUES (?, ?, 'webhook', ?, ?, 500000, 1,"
        " 9000000000000000, 1)", runs)
    db.executemany("INSERT INTO plan_reservations (run_id, percent, learning) VALUES (?, 1, 0)",
                   [(run[0],) for run in runs])
    db.execute("INSERT INTO groups (run_id, role, pgid, leader_pid, leader_start)"
               " VALUES ('run_20261206T000000Z_stopping', 'worker', 4242, 4242, 'x')")
    db.execute("COMMIT")
    return db


def _steps(db: sqlite3.Connection, statement: str) -> int:
    """How many virtual-machine steps the statement took (to ``_STEPS_PER_TICK``)."""
    ticks = 0

    def tick() -> int:
        nonlocal ticks
        ticks += 1
        return 0

    args = tuple(1 for _ in range(statement.count("?")))
    db.set_progress_handler(tick, _STEPS_PER_TICK)
    try:
        db.execute("SAVEPOINT counted")
        db.execute(statement, args).fetchall()
        db.execute("ROLLBACK TO counted")
        db.execute("RELEASE counted")
    finally:
        db.set_progress_handler(None, 0)
    return ticks * _STEPS_PER_TICK


async def _made(path: Path) -> Path:
    async with StateDB.open(path):
        pass
    return path


@pytest.mark.parametrize("name", sorted(STATEMENTS))
async def test_a_statement_over_open_runs_takes_as_long_beside_5000_finished_runs_as_50(
    tmp_path: Path, name: str
) -> None:
    young = _site(await _made(tmp_path / "young.sqlite3"), 50)
    aged = _site(await _made(tmp_path / "aged.sqlite3"), 5_000)

    young_steps, aged_steps = _steps(young, STATEMENTS[name]), _steps(aged, STATEMENTS[name])

    assert aged_steps <= young_steps + 50, (name, young_steps, aged_steps)


async def test_a_database_of_the_schema_before_gets_the_index_as_it_opens(
    tmp_path: Path,
) -> None:
    path = await _made(tmp_path / "bothy.sqlite3")
    older = _site(path, 5_000)
    older.execute("DROP INDEX runs_crashed")
    older.execute("PRAGMA user_version = 12")
    before = _steps(older, budget._FIGURES)
    older.close()

    await _made(path)

    reopened = sqlite3.connect(path, isolation_level=None)
    assert _steps(reopened, budget._FIGURES) < before / 10
    assert reopened.execute("PRAGMA user_version").fetchone()[0] == 13
