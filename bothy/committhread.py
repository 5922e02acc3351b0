"""A thread of its own for one writer's blocking commits: :class:`CommitThread`.

A group commit hands each batch to a thread (the write and fsync must not block the event
loop) and waits for it. ``asyncio.to_thread`` costs ~110–160 µs of CPU for each hand-off
here (a context copy, the executor's work item and ``concurrent.futures.Future`` with its
lock, the future chained back to the loop): about 8 µs a record in a commit of 16, as much as
chaining the record. :class:`CommitThread` hands a call over on a ``SimpleQueue`` and answers
an asyncio future with one ``call_soon_threadsafe``, nothing else.

One thread per writer, so its commits run one at a time in the order they were handed over
(the idle hook's durable step too). The thread is started with the first call, ends after
``idle_exit_s`` with nothing to do (a process holding many registers keeps no idle threads),
and is started afresh in a forked child. At interpreter exit a commit under way is waited
for, as the default executor's is: a write cut short between its ``write`` and its
``fsync`` (or its short-write truncation) is never left behind by an exit.

The caller's await may be cancelled; the call goes on (a thread cannot be stopped), and its
result is dropped. A loop closed meanwhile is not answered.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["CommitThread"]

A = TypeVar("A")
R = TypeVar("R")

_STOP = object()  # handed over at interpreter exit: the thread ends after the call before it


class CommitThread:
    """Runs ``fn(arg)`` calls for coroutines, one at a time, on one thread named ``name``."""

    def __init__(self, name: str, *, idle_exit_s: float = 1.0) -> None:
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._reset()

    def _reset(self) -> None:
        """Nothing started (again, in a forked child: the parent's thread is not here)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()  # whether the thread runs, decided under it
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[[A], R], arg: A) -> R:
        """``fn(arg)`` on the thread, after the calls handed over before it; its result, or
        the exception it raised."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[R] = loop.create_future()
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            self._calls.put((loop, outcome, fn, arg))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name,
                                                daemon=True)
                self._thread.start()
                _LIVE.add(self)
        return await outcome

    def _serve(self) -> None:
        calls = self._calls
        while True:
            try:
                call = calls.get(timeout=self._idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if calls.empty():  # nothing handed over meanwhile: end (run starts anew)
                        self._thread = None
                        return
                continue
            if call is _STOP:
                with self._lock:
                    self._thread = None
                return
            _call(*call)
            del call  # hold nothing of it while idle

    def _stop_at_exit(self) -> None:
        """Let the call under way (and those handed over before) finish, then end."""
        with self._lock:
            thread = self._thread if self._pid == os.getpid() else None
            if thread is None:
                return
            self._calls.put(_STOP)
        thread.join()


def _call(loop: asyncio.AbstractEventLoop, outcome: asyncio.Future[Any],
          fn: Callable[[Any], Any], arg: Any) -> None:
    try:
        result = fn(arg)
    except BaseException as exc:  # the caller's to hear, whatever it is
        _answer(loop, outcome, None, exc)
    else:
        _answer(loop, outcome, result, None)


def _answer(loop: asyncio.AbstractEventLoop, outcome: asyncio.Future[Any], result: Any,
            exc: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # the loop was closed: nobody waits any more
        loop.call_soon_threadsafe(_settle, outcome, result, exc)


def _settle(outcome: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if outcome.done():  # its caller was cancelled
        return
    if exc is None:
        outcome.set_result(result)
    else:
        outcome.set_exception(exc)


_LIVE: weakref.WeakSet[CommitThread] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for commit_thread in list(_LIVE):
        commit_thread._stop_at_exit()
