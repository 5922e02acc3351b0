"""The inbox: wakes made durable before anyone is told they arrived (SPEC §5, rule 3).

Each delivery is one file, ``$BOTHY_HOME/inbox/<sha256(route NUL key)>.json`` (0600, in a 0700
directory; a source other than ``webhook`` is part of the hash too), indexed by one row of the
``wakes`` table in the state database. A wake's source (``webhook``, ``schedule``) is part of its
identity: the same route and key from two sources are two wakes. ``accept`` makes
a delivery durable in this order, and returns only after the last step (contracts.md §7):

1. write the payload to a fresh temporary file in the inbox directory and fsync it;
2. ``os.link`` it to its final name. The name is derived from the route and the dedupe key,
   and ``link`` (unlike ``rename``) never replaces: an existing name means the delivery was
   seen before, and that file was complete and fsynced before it got its name;
3. unlink the temporary name and fsync the directory, so the final name survives a power loss;
4. insert the ``wakes`` row (INSERT … ON CONFLICT DO NOTHING; WAL with synchronous=FULL, so the
   commit is fsynced).

A crash between 2 and 4 leaves a file without a row; :meth:`Inbox.recover`, run at start-up,
gives it one. A crash before 2 leaves a temporary file, which :meth:`Inbox.prune` removes. There
is never a row without a file: prune deletes files before rows, so a forgotten delivery cannot
come back as a new one.

Steps 3 (its directory fsync) and 4 are a *group commit*: every delivery that reaches them
while a commit is under way waits for the next one, which covers them all with one directory
fsync and one SQLite transaction. Each caller still returns only after the commit holding its
row, so nothing is acknowledged early; under load N commits become one.

Whether a delivery is new is decided by the row, not the file: a delivery whose file exists
but whose row is missing (its first attempt failed at step 3 or 4 and was answered 503) is
queued by the sender's retry, and reported as accepted then.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import secrets
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bothy.clock import Clock, to_us
from bothy.engine.state import StateDB
from bothy.errors import InboxError
from bothy.fsync import fsync, fsync_directory

_FORMAT_VERSION = 1
_WEBHOOK = "webhook"  # the source of a delivery that names none (files written before sources)
_SUFFIX = ".json"
_TEMP_PREFIX = ".tmp-"
_FILE_MODE = 0o600
_DIR_MODE = 0o700
_FINISHED = ("done", "ignored", "abandoned")
_DELETE_CHUNK = 500  # ids per DELETE statement, well under SQLite's 32,766 variables
_ROWS_PER_INSERT = 500  # a group commit's rows; 8 variables each: 4,000 per statement

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivery:
    """One received delivery, as it is kept on disk and handed to the dispatcher.

    ``key`` is the dedupe key: for GitHub ``X-GitHub-Delivery + ":" + X-GitHub-Hook-ID``
    (the GUID names the event, shared by every hook it goes to: contracts.md §1.1).
    ``headers`` have lower-case names. ``body`` is the raw bytes the signature covered.
    ``source`` says what woke it: ``webhook``, or ``schedule`` (``route`` is then the
    schedule's name, ``key`` the fire time and ``body`` a JSON snapshot of the schedule).
    """

    route: str
    key: str
    event: str
    action: str | None
    headers: dict[str, str]
    body: bytes
    received_at: datetime
    source: str = _WEBHOOK


@dataclass(frozen=True)
class Accepted:
    """The delivery is durable and queued as wake ``wake_id``."""

    wake_id: int


@dataclass(frozen=True)
class Duplicate:
    """The delivery was seen before and is not queued again (``wake_id`` None if forgotten)."""

    wake_id: int | None


@dataclass(frozen=True)
class Reinserted:
    """A payload file that had no row and got one at start-up; ``ran_as`` the run that the
    register shows already ran it (then the wake is closed, not queued)."""

    wake_id: int
    source: str
    route: str
    key: str
    file: str
    ran_as: str | None


@dataclass(frozen=True)
class WakeRow:
    """One row of the ``wakes`` table. ``file`` is the payload's name in the inbox directory."""

    id: int
    source: str
    route: str
    key: str
    event: str
    action: str | None
    status: str
    attempts: int
    next_try_us: int
    received_us: int
    run_id: str | None
    file: str
    note: str | None
    finished_us: int | None = None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> WakeRow:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


@dataclass
class _Pending:
    """A delivery whose file is linked, waiting for the group commit (steps 3 and 4)."""

    delivery: Delivery
    file: str
    outcome: asyncio.Future[Accepted | Duplicate]


class Inbox:
    """Durable wakes: the files under ``root`` and their rows in ``db``."""

    def __init__(self, root: Path, db: StateDB, *, clock: Clock) -> None:
        self.root = root
        self._db = db
        self._clock = clock
        self._waiting: list[_Pending] = []
        # The group committer: started by the first delivery that finds none running, ends
        # when nobody is waiting. Owned here; every waiter awaits its own future.
        self._committer: asyncio.Task[None] | None = None

    # -- intake ----------------------------------------------------------------------------

    async def accept(self, delivery: Delivery) -> Accepted | Duplicate:
        """Make ``delivery`` durable (file, directory, row: see the module docstring).

        Raises InboxError when it cannot be made durable; the delivery is then not queued
        and the sender should be told to retry (503).
        """
        name = payload_name(delivery.route, delivery.key, delivery.source)
        try:
            await asyncio.to_thread(_store_payload, self.root, name, delivery)
        except OSError as exc:
            raise InboxError(
                f"Cannot make delivery {delivery.key!r} of route {delivery.route!r} durable in"
                f" {self.root}: {exc.strerror or exc}"
            ) from exc
        pending = _Pending(delivery, name, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_waiting(), name="inbox-commit")
        return await pending.outcome

    async def _commit_waiting(self) -> None:
        while self._waiting:
            batch = self._waiting[:_ROWS_PER_INSERT]
            del self._waiting[:_ROWS_PER_INSERT]
            try:
                outcomes = await self._commit(batch)
            except asyncio.CancelledError:
                for pending in batch:
                    _settle(pending.outcome, InboxError("the inbox stopped before the commit"))
                raise
            except Exception as exc:  # every waiter hears of it; an unknown fault is logged
                message = str(exc)
                if not isinstance(exc, InboxError):
                    _log.exception("inbox: the group commit failed")
                    message = f"Cannot commit {len(batch)} wake(s): {exc!r}"
                for pending in batch:
                    _settle(pending.outcome, InboxError(message))
            else:
                for pending, outcome in zip(batch, outcomes, strict=True):
                    _settle(pending.outcome, outcome)

    async def _commit(self, batch: list[_Pending]) -> list[Accepted | Duplicate]:
        """Steps 3 and 4 for a whole batch: one directory fsync, then one INSERT statement."""
        try:
            await asyncio.to_thread(fsync_directory, self.root)
        except OSError as exc:
            raise InboxError(f"Cannot fsync the inbox directory {self.root}: {exc}") from exc
        try:
            return await self._insert([(p.delivery, p.file) for p in batch])
        except sqlite3.Error as exc:
            raise InboxError(f"Cannot record {len(batch)} wake(s) in the state database: {exc}"
                             ) from exc

    async def _insert(self, items: list[tuple[Delivery, str]]) -> list[Accepted | Duplicate]:
        """Insert-if-absent the rows of ``items`` in one statement (its own transaction).

        One statement, because each is a round trip to SQLite's thread, and under load a
        round trip costs more than the rows: BEGIN, INSERT, COMMIT took three times as long.
        """
        params: list[object] = []
        for delivery, file in items:
            received_us = to_us(delivery.received_at)
            params += [delivery.source, delivery.route, delivery.key, delivery.event,
                       delivery.action, received_us, received_us, file]
        rows = await self._db.atomic(
            "INSERT INTO wakes (source, route, key, event, action, status, attempts,"
            " next_try_us, received_us, file) VALUES "
            + ",".join("(?, ?, ?, ?, ?, 'queued', 0, ?, ?, ?)" for _ in items)
            + " ON CONFLICT (source, route, key) DO NOTHING RETURNING id, source, route, key",
            tuple(params),
        )
        inserted = {(row["source"], row["route"], row["key"]): int(row["id"]) for row in rows}
        outcomes: list[Accepted | Duplicate] = []
        for delivery, _ in items:
            ident = (delivery.source, delivery.route, delivery.key)
            wake_id = inserted.pop(ident, None)  # the first copy in the batch is the new one
            if wake_id is not None:
                outcomes.append(Accepted(wake_id))
            else:
                outcomes.append(Duplicate(await self._wake_id(*ident)))
        return outcomes

    async def _wake_id(self, source: str, route: str, key: str) -> int | None:
        row = await self._db.fetch_one(
            "SELECT id FROM wakes WHERE source = ? AND route = ? AND key = ?",
            (source, route, key),
        )
        return int(row[0]) if row is not None else None

    async def recover(
        self, ran_as: Callable[[str, str], str | None] | None = None
    ) -> list[Reinserted]:
        """Give a row to every payload file that has none, and say what each became.

        A file without a row is a crash between file and row, or a state database restored
        from an older copy. ``ran_as(route, key)`` names the run the register shows already
        ran that delivery: such a wake is recorded closed (``done``, with that run), never
        queued to run again. Every other one is queued. Run it at start-up, before the
        listeners. A file that cannot be read back is left where it is, and logged.
        """
        known = {row["file"] for row in await self._db.fetch_all("SELECT file FROM wakes")}
        try:
            names = await asyncio.to_thread(_payload_names, self.root)
        except OSError as exc:
            raise InboxError(f"Cannot list the inbox {self.root}: {exc}") from exc
        reinserted = []
        for name in names:
            if name in known:
                continue
            try:
                delivery = await self._read(name)
            except InboxError as exc:
                _log.warning("inbox: %s; leaving it for an operator", exc)
                continue
            try:
                [outcome] = await self._insert([(delivery, name)])
            except sqlite3.Error as exc:
                raise InboxError(f"Cannot record recovered wake {name}: {exc}") from exc
            if not isinstance(outcome, Accepted):
                continue
            run_id = ran_as(delivery.route, delivery.key) if ran_as is not None else None
            if run_id is not None:
                await self.finish(outcome.wake_id, "done", run_id=run_id,
                                  note=f"restored from its file; the register shows {run_id}"
                                  " ran it already")
            reinserted.append(Reinserted(outcome.wake_id, delivery.source, delivery.route,
                                         delivery.key, name, run_id))
        return reinserted

    # -- the dispatcher's side -------------------------------------------------------------

    async def due(self, now_us: int, limit: int = 50) -> list[WakeRow]:
        """Queued wakes whose time has come, in arrival order."""
        rows = await self._db.fetch_all(
            "SELECT * FROM wakes WHERE status = 'queued' AND next_try_us <= ?"
            " ORDER BY received_us, id LIMIT ?",
            (now_us, limit),
        )
        return [WakeRow.from_row(row) for row in rows]

    async def load(self, wake: WakeRow) -> Delivery:
        """The delivery of ``wake``, read back from its file; its body byte for byte."""
        return await self._read(wake.file)

    async def claim(self, wake_id: int) -> bool:
        """Take a queued wake (queued → running); False if it was not queued (someone has it)."""
        async with self._db.transaction():
            changed = await self._db.execute(
                "UPDATE wakes SET status = 'running', run_id = NULL"
                " WHERE id = ? AND status = 'queued'",
                (wake_id,),
            )
        return changed == 1

    async def set_run(self, wake_id: int, run_id: str) -> None:
        """Record the run minted for a running wake, before the run is admitted."""
        async with self._db.transaction():
            changed = await self._db.execute(
                "UPDATE wakes SET run_id = ? WHERE id = ? AND status = 'running'",
                (run_id, wake_id),
            )
        if changed != 1:
            raise InboxError(f"Cannot record run {run_id} for wake {wake_id}: it is not running")

    async def finish(
        self, wake_id: int, status: str, *, run_id: str | None, note: str | None
    ) -> None:
        """Close a queued or running wake as ``done``, ``ignored`` or ``abandoned``.

        ``run_id`` None keeps the run already recorded, if any.
        """
        if status not in _FINISHED:
            raise ValueError(f"a wake finishes as one of {', '.join(_FINISHED)}, not {status!r}")
        async with self._db.transaction():
            changed = await self._db.execute(
                "UPDATE wakes SET status = ?, run_id = COALESCE(?, run_id), note = ?,"
                " finished_us = ? WHERE id = ? AND status IN ('queued', 'running')",
                (status, run_id, note, to_us(self._clock()), wake_id),
            )
        if changed != 1:
            raise InboxError(f"Cannot finish wake {wake_id} as {status}: it is not queued or"
                             " running")

    async def retry_later(self, wake_id: int, *, next_try_us: int, note: str) -> int:
        """Put a running wake back in the queue (running → queued); return its attempts so far.

        The run id is cleared: the next attempt mints its own, and a crash before it does
        must not be mistaken for a run under way.
        """
        async with self._db.transaction():
            row = await self._db.fetch_one(
                "UPDATE wakes SET status = 'queued', attempts = attempts + 1, next_try_us = ?,"
                " note = ?, run_id = NULL WHERE id = ? AND status = 'running' RETURNING attempts",
                (next_try_us, note, wake_id),
            )
        if row is None:
            raise InboxError(f"Cannot retry wake {wake_id} later: it is not running")
        return int(row[0])

    async def in_flight(self) -> list[WakeRow]:
        """Wakes marked running: after a crash, those a dead daemon had taken."""
        rows = await self._db.fetch_all(
            "SELECT * FROM wakes WHERE status = 'running' ORDER BY received_us, id")
        return [WakeRow.from_row(row) for row in rows]

    async def prune(self, older_than_us: int) -> int:
        """Forget finished wakes received before ``older_than_us``, files first, then rows.

        Also removes temporary files older than that (left by a crash mid-write). Keep at
        least GitHub's redelivery window (3 days, 7 on GHES: contracts.md §1.5): a delivery
        forgotten here would be queued again if it were redelivered. Returns how many wakes.
        """
        marks = ",".join("?" for _ in _FINISHED)
        rows = await self._db.fetch_all(
            f"SELECT id, file FROM wakes WHERE status IN ({marks}) AND received_us < ?",
            (*_FINISHED, older_than_us),
        )
        try:
            await asyncio.to_thread(
                _remove_payloads, self.root, [row["file"] for row in rows], older_than_us
            )
        except OSError as exc:
            raise InboxError(f"Cannot remove old payloads from {self.root}: {exc}") from exc
        ids = [int(row["id"]) for row in rows]
        async with self._db.transaction():
            for start in range(0, len(ids), _DELETE_CHUNK):
                chunk = ids[start:start + _DELETE_CHUNK]
                await self._db.execute(
                    f"DELETE FROM wakes WHERE id IN ({','.join('?' for _ in chunk)})",
                    tuple(chunk),
                )
        return len(ids)

    async def _read(self, name: str) -> Delivery:
        try:
            data = await asyncio.to_thread((self.root / name).read_bytes)
        except OSError as exc:
            raise InboxError(f"Cannot read wake payload {self.root / name}: {exc}") from exc
        try:
            return decode_payload_file(data)
        except ValueError as exc:
            raise InboxError(f"Wake payload {self.root / name} is damaged: {exc}") from exc


# -- the file format -----------------------------------------------------------------------


def payload_name(route: str, key: str, source: str = _WEBHOOK) -> str:
    """The file name of a delivery: the same source, route and key always give the same name.

    A webhook's name hashes only its route and key (as before sources existed), so files
    already on disk keep their names.
    """
    ident = f"{route}\0{key}" if source == _WEBHOOK else f"{source}\0{route}\0{key}"
    digest = hashlib.sha256(ident.encode()).hexdigest()
    return digest + _SUFFIX


def encode_payload_file(delivery: Delivery) -> bytes:
    """The payload file: JSON with the body as text if it is UTF-8, else base64."""
    try:
        body, encoding = delivery.body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        body, encoding = base64.b64encode(delivery.body).decode("ascii"), "base64"
    document = {
        "version": _FORMAT_VERSION,
        "source": delivery.source,
        "route": delivery.route,
        "key": delivery.key,
        "event": delivery.event,
        "action": delivery.action,
        "headers": delivery.headers,
        "received_at": delivery.received_at.isoformat(),
        "body_encoding": encoding,
        "body": body,
    }
    return json.dumps(document, separators=(",", ":")).encode("ascii")


def decode_payload_file(data: bytes) -> Delivery:
    """Read back what :func:`encode_payload_file` wrote; ValueError if it is not that."""
    try:
        document: Any = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("version") != _FORMAT_VERSION:
        raise ValueError(f"not an inbox payload of format version {_FORMAT_VERSION}")
    try:
        body_text: str = document["body"]
        if document["body_encoding"] == "base64":
            body = base64.b64decode(body_text, validate=True)
        else:
            body = body_text.encode("utf-8")
        received_at = datetime.fromisoformat(document["received_at"])
        return Delivery(
            route=str(document["route"]),
            key=str(document["key"]),
            event=str(document["event"]),
            action=document["action"],
            headers={str(k): str(v) for k, v in document["headers"].items()},
            body=body,
            received_at=received_at,
            source=str(document.get("source", _WEBHOOK)),
        )
    except (KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise ValueError(f"a field is missing or malformed ({exc!r})") from exc


# -- blocking file work (always called through asyncio.to_thread) ---------------------------


def _store_payload(root: Path, name: str, delivery: Delivery) -> None:
    """Steps 1 and 2: the payload fsynced under a temporary name, then linked to ``name``."""
    _ensure_dir(root)
    final = root / name
    if final.exists():
        return  # seen before: that file was complete and fsynced before it got its name
    data = encode_payload_file(delivery)
    temp = root / f"{_TEMP_PREFIX}{secrets.token_hex(8)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # a concurrent copy of it got there first
            os.link(temp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _ensure_dir(root: Path) -> None:
    if root.is_dir():
        return
    # FileExistsError when ``root`` is a file: the caller reports it as an OSError.
    root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    fsync_directory(root.parent)


def _payload_names(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(entry.name for entry in os.scandir(root)
                  if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."))


def _remove_payloads(root: Path, names: list[str], older_than_us: int) -> None:
    if not root.is_dir():
        return
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / name)
    for entry in os.scandir(root):
        if entry.name.startswith(_TEMP_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime_ns // 1000 < older_than_us:
                    os.unlink(entry.path)
    fsync_directory(root)  # the names are gone for good before their rows are


def _settle(future: asyncio.Future[Accepted | Duplicate],
            outcome: Accepted | Duplicate | InboxError) -> None:
    if future.done():  # its caller went away (cancelled); nobody is waiting for it
        return
    if isinstance(outcome, InboxError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
