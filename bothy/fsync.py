"""Making a write durable: the one fsync every durable write in Bothy goes through.

On macOS ``fsync()`` only hands the data to the drive, which may keep it in its cache across a
power loss; ``fcntl(F_FULLFSYNC)`` asks the drive to flush (contracts.md §7, and Apple's
fsync(2) man page). Some filesystems (network, FAT) refuse F_FULLFSYNC: then plain fsync is the
best there is. Everywhere else ``fsync()`` is the flush.

A new name is durable only once its directory is fsynced too: :func:`fsync_directory`.
Standard library only: ``bothy status`` reaches this through ``atomicfile`` and must start fast.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

__all__ = ["fsync", "fsync_directory"]


def fsync(fd: int) -> None:
    """Flush ``fd``'s data to stable storage (F_FULLFSYNC on macOS); OSError if it cannot."""
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
