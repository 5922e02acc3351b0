"""What a long-running ``bothy serve`` keeps in memory beyond its code, and what it gives back.

A serve is left running for months; its resident memory should level off, not creep up with
every run. A soak of 2,400 Slack mentions on one serve grew by ~13 MB: +2.8 MB in use and
+3.5 MB free inside the C heap (mallinfo2), and Python caches that were bounded but large (the
register's checked names, Slack's dedupe keys: their caps, in their own modules, are now 512
and 2,000). The C heap's part is this module's:

- SQLite's page cache. Each long-lived connection (the state database, the register's index)
  keeps up to 2 MB of pages by default, and fills it as its file grows. Here it is held to
  :data:`SQLITE_PAGE_CACHE_KIB`; the files stay in the system's page cache, so a page read
  again costs a copy, not a disk read.
- Freed memory inside the C heap. glibc returns the top of its heap to the system, but not
  the free pages between chunks still in use; :func:`keep_heap_trimmed` asks it to
  (``malloc_trim``) every few minutes. Where there is no glibc (macOS's allocator gives
  memory back on its own), it does nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import cache

_log = logging.getLogger(__name__)

SQLITE_PAGE_CACHE_KIB = 512  # per connection; SQLite's default is 2,000 KiB
SQLITE_PAGE_CACHE_PRAGMA = f"PRAGMA cache_size = -{SQLITE_PAGE_CACHE_KIB}"  # negative: KiB
TRIM_EVERY_S = 300.0


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes  # here: every command opens the state database, only serve trims

    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library already loaded in this process
    except (AttributeError, OSError):
        return None  # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system; True if any were given back.
    Blocking (a few ms on a serve's heap): call it from a thread."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


async def keep_heap_trimmed(stop: asyncio.Event, *, every_s: float = TRIM_EVERY_S,
                            trim: Callable[[], bool] = trim_heap) -> None:
    """Trim the heap every ``every_s`` until ``stop`` is set."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            gave_back = await asyncio.to_thread(trim)
            _log.debug("heap trimmed: %s", "pages given back" if gave_back else "nothing to give")
