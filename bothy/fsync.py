"""Making a write durable: the one fsync every durable write in Bothy goes through.

On macOS ``fsync()`` only hands the data to the drive, which may keep it in its cache across a
power loss; ``fcntl(F_FULLFSYNC)`` asks the drive to flush (contracts.md §7, and Apple's
fsync(2) man page). Some filesystems (network, FAT) refuse F_FULLFSYNC: then plain fsync is the
best there is. Everywhere else ``fsync()`` is the flush.

A new name is durable only once its directory is fsynced too: :func:`fsync_directory`.
Standard library only: ``bothy status`` reaches this through ``atomicfile`` and must start fast.

A fault point, for proving what happens when the disk fails (tests only): with
``BOTHY_FAULT_FSYNC`` naming a file, every fsync fails with EIO — as Linux reports a write
the disk could not take — while that file exists, for files under the directory it names
(its content; empty: every file). Nothing else of Bothy is replaced.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

_FAULT_POINT = "BOTHY_FAULT_FSYNC"

__all__ = ["fsync", "fsync_directory"]


def fsync(fd: int) -> None:
    """Flush ``fd``'s data to stable storage (F_FULLFSYNC on macOS); OSError if it cannot."""
    trigger = os.environ.get(_FAULT_POINT)
    if trigger is not None:
        _injected_fault(fd, trigger)
    if sys.platform == "darwin":  # spelled out so that mypy knows F_FULLFSYNC exists here
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # refused by this filesystem: fsync below is the best there is
    os.fsync(fd)


def fsync_directory(directory: Path) -> None:
    """Make the names in ``directory`` durable (a file's fsync does not persist its name)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def _injected_fault(fd: int, trigger: str) -> None:
    """Raise EIO if the fault point is armed for ``fd``'s file (see the module docstring)."""
    try:
        under = Path(trigger).read_text().strip()
    except OSError:
        return  # not armed
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if not under or target == under or target.startswith(under.rstrip("/") + "/"):
        raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (fault injected by BOTHY_FAULT_FSYNC)")
