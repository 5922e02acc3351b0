"""Payloads that have no row in the ``wakes`` table, found at start-up (``Inbox.recover``).

A line of a segment has no row when the process crashed between the segment's fsync and the
rows' commit, or when the state database was restored from an older copy. The rows of a
segment always cover a prefix of it, so only the lines past the last one a row names are read.
A payload file of an older Bothy (one per delivery) has no row when its own crash came between
the file and the row. A line or file that cannot be read back is left where it is, and logged.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from bothy.engine.state import StateDB
from bothy.errors import InboxError
from bothy.wakes.delivery import Delivery, decode_payload_file, payload_file_names
from bothy.wakes.segments import Segments, Span

Unindexed = tuple[Delivery, Span | None, str]  # the delivery, its line (None: a file), the file

_log = logging.getLogger(__name__)


async def unindexed(root: Path, db: StateDB, segments: Segments) -> list[Unindexed]:
    """Every payload under ``root`` without a row: segment lines, then older files."""
    return await _lines(root, db, segments) + await _files(root, db)


async def _lines(root: Path, db: StateDB, segments: Segments) -> list[Unindexed]:
    """Lines of each segment past the last one a row names (the rows cover a prefix)."""
    rows = await db.fetch_all(
        "SELECT file, MAX(payload_at + payload_bytes) AS covered FROM wakes"
        " WHERE payload_at IS NOT NULL GROUP BY file")
    covered = {row["file"]: int(row["covered"]) for row in rows}
    try:
        return await asyncio.to_thread(_lines_past, segments, covered)
    except OSError as exc:
        raise InboxError(f"Cannot read the inbox's segments in {root}: {exc}") from exc


def _lines_past(segments: Segments, covered: dict[str, int]) -> list[Unindexed]:
    found: list[Unindexed] = []
    for segment in segments.names():
        for span, line in segments.lines_after(segment, covered.get(segment, 0)):
            try:
                found.append((decode_payload_file(line), span, segment))
            except ValueError as exc:
                _log.warning("inbox: line at offset %d of %s is damaged (%s); leaving it"
                             " for an operator", span.offset, segment, exc)
    return found


async def _files(root: Path, db: StateDB) -> list[Unindexed]:
    """Payload files of an older Bothy (one per delivery) that have no row."""
    known = {row["file"] for row in await db.fetch_all(
        "SELECT file FROM wakes WHERE payload_at IS NULL")}
    try:
        names = await asyncio.to_thread(payload_file_names, root)
    except OSError as exc:
        raise InboxError(f"Cannot list the inbox {root}: {exc}") from exc
    found: list[Unindexed] = []
    for name in names:
        if name in known:
            continue
        try:
            found.append((await read_payload_file(root, name), None, name))
        except InboxError as exc:
            _log.warning("inbox: %s; leaving it for an operator", exc)
    return found


async def read_payload_file(root: Path, name: str) -> Delivery:
    """A payload file of an older Bothy, read back; InboxError if it cannot be."""
    try:
        data = await asyncio.to_thread((root / name).read_bytes)
    except OSError as exc:
        raise InboxError(f"Cannot read wake payload {root / name}: {exc}") from exc
    try:
        return decode_payload_file(data)
    except ValueError as exc:
        raise InboxError(f"Wake payload {root / name} is damaged: {exc}") from exc
