"""The register's human form (SPEC §2): one greppable line per record.

``seq ts kind event outcome subject run_id``, with ``-`` for a field that is empty:
``0017 2026-09-24T10:14:02.391650+00:00 run admitted ok pr:42 run_20260924T101402Z_8d41e7b2``.
``seq`` has at least four digits; ``ts`` is the stored timestamp (UTC, microseconds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bothy.engine.auditrecord import format_ts

if TYPE_CHECKING:
    from bothy.engine.auditrecord import AuditRecord

__all__ = ["human_line"]


def human_line(record: AuditRecord) -> str:
    """The record as one line for people and ``grep`` (``bothy audit``)."""
    return (
        f"{record.seq:04d} {format_ts(record.ts)} {record.kind} {record.event} {record.outcome} "
        f"{record.subject or '-'} {record.run_id or '-'}"
    )
