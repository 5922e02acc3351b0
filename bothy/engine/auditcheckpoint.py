"""The checkpoint beside the register (``<path>.checkpoint``): its head, anchored.

It names the file's identity and the offset, seq and hash of the last record a writer appended
after verifying the chain up to it. A process's first append verifies only what was appended
since (:class:`Checkpoint`'s ``describes``); a register that verifies but stops before the
anchored head lost its last records (:func:`against_anchor`). It is rewritten in place after
appends and never fsynced: one lost or behind only costs a longer verify.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from bothy.engine.auditchain import Fault, VerifyReport
from bothy.engine.auditfile import FILE_MODE, last_line
from bothy.engine.auditrecord import body_of, parse_line

__all__ = ["Checkpoint", "against_anchor", "checkpoint_path_for", "read_checkpoint",
           "remove_checkpoint", "write_checkpoint"]

_CHECKPOINT_BYTES = 256  # the checkpoint's fixed width (its JSON is about 170 bytes)


@dataclass(frozen=True)
class Checkpoint:
    dev: int
    ino: int
    offset: int
    seq: int
    hash: str

    def describes(self, fd: int, st: os.stat_result) -> bool:
        """Same file, at least as long, and the record ending at the offset still ours."""
        if (self.dev, self.ino) != (st.st_dev, st.st_ino) or not 0 < self.offset <= st.st_size:
            return False
        if os.pread(fd, 1, self.offset - 1) != b"\n":
            return False
        line = last_line(fd, self.offset)
        parsed = parse_line(line)
        return (not isinstance(parsed, str) and parsed.seq == self.seq
                and parsed.hash == self.hash
                and hashlib.sha256(body_of(line)).hexdigest() == self.hash)


def against_anchor(
    report: VerifyReport, point: Checkpoint | None, where: Path
) -> VerifyReport:
    """A chain that verifies but ends before the head anchored in state lost its last records
    (cut back to a record boundary, or replaced by an older copy)."""
    if not report.ok or point is None or point.seq <= report.last_seq:
        return report
    first, last = report.last_seq + 1, point.seq
    what = (f"record {first:04d} is missing" if first == last
            else f"records {first:04d}–{last:04d} are missing")
    return replace(report, ok=False, fault=Fault.MISSING, first_bad_seq=first, problem=(
        f"{what} from the end: the register stops at {report.last_seq:04d} but its head "
        f"anchored in {where.name} is {last:04d}"))


def checkpoint_path_for(register: Path) -> Path:
    """Where ``register``'s checkpoint is kept (``<register>.checkpoint``)."""
    return register.with_name(register.name + ".checkpoint")


def read_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint, or None when absent or unreadable (then the whole chain is verified)."""
    try:
        data = json.loads(path.read_bytes())
        point = Checkpoint(dev=data["dev"], ino=data["ino"], offset=data["offset"],
                            seq=data["seq"], hash=data["hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(isinstance(v, int) for v in (point.dev, point.ino, point.offset, point.seq)):
        return None
    return point


def write_checkpoint(path: Path, st: os.stat_result, seq: int, digest: str) -> None:
    """Rewrite the checkpoint in place (no fsync: one lost or behind only costs a longer
    verify).

    One ``pwrite`` of a fixed width over the old content, not a new file renamed into place:
    on ext4 a rename over a file costs as much as the fsync it saves. A reader that meets a
    half-written checkpoint cannot parse it and verifies the whole chain instead.
    """
    data = json.dumps({"dev": st.st_dev, "ino": st.st_ino, "offset": st.st_size, "seq": seq,
                       "hash": digest}).encode().ljust(_CHECKPOINT_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError:
        return  # the record is durable; without a checkpoint the next process verifies it all
    try:
        os.pwrite(fd, data, 0)
        if os.fstat(fd).st_size > len(data):  # one written by an older Bothy, or longer
            os.ftruncate(fd, len(data))
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()  # rather none than a torn one
    finally:
        os.close(fd)


def remove_checkpoint(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()

