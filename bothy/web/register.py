"""The register as the overview shows it: its anchored head and its latest records.

Cheap on purpose, since every page load asks: the head is the checkpoint a writer left after
verifying the chain up to its record (``AuditLog.anchored_head``: one short read), and the
latest records are parsed from the last ``tail_bytes`` of the file only. Neither walks the
chain; ``bothy audit verify`` does that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.auditrecord import parse_line

__all__ = ["RegisterState", "RegisterView"]

_TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class RegisterState:
    """What the overview says of the register."""

    anchored: tuple[int, str] | None  # (seq, hash) a writer verified the chain up to
    last_seq: int | None  # the last record in the file, verified or not
    last_hash: str | None
    recent: list[AuditRecord]  # the latest records read, oldest first
    size_bytes: int


class RegisterView:
    """Reads of the register at ``path`` for the pages; never writes."""

    def __init__(self, path: Path, *, tail_bytes: int = _TAIL_BYTES) -> None:
        self._log = AuditLog(path)
        self._path = path
        self._tail_bytes = tail_bytes

    def state(self) -> RegisterState:
        recent, size = self._tail()
        last = recent[-1] if recent else None
        return RegisterState(self._log.anchored_head(), last.seq if last else None,
                             last.hash if last else None, recent, size)

    def _tail(self) -> tuple[list[AuditRecord], int]:
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return [], 0
        try:
            size = os.fstat(fd).st_size
            start = max(size - self._tail_bytes, 0)
            raw = os.pread(fd, size - start, start)
        finally:
            os.close(fd)
        lines = raw.split(b"\n")
        if start > 0:
            lines = lines[1:]  # cut mid-record: the first piece is not a whole line
        found = []
        for line in lines[:-1]:  # the piece after the last newline is not a whole record
            parsed = parse_line(line)
            if not isinstance(parsed, str):
                found.append(parsed)
        return found, size
