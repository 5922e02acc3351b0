"""The main task's waits: the first of several things, and stop signals only recorded."""

from __future__ import annotations

import asyncio
import os
import signal

from bothy.waits import first_of, recording_stop_signals

BOUND_S = 5.0


async def test_first_of_says_which_came_first_and_ends_only_the_waits_it_started() -> None:
    """A coroutine that lost is cancelled; the caller's own task is left running."""
    never = asyncio.Event()
    callers = asyncio.create_task(never.wait())
    came = asyncio.Event()
    came.set()
    lost_cancelled = asyncio.Event()

    async def loser() -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            lost_cancelled.set()
            raise

    async with asyncio.timeout(BOUND_S):
        assert await first_of(callers, came.wait(), loser()) == 1
    assert lost_cancelled.is_set()
    assert not callers.done()
    callers.cancel()


async def test_first_of_returns_when_the_callers_task_ends_first() -> None:
    """The dispatcher's case: a wake's task that ends before its admission releases the wait."""
    async def ends_at_once() -> None:
        return None

    ended = asyncio.create_task(ends_at_once())
    async with asyncio.timeout(BOUND_S):
        assert await first_of(asyncio.Event().wait(), ended) == 1
    assert ended.done() and not ended.cancelled()


async def test_a_first_stop_signal_sets_stop_and_a_second_sets_hurry() -> None:
    """Real signals to this process: the handlers record, and are removed on the way out."""
    stop, hurry = asyncio.Event(), asyncio.Event()
    before = signal.getsignal(signal.SIGTERM)
    with recording_stop_signals(stop, hurry):
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(BOUND_S):
            await stop.wait()
        assert not hurry.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        async with asyncio.timeout(BOUND_S):
            await hurry.wait()
    assert signal.getsignal(signal.SIGTERM) == before
