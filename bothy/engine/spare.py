"""The spare: one ``codex app-server`` that ``bothy serve`` starts ahead of the next run.

Starting codex and answering its ``initialize`` is most of what a run costs before the model
is asked (docs/ARCHITECTURE.md, "The spare"). ``bothy serve`` pays it ahead:

* the spare is started with exactly the launch (argv, environment, ``CODEX_HOME``) and working
  directory that the site's runs use; a run whose profile sets ``codex_config`` needs another
  launch and starts its own (cold), and the spare waits for the next run that fits;
* it is a process group recorded like a run's worker, in the ``spares`` table with this
  process as its owner, before it is initialized, so that a later Bothy ends it should this
  one die (``engine/recovery.py``);
* it starts its thread ahead too (``thread/start``, most of what codex does before a run's
  turn), with the params of the last run's new thread that could be started ahead (one with
  no dynamic tools and no skill roots: those are the run's own; :meth:`Spare.expect`), at
  first a plain run's. The run takes that thread only if the thread it would start has equal
  params and nothing codex read into it as it started it has changed since (the workspace's
  AGENTS.md, the date: ``engine/threadinputs.py``; ``Worker.take_thread_ahead``); otherwise,
  or when it resumes a conversation's thread, it starts its own on the spare as before, and
  the one made ahead is left unused. codex writes a thread's rollout only at its first turn:
  an unused thread leaves nothing under ``CODEX_HOME`` once its app-server exits in order
  (its shell snapshot and lock go with it); a group SIGKILLed (serve killed, then recovery)
  leaves the thread's ``thread-writer-locks/<id>.lock`` behind;
* it is handed to exactly one run: :meth:`Spare.take` forgets a ready spare with no
  ``await`` between finding it ready and forgetting it (one still starting is waited for
  first, until :data:`STARTING_WAIT_S` after its spawn), so no second run can have it; its
  row goes once the run has recorded the group as its own (:meth:`Spare.run_started`); a
  stop ends the wait, and the run then withdraws without a worker; the next spare is
  started when that run ends, or a second after its turn started, whichever is first: not
  on the run's way to its turn nor beside codex building the model request, yet ready for a
  mention that comes while a long run works;
* it holds no pool slot and no reservation: it is not a run, and asks for nothing;
* a dead spare is never handed over (its death is noticed and recorded while it waits, and
  checked again when a run takes it), nor one started before ``CODEX_HOME``'s ``config.toml``
  or ``auth.json`` changed (codex reads them when it starts): it is ended, the run starts
  cold, and a new spare is started;
* a spare that could not start, or died, is replaced only when the next run starts (never in
  a loop); and it is ended when ``bothy serve`` stops.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from bothy.clock import Clock, to_us
from bothy.engine.audit import AuditLog
from bothy.engine.launch import Launch
from bothy.engine.procgroup import GroupRecord, process_start_time
from bothy.engine.state import StateDB
from bothy.engine.worker import ThreadParams, Worker
from bothy.errors import AppServerError, ProcessGroupError

__all__ = ["CODEX_FILES", "STARTING_WAIT_S", "Cold", "Spare", "SpareState"]

CODEX_FILES = ("config.toml", "auth.json")
"""What codex reads from ``CODEX_HOME`` as it starts: a spare older than a change is stale."""


class SpareState(StrEnum):
    """Where one spare is: starting (spawned, not yet initialized), ready, taken by a run, or
    ended without one."""

    STARTING = "starting"
    READY = "ready"
    TAKEN = "taken"
    ENDED = "ended"


@dataclass(frozen=True)
class Cold:
    """Why a run starts its own app-server instead of the spare."""

    reason: str


STARTING_WAIT_S = 2.0
"""Until how long after a spare's spawn a run waits for it to be up, rather than start its
own app-server (codex's initialize and thread/start take tens to a few hundred milliseconds
here, loaded or not)."""

_Files = tuple[tuple[str, tuple[int, int, int] | None], ...]


def _codex_files(codex_home: Path) -> _Files:
    """Identity (inode, size, mtime) of each file codex reads at start; None if absent."""
    seen: list[tuple[str, tuple[int, int, int] | None]] = []
    for name in CODEX_FILES:
        try:
            stat = (codex_home / name).stat()
        except OSError:
            seen.append((name, None))
        else:
            seen.append((name, (stat.st_ino, stat.st_size, stat.st_mtime_ns)))
    return tuple(seen)


@dataclass(eq=False)
class _Held:
    """One spare: its worker, what CODEX_HOME held when it was started, its tasks."""

    worker: Worker
    files: _Files
    state: SpareState = SpareState.STARTING
    up: asyncio.Task[bool] | None = None  # spawn, record, initialize: True once ready
    watch: asyncio.Task[None] | None = None  # notices its death while it waits
    record: GroupRecord | None = None
    spawned_s: float = field(default_factory=time.monotonic)  # (monotonic) when start() made it


async def _up_within(held: _Held, wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``held``'s start to end, however it ends (up, failed, or
    stopped by ``close``); a run cancelled meanwhile leaves the start going on."""
    if wait_s > 0 and held.up is not None and not held.up.done():
        await asyncio.wait({held.up}, timeout=wait_s)


class Spare:
    """At most one spare app-server, started ahead, for the next run that fits its launch.

    ``start`` starts one in the background (if none is held); ``take`` hands it to a run or
    says why not; ``run_started`` is told once that run recorded the group as its own;
    ``close`` ends it for good. Every task it starts is its own and ends by ``close``.
    """

    def __init__(self, launch: Launch, *, cwd: Path, db: StateDB, audit: AuditLog,
                 clock: Clock, grace_s: float, thread: ThreadParams | None = None) -> None:
        self.launch = launch
        self.cwd = cwd
        self.thread = thread  # what the next spare's thread is started with; None: no thread
        self._db = db
        self._audit = audit
        self._clock = clock
        self._grace_s = grace_s
        self._held: _Held | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: set[asyncio.Task[Any]] = set()  # start_after's, cancelled by close
        self._closed = False
        self._failure: BaseException | None = None
        self._owner_start = process_start_time(os.getpid())

    def start(self) -> None:
        """Start a spare in the background, unless one is held or the spare is closed."""
        if self._closed or self._held is not None:
            return
        worker = Worker(self.launch, cwd=self.cwd, events=asyncio.Queue())
        held = self._held = _Held(worker, _codex_files(self.launch.codex_home))
        held.up = self._own(self._bring_up(held))

    async def take(self, launch: Launch, cwd: Path) -> Worker | Cold:
        """The spare for a run with this launch and cwd, initialized and alive; or why not.

        Only a ready spare is handed over. A spare still starting (a run that comes right
        after the last one ended: the next spare starts then) is waited for until
        :data:`STARTING_WAIT_S` after its spawn: it was spawned before this run came, so as a
        rule it is up sooner than a cold app-server would be. One not up by then (stuck, or
        slow on a machine too busy) is left where it is, and the run starts cold: a codex
        stuck in its start holds up only the runs that come in its first seconds. A stop
        ends the wait (``close``). Once ready, the spare is handed over with no ``await``
        between finding it ready and forgetting it: no other run can have it.
        """
        if launch != self.launch or cwd != self.cwd:
            return Cold("the run's launch (its profile's codex_config) is not the spare's")
        starting = self._held
        if starting is not None and starting.state is SpareState.STARTING:
            await _up_within(starting, starting.spawned_s + STARTING_WAIT_S - time.monotonic())
            if self._held is not starting:
                return Cold(self._gone(starting))
        held = self._held
        if held is None:
            return Cold("bothy is stopping" if self._closed else "no spare was ready")
        if held.state is SpareState.STARTING:
            return Cold(f"the spare was still starting {STARTING_WAIT_S:g} s after its spawn")
        self._held = None  # from here on, no other run can have it
        if held.watch is not None:
            held.watch.cancel()
        unfit = self._unfit(held)
        if unfit is not None:
            why, failed = unfit
            self._own(self._end(held, why, failed=failed))
            return Cold(why)
        held.state = SpareState.TAKEN
        held.worker.marks["taken"] = time.monotonic()
        return held.worker

    def _gone(self, waited: _Held) -> str:
        """Why the spare a run waited for is not there once the wait is over."""
        if self._closed:
            return "bothy is stopping"
        if waited.state is SpareState.TAKEN:
            return "another run took the spare it waited for"
        return "the spare it waited for could not start"

    def expect(self, launch: Launch, params: ThreadParams) -> None:
        """A run on ``launch`` starts a new thread with ``params``: the next spare's thread is
        started so, if it can be made ahead (no dynamic tools nor skill roots: those are the
        run's own, the one started ahead would never fit it); a spare already held keeps its
        own thread, taken only by a run it fits."""
        if launch == self.launch and not params.dynamic_tools and not params.skill_roots:
            self.thread = params

    def start_after(self, delay_s: float) -> None:
        """:meth:`start` in ``delay_s`` (a run's turn is under way: its model request goes out
        first, and the next spare is started while the model works)."""
        if not self._closed:
            self._timers.add(self._own(self._start_later(delay_s)))

    async def _start_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.start()

    def run_started(self, record: GroupRecord) -> None:
        """A run has recorded the spare's group as its own: the spare's row goes (in the
        background, off the run's way to its turn)."""
        self._own(self._forget(record))

    @property
    def failure(self) -> BaseException | None:
        """What broke one of the spare's own tasks (a broken register or state database),
        for its owner to raise once it has stopped; never dropped unseen."""
        return self._failure

    async def close(self, why: str = "bothy is stopping") -> None:
        """End the held spare and start no other; wait for what is still being ended (a
        failure meanwhile is :attr:`failure`, not raised here: the caller's stop goes on)."""
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        held, self._held = self._held, None
        if held is not None:
            if held.up is not None and not held.up.done():
                held.up.cancel()  # a start under way is stopped where it is, and recorded
            self._own(self._end(held, why))
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # --- One spare's life ------------------------------------------------------------------

    async def _bring_up(self, held: _Held) -> bool:
        worker = held.worker
        plan = self.thread
        try:
            held.record = await worker.start()
            await self._remember(held.record)
            await worker.initialize()
            ahead = await worker.start_thread_ahead(plan) if plan is not None else None
        except (AppServerError, ProcessGroupError) as exc:
            self._drop(held)
            await self._stop(held, worker.failure(f"it could not start: {exc}"), failed=True)
            return False
        except BaseException:
            self._drop(held)
            await asyncio.shield(self._stop(held, "bothy stopped while it started",
                                            failed=False))
            raise
        await self._audit.record("spare", "started", "ok", details={
            "pgid": held.record.pgid, "leader_pid": held.record.leader_pid,
            "leader_start": held.record.leader_start, "command": self.launch.argv[0],
            "initialize_ms": round((worker.marks["initialized"] - worker.marks["spawn"])
                                   * 1000, 3),
            **({} if ahead is None else {
                "thread_id": ahead.info.thread_id, "thread_kept": ahead.params.keep,
                "thread_sandbox": ahead.params.sandbox,
                "thread_start_ms": round((worker.marks["thread_started"]
                                          - worker.marks["thread_start_sent"]) * 1000, 3)})})
        held.state = SpareState.READY  # handed over only once its start is on the register
        held.watch = self._own(self._watch(held))
        return True

    async def _watch(self, held: _Held) -> None:
        """While it waits: a spare that dies is recorded and let go (the next run starts cold,
        and a new spare with it)."""
        await held.worker.exited.wait()
        if self._held is held:
            self._held = None
            await self._end(held, "it died while waiting for a run", failed=True)

    def _unfit(self, held: _Held) -> tuple[str, bool] | None:
        """Why a ready spare must not be handed over, and whether that is a failure."""
        if held.worker.exited.is_set() or not held.worker.is_alive():
            return "the spare had died", True
        now = _codex_files(self.launch.codex_home)
        if now != held.files:
            changed = " and ".join(name for (name, is_now), (_, was) in
                                   zip(now, held.files, strict=True) if is_now != was)
            return f"CODEX_HOME's {changed} changed after the spare started", False
        return None

    async def _end(self, held: _Held, why: str, *, failed: bool = False) -> None:
        """End a spare no run has: let its start settle (a failed start records itself),
        then stop its group."""
        if held.up is not None and not held.up.done():
            await asyncio.wait({held.up})
        if held.state is SpareState.ENDED:
            return
        if held.watch is not None and held.watch is not asyncio.current_task():
            held.watch.cancel()
        await self._stop(held, why, failed=failed)

    async def _stop(self, held: _Held, why: str, *, failed: bool) -> None:
        held.state = SpareState.ENDED
        report = await held.worker.stop(grace_s=self._grace_s)
        survived = report is not None and bool(report.survivors)
        if held.record is not None and not survived:
            await self._forget(held.record)  # a survivor stays recorded: recovery tries again
        await self._audit.record("spare", "ended", "failed" if failed or survived else "ok",
                                 details={"why": why,
                                          "pgid": held.record.pgid if held.record else None,
                                          "how": report.describe() if report else "never started",
                                          "exit_code": held.worker.exit_code()})

    def _drop(self, held: _Held) -> None:
        if self._held is held:
            self._held = None

    # --- Its row, and its tasks ------------------------------------------------------------

    async def _remember(self, record: GroupRecord) -> None:
        await self._db.atomic(
            "INSERT OR REPLACE INTO spares (pgid, leader_pid, leader_start, owner_pid,"
            " owner_start, started_us) VALUES (?, ?, ?, ?, ?, ?)",
            (record.pgid, record.leader_pid, record.leader_start, os.getpid(),
             self._owner_start, to_us(self._clock())))

    async def _forget(self, record: GroupRecord) -> None:
        await self._db.atomic("DELETE FROM spares WHERE pgid = ? AND leader_start = ?",
                              (record.pgid, record.leader_start))

    def _own(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(work, name="spare")
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[Any]) -> None:
        """A task of the spare's ended: what broke one is kept as :attr:`failure`."""
        self._tasks.discard(task)
        self._timers.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
