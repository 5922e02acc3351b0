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
"""

from __future__ import annotations

import asyncio
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
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"a group commit takes at least one item per batch, not {max_batch}")
        self._commit = commit
        self._max_batch = max_batch
        self._name = name
        # Futures belong to one loop: each loop that submits gets its own queue and committer
        # (an AuditLog may outlive several asyncio.run calls, or serve two loops at once).
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue[T, R]] = (
            weakref.WeakKeyDictionary())

    async def submit(self, item: T) -> R:
        """Add ``item`` to the next commit; return its result once that commit has returned."""
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _Queue()
        outcome: asyncio.Future[R] = loop.create_future()
        queue.waiting.append((item, outcome))
        if queue.committer is None or queue.committer.done():
            queue.committer = loop.create_task(self._commit_waiting(queue), name=self._name)
        return await outcome

    async def _commit_waiting(self, queue: _Queue[T, R]) -> None:
        """Commit batches while anyone waits; the batch grows with what arrived meanwhile."""
        while queue.waiting:
            batch = queue.waiting[: self._max_batch]
            del queue.waiting[: self._max_batch]
            try:
                results = await self._commit([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{self._name}: {len(results)} results for a batch of"
                                       f" {len(batch)}")
            except asyncio.CancelledError:
                stopped = CommitStopped(f"{self._name}: stopped before the commit finished")
                for _, outcome in (*batch, *queue.waiting):
                    _settle(outcome, stopped)
                queue.waiting.clear()
                raise
            except Exception as exc:  # every waiter of the batch hears it
                for _, outcome in batch:
                    _settle(outcome, exc)
            else:
                for (_, outcome), result in zip(batch, results, strict=True):
                    if not outcome.done():  # its caller went away (cancelled)
                        outcome.set_result(result)


def _settle(outcome: asyncio.Future[R], exc: BaseException) -> None:
    if not outcome.done():
        outcome.set_exception(exc)
