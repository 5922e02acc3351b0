"""What the inbox keeps, and for how long: finished wakes are forgotten with their payloads.

A wake is remembered (its row, and its payload line in a segment) while it may still run, and
after it finished for ``wakes.keep_deliveries_days``: long enough that GitHub's redelivery of
it (3 days back, 7 on GHES: contracts.md §1.5) is recognised as a duplicate. After that it is
forgotten, so that the inbox does not grow without bound on a site that runs for years:

- a segment goes, with its rows, once every wake in it finished before the cut-off (a row
  closed before finish times were kept counts from when it was received); never the one this
  process appends to (:mod:`bothy.wakes.segments` starts a new one past a size and an age, so
  that the current one too becomes old and goes), and never the highest-numbered one on disk:
  a new segment is numbered one past it, and a number must never name two segments (a state
  database restored from an older copy would point its rows at the new one's lines);
- lines that never got a row (a batch answered 503) go with their segment; a segment with no
  row at all goes once its file is older than the cut-off;
- a delivery closed ignored at intake keeps no payload (its row's ``file`` is
  :data:`NO_PAYLOAD`, with no offset): only its row is kept, to know it again, and goes alone;
- payload files of an older Bothy (one per delivery) go as before, with the temporary files
  it left.

``bothy serve`` prunes at start-up and every hour (:meth:`Retention.keep_pruned`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bothy.clock import Clock, to_us
from bothy.engine.state import StateDB
from bothy.errors import InboxError
from bothy.wakes.delivery import remove_payload_files
from bothy.wakes.segments import Segments

FINISHED = ("done", "ignored", "abandoned")  # the statuses of a wake that will not run again
NO_PAYLOAD = ""  # the file of a row that keeps no payload (closed ignored at intake)
_DELETE_CHUNK = 500  # ids per DELETE statement, well under SQLite's 32,766 variables
_PRUNE_EVERY_S = 3600.0
_FINISHED_US = "COALESCE(finished_us, received_us)"  # rows closed before finish times were kept

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruned:
    """What a prune forgot: how many wakes, and the segment files it removed."""

    wakes: int
    segments: list[str]


class Retention:
    """Forgets the finished wakes of the inbox under ``root`` (rows in ``db``, payloads in
    ``segments``) once they are old."""

    def __init__(self, root: Path, db: StateDB, segments: Segments, *, clock: Clock) -> None:
        self._root = root
        self._db = db
        self._segments = segments
        self._clock = clock

    async def keep_pruned(
        self, prune: Callable[[int], Awaitable[int]], keep_s: float, stop: asyncio.Event,
        *, every_s: float = _PRUNE_EVERY_S,
    ) -> None:
        """Call ``prune`` with the cut-off ``keep_s`` before now, at once and then every
        ``every_s``, until ``stop`` is set. A failure (a disk that refuses) is logged and
        tried again next time: nothing is lost by keeping a payload longer."""
        while not stop.is_set():
            try:
                forgotten = await prune(to_us(self._clock()) - int(keep_s * 1_000_000))
            except InboxError as exc:
                _log.warning("inbox: cannot prune finished wakes (tried again in %g s): %s",
                             every_s, exc)
            else:
                if forgotten:
                    _log.info("inbox: forgot %d finished wakes older than %g days", forgotten,
                              keep_s / 86_400)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_s):
                    await stop.wait()

    async def prune(self, older_than_us: int) -> Pruned:
        """Forget wakes finished before ``older_than_us``, payloads first, then rows
        (see the module docstring); says what went. InboxError if the disk or the
        state database refuses (what was not removed stays, to be pruned next time).

        The caller makes sure no batch is between its segment append and its rows meanwhile
        (:meth:`bothy.wakes.inbox.Inbox.prune`): a segment is judged by its rows.
        """
        try:
            return await self._prune(older_than_us)
        except sqlite3.Error as exc:
            raise InboxError(f"Cannot forget old wakes in the state database: {exc}") from exc

    async def _prune(self, older_than_us: int) -> Pruned:
        marks = ",".join("?" for _ in FINISHED)
        files = await self._db.fetch_all(
            f"SELECT id, file FROM wakes WHERE payload_at IS NULL AND status IN ({marks})"
            f" AND {_FINISHED_US} < ?", (*FINISHED, older_than_us))
        segments = await self._db.fetch_all(
            f"SELECT file, COUNT(*) AS wakes, SUM(status IN ({marks}) AND {_FINISHED_US} < ?)"
            " AS old FROM wakes WHERE payload_at IS NOT NULL GROUP BY file",
            (*FINISHED, older_than_us))
        indexed = {row["file"]: row["wakes"] == row["old"] for row in segments}
        try:
            gone = await asyncio.to_thread(self._prune_segments, indexed, older_than_us)
            await asyncio.to_thread(
                remove_payload_files, self._root,
                [row["file"] for row in files if row["file"] != NO_PAYLOAD], older_than_us)
        except OSError as exc:
            raise InboxError(f"Cannot remove old payloads from {self._root}: {exc}") from exc
        ids = [int(row["id"]) for row in files]
        async with self._db.transaction():
            for start in range(0, len(ids), _DELETE_CHUNK):
                chunk = ids[start:start + _DELETE_CHUNK]
                await self._db.execute(
                    f"DELETE FROM wakes WHERE id IN ({','.join('?' for _ in chunk)})",
                    tuple(chunk),
                )
            forgotten = len(ids)
            for start in range(0, len(gone), _DELETE_CHUNK):
                names = gone[start:start + _DELETE_CHUNK]
                forgotten += await self._db.execute(
                    f"DELETE FROM wakes WHERE file IN ({','.join('?' for _ in names)})"
                    " AND payload_at IS NOT NULL", tuple(names))
        return Pruned(forgotten, gone)

    def _prune_segments(self, indexed: dict[str, bool], older_than_us: int) -> list[str]:
        """Remove the segments that may go; return their names, with those of segments
        already gone whose rows may go (a prune that failed between the two)."""
        present = self._segments.names()
        kept = {self._segments.current, *present[-1:]}  # the one written, the highest number
        gone = [name for name in present if name not in kept
                and indexed.get(name, self._segments.mtime_us(name) < older_than_us)]
        self._segments.remove(gone)
        return gone + [name for name, old in indexed.items() if old and name not in present]
