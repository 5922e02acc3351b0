"""The inbox's payloads on disk: append-only segment files, one line per delivery.

``$BOTHY_HOME/inbox/wakes-000001.seg``, ``wakes-000002.seg``… (0600, in the 0700 inbox). A
batch of payloads (one line each, ending in a newline) is appended in one ``write`` and made
durable by one fsync — the group commit's fsync (:mod:`bothy.groupcommit`); a new segment's
name is made durable by fsyncing the directory before its first batch is acknowledged.

A process never appends to a segment an earlier process wrote: its tail may have been cut by
a crash mid-write. Each process starts its own segment at its first batch, and a new one past
:data:`_SEGMENT_BYTES` or :data:`_SEGMENT_AGE_S` (so that a quiet site's segment too grows
old and can be pruned: :mod:`bothy.wakes.retention`), and after a failed write or fsync
(after a failed fsync the kernel may have dropped the pages it could not write: nothing more
is written behind them).

Where a payload is, and which lines hold a queued wake, is the state database's (the
``wakes`` rows name segment, offset and length): this module only writes and reads bytes.
Everything here blocks; the inbox calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bothy.fsync import fsync, fsync_directory

_NAME = re.compile(r"wakes-(\d{6,})\.seg")
_SEGMENT_BYTES = 64 * 1024 * 1024
_SEGMENT_AGE_S = 86_400.0
_FILE_MODE = 0o600
_DIR_MODE = 0o700


@dataclass(frozen=True)
class Span:
    """Where one payload line is: its segment, offset and length (the newline included)."""

    segment: str
    offset: int
    length: int


@dataclass
class _Open:
    name: str
    fd: int
    size: int
    opened_s: float


class Segments:
    """The segment files under ``root``; one writer per process (the inbox's committer).
    ``now_s`` is the time in seconds (the inbox's clock), for a segment's age."""

    def __init__(self, root: Path, *, now_s: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self._now_s = now_s
        self._current: _Open | None = None
        self._lock = threading.Lock()

    @property
    def current(self) -> str | None:
        """The segment this process appends to (never pruned while it is)."""
        return self._current.name if self._current is not None else None

    def append(self, lines: list[bytes]) -> list[Span]:
        """Append ``lines`` in one write and fsync them; return where each one is.

        Raises OSError if they cannot be made durable; then none of them counts (the bytes
        are cut back where the filesystem lets us, and the next batch starts a new segment).
        """
        with self._lock:
            target, new = self._target()
            data = b"".join(lines)
            try:
                _write_all(target.fd, data)
                fsync(target.fd)
                if new:  # the name must be durable before any line in it is acknowledged
                    fsync_directory(self.root)
            except OSError:
                self._abandon(target)
                raise
            spans = []
            offset = target.size
            for line in lines:
                spans.append(Span(target.name, offset, len(line)))
                offset += len(line)
            target.size = offset
            return spans

    def read(self, span: Span) -> bytes:
        """The line at ``span``, without its newline; OSError if the file cannot be read,
        ValueError if what is there is not a whole line."""
        fd = os.open(self.root / span.segment, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, span.length, span.offset)
        finally:
            os.close(fd)
        if len(data) != span.length or not data.endswith(b"\n"):
            raise ValueError(f"no whole line of {span.length} bytes at offset {span.offset} of"
                             f" {span.segment}")
        return data[:-1]

    def names(self) -> list[str]:
        """Every segment file, oldest first."""
        return [name for _, name in self._numbered()]

    def _numbered(self) -> list[tuple[int, str]]:
        if not self.root.is_dir():
            return []
        return sorted((int(m.group(1)), entry.name) for entry in os.scandir(self.root)
                      if (m := _NAME.fullmatch(entry.name)))

    def lines_after(self, segment: str, offset: int) -> Iterator[tuple[Span, bytes]]:
        """The whole lines of ``segment`` from ``offset`` on (a last line cut short by a crash
        is not one: it was never acknowledged)."""
        with (self.root / segment).open("rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    return
                yield Span(segment, offset, len(line)), line[:-1]
                offset += len(line)

    def mtime_us(self, segment: str) -> int:
        return (self.root / segment).stat().st_mtime_ns // 1000

    def remove(self, segments: list[str]) -> None:
        """Delete ``segments`` (never the current one) and make their removal durable."""
        with self._lock:
            gone = [s for s in segments if s != self.current]
            for segment in gone:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / segment)
            if gone:
                fsync_directory(self.root)

    def close(self) -> None:
        """Stop appending to the current segment (the next batch starts a new one)."""
        with self._lock:
            self._close_current()

    def _target(self) -> tuple[_Open, bool]:
        """The segment to append to, and whether it was created for this batch."""
        current = self._current
        if (current is not None and current.size < _SEGMENT_BYTES
                and self._now_s() - current.opened_s < _SEGMENT_AGE_S):
            return current, False
        self._close_current()
        _ensure_dir(self.root)
        numbered = self._numbered()
        number = numbered[-1][0] + 1 if numbered else 1
        while True:
            name = f"wakes-{number:06d}.seg"
            try:
                fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | os.O_APPEND | os.O_CLOEXEC, _FILE_MODE)
            except FileExistsError:  # another inbox on this directory took it first
                number += 1
                continue
            os.fchmod(fd, _FILE_MODE)  # exact mode, whatever the umask
            self._current = _Open(name, fd, 0, self._now_s())
            return self._current, True

    def _close_current(self) -> None:
        if self._current is not None:
            os.close(self._current.fd)
            self._current = None

    def _abandon(self, target: _Open) -> None:
        """Cut a failed batch back off (best effort) and never append behind it again."""
        with contextlib.suppress(OSError):
            os.ftruncate(target.fd, target.size)
        self._close_current()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _ensure_dir(root: Path) -> None:
    if root.is_dir():
        return
    # FileExistsError when ``root`` is a file: the caller reports it as an OSError.
    root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    fsync_directory(root.parent)
