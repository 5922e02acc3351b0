"""The register's index by run id: where each run's records lie, kept beside the register.

``bothy trace RUN`` and ``bothy audit --run RUN`` read one run's records through it instead of
the whole register (a year of records is a million lines). :class:`RunIndex` is an SQLite file
beside the register (``<register>.index``) holding, for each record of a run (and each wake
record, under its wake id), the segment file, the byte offset and the seq of its line; and
the point it is complete up to (the current file's identity, the offset, seq and hash of the
last record it covers).

The writer keeps it at one hook, :meth:`RunIndex.note`, called after a record is durable, with
the records just written and where. A note never fails an append and never waits: on a busy
or broken index it is skipped, and the index is merely behind.

An index never decides truth, it only says where to look:

- Behind (a skipped note, a note the writer keeps pending during a burst of group commits,
  a crash between the fsync and the note): a reader indexes what was
  appended after the point it covers, reading only those bytes.
- Missing, stale (the point it covers is not in the register any more: a repair started a new
  segment, the file was replaced) or corrupt: it is rebuilt from the register, across segments.
- Every record read through it is checked: its line parses, its hash matches its content, its
  seq is the one the index gave, and it belongs to the run asked about. A record that fails
  any check makes the index rebuilt once; if it still fails, the whole register is scanned.
  An entry pointing at another run's record therefore never shows it. What an index cannot
  prove is that it lists every record of the run: an index with entries deleted hides them
  until it is rebuilt (``audit verify`` checks the register itself, never the index).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from bothy.engine.auditfile import lock_path_for, settled_size
from bothy.engine.auditrecord import AuditRecord, body_of, parse_line
from bothy.footprint import SQLITE_PAGE_CACHE_PRAGMA

if TYPE_CHECKING:
    from bothy.engine.audit import AuditLog

__all__ = ["RunIndex", "belongs_to", "wake_id_for", "wake_key"]

_VERSION = 1
_CATCH_UP_MAX_BYTES = 1 << 20  # a writer indexes a gap this small itself; a reader any gap
_READ_CHUNK_BYTES = 8192
_READER_BUSY_MS = 5000
_FILE_MODE = 0o600
_WAKE = "wake:"


def belongs_to(record: AuditRecord, run_id: str) -> bool:
    """The run's own records, and the record of the wake that asked for it (which has no run
    yet: its details carry the wake id the run's records name)."""
    if record.run_id is not None:
        return record.run_id == run_id
    return record.kind == "wake" and record.details.get("wake_id") == wake_id_for(run_id)


def wake_key(wake_id: str) -> str:
    """The index's key for a wake's record: the wake id, marked so it is never a run id."""
    return _WAKE + wake_id


def _key_of(record: AuditRecord) -> str | None:
    if record.run_id is not None:
        return record.run_id
    wake_id = record.details.get("wake_id")
    if record.kind == "wake" and isinstance(wake_id, str):
        return wake_key(wake_id)
    return None


def wake_id_for(run_id: str) -> str:
    """The id of the wake that asked for run ``run_id``: ``wake_`` and the run id's stamp.

    A wake has no run yet when it is recorded (``wake received ok pr:42 -``); its record
    carries this id in its details, and the run's first records name it, so the wake is found
    from the run. Each attempt of a delivery is a wake of its own, with a fresh run id.
    (``bothy.engine.run.wake_id_for`` is this function.)"""
    return "wake_" + run_id.removeprefix("run_")


class _Point(NamedTuple):  # (a NamedTuple, not a dataclass: cheaper to define at each start)
    """What the index covers: the current file up to ``offset``, whose last record it names."""

    dev: int
    ino: int
    offset: int
    seq: int
    hash: str


class _Entry(NamedTuple):
    key: str
    seq: int
    segment: str
    offset: int


class _Unreadable(Exception):
    """The register could not be indexed (a line that is no record): scan it instead."""


class RunIndex:
    """The index by run id of the register at ``register`` (see the module's docstring).

    ``on_rebuild`` is called before the index is built from the whole register (a command
    says so: at a million records that takes seconds, once).
    """

    def __init__(self, register: Path, *, on_rebuild: Callable[[], None] | None = None) -> None:
        self.register = register
        self._on_rebuild = on_rebuild
        self.path = register.with_name(register.name + ".index")
        self._lock_path = lock_path_for(register)
        self._writer: sqlite3.Connection | None = None
        self._writer_ino: int | None = None

    # -- the writer's hook --------------------------------------------------------------------

    def note(self, written: os.stat_result, placed: Sequence[tuple[int, AuditRecord]]) -> None:
        """Records just made durable in the register (``written``: its stat after the write),
        each with the offset of its line; called under the writers' lock. Never raises."""
        if not placed:
            return
        try:
            self._note(written, placed)
        except (sqlite3.Error, OSError, ValueError):
            self._close_writer()  # behind, not wrong: a reader catches it up or rebuilds it

    def _note(self, written: os.stat_result, placed: Sequence[tuple[int, AuditRecord]]) -> None:
        first_offset, first = placed[0]
        fresh = first_offset == 0 and first.seq == 1  # a new register: start its index
        db = self._writer_connection(create=fresh)
        if db is None:
            return
        with _immediate(db):
            point = _read_point(db)
            if point is None and fresh:
                _create_tables(db)
            elif point is None or (point.dev, point.ino) != (written.st_dev, written.st_ino):
                return  # missing or of another file: a reader rebuilds it
            elif point.offset != first_offset:
                if not point.offset < first_offset <= point.offset + _CATCH_UP_MAX_BYTES:
                    return
                # Behind by a little (a note skipped): index the gap, under the writers' lock.
                if not _catch_up(db, self.register, point, first_offset):
                    return
            last = placed[-1][1]
            segment = self.register.name
            _insert(db, [(key, record.seq, segment, offset) for offset, record in placed
                         if (key := _key_of(record)) is not None])
            _write_point(db, _Point(written.st_dev, written.st_ino, written.st_size, last.seq,
                                    last.hash))

    def _writer_connection(self, *, create: bool) -> sqlite3.Connection | None:
        """The writer's connection, reopened if the file at ``path`` is not the one it has."""
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = None
        if self._writer is not None and ino == self._writer_ino:
            return self._writer
        self._close_writer()
        if ino is None and not create:
            return None
        db = _connect(self.path, create=create, busy_ms=0)
        self._writer, self._writer_ino = db, os.stat(self.path).st_ino
        return db

    def _close_writer(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(sqlite3.Error):
                self._writer.close()
        self._writer, self._writer_ino = None, None

    def close(self) -> None:
        """Close the writer's connection (a reader's is closed by each read)."""
        self._close_writer()

    # -- reading ------------------------------------------------------------------------------

    def records(self, run_id: str) -> list[AuditRecord]:
        """The run's records and its wake's, in register order: through the index (caught up,
        or rebuilt, first), each checked; the whole register scanned if that fails.

        Like a scan, raises AuditIntegrityError for a line that is no record (the scan says
        which); reading needs neither the writer nor an event loop while the index serves."""
        if not self.register.exists():
            return []  # as the scan of a register never written
        keys = (run_id, wake_key(wake_id_for(run_id)))
        for rebuild in (False, True):
            try:
                found = self._through_index(keys, run_id, rebuild=rebuild)
            except (_Unreadable, sqlite3.Error, OSError):
                break
            if found is not None:
                return found
        return [record for record in _log(self.register).records() if belongs_to(record, run_id)]

    def _through_index(
        self, keys: tuple[str, ...], run_id: str, *, rebuild: bool
    ) -> list[AuditRecord] | None:
        """The run's records, or None when one of them is not what the index said."""
        with self._reader(rebuild=rebuild) as db:
            rows = db.execute(
                f"SELECT seq, segment, offset FROM entries WHERE key IN"
                f" ({', '.join('?' * len(keys))}) ORDER BY seq", keys).fetchall()
        records: list[AuditRecord] = []
        with _Files(self.register.parent) as files:
            for seq, segment, offset in rows:
                record = files.record_at(segment, offset)
                if record is None or record.seq != seq or not belongs_to(record, run_id):
                    return None
                records.append(record)
        return records

    @contextlib.contextmanager
    def _reader(self, *, rebuild: bool) -> Iterator[sqlite3.Connection]:
        """A connection to an index that covers the whole register as it stands."""
        db = self._covering(rebuild=rebuild)
        try:
            yield db
        finally:
            db.close()

    def _covering(self, *, rebuild: bool) -> sqlite3.Connection:
        try:
            db = _connect(self.path, create=True, busy_ms=_READER_BUSY_MS)
            try:
                self._cover(db, rebuild=rebuild)
            except BaseException:
                db.close()
                raise
            return db
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                raise  # busy, or cannot open: not a broken file, nothing to remove
        # Not a database any more (or a broken one): start it again from nothing.
        _remove(self.path)
        db = _connect(self.path, create=True, busy_ms=_READER_BUSY_MS)
        try:
            self._cover(db, rebuild=True)
        except BaseException:
            db.close()
            raise
        return db

    def _cover(self, db: sqlite3.Connection, *, rebuild: bool) -> None:
        """Catch the index up with the register, or rebuild it when it is not of this file."""
        # The point is read before the register's size is taken: a writer moves it only
        # after its record is on disk, so the size seen next is never short of it.
        point = None if rebuild else _read_point(db)
        size = _settled_size(self._lock_path, self.register)
        if size is None:
            raise FileNotFoundError(self.register)  # gone since: the scan says what there is
        st = os.stat(self.register)
        if point is None or not _describes(point, self.register, st, size):
            if self._on_rebuild is not None:
                self._on_rebuild()
            _rebuild(db, self.register, st, size)
        elif point.offset < size:
            with _immediate(db):
                again = _read_point(db)
                if again is not None and (again.dev, again.ino) == (st.st_dev, st.st_ino) \
                        and again.offset < size:
                    _catch_up(db, self.register, again, size, strict=True)


# -- building -----------------------------------------------------------------------------------


def _rebuild(db: sqlite3.Connection, register: Path, st: os.stat_result, size: int) -> None:
    """Index the whole register, every segment, from nothing (one transaction)."""
    with _immediate(db):
        db.execute("DROP TABLE IF EXISTS entries")
        db.execute("DROP TABLE IF EXISTS point")
        _create_tables(db)
        last: tuple[int, str] | None = None
        for path, stop_after in _log(register).segments():
            current = path == register
            entries, last_here = _scan(path, 0, size if current else None, stop_after)
            _insert(db, entries)
            last = last_here or last
        if last is not None:
            _write_point(db, _Point(st.st_dev, st.st_ino, size, *last))


def _log(register: Path) -> AuditLog:
    """The register's writer, for what only it knows: its segments, and the scan of them."""
    from bothy.engine.audit import AuditLog

    return AuditLog(register)


def _catch_up(db: sqlite3.Connection, register: Path, point: _Point, end: int,
              *, strict: bool = False) -> bool:
    """Index the current file's records between the point covered and ``end``."""
    try:
        entries, last = _scan(register, point.offset, end, None)
    except _Unreadable:
        if strict:
            raise
        return False
    _insert(db, entries)
    if last is not None:
        _write_point(db, _Point(point.dev, point.ino, end, *last))
    return True


def _scan(path: Path, start: int, end: int | None, stop_after: int | None
          ) -> tuple[list[_Entry], tuple[int, str] | None]:
    """The entries of the lines of ``path`` from ``start`` to ``end`` (a kept segment: up to
    its last good seq), and the seq and hash of the last record read."""
    entries: list[_Entry] = []
    last: tuple[int, str] | None = None
    segment = path.name
    with path.open("rb") as f:
        f.seek(start)
        offset = start
        limit = end if end is not None else os.fstat(f.fileno()).st_size
        for raw in f:
            if offset >= limit or (stop_after is not None and last is not None
                                   and last[0] >= stop_after):
                break
            if offset + len(raw) > limit or not raw.endswith(b"\n"):
                raise _Unreadable(f"{path}: a truncated line at byte {offset}")
            seq, key, digest = _where(raw, path, offset)
            if stop_after is not None and seq > stop_after:
                break
            if key is not None:
                entries.append(_Entry(key, seq, segment, offset))
            last = (seq, digest)
            offset += len(raw)
    return entries, last


# The canonical line's first fields, in their fixed order (bothy/engine/auditrecord.py): enough
# to index most lines without decoding them. A line it does not fit is decoded in full, and a
# wrong guess costs nothing: every record read through the index is checked.
_HEAD = re.compile(rb'\{"seq":(\d+),"ts":"[^"\\]*","kind":"([^"\\]*)","event":"[^"\\]*",'
                   rb'"outcome":"[^"\\]*","subject":(?:null|"[^"\\]*"),"run_id":(?:null|"([^"\\]*)"),')

_TAIL = re.compile(rb',"hash":"[0-9a-f]{64}"\}\n')


def _where(raw: bytes, path: Path, offset: int) -> tuple[int, str | None, str]:
    """The seq, index key and hash of a whole line (with its newline)."""
    head = _HEAD.match(raw)
    if head is not None and _TAIL.fullmatch(raw, len(raw) - 76) is not None \
            and (head[3] is not None or head[2] != b"wake"):
        return (int(head[1]), head[3].decode("ascii") if head[3] is not None else None,
                raw[-67:-3].decode("ascii"))
    parsed = parse_line(raw[:-1])
    if isinstance(parsed, str):
        raise _Unreadable(f"{path}: the line at byte {offset} {parsed}")
    return parsed.seq, _key_of(parsed), parsed.hash


# -- reading one line ---------------------------------------------------------------------------


class _Files:
    """The register's segment files opened once each, to read records at offsets."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._fds: dict[str, int] = {}

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def record_at(self, segment: str, offset: int) -> AuditRecord | None:
        """The record whose line starts at ``offset``, if the line there is a whole record
        whose hash matches its content."""
        if "/" in segment or segment.startswith("."):
            return None
        fd = self._fds.get(segment)
        if fd is None:
            try:
                fd = os.open(self._directory / segment, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            self._fds[segment] = fd
        if offset > 0 and os.pread(fd, 1, offset - 1) != b"\n":
            return None  # not the start of a line
        line = _line_at(fd, offset)
        if line is None:
            return None
        parsed = parse_line(line)
        if isinstance(parsed, str) or hashlib.sha256(body_of(line)).hexdigest() != parsed.hash:
            return None
        return parsed


def _line_at(fd: int, offset: int) -> bytes | None:
    data = b""
    while True:
        chunk = os.pread(fd, _READ_CHUNK_BYTES, offset + len(data))
        if not chunk:
            return None  # no newline before the end: not a whole line
        cut = chunk.find(b"\n")
        if cut != -1:
            return data + chunk[:cut]
        data += chunk


def _describes(point: _Point, register: Path, st: os.stat_result, size: int) -> bool:
    """The point is in this file and its record still ends at its offset."""
    if (point.dev, point.ino) != (st.st_dev, st.st_ino) or not 0 < point.offset <= size:
        return False
    fd = os.open(register, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.pread(fd, 1, point.offset - 1) != b"\n":
            return False
        start = point.offset - 1
        tail = b""
        while start > 0:  # back to the start of the line that ends at the offset
            begin = max(0, start - _READ_CHUNK_BYTES)
            tail = os.pread(fd, start - begin, begin) + tail
            start = begin
            if (cut := tail.rfind(b"\n")) != -1:
                tail = tail[cut + 1:]
                break
        parsed = parse_line(tail)
        return (not isinstance(parsed, str) and parsed.seq == point.seq
                and parsed.hash == point.hash
                and hashlib.sha256(body_of(tail)).hexdigest() == point.hash)
    finally:
        os.close(fd)


def _settled_size(lock_path: Path, register: Path) -> int | None:
    """The register's size at a moment no writer is mid-append (None: there is none)."""
    try:
        fd = os.open(register, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return settled_size(lock_path, fd)
    finally:
        os.close(fd)


# -- the SQLite file ----------------------------------------------------------------------------


def _connect(path: Path, *, create: bool, busy_ms: int) -> sqlite3.Connection:
    mode = "rwc" if create else "rw"
    existed = path.exists()
    db = sqlite3.connect(f"file:{path}?mode={mode}", uri=True, isolation_level=None,
                         check_same_thread=False, timeout=busy_ms / 1000)
    try:
        if not existed:
            os.chmod(path, _FILE_MODE)
        # WAL: readers never wait on a writer. NORMAL: no fsync per commit (the index is
        # rebuilt from the register whenever it is lost or behind).
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(SQLITE_PAGE_CACHE_PRAGMA)  # held open by a serve for months
        if _read_version(db) not in (None, _VERSION):
            raise sqlite3.DatabaseError("an index of another format")
    except BaseException:
        db.close()
        raise
    return db


def _read_version(db: sqlite3.Connection) -> int | None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    return int(version) if version else None


def _create_tables(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT NOT NULL, seq INTEGER NOT NULL,"
               " segment TEXT NOT NULL, offset INTEGER NOT NULL, PRIMARY KEY (key, seq))"
               " WITHOUT ROWID")
    db.execute("CREATE TABLE IF NOT EXISTS point (one INTEGER PRIMARY KEY CHECK (one = 1),"
               " dev INTEGER, ino INTEGER, offset INTEGER, seq INTEGER, hash TEXT)")
    db.execute(f"PRAGMA user_version={_VERSION}")


def _read_point(db: sqlite3.Connection) -> _Point | None:
    try:
        row = db.execute("SELECT dev, ino, offset, seq, hash FROM point").fetchone()
    except sqlite3.OperationalError:  # no such table: an index never built
        return None
    if row is None or not all(isinstance(v, int) for v in row[:4]) \
            or not isinstance(row[4], str):
        return None
    return _Point(*row)


def _write_point(db: sqlite3.Connection, point: _Point) -> None:
    db.execute("INSERT OR REPLACE INTO point VALUES (1, ?, ?, ?, ?, ?)",
               (point.dev, point.ino, point.offset, point.seq, point.hash))


def _insert(db: sqlite3.Connection, entries: Iterable[tuple[str, int, str, int]]) -> None:
    """Rows of (key, seq, segment, offset): an ``_Entry`` is one."""
    db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)", entries)


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, taken at once (a writer's note gives up if it is busy)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _remove(path: Path) -> None:
    for name in (path.name, path.name + "-wal", path.name + "-shm", path.name + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            path.with_name(name).unlink()

