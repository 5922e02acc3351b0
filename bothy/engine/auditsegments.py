"""The register's segments: a repaired register reads as one chain across its files.

``bothy audit repair`` keeps a broken register aside untouched (``<path>.broken-<stamp>``) and
starts a new file whose first record, ``audit repaired``, names the kept file and its last good
seq and hash (:func:`repair_link`). :func:`segments_of` follows those links back, oldest first;
:func:`verify_file` verifies a file after the segments it links to.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.auditchain import Fault, VerifyReport, verify_lines
from bothy.engine.auditcheckpoint import against_anchor, checkpoint_path_for, read_checkpoint
from bothy.engine.auditfile import lock_path_for, settled_size
from bothy.engine.auditrecord import parse_line

__all__ = ["REPAIR_EVENT", "REPAIR_KIND", "Link", "file_lines", "lines_from", "repair_link",
           "segments_of", "verify_file", "verify_register"]

REPAIR_KIND, REPAIR_EVENT = "audit", "repaired"
_MAX_SEGMENTS = 1000  # links followed back through repaired segments before giving up


def segments_of(path: Path) -> list[tuple[Path, int | None]]:
    """The register's files oldest first, each with the last seq of it that counts."""
    chain: list[tuple[Path, int | None]] = []
    stop_after: int | None = None
    for _ in range(_MAX_SEGMENTS):
        link = repair_link(path)
        # A kept file counts up to its last good record; an older segment it links to
        # up to that segment's own last good record, or less if the repair came earlier.
        chain.append((path, stop_after))
        if link is None:
            break
        path = link.kept
        stop_after = link.seq if stop_after is None else min(link.seq, stop_after)
    chain.reverse()
    return chain


@dataclass(frozen=True)
class Link:
    kept: Path
    seq: int
    hash: str


def repair_link(path: Path) -> Link | None:
    """The earlier segment a file's first record names, if that record is a repair."""
    try:
        with path.open("rb") as f:
            first = f.readline()
    except OSError:
        return None
    parsed = parse_line(first.rstrip(b"\n"))
    if isinstance(parsed, str) or (parsed.kind, parsed.event) != (REPAIR_KIND, REPAIR_EVENT):
        return None
    kept, seq, digest = (parsed.details.get(k) for k in ("kept", "last_good_seq",
                                                            "last_good_hash"))
    if not isinstance(kept, str) or "/" in kept or not isinstance(seq, int) \
            or not isinstance(digest, str):
        return None
    return Link(kept=path.with_name(kept), seq=seq, hash=digest)


def verify_register(path: Path) -> VerifyReport:
    """The whole chain of the register at ``path``, across its repaired segments, held
    against the head its checkpoint anchors (``AuditLog.verify``). Reads only: any process
    may make it, beside the writers."""
    # The checkpoint first, then the file: a writer rewrites the checkpoint only after the
    # fsync of what it covers, so the file read afterwards reaches at least that far. Read
    # the other way round, a burst appended between the two reads would be named missing.
    checkpoint = checkpoint_path_for(path)
    point = read_checkpoint(checkpoint)
    return against_anchor(verify_file(path, lock_path_for(path), None, 0), point, checkpoint)


def verify_file(
    path: Path, lock_path: Path | None, stop_after: int | None, depth: int
) -> VerifyReport:
    """Verify ``path`` (up to ``stop_after``), first the segments its repair record links to."""
    link = repair_link(path) if depth < _MAX_SEGMENTS else None
    if link is None:
        return verify_lines(lambda: file_lines(path, lock_path), stop_after=stop_after)
    if stop_after is not None and stop_after <= link.seq:
        # The part of this file that counts lies wholly in the earlier segment.
        return verify_file(link.kept, None, stop_after, depth + 1)
    earlier = verify_file(link.kept, None, link.seq, depth + 1)
    if not earlier.ok or (earlier.last_seq, earlier.last_hash) != (link.seq, link.hash):
        problem = (earlier.problem if not earlier.ok else
                   f"the kept segment {link.kept.name} no longer ends its good part at record "
                   f"{link.seq:04d} with the hash the repair recorded")
        return VerifyReport(ok=False, count=earlier.count, first_bad_seq=earlier.first_bad_seq,
                            line_no=earlier.line_no, problem=problem,
                            fault=earlier.fault or Fault.ALTERED, last_seq=earlier.last_seq,
                            last_hash=earlier.last_hash, repaired_at=earlier.repaired_at)
    here = verify_lines(lambda: file_lines(path, lock_path), start_seq=link.seq,
                        start_hash=link.hash, stop_after=stop_after)
    return VerifyReport(ok=here.ok, count=earlier.count + here.count,
                        first_bad_seq=here.first_bad_seq, line_no=here.line_no,
                        problem=here.problem, fault=here.fault, last_seq=here.last_seq,
                        last_hash=here.last_hash,
                        repaired_at=(*earlier.repaired_at, link.seq + 1))


def file_lines(path: Path, lock_path: Path | None) -> Iterator[tuple[int, bytes]]:
    """Numbered lines, as far as the file reached when no writer was mid-append.

    With ``lock_path``, reading stops at the size seen under the writers' lock, so an append
    in progress is never mistaken for a truncated record (without it: the caller holds it).
    """
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        size = (settled_size(lock_path, f.fileno()) if lock_path is not None
                else os.fstat(f.fileno()).st_size)
        offset = 0
        for line_no, line in enumerate(f, start=1):
            if offset + len(line) > size:
                if offset < size:
                    yield line_no, line[: size - offset]
                return
            offset += len(line)
            yield line_no, line


def lines_from(fd: int, offset: int, size: int) -> Iterator[tuple[int, bytes]]:
    """The lines between ``offset`` and ``size`` (line numbers count from the offset)."""
    data = os.pread(fd, size - offset, offset) if size > offset else b""
    yield from enumerate(io.BytesIO(data), start=1)

