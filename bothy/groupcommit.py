"""Group commit: what arrives together is made durable together (SPEC §2, rule 3).

Each write that must be durable before its caller is told "yes" costs an fsync, and an fsync
costs the same for one record as for a hundred. :class:`GroupCommit` lets the callers that
arrive while a commit is under way wait for the next one, which covers them all: one call of
the owner's ``commit`` for the whole batch (one write and fsync of an append-only segment, one
SQLite transaction — whatever that owner's commit is). Under load N commits become one; alone,
a caller waits for exactly one commit, as before.

The register (:mod:`bothy.engine.audit`) and the inbox (:mod:`bothy.wakes.inbox`) both make
their writes durable through it; neither keeps a copy of this logic.

Every caller still returns only after the commit that holds its item has returned, and hears
that commit's failure if it failed: nothing is acknowledged early. Items are committed in the
order they were submitted (the register's seq order is its chain order).

A caller that is cancelled while it waits does not take its item back: a write already
submitted goes on, as a write under way always did.

``in_flight``: how many commits may be under way at once (default one: each batch's commit
starts once the one before has returned). With more, the next batch is taken while earlier
commits are still in their slow steps, and ``commit`` must itself keep their effects in order
(the inbox does: segment appends, then inserts, each in batch order).

``idle``: called by the committer once nobody waits any more — once the commits under way
have returned, the callers they answered have had their turn of the loop to come back, and
nothing more has arrived for ``idle_after_s`` (the register does there what it need not do
after each commit: its durable step; an intake that submits a batch every few milliseconds
would otherwise call it after each). The next commit waits for it. It must not raise; if it
does, the error is dropped.

:meth:`GroupCommit.submit_all`: several items at once, one future each, without a task
for each caller (an intake recording a batch of deliveries).

``linger_s``: callers answered together by one commit (HTTP senders, each waiting for its
answer before it sends again) come back together, but not at once; the first back would get a
commit of its own and the rest would wait for it. So when fewer wait than the last batch
held, the committer waits up to ``linger_s`` for them (never when the last batch was one).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["CommitStopped", "GroupCommit"]

T = TypeVar("T")
R = TypeVar("R")


class CommitStopped(Exception):
    """The event loop stopped the committer before the commit holding an item ran."""


@dataclass
class _Queue(Generic[T, R]):
    """One event loop's waiters, and the task committing for them (None when idle)."""

    waiting: list[tuple[T, asyncio.Future[R]]] = field(default_factory=list)
    committer: asyncio.Task[None] | None = None
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    running: set[asyncio.Task[None]] = field(default_factory=set)  # commits under way
    last_batch: int = 1
    enough: asyncio.Event | None = None  # set once as many wait as the last batch held
    arrived: asyncio.Event | None = None  # set by the next submission (the idle hook's wait)


class GroupCommit(Generic[T, R]):
    """Batches submitted items into calls of ``commit``, at most ``max_batch`` items each.

    ``commit`` receives the items in submission order and returns one result per item, in
    the same order; if it raises, every caller of that batch hears the exception.
    """

    def __init__(
        self,
        commit: Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        max_batch: int,
        name: str,
        linger_s: float = 0.0,
        in_flight: int = 1,
        idle: Callable[[], Awaitable[None]] | None = None,
        idle_after_s: float = 0.0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"a group commit takes at least one item per batch, not {max_batch}")
        self._commit = commit
        self._max_batch = max_batch
        self._name = name
        self._linger_s = linger_s
        self._in_flight = in_flight
        self._idle = idle
        self._idle_after_s = idle_after_s
        # Futures belong to one loop: each loop that submits gets its own queue and committer
        # (an AuditLog may outlive several asyncio.run calls, or serve two loops at once).
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue[T, R]] = (
            weakref.WeakKeyDictionary())
        self._last: tuple[asyncio.AbstractEventLoop, _Queue[T, R]] | None = None

    def submit(self, item: T) -> asyncio.Future[R]:
        """Add ``item`` to the next commit (from the event loop); its future, answered once
        that commit has returned (``await group.submit(item)``; cancelling it stops nothing).
        A future, not a coroutine: one frame less for each caller."""
        loop = asyncio.get_running_loop()
        queue = self._queue(loop)
        outcome: asyncio.Future[R] = loop.create_future()
        queue.waiting.append((item, outcome))
        self._arrived(queue, loop)
        return outcome

    def submit_all(self, items: Sequence[T]) -> list[asyncio.Future[R]]:
        """Add ``items``, in order, to the next commit (from the event loop); one future each,
        answered once the commit holding it has returned (cancelling one stops nothing)."""
        loop = asyncio.get_running_loop()
        queue = self._queue(loop)
        outcomes: list[asyncio.Future[R]] = [loop.create_future() for _ in items]
        queue.waiting.extend(zip(items, outcomes, strict=True))
        self._arrived(queue, loop)
        return outcomes

    def _queue(self, loop: asyncio.AbstractEventLoop) -> _Queue[T, R]:
        last = self._last
        if last is not None and last[0] is loop:
            return last[1]  # the loop that submitted last (mostly the only one)
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _Queue(slots=asyncio.Semaphore(self._in_flight))
        self._last = (loop, queue)
        return queue

    def _arrived(self, queue: _Queue[T, R], loop: asyncio.AbstractEventLoop) -> None:
        """Items were just queued: wake a lingering committer, or start one."""
        if queue.enough is not None and len(queue.waiting) >= queue.last_batch:
            queue.enough.set()
        if queue.arrived is not None:
            queue.arrived.set()
        if queue.committer is None or queue.committer.done():
            queue.committer = loop.create_task(self._commit_waiting(queue), name=self._name)

    async def _commit_waiting(self, queue: _Queue[T, R]) -> None:
        """Commit batches while anyone waits; the batch grows with what arrived meanwhile.

        A batch is taken once a commit slot is free: with ``in_flight`` > 1, while the commits
        before it are still under way (their owner keeps their effects in order). Then, with
        an ``idle`` hook, it waits for quiet and calls it."""
        try:
            while True:
                while queue.waiting:
                    await self._take_batch(queue)
                if self._idle is None:
                    return
                if not await self._quiet(queue) or await self._arrives_within(queue):
                    continue  # someone came back, or came: commit for them first
                with contextlib.suppress(Exception):  # it must not raise (see the module)
                    await self._idle()
                if not queue.waiting:
                    return
        except asyncio.CancelledError:
            stopped = CommitStopped(f"{self._name}: stopped before the commit")
            for _, outcome in queue.waiting:
                _settle(outcome, stopped)
            queue.waiting.clear()
            raise

    async def _take_batch(self, queue: _Queue[T, R]) -> None:
        """Start the commit of the next batch once a slot is free."""
        await queue.slots.acquire()
        try:
            await self._linger(queue)
        except BaseException:
            queue.slots.release()
            raise
        batch = queue.waiting[: self._max_batch]
        del queue.waiting[: self._max_batch]
        queue.last_batch = max(1, len(batch))
        if self._in_flight == 1:  # one at a time: the committer commits it itself (no task)
            await self._commit_one(queue, batch)
            return
        task = asyncio.get_running_loop().create_task(self._commit_one(queue, batch))
        queue.running.add(task)  # a commit under way ends, whatever its committer does
        task.add_done_callback(queue.running.discard)

    async def _quiet(self, queue: _Queue[T, R]) -> bool:
        """Wait for the commits under way, then one turn of the loop; whether nobody waits."""
        while queue.running and not queue.waiting:
            await asyncio.wait(set(queue.running))
        await asyncio.sleep(0)  # the callers just answered come back now, if they are coming
        return not queue.waiting

    async def _arrives_within(self, queue: _Queue[T, R]) -> bool:
        """Whether anything is submitted within ``idle_after_s``."""
        if self._idle_after_s <= 0:
            return False
        queue.arrived = asyncio.Event()
        try:
            async with asyncio.timeout(self._idle_after_s):
                await queue.arrived.wait()
        except TimeoutError:
            return False
        finally:
            queue.arrived = None
        return True

    async def _commit_one(
        self, queue: _Queue[T, R], batch: list[tuple[T, asyncio.Future[R]]]
    ) -> None:
        """One batch's commit; every waiter hears its result or its failure. Frees the slot."""
        try:
            results = await self._commit([item for item, _ in batch]) if batch else []
            if len(results) != len(batch):
                raise RuntimeError(f"{self._name}: {len(results)} results for a batch of"
                                   f" {len(batch)}")
        except asyncio.CancelledError:
            stopped = CommitStopped(f"{self._name}: stopped before the commit finished")
            for _, outcome in batch:
                _settle(outcome, stopped)
            raise
        except Exception as exc:  # every waiter of the batch hears it
            for _, outcome in batch:
                _settle(outcome, exc)
        else:
            for (_, outcome), result in zip(batch, results, strict=True):
                if not outcome.done():  # its caller went away (cancelled)
                    outcome.set_result(result)
        finally:
            queue.slots.release()

    async def _linger(self, queue: _Queue[T, R]) -> None:
        """Wait up to ``linger_s`` for as many callers as the last batch held."""
        if self._linger_s <= 0 or len(queue.waiting) >= min(queue.last_batch, self._max_batch):
            return
        queue.enough = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._linger_s):
                    await queue.enough.wait()
        finally:
            queue.enough = None


def _settle(outcome: asyncio.Future[R], exc: BaseException) -> None:
    if not outcome.done():
        outcome.set_exception(exc)
