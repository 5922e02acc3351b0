"""A `bothy run`'s head start: its ``codex app-server`` spawned as soon as the run is checked.

Most of a foreground run's start is Bothy's own (the engine's imports, the state database,
the register, recovery, the gates: issue 18), and most of codex's (its spawn, ``initialize``,
the run's ``thread/start``) needs none of it. So ``bothy run`` spawns codex first and lets it
start beside Bothy's set-up; the supervisor takes it where it would have spawned a cold one:

* it is spawned only once the config, the command line and the workspace are checked: an
  error in any of them is said as before, with no codex started;
* it is asked to ``initialize`` at once and, for a run without a profile, its thread is
  started ahead with the params such a run's thread has (``ThreadParams.plain``), as the
  spare's is (engine/spare.py); the run uses that thread only if it would have started an
  equal one and nothing codex read into it has changed (``Worker.take_thread_ahead``);
* it spends nothing and is on no record until the run takes it: then its group is attached
  to the run and `run started` names it (``head_start: taken``), as a cold worker's group is.
  Should Bothy die before that, codex ends with its standard input, as a cold worker spawned
  an instant before its record does;
* the run takes it once, with its first steps still under way: the run awaits them where it
  would have awaited a cold codex's ``initialize``, and an error of them is the run's, said as
  a cold start's would be;
* a run whose launch is not the site's (a profile's ``codex_config``) starts cold, and the
  head start is ended; so is one no run took (refused at a gate, stopped while waiting), when
  the command closes it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bothy.engine.launch import Launch
from bothy.engine.worker import ThreadParams, Worker
from bothy.errors import ProcessGroupError

if TYPE_CHECKING:
    from bothy.engine.spare import Cold

__all__ = ["HeadStart"]


class HeadStart:
    """One app-server spawned ahead of one run: :meth:`begin` spawns it, :meth:`take` hands it
    to the run (or says why not), :meth:`close` ends it unless the run took it."""

    def __init__(self, launch: Launch, *, cwd: Path, grace_s: float) -> None:
        self.launch = launch
        self.cwd = cwd
        self._grace_s = grace_s
        self._worker: Worker | None = None
        self._steps: asyncio.Task[Any] | None = None  # initialize, then the thread ahead
        self._failed: str | None = None  # why it could not be spawned
        self._taken = False
        self._ending: asyncio.Task[None] | None = None

    @classmethod
    async def begin(cls, launch: Launch, *, cwd: Path, grace_s: float,
                    thread: ThreadParams | None) -> HeadStart:
        """Spawn codex and ask it to initialize (then to start ``thread``, if given); return
        once the request is written, so that codex starts while the caller goes on."""
        head = cls(launch, cwd=cwd, grace_s=grace_s)
        worker = Worker(launch, cwd=cwd, events=asyncio.Queue())
        try:
            await worker.start()
        except (OSError, ProcessGroupError) as exc:
            head._failed = str(exc)  # the run starts cold, and meets (and says) it itself
            return head
        head._worker = worker
        head._steps = asyncio.ensure_future(head._first_steps(worker, thread))
        await asyncio.sleep(0)  # (initialize is written to codex before the caller's imports)
        return head

    @staticmethod
    async def _first_steps(worker: Worker, thread: ThreadParams | None) -> None:
        await worker.initialize()
        if thread is not None:
            await worker.start_thread_ahead(thread)

    def take(self, launch: Launch, cwd: Path) -> tuple[Worker, asyncio.Future[Any]] | Cold:
        """The head start's worker for a run with this launch and cwd, with its first steps
        (under way or done: the run awaits them); or why the run starts cold. Once only."""
        from bothy.engine.spare import Cold

        if self._taken:
            return Cold("the head start was taken already")
        self._taken = True
        worker, steps = self._worker, self._steps
        if worker is None or steps is None:
            return Cold(f"the head start could not be spawned: {self._failed}")
        if launch != self.launch or cwd != self.cwd:
            self._ending = asyncio.ensure_future(self._end(worker, steps))
            return Cold("the run's launch (its profile's codex_config) is not the head start's")
        self._worker = self._steps = None  # the run's from here on: it stops it
        return worker, steps

    async def close(self) -> None:
        """End the app-server unless a run took it (then the run stopped it)."""
        worker, steps, self._worker, self._steps = self._worker, self._steps, None, None
        self._taken = True
        if worker is not None and steps is not None:
            await asyncio.shield(self._end(worker, steps))
        if self._ending is not None:
            await asyncio.shield(self._ending)

    async def _end(self, worker: Worker, steps: asyncio.Future[Any]) -> None:
        steps.cancel()  # (a no-op once done)
        await asyncio.wait({steps})
        if not steps.cancelled():
            steps.exception()  # its outcome is moot: no run has it
        await worker.stop(grace_s=self._grace_s)
