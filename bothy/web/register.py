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
_ALERT = b'"kind":"alert"'  # as the canonical line writes it (bothy.engine.auditrecord)


@dataclass(frozen=True)
class RegisterState:
    """What the overview says of the register."""

    anchored: tuple[int, str] | None  # (seq, hash) a writer verified the chain up to
    last_seq: int | None  # the last record in the file, verified or not
    last_hash: str | None
    alerts: list[AuditRecord]  # the alert records among the latest, oldest first
    looked_at: int  # how many of the latest records were looked through for them
    size_bytes: int


class RegisterView:
    """Reads of the register at ``path`` for the pages; never writes."""

    def __init__(self, path: Path, *, tail_bytes: int = _TAIL_BYTES) -> None:
        self._log = AuditLog(path)
        self._path = path
        self._tail_bytes = tail_bytes

    def state(self) -> RegisterState:
        lines, size = self._tail()
        # Only the lines that can be alerts are parsed (a byte test first), and the last one.
        alerts = [parsed for line in lines if _ALERT in line
                  if not isinstance(parsed := parse_line(line), str) and parsed.kind == "alert"]
        last = parse_line(lines[-1]) if lines else None
        if isinstance(last, str):
            last = None
        return RegisterState(self._log.anchored_head(), last.seq if last else None,
                             last.hash if last else None, alerts, len(lines), size)

    def _tail(self) -> tuple[list[bytes], int]:
        """The whole lines among the last ``tail_bytes`` of the file, and its size."""
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
        return lines[:-1], size  # the piece after the last newline is not a whole record
