"""How the main task waits: on the first of several things, and on stop signals.

STYLE: signal handlers only record; the main task acts. :func:`recording_stop_signals` is the
one place a SIGINT or SIGTERM is heard (``bothy serve`` and a foreground ``bothy run`` alike):
the first sets ``stop``, a second sets ``hurry``. :func:`first_of` is how the main task then
waits for whichever of its work and those events comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def first_of(*waits: Awaitable[Any]) -> int:
    """Wait until the first of ``waits`` is done; return its position.

    A coroutine among them runs for this wait only: if another is first, it is cancelled and
    awaited. A task or future passed in belongs to the caller and is left as it is."""
    owned = [not asyncio.isfuture(wait) for wait in waits]
    futures = [asyncio.ensure_future(wait) for wait in waits]
    try:
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        return next(i for i, future in enumerate(futures) if future in done)
    finally:
        for future, ours in zip(futures, owned, strict=True):
            if ours and not future.done():
                future.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await future


@contextlib.contextmanager
def recording_stop_signals(stop: asyncio.Event, hurry: asyncio.Event) -> Iterator[None]:
    """While inside, a first SIGINT or SIGTERM sets ``stop`` and a later one ``hurry`` (skip
    the waits). The handlers record only; the running loop's main task acts on the events."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            hurry.set()
        stop.set()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal)
    try:
        yield
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
