"""``bothy serve``'s single-instance lock, ``state/serve.lock``: who holds it, and what that says.

* A serve takes it (an exclusive ``flock``) before anything else and holds it for its whole
  life, with its pid written in the file: a second serve is refused, naming that pid. A start
  waits a moment (``_START_PAUSES_S``) for a lock held only for a status's look (below).
* What a serve must not see (``bothy audit repair``) takes it for as long as it works, and
  empties the pid: it is not a serve, so a serve refused meanwhile names nobody.
* ``bothy status`` (and ``doctor``) ask :func:`serve_alive` whether the serve that published
  ``state/serve.json`` still runs. The lock answers without the process table (psutil's import
  was ~45 % of a status beside a running serve; issue 18) and without taking the lock from a
  live serve; where it cannot tell, the caller asks the process table as before.

A ``flock`` is released by the kernel when its holder exits, however it exits, so a lock
nobody holds means no serve runs, whatever ``serve.json`` still says.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from bothy.errors import TemporaryFailure

TYPE_CHECKING = False  # (``typing`` is not imported for mypy's sake on status's way)
if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from pathlib import Path

__all__ = ["serve_alive", "serve_holding", "single_instance"]


# How long a serve's start waits, in steps, for a lock held only an instant: a status's or
# doctor's look (``serve_alive``) holds it for the microseconds of a close when the last
# serve died and its pid went to another process. A serve that runs holds it for good.
_START_PAUSES_S = (0.005, 0.02, 0.1)


@contextlib.asynccontextmanager
async def single_instance(lock_path: Path) -> AsyncIterator[None]:
    """Hold the lock as the site's one serve, with this process's pid in it; refused
    (TemporaryFailure) while another serve holds it (still held after ``_START_PAUSES_S``)."""
    import asyncio  # (only serve's start needs it: status's way stays without asyncio)

    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for pause_s in _START_PAUSES_S:
            if _taken(fd):
                break
            await asyncio.sleep(pause_s)
        else:
            if not _taken(fd):
                holder = _holder(fd)
                raise TemporaryFailure(
                    f"another bothy serve (pid {holder}) holds {lock_path}; not starting a second"
                    if holder != "unknown" else  # a repair empties it (serve_holding)
                    f"{lock_path} is held by a bothy that is not a serve (a register repair); "
                    "not starting until it is done")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def serve_holding(lock_path: Path, *, doing: str) -> Iterator[None]:
    """Hold ``bothy serve``'s single-instance lock while ``doing`` something it must not see;
    refused (TemporaryFailure) while a daemon runs."""
    with _serve_lock(lock_path, lambda holder: (
            f"refusing to {doing} while bothy serve (pid {holder}) runs: stop it first")) as fd:
        # The pid left in the file is a serve's that has gone; this holder is no serve.
        os.ftruncate(fd, 0)
        yield


@contextlib.contextmanager
def _serve_lock(lock_path: Path, refusal: Callable[[str], str]) -> Iterator[int]:
    """The serve lock, held until the block ends; ``refusal(holder pid)`` if another has it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not _taken(fd):
            raise TemporaryFailure(refusal(_holder(fd)))
        yield fd
    finally:
        os.close(fd)


def _taken(fd: int) -> bool:
    """The lock taken (exclusive) on ``fd``, or False while another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote in it, or "unknown"."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def serve_alive(lock_path: Path, pid: int) -> bool | None:
    """Whether the serve that published ``pid`` still runs, by the lock: True when a serve
    holds it with ``pid`` written in it; False when no process has that pid, or when nobody
    holds the lock (no serve runs); None when the lock cannot tell (another serve holds it,
    or there is no lock file), for the process table to answer.

    The lock is tried only once a process with ``pid`` is known to exist: it is then held by
    that serve (the try takes nothing), unless the serve died and its pid went to another
    process, the one case where the try holds the lock, for the microseconds of a close.
    """
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the pid exists is checked
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a serve holds it (or a repair, which leaves no pid)
            written = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return True if written == str(pid) else None
        return False
    finally:
        os.close(fd)  # a lock taken here goes with it
