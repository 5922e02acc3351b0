"""A state database transaction cancelled while it begins (a stop arriving as serve writes):
the connection is left usable, as every later writer of the daemon needs it.

Found by the stop matrix: a spare app-server's start, cancelled by SIGTERM while its row's
BEGIN IMMEDIATE waited in aiosqlite's thread, left the connection inside a transaction nobody
ended, and ``bothy serve`` exited 1 with "cannot start a transaction within a transaction".
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from bothy.engine.state import StateDB


async def _approve(db: StateDB, tool: str, begun: asyncio.Event | None = None) -> None:
    if begun is not None:
        begun.set()  # its waiter runs once this task is suspended in the BEGIN below
    async with db.transaction():
        await db.execute("INSERT INTO approvals (tool, approved_by, approved_us, run_id)"
                         " VALUES (?, 'U1', 1, 'run_1')", (tool,))


async def test_a_transaction_cancelled_while_it_begins_leaves_the_connection_usable(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bothy.sqlite3"
    async with StateDB.open(path) as db:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # holds the write lock: our BEGIN waits behind it
        begun = asyncio.Event()
        cancelled = asyncio.create_task(_approve(db, "first", begun))
        await begun.wait()  # its BEGIN is handed to aiosqlite's thread, waiting for the lock
        cancelled.cancel()
        other.execute("ROLLBACK")  # the BEGIN now goes through, after its caller was cancelled
        other.close()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await _approve(db, "second")  # the next writer is not inside a leftover transaction
        tools = [row["tool"] for row in await db.fetch_all("SELECT tool FROM approvals")]
    assert tools == ["second"]
