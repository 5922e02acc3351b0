"""Bothy's state: one SQLite database shared by every Bothy process on the machine.

Every connection runs WAL with ``synchronous=FULL`` (a committed gate decision survives a power
loss, not only a crash: contracts.md §8) and every write that decides something opens with
``BEGIN IMMEDIATE``, or is one writing statement (:meth:`StateDB.atomic`: it takes the write
lock before it reads), so that several processes see one truth: a deferred transaction that
read and then writes after another process committed fails at once with SQLITE_BUSY instead
of waiting (contracts.md §8, "the multi-process trap").

Times are integer microseconds since the epoch (UTC); money is integer micro-dollars.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

from bothy.errors import StateCorruptError, StateError
from bothy.footprint import SQLITE_PAGE_CACHE_PRAGMA

_SCHEMA_VERSION = 13  # 10: report_to + preflight on schedules; 11: wakes' payload place;
# 12: spare app-servers (engine/spare.py); 13: runs_crashed
_BUSY_TIMEOUT_MS = 30_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    seq                 INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id              TEXT NOT NULL UNIQUE,
    subject             TEXT NOT NULL,
    source              TEXT NOT NULL,
    status              TEXT NOT NULL CHECK (status IN ('queued', 'running', 'finished')),
    outcome             TEXT,
    reserved_micros     INTEGER NOT NULL,
    spent_micros        INTEGER NOT NULL DEFAULT 0,
    tokens              INTEGER NOT NULL DEFAULT 0,
    model               TEXT,
    admitted_us         INTEGER NOT NULL,
    started_us          INTEGER,
    finished_us         INTEGER,
    expires_us          INTEGER NOT NULL,
    owner_pid           INTEGER NOT NULL,
    owner_start         TEXT,
    pgid                INTEGER,
    leader_pid          INTEGER,
    leader_start        TEXT,
    cancel_requested_us INTEGER,
    crashed             INTEGER NOT NULL DEFAULT 0,
    reason              TEXT,
    final_text          TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status);
CREATE INDEX IF NOT EXISTS runs_by_lane ON runs (subject, seq);
-- The few runs a crash cut short: what an open run's reservation is summed over on every
-- admission is "queued or running, or crashed" (budget, plan windows, status), which without
-- it reads every run the site ever had (~13 ms at 100,000 runs, on each admission).
CREATE INDEX IF NOT EXISTS runs_crashed ON runs (crashed) WHERE crashed = 1;
CREATE TABLE IF NOT EXISTS spend (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id  TEXT NOT NULL,
    day     TEXT NOT NULL,
    micros  INTEGER NOT NULL,
    at_us   INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS spend_by_day ON spend (day);
CREATE TABLE IF NOT EXISTS groups (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id       TEXT NOT NULL,
    role         TEXT NOT NULL,
    pgid         INTEGER NOT NULL,
    leader_pid   INTEGER NOT NULL,
    leader_start TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS groups_by_run ON groups (run_id);
CREATE TABLE IF NOT EXISTS spares (
    pgid         INTEGER PRIMARY KEY,  -- a spare app-server no run has taken yet (schema 12)
    leader_pid   INTEGER NOT NULL,
    leader_start TEXT NOT NULL,
    owner_pid    INTEGER NOT NULL,     -- the bothy serve that started it
    owner_start  TEXT,
    started_us   INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS approvals (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    tool         TEXT NOT NULL,
    approved_by  TEXT NOT NULL,
    approved_us  INTEGER NOT NULL,
    run_id       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS approvals_by_tool ON approvals (tool, approved_us);
CREATE TABLE IF NOT EXISTS questions (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id       TEXT NOT NULL,
    kind         TEXT NOT NULL CHECK (kind IN ('approval', 'input')),
    tool         TEXT,
    text         TEXT NOT NULL,
    asked_us     INTEGER NOT NULL,
    deadline_us  INTEGER NOT NULL,
    status       TEXT NOT NULL CHECK (status IN ('pending', 'answered', 'timed_out', 'stopped')),
    answer       TEXT,
    answered_by  TEXT,
    answered_us  INTEGER
);
CREATE INDEX IF NOT EXISTS questions_by_run ON questions (run_id, status);
CREATE TABLE IF NOT EXISTS wakes (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    source       TEXT NOT NULL,
    route        TEXT NOT NULL,
    key          TEXT NOT NULL,
    event        TEXT NOT NULL,
    action       TEXT,
    status       TEXT NOT NULL
                 CHECK (status IN ('queued', 'running', 'done', 'ignored', 'abandoned')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    next_try_us  INTEGER NOT NULL,
    received_us  INTEGER NOT NULL,
    run_id       TEXT,
    file         TEXT NOT NULL,  -- '' (and no payload_at): no payload kept (ignored at intake)
    note         TEXT,
    finished_us  INTEGER,
    payload_at    INTEGER,  -- where its line is in the segment named by file (schema 10),
    payload_bytes INTEGER,  -- both NULL for a payload in a file of its own (before that)
    UNIQUE (source, route, key)
);
CREATE INDEX IF NOT EXISTS wakes_by_status ON wakes (status, received_us);
CREATE TABLE IF NOT EXISTS schedules (
    name           TEXT PRIMARY KEY,
    cron           TEXT NOT NULL,
    kind           TEXT NOT NULL CHECK (kind IN ('prompt', 'sop', 'heartbeat', 'dream')),
    prompt         TEXT,
    sop            TEXT,
    profile        TEXT,
    verify_argv    TEXT,  -- a JSON list of strings
    verify_regex   TEXT,
    max_usd_micros INTEGER,
    created_us     INTEGER NOT NULL,
    last_fire_us   INTEGER,
    next_fire_us   INTEGER,
    ref            TEXT,  -- its runs' task in Cairn (schema 8)
    report_to      TEXT,  -- where its findings go, e.g. slack:C0OPS (schema 10)
    preflight_argv TEXT,  -- a heartbeat's preflight command, a JSON list (schema 10)
    preflight_sha256 TEXT  -- the hash of the last fire's preflight output (schema 10)
);
CREATE TABLE IF NOT EXISTS chat_threads (
    thread_key   TEXT PRIMARY KEY,
    platform     TEXT NOT NULL,
    channel      TEXT NOT NULL,
    thread       TEXT NOT NULL,
    last_run_id  TEXT,
    last_answer  TEXT,
    codex_thread TEXT,
    updated_us   INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS report_posts (
    platform   TEXT NOT NULL,
    channel    TEXT NOT NULL,
    message    TEXT NOT NULL,  -- the post's id (Slack ts): a reply's thread
    run_id     TEXT NOT NULL,
    posted_us  INTEGER NOT NULL,
    PRIMARY KEY (platform, channel, message)
);
CREATE TABLE IF NOT EXISTS pollers (
    name          TEXT PRIMARY KEY,
    etag          TEXT,
    last_modified TEXT,
    body_sha256   TEXT,
    seen_ids      TEXT,
    changes       INTEGER NOT NULL DEFAULT 0,
    failures      INTEGER NOT NULL DEFAULT 0,
    last_failure  TEXT,
    next_due_us   INTEGER NOT NULL DEFAULT 0,
    polled_us     INTEGER
);
CREATE TABLE IF NOT EXISTS task_claims (
    run_id      TEXT PRIMARY KEY,
    ref         TEXT NOT NULL,
    subject     TEXT NOT NULL,
    claimed_us  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS plan_windows (
    name          TEXT PRIMARY KEY CHECK (name IN ('primary', 'secondary')),
    used_percent  INTEGER NOT NULL,
    window_mins   INTEGER,
    resets_at_us  INTEGER,
    seen_us       INTEGER NOT NULL,
    run_id        TEXT
);
CREATE TABLE IF NOT EXISTS plan_reservations (
    run_id             TEXT PRIMARY KEY,
    percent            INTEGER NOT NULL,
    learning           INTEGER NOT NULL DEFAULT 0,
    primary_at_admit   INTEGER,
    secondary_at_admit INTEGER
);
"""

_ADDED_COLUMNS = (  # (table, column, type), oldest first
    ("schedules", "ref", "TEXT"),
    ("schedules", "report_to", "TEXT"),
    ("schedules", "preflight_argv", "TEXT"),
    ("schedules", "preflight_sha256", "TEXT"),
    ("wakes", "payload_at", "INTEGER"),
    ("wakes", "payload_bytes", "INTEGER"),
)


@dataclass(frozen=True)
class RunRow:
    """One row of the ``runs`` table."""

    seq: int
    run_id: str
    subject: str
    source: str
    status: str
    outcome: str | None
    reserved_micros: int
    spent_micros: int
    tokens: int
    model: str | None
    admitted_us: int
    started_us: int | None
    finished_us: int | None
    expires_us: int
    owner_pid: int
    owner_start: str | None
    pgid: int | None
    leader_pid: int | None
    leader_start: str | None
    cancel_requested_us: int | None
    crashed: int
    reason: str | None
    final_text: str | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> RunRow:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


class StateDB:
    """An open connection to the state database. Use ``async with StateDB.open(path)``."""

    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._db = connection
        # One connection is shared by every coroutine of a process (webhook intake, the
        # dispatcher, the gates): their transactions must take turns, or a second BEGIN
        # fails with "cannot start a transaction within a transaction".
        self._transaction_lock = asyncio.Lock()

    @classmethod
    @asynccontextmanager
    async def open(cls, path: Path) -> AsyncIterator[StateDB]:
        try:
            connection = await aiosqlite.connect(
                path, isolation_level=None, timeout=_BUSY_TIMEOUT_MS / 1000
            )
        except sqlite3.Error as exc:
            raise StateError(f"cannot open the state database {path}: {exc}") from exc
        try:
            connection.row_factory = aiosqlite.Row
            db = cls(connection)
            await db._prepare(path)
            yield db
        finally:
            await connection.close()

    async def _prepare(self, path: Path) -> None:
        try:
            await self._db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            await self._db.execute("PRAGMA journal_mode = WAL")
            await self._db.execute(SQLITE_PAGE_CACHE_PRAGMA)  # a serve lives for months
            await self._db.execute("PRAGMA synchronous = FULL")
            if sys.platform == "darwin":
                # macOS fsync does not reach the platter; F_FULLFSYNC does (contracts.md §7).
                await self._db.execute("PRAGMA fullfsync = 1")
                await self._db.execute("PRAGMA checkpoint_fullfsync = 1")
            async with self._db.execute("PRAGMA user_version") as cursor:
                row = await cursor.fetchone()
            if row is not None and row[0] >= _SCHEMA_VERSION:
                return
            async with self.transaction():
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        await self._db.execute(statement)
                await self._add_missing_columns()
                await self._allow_dream_schedules()
                await self._db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            if corrupt := StateCorruptError.from_sqlite(path, exc):
                raise corrupt from exc
            raise StateError(f"cannot prepare the state database {path}: {exc}") from exc
        await asyncio.to_thread(path.chmod, 0o600)

    async def _add_missing_columns(self) -> None:
        """Columns added since a table was first created (CREATE IF NOT EXISTS keeps the old
        shape): added to a database made by an earlier Bothy."""
        for table, column, kind in _ADDED_COLUMNS:
            rows = await self.fetch_all(f"PRAGMA table_info({table})")
            if column not in {row["name"] for row in rows}:
                await self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    async def _allow_dream_schedules(self) -> None:
        """Version 9: a schedules table made before dreams existed gets the new kind (SQLite
        cannot alter a CHECK constraint: the table is copied into one that has it)."""
        async with self._db.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'schedules'"
        ) as cursor:
            row = await cursor.fetchone()
        if row is None or "'dream'" in str(row[0]):
            return
        await self._db.execute("ALTER TABLE schedules RENAME TO schedules_before_dreams")
        create = _SCHEMA[_SCHEMA.index("CREATE TABLE IF NOT EXISTS schedules"):]
        await self._db.execute(create[: create.index(";")])
        rows = await self.fetch_all("PRAGMA table_info(schedules_before_dreams)")
        columns = ", ".join(str(row["name"]) for row in rows)
        await self._db.execute(f"INSERT INTO schedules ({columns})"
                               f" SELECT {columns} FROM schedules_before_dreams")
        await self._db.execute("DROP TABLE schedules_before_dreams")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[StateDB]:
        """A write transaction taken with BEGIN IMMEDIATE; committed on success.

        Transactions on this connection take turns (not re-entrant: do not nest them).
        """
        async with self._transaction_lock:
            try:
                await self._to_its_end("BEGIN IMMEDIATE")
            except asyncio.CancelledError:
                if self._db.in_transaction:  # begun after all: the caller will not go on
                    await self._to_its_end("ROLLBACK")
                raise
            try:
                yield self
            except BaseException:
                await self._to_its_end("ROLLBACK")
                raise
            else:
                await self._to_its_end("COMMIT")

    async def _to_its_end(self, sql: str) -> None:
        """Run a statement that begins or ends a transaction to its end, even if the caller is
        cancelled meanwhile (then the cancellation is raised once it has ended).

        aiosqlite runs a statement on in its thread whatever happens to the awaiting task: a
        BEGIN cancelled half-way would otherwise leave the connection inside a transaction
        nobody ends, and every later one would fail ("cannot start a transaction within a
        transaction") for the life of the process.
        """
        statement = asyncio.ensure_future(self._db.execute(sql))
        try:
            await asyncio.shield(statement)
        except asyncio.CancelledError:
            if not statement.done():
                await asyncio.wait({statement})
            if not statement.cancelled():
                statement.exception()  # seen here: the cancellation is what is raised
            raise

    async def atomic(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """Run one statement as a transaction of its own; return the rows it returns.

        SQLite makes a single statement atomic, and a writing statement takes the write lock
        before it reads, as BEGIN IMMEDIATE would; a reading one sees one committed snapshot
        (never another coroutine's transaction half-done: it takes its turn). One round trip
        to the database thread instead of three (BEGIN, the statement, COMMIT): for hot paths
        such as the inbox's group commit and the budget gate. Takes its turn with
        :meth:`transaction`; do not call it inside one.
        """
        async with self._transaction_lock:
            return list(await self._db.execute_fetchall(sql, params))

    async def execute(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """Run a statement; return the number of rows it changed."""
        cursor = await self._db.execute(sql, params)
        changed = cursor.rowcount
        await cursor.close()
        return changed

    async def fetch_all(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        # One round trip to the database thread, not three (execute, fetch, close): each
        # costs the event loop ~50-90 us of CPU here, more than a small query itself.
        return list(await self._db.execute_fetchall(sql, params))

    async def fetch_one(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        """The first row, or None. For a query of one row (by key, ``LIMIT 1``, an
        aggregate): every row it yields is fetched, in one round trip (see ``fetch_all``)."""
        rows = list(await self._db.execute_fetchall(sql, params))
        return rows[0] if rows else None

    async def scalar(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        row = await self.fetch_one(sql, params)
        if row is None or row[0] is None:
            return 0
        return int(row[0])

    async def run(self, run_id: str) -> RunRow | None:
        row = await self.fetch_one("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return RunRow.from_row(row) if row is not None else None

    async def runs_with_status(self, *statuses: str) -> list[RunRow]:
        marks = ",".join("?" for _ in statuses)
        rows = await self.fetch_all(
            f"SELECT * FROM runs WHERE status IN ({marks}) ORDER BY seq", tuple(statuses)
        )
        return [RunRow.from_row(row) for row in rows]
