"""The local search index of a profile's day notes: SQLite, FTS5 where it exists.

One file per profile (``index.sqlite3``), written only under the profile's lock. The table
``notes`` holds each note with where it came from (its run, and whether that run was
trusted: provenance the model cannot write through prose); ``notes_fts`` is an FTS5
external-content index over it, ranked by BM25.

FTS5 pitfalls handled here (research note §A.4): every query token is quoted, so ``ACME-12``,
``it's``, ``gateway/run.py`` or ``--force`` are phrases, never syntax; where FTS5 is missing
(the probe fails) or the profile sets ``"search": "scan"``, a case-insensitive scan answers
instead. Deleted notes must not linger in the file: ``secure_delete`` zeroes freed pages, the
FTS5 index is merged after deletions (its old segments still hold the tokens otherwise), the
file is vacuumed, and the journal is a rollback journal (a WAL would keep old pages).
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY,
    day TEXT NOT NULL,
    n INTEGER NOT NULL,
    text TEXT NOT NULL,
    run_id TEXT,
    trusted INTEGER NOT NULL,
    UNIQUE (day, n)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_FTS_TABLE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS notes_fts USING fts5("
    "text, content='notes', content_rowid='id', tokenize='unicode61')"
)
_SNIPPET_CHARS = 300


@dataclass(frozen=True)
class Note:
    """One day note, as the index holds it. ``ref`` is how tools and the CLI name it."""

    id: int
    day: str
    n: int
    text: str
    run_id: str | None
    trusted: bool

    @property
    def ref(self) -> str:
        return f"{self.day}#{self.n}"


def probe_fts5(connect: Callable[[], sqlite3.Connection] | None = None) -> str | None:
    """Whether FTS5 really works here: create a table, index a row, match it.

    Returns None when it does, or the reason it does not (SQLite's own error).
    """
    db = connect() if connect else sqlite3.connect(":memory:")
    try:
        db.execute("CREATE VIRTUAL TABLE probe USING fts5(text)")
        db.execute("INSERT INTO probe (text) VALUES ('bothy probe')")
        found = db.execute("SELECT count(*) FROM probe WHERE probe MATCH '\"probe\"'").fetchone()
        return None if found == (1,) else "an FTS5 match found nothing"
    except sqlite3.Error as exc:
        return str(exc)
    finally:
        db.close()


def fts_query(query: str) -> str:
    """``query`` as an FTS5 expression: each whitespace-separated token a quoted phrase.

    NUL ends a string for SQLite's FTS5 parser ("unterminated string"): it is dropped.
    """
    tokens = [token.replace("\x00", "") for token in query.split()]
    return " ".join('"' + token.replace('"', '""') + '"' for token in tokens if token)


@dataclass(frozen=True)
class SearchMode:
    """How a profile's notes are searched, and why."""

    fts5: bool
    why: str


@functools.cache
def _probe_once() -> str | None:
    return probe_fts5()


def search_mode(setting: str, probe: Callable[[], str | None] = _probe_once) -> SearchMode:
    """FTS5 unless the profile forces the scan or the probe (run once per process) fails."""
    if setting == "scan":
        return SearchMode(False, "case-insensitive scan (forced by the profile's memory.search)")
    return _mode(probe())


def _mode(problem: str | None) -> SearchMode:
    if problem is None:
        return SearchMode(True, "FTS5 search")
    return SearchMode(False, f"case-insensitive scan (FTS5 is missing: {problem})")


class SearchIndex:
    """The index file of one profile. ``fts5`` says whether searches use FTS5 or the scan.

    The FTS5 table is kept in step only by FTS5-mode writes; a scan-mode write marks it
    stale (``meta.fts_synced``) and the next FTS5-mode open rebuilds it from ``notes``.
    """

    def __init__(self, path: Path, *, fts5: bool) -> None:
        self.path = path
        self.fts5 = fts5
        self._checked_sync = False

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA secure_delete = ON")
            db.execute("PRAGMA journal_mode = DELETE")
            db.execute("PRAGMA synchronous = FULL")
            db.executescript(_SCHEMA)
            if self.fts5:
                db.execute(_FTS_TABLE)
                if not self._checked_sync:
                    self._resync(db)
            yield db
        finally:
            db.close()

    def _resync(self, db: sqlite3.Connection) -> None:
        row = db.execute("SELECT value FROM meta WHERE key = 'fts_synced'").fetchone()
        if row is None or row[0] != "1":
            db.execute("INSERT INTO notes_fts (notes_fts) VALUES ('rebuild')")
            _set_meta(db, "fts_synced", "1")
        self._checked_sync = True

    def add(self, day: str, n: int, text: str, *, run_id: str | None, trusted: bool) -> None:
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            cursor = db.execute(
                "INSERT INTO notes (day, n, text, run_id, trusted) VALUES (?, ?, ?, ?, ?)",
                (day, n, text, run_id, int(trusted)),
            )
            if self.fts5:
                db.execute("INSERT INTO notes_fts (rowid, text) VALUES (?, ?)",
                           (cursor.lastrowid, text))
            else:
                _set_meta(db, "fts_synced", "0")
            db.execute("COMMIT")

    def search(self, query: str, *, limit: int = 10) -> list[Note]:
        """The notes matching every token of ``query``, best first (FTS5) or newest first."""
        if not query.replace("\x00", "").split():
            return []
        with self._db() as db:
            if self.fts5:
                rows = db.execute(
                    "SELECT notes.id, day, n, notes.text, run_id, trusted FROM notes_fts"
                    " JOIN notes ON notes.id = notes_fts.rowid WHERE notes_fts MATCH ?"
                    " ORDER BY rank LIMIT ?", (fts_query(query), limit),
                ).fetchall()
                return [_note(row) for row in rows]
            tokens = [token.casefold() for token in query.split()]
            found: list[Note] = []
            for row in db.execute("SELECT id, day, n, text, run_id, trusted FROM notes"
                                  " ORDER BY id DESC"):
                folded = str(row[3]).casefold()
                if all(token in folded for token in tokens):
                    found.append(_note(row))
                    if len(found) >= limit:
                        break
            return found

    def day(self, day: str) -> list[Note]:
        with self._db() as db:
            rows = db.execute("SELECT id, day, n, text, run_id, trusted FROM notes"
                              " WHERE day = ? ORDER BY n", (day,)).fetchall()
        return [_note(row) for row in rows]

    def last_n(self, day: str) -> int:
        with self._db() as db:
            row = db.execute("SELECT max(n) FROM notes WHERE day = ?", (day,)).fetchone()
        return int(row[0] or 0)

    def since(self, after_id: int, *, trusted_only: bool) -> list[Note]:
        """Notes newer than ``after_id`` (the dream's cursor), oldest first."""
        with self._db() as db:
            rows = db.execute(
                "SELECT id, day, n, text, run_id, trusted FROM notes WHERE id > ?"
                + (" AND trusted = 1" if trusted_only else "") + " ORDER BY id", (after_id,),
            ).fetchall()
        return [_note(row) for row in rows]

    def days_before(self, day: str) -> list[str]:
        """The days older than ``day`` that still have notes in the index."""
        with self._db() as db:
            rows = db.execute("SELECT DISTINCT day FROM notes WHERE day < ? ORDER BY day",
                              (day,)).fetchall()
        return [str(row[0]) for row in rows]

    def get_meta(self, key: str, default: str) -> str:
        with self._db() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self._db() as db:
            _set_meta(db, key, value)

    def forget_days(self, days: list[str]) -> int:
        """Delete every note of ``days`` so that none of their text is left in the file."""
        if not days:
            return 0
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            marks = ",".join("?" * len(days))
            rows = db.execute(f"SELECT id, text FROM notes WHERE day IN ({marks})",
                              days).fetchall()
            if self.fts5:
                db.executemany("INSERT INTO notes_fts (notes_fts, rowid, text)"
                               " VALUES ('delete', ?, ?)", rows)
            db.execute(f"DELETE FROM notes WHERE day IN ({marks})", days)
            if not self.fts5:
                # The scan cannot update an FTS5 table: drop it (its segments hold the
                # deleted tokens); an FTS5-mode open rebuilds it from what is left.
                with contextlib.suppress(sqlite3.Error):
                    db.execute("DROP TABLE IF EXISTS notes_fts")
                _set_meta(db, "fts_synced", "0")
            db.execute("COMMIT")
            if self.fts5:
                db.execute("INSERT INTO notes_fts (notes_fts) VALUES ('optimize')")
            db.execute("VACUUM")
        return len(rows)


def _set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key)"
               " DO UPDATE SET value = excluded.value", (key, value))


def _note(row: tuple[object, ...]) -> Note:
    return Note(id=int(str(row[0])), day=str(row[1]), n=int(str(row[2])),
                text=str(row[3]), run_id=None if row[4] is None else str(row[4]),
                trusted=bool(row[5]))


def snippet(text: str) -> str:
    """One line of a note, short enough for a listing."""
    line = " ".join(text.split())
    return line if len(line) <= _SNIPPET_CHARS else line[: _SNIPPET_CHARS - 3] + "..."
