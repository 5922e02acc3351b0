"""A run, end to end: wake → gates → worker → supervise → settle → record.

Each step is a method of :class:`Supervisor`; what the worker says during a turn is drained by
:class:`~bothy.engine.turn.TurnStream`. The audit record that closes a run and its budget
settlement are written in ``finally`` so that no exit path (limit, cancel, crash of the
worker, our own cancellation) leaves a reservation or an unfinished trace behind.

What a run needs only once codex has answered ``initialize`` (the turn's stream, the tools,
the question board and the approvals behind them) is imported right after a cold codex is
spawned and asked to initialize, while codex starts on its own (most of a cold start), not on
the way through the gates to the spawn (issue 18).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bothy.clock import Clock
from bothy.config import Config
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog, NewRecord
from bothy.engine.budget import Admitted, BudgetGate, Refused, Ticket, budget_gate
from bothy.engine.launch import Launch, build_launch
from bothy.engine.pool import Waiting, Withdrawn, WorkerPool
from bothy.engine.prices import PriceTable
from bothy.engine.procgroup import GroupRecord, StopReport, process_start_time
from bothy.engine.recovery import Recovered, Recovery
from bothy.engine.run import (
    Outcome,
    Progress,
    RunEnd,
    RunRequest,
    RunResult,
    SilentProgress,
    new_run_id,
    wake_id_for,
)
from bothy.engine.state import StateDB
from bothy.engine.task_link import TaskClaims, TaskLink
from bothy.engine.traceids import traceparent
from bothy.engine.worker import (
    APPROVAL_POLICY,
    PLAIN_SANDBOX,
    ThreadInfo,
    ThreadParams,
    Worker,
)
from bothy.errors import AppServerError, ProcessGroupError
from bothy.money import format_usd

if TYPE_CHECKING:
    from bothy.engine.checklist import Checklist
    from bothy.engine.headstart import HeadStart  # (only a `bothy run` has one)
    from bothy.engine.questions import QuestionBoard
    from bothy.engine.spare import Cold, Spare  # (only bothy serve keeps a spare)
    from bothy.engine.tokenmeter import TokenMeter
    from bothy.engine.toolbox import Asker, Toolbox
    from bothy.engine.turn import LiveRun, Turn, TurnStream
    from bothy.engine.verdicts import ApprovalStore
    from bothy.memory.session import MemorySession
    from bothy.memory.site import SiteMemory

FINAL_TEXT_MAX_CHARS = 20_000
STOPPED_BEFORE_START = "bothy stopped before the run started (it had no worker yet)"
# The next spare starts when a run ends or this long after its turn started: after codex has
# sent the model request (tens of ms), while a real model works (seconds).
SPARE_AFTER_TURN_S = 1.0


Told = Callable[[RunResult], Awaitable[None]]
"""Who hears a run's end as soon as it is recorded (a chat thread): ``execute``'s ``told``."""

RefusedWith = Callable[[Refused], Sequence[NewRecord]]
"""The records a caller adds to a refusal at admission, in its commit: ``execute``'s
``refused_with`` (the dispatcher's `wake deferred` or `wake abandoned`)."""


class _Unasked:
    """The asker of a run nobody is watching: a question is held on the board only."""

    def question(self, run_id: str, text: str) -> None: ...
    def declined(self, run_id: str, text: str) -> None: ...


class Supervisor:
    """Runs one request at a time under every gate; share one per process."""

    def __init__(
        self,
        cfg: Config,
        *,
        db: StateDB,
        audit: AuditLog,
        alerts: Alerts,
        launch: Launch,
        clock: Clock,
        checklist_path: Path,
        memory: SiteMemory | None = None,
    ) -> None:
        self._cfg = cfg
        self._memory = memory
        self._checklist_path = checklist_path
        self._tools: _ToolParts | None = None  # made by the first run that has a worker
        self._db = db
        self._audit = audit
        self._alerts = alerts
        self._launch = launch
        self._launches: dict[str, Launch] = {}  # profile -> its own, when it sets codex_config
        self._spare: Spare | None = None
        self._head_start: HeadStart | None = None
        self._clock = clock
        self._prices = PriceTable(cfg.budget.prices)
        self.budget: BudgetGate = budget_gate(db, cfg.budget, self._prices, clock=clock)
        self.pool = WorkerPool(db, cfg.pool, clock=clock)
        self.recovery = Recovery(db, audit, clock=clock, grace_s=cfg.limits.stop_grace_s)
        self._claims = TaskClaims(cfg.cairn, cwd=cfg.workspace, db=db, audit=audit,
                                  clock=clock, site=cfg.site)
        self._threads: dict[str, str] = {}  # run id -> kept Codex thread id
        self._meters: dict[str, TokenMeter] = {}  # run id -> its own tokens, turn by turn
        self._owner_start = process_start_time(os.getpid())
        # Set by the owner (a signal handler) to stop every run of this process gracefully.
        self.stopping = asyncio.Event()
        # Set at a stop's signal (``close_to_new_workers``): no run starts a worker from then
        # on; one still waiting withdraws, while the runs at a worker keep working.
        self._no_new_workers = asyncio.Event()

    def close_to_new_workers(self) -> None:
        """From now on no run of this process starts a worker: those waiting for a slot or in
        their lane withdraw at once (woken here), with ``STOPPED_BEFORE_START``; the runs
        already at a worker are left to finish. :attr:`stopping` implies it."""
        self._no_new_workers.set()
        self.pool.freed()  # waiters look now, and withdraw

    @property
    def closed_to_new_workers(self) -> bool:
        """Whether a run that has no worker yet must withdraw rather than start one."""
        return self._no_new_workers.is_set() or self.stopping.is_set()

    def keep_spare(self) -> Spare:
        """The spare app-server this supervisor's runs take (``bothy serve``): started with
        the launch and workspace a run without a profile ``codex_config`` uses, its thread
        at first as a run without a profile starts one (kept, as a chat conversation's is,
        when chat is configured); then as the last run's. The caller starts it and closes
        it."""
        from bothy.engine.spare import Spare

        chat = self._cfg.chat.slack is not None or self._cfg.chat.discord is not None
        first = ThreadParams.plain(self._cfg.codex.model, keep=chat)
        self._spare = Spare(self._launch, cwd=self._cfg.workspace, db=self._db,
                            audit=self._audit, clock=self._clock,
                            grace_s=self._cfg.limits.stop_grace_s, thread=first)
        return self._spare

    def use_head_start(self, head: HeadStart) -> None:
        """The next run takes ``head``'s app-server, spawned ahead of it (``bothy run``:
        engine/headstart.py), if it fits; the caller closes it."""
        self._head_start = head

    def _launch_for(self, request: RunRequest) -> Launch:
        """How this run's app-server is started: the site's launch, or its profile's own."""
        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        if profile is None or not profile.codex_config:
            return self._launch
        assert request.profile is not None
        if request.profile not in self._launches:
            self._launches[request.profile] = build_launch(
                self._cfg.codex, profile_config=profile.codex_config)
        return self._launches[request.profile]

    async def recover(self) -> list[Recovered]:
        """At start: end what a dead Bothy left behind, then give back the tasks it held."""
        recovered = await self.recovery.sweep()
        await self._claims.release_left()
        return recovered

    async def execute(
        self,
        request: RunRequest,
        progress: Progress | None = None,
        *,
        asker: Asker | None = None,
        admitted: asyncio.Event | None = None,
        told: Told | None = None,
        refused_with: RefusedWith | None = None,
    ) -> RunResult:
        """Take one wake through the gates and, if admitted, through a worker.

        ``progress`` shows the run; ``asker`` shows its questions to whoever can answer them;
        ``admitted`` is set once the gates have admitted the run (a caller that keeps its wakes
        in arrival order waits for it, or for the refusal that ends the run). ``told`` hears
        the end of a run that had a worker as soon as it is settled and recorded, before the
        worker is stopped (the answer does not wait for codex's exit); it is not called for a run
        that never reached a worker. Either way this returns once the worker is stopped.

        ``refused_with`` names the records the caller adds to a refusal at admission (a wake
        deferred): they join its `wake received` and `run refused` in one commit, after them.
        A gate that decides at once (the dollar gate) has `wake received` recorded with its
        decision, in one commit; one that may wait (the plan gate's learner) has it recorded
        first, as the wait begins."""
        run_id = request.run_id or new_run_id(self._clock)
        received: list[NewRecord] = [self._received(run_id, request)]
        if not self.budget.decides_at_once:
            await self._record_together(received)
            received = []
        shown = progress or SilentProgress()
        decision = await self.budget.admit(
            Ticket(run_id, request.subject, request.source, request.max_usd_micros,
                   os.getpid(), self._owner_start, self._cfg.codex.model),
            on_wait=shown.waiting,
        )
        if isinstance(decision, Refused):
            also = refused_with(decision) if refused_with is not None else ()
            await self._record_together([*received, self._refused_record(
                run_id, request.subject, decision), *also])
            return RunResult(run_id, Outcome.REFUSED, 0, "", decision.sentence())
        await self._record_together([*received, *self._admitted(run_id, request.subject,
                                                                decision)])
        if admitted is not None:
            admitted.set()
        shown.admitted(run_id)
        link = await self._task_link(run_id, request)
        closing = _Closing(lambda ended: self._settle(run_id, request.subject, ended), told)
        ended = RunEnd(Outcome.FAILED, "the run ended unexpectedly")
        try:
            ended = await self._claim_and_work(run_id, request, decision, shown,
                                               asker or _Unasked(), link, closing)
        except asyncio.CancelledError:
            ended = RunEnd(Outcome.CANCELLED, "bothy was stopped while the run worked")
            raise
        finally:
            result = await asyncio.shield(closing.settle(ended))
            if link is not None:  # the note, then the release: last of all, in every ending
                await asyncio.shield(link.finish(result.outcome, result.cost_micros,
                                                 result.answer, result.reason))
            self.pool.freed()  # this process's waiters look at once
        return result

    async def _task_link(self, run_id: str, request: RunRequest) -> TaskLink | None:
        """The run's tie to its task in Cairn, if it names a valid one (docs/CAIRN.md)."""
        if request.ref is None:
            return None
        from bothy.engine.cairn import ref_problem  # (loaded by the runs that name a task)

        if problem := ref_problem(request.ref):
            await self._claims.refuse_ref(request.ref, problem, run_id=run_id,
                                          subject=request.subject)
            return None
        return self._claims.link(request.ref, run_id=run_id, subject=request.subject)

    async def _take_task(
        self, run_id: str, request: RunRequest, link: TaskLink
    ) -> RunRequest | Refused:
        """Claim the task and put its brief ahead of the prompt; refused if someone holds it."""
        refusal = await link.claim()
        if refusal is not None:
            await self._refused(run_id, request.subject, refusal)
            return refusal
        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        enabled = profile.cairn_brief if profile is not None else True
        return replace(request, prompt=await link.briefed(request.prompt, enabled=enabled))

    def _received(self, run_id: str, request: RunRequest) -> NewRecord:
        return NewRecord(
            "wake", "received", "ok", subject=request.subject,
            details={"wake_id": wake_id_for(run_id), "source": request.source,
                     "prompt_chars": len(request.prompt),
                     "trusted": request.trusted, **request.wake_details},
        )

    async def _refused(self, run_id: str, subject: str, refusal: Refused) -> None:
        """The one record of a run refused at a gate after admission (its model's price, a
        task someone holds); a refusal at admission joins its wake's records."""
        await self._record_together([self._refused_record(run_id, subject, refusal)])

    def _refused_record(self, run_id: str, subject: str, refusal: Refused) -> NewRecord:
        """The one record of a run refused at a gate (at admission, or by its model's price)."""
        return NewRecord(
            "run", "refused", "refused", subject=subject, run_id=run_id,
            details={"wake_id": wake_id_for(run_id), "gate": refusal.gate,
                     "message": refusal.message, **refusal.figures},
        )

    def _admitted(self, run_id: str, subject: str, admitted: Admitted) -> list[NewRecord]:
        # The plan gate's figures are percents of the rate-limit windows, not dollars.
        figures = admitted.figures or {
            "reserved_usd": format_usd(admitted.reserved_micros, 6),
            "used_usd": format_usd(admitted.used_micros, 6),
            "already_reserved_usd": format_usd(admitted.already_reserved_micros, 6),
            "ceiling_usd": format_usd(admitted.ceiling_micros, 6),
        }
        records = [NewRecord("run", "admitted", "ok", subject=subject, run_id=run_id,
                             details={"wake_id": wake_id_for(run_id), **figures})]
        if admitted.learning:
            records.append(NewRecord(
                "plan", "window", "unknown", subject=subject, run_id=run_id,
                details={"why": "no rate-limit window is known yet: this run is admitted to"
                                " learn them, and runs behind it wait for what it learns"},
            ))
        return records

    async def _record_together(self, records: Sequence[NewRecord]) -> None:
        """Submit ``records`` together, in order (one commit, one fsync, when nothing else is
        being committed), and return once every one is durable; the first failure is raised."""
        for outcome in await self._audit.record_all(records):
            if isinstance(outcome, Exception):
                raise outcome

    async def _claim_and_work(
        self, run_id: str, request: RunRequest, admitted: Admitted, progress: Progress,
        asker: Asker, link: TaskLink | None, closing: _Closing,
    ) -> RunEnd:
        tries = 0

        async def between_tries() -> None:
            nonlocal tries
            if self.closed_to_new_workers:  # the try below withdraws it
                await self.pool.request_cancel(run_id)
            await self.recovery.sweep()
            if tries:  # before the first try the reservation is fresh: admission just made it
                await self.budget.refresh(run_id)
            tries += 1

        claim = await self.pool.wait_for_slot(
            run_id, between_tries=between_tries, on_wait=lambda w: self._waiting(w, progress)
        )
        if isinstance(claim, Withdrawn):
            return RunEnd(Outcome.CANCELLED, STOPPED_BEFORE_START
                          if self.closed_to_new_workers else claim.reason)
        if self.closed_to_new_workers:  # the slot came as the stop did: no worker starts now
            return RunEnd(Outcome.CANCELLED, STOPPED_BEFORE_START)
        if link is not None:
            taken = await self._take_task(run_id, request, link)
            if isinstance(taken, Refused):
                return RunEnd(Outcome.REFUSED, taken.sentence())
            request = taken
        return await self._work(run_id, request, admitted, progress, asker, link, closing)

    def _waiting(self, waiting: Waiting, progress: Progress) -> None:
        progress.waiting(waiting.reason)

    async def _work(
        self, run_id: str, request: RunRequest, admitted: Admitted, progress: Progress,
        asker: Asker, link: TaskLink | None, closing: _Closing,
    ) -> RunEnd:
        deadline = asyncio.get_running_loop().time() + request.wall_clock_s
        launch = self._launch_for(request)
        source, taken, ahead = await self._started_ahead(launch)
        if not isinstance(taken, Worker) and self.closed_to_new_workers:
            return RunEnd(Outcome.CANCELLED, STOPPED_BEFORE_START)  # (it waited on the spare)
        worker = taken if isinstance(taken, Worker) else Worker(
            launch, cwd=self._cfg.workspace, events=asyncio.Queue())
        try:
            record = worker.record if worker is taken else await worker.start()
        except (OSError, ProcessGroupError) as exc:
            return RunEnd(Outcome.FAILED, f"the worker could not start: {exc}")
        # The group attached and `run started` made durable while codex does its own first
        # steps (initialize when cold, thread/start), which spend nothing: _converse sends
        # turn/start, and records anything of the run, only once this is done.
        started = asyncio.ensure_future(self._started(
            run_id, request.subject, record, launch, taken, progress, source=source))
        # A cold codex is asked to initialize at once; what the run needs only once it answers
        # is loaded while it starts (the module's docstring), and _prepared awaits the answer
        # (or a head start's first steps, under way since before the run's set-up).
        initializing = ahead
        if initializing is None and not worker.initialized:
            initializing = asyncio.ensure_future(worker.initialize())
        toolbox: Toolbox | None = None
        try:
            try:
                await asyncio.sleep(0)  # (initialize is written to codex before the imports)
                from bothy.engine.turn import LiveRun

                toolbox = self._toolbox(run_id, request, asker, deadline, link)
                live = LiveRun(request, worker, worker.events, progress, toolbox, deadline)
                ended = await self._converse(run_id, live, admitted, started, initializing)
            except AppServerError as exc:
                ended = RunEnd(Outcome.FAILED, worker.failure(str(exc)))
            except BaseException:  # cancelled, or broken: the worker is stopped, then we go
                await asyncio.wait({started})  # its start is on record before its stop
                await self._stop_worker(run_id, request.subject, worker, toolbox,
                                        asyncio.ensure_future(self._end_worker(worker)))
                raise
            finally:  # initialize settled and its outcome taken, whether awaited or not
                if initializing is not None:
                    initializing.cancel()  # (a no-op once it is done)
                    await asyncio.wait({initializing})
                    if not initializing.cancelled():
                        initializing.exception()  # (an error of it is met as the run's, or moot)
            if closing.tells:
                await self._told_while_stopping(run_id, request.subject, worker, toolbox,
                                                ended, closing)
            else:  # nobody to tell before execute returns: stopped, then settled (the
                # register's usual order, `run finished` last)
                await self._stop_worker(run_id, request.subject, worker, toolbox,
                                        asyncio.ensure_future(self._end_worker(worker)))
            return ended
        finally:
            if self._spare is not None:
                self._spare.start()  # a no-op if one is held or starting

    async def _started_ahead(
        self, launch: Launch
    ) -> tuple[str, Worker | Cold | None, asyncio.Future[Any] | None]:
        """Where this run's app-server was started ahead (the detail `run started` names), and
        that app-server if it fits (or why not; None when there is none to take): the spare's
        (``bothy serve``), initialized; or the head start's (``bothy run``), with its first
        steps, which may still be under way."""
        if self._head_start is not None:
            head, self._head_start = self._head_start, None  # (one run's, taken once)
            took = head.take(launch, self._cfg.workspace)
            worker, steps = took if isinstance(took, tuple) else (took, None)
            return "head_start", worker, steps
        if self._spare is not None:
            return "spare", await self._spare.take(launch, self._cfg.workspace), None
        return "spare", None, None

    async def _told_while_stopping(
        self, run_id: str, subject: str, worker: Worker, toolbox: Toolbox | None, ended: RunEnd,
        closing: _Closing,
    ) -> None:
        """The run's end settled and recorded, then told, then its worker stopped: codex's
        exit (tens of ms) is not on the answer's way. The group stays recorded for recovery
        until `worker stopped` (``groups``, role ``worker``): a crash before it leaves a
        group the next start ends.

        The stop starts once the answer is out, not beside it: its signals, process-table
        scans and codex's exit would compete with the settlement and the post (measured: a
        reply sent as `run finished` appeared then found the conversation's Codex thread not
        yet remembered, and started a new one)."""
        try:
            result = await asyncio.shield(closing.settle(ended))
            await closing.tell(result)
        finally:
            await self._stop_worker(run_id, subject, worker, toolbox,
                                    asyncio.ensure_future(self._end_worker(worker)))

    async def _started(self, run_id: str, subject: str, record: GroupRecord, launch: Launch,
                       taken: Worker | Cold | None, progress: Progress, *, source: str) -> None:
        """Attach the worker's group to the run (for recovery, should we die), then say so;
        whether it is the one started ahead (``source``: the spare, whose row goes once the
        run has it, or a `bothy run`'s head start), or why not.

        Runs beside codex's first steps. Until the group is attached, a death leaves it named
        by the spare's row (``spares``, forgotten only after `run started`) or, cold, by
        nothing, as before (codex, spawned an instant earlier, ends with its stdin)."""
        await self.pool.attach_worker(run_id, record)
        details: dict[str, Any] = {"pgid": record.pgid, "leader_pid": record.leader_pid,
                                   "leader_start": record.leader_start,
                                   "command": launch.argv[0]}
        if taken is not None:
            details[source] = "taken" if isinstance(taken, Worker) else "cold"
            if not isinstance(taken, Worker):  # Cold
                details["cold"] = taken.reason
        await self._audit.record("run", "started", "ok", subject=subject, run_id=run_id,
                                 details=details)
        if self._spare is not None and isinstance(taken, Worker):
            self._spare.run_started(record)
        progress.started(run_id, record.leader_pid)

    async def _end_worker(self, worker: Worker) -> StopReport | None:
        return await worker.stop(grace_s=self._cfg.limits.stop_grace_s)

    async def _stop_worker(
        self, run_id: str, subject: str, worker: Worker, toolbox: Toolbox | None,
        ending: asyncio.Future[StopReport | None],
    ) -> None:
        """Wait for the worker's group to end (``ending``), stop the run's tools (if it got as
        far as having them), record `worker stopped`, then forget the group recovery would
        have ended (freeing the lane and the slot it held)."""
        report = await asyncio.shield(ending)
        if toolbox is not None:
            await asyncio.shield(toolbox.stop())
        await asyncio.shield(self._audit.record(
            "worker", "stopped", "failed" if report and report.survivors else "ok",
            subject=subject, run_id=run_id,
            details={"how": report.describe() if report else "never started",
                     "exit_code": worker.exit_code()},
        ))
        # Forgotten even with survivors (`worker stopped failed` names them): the row holds
        # the run's lane and slot (engine/pool.py), which must not stay held while we live.
        await asyncio.shield(self.pool.worker_stopped(run_id))

    def _toolbox(
        self, run_id: str, request: RunRequest, asker: Asker, deadline: float,
        link: TaskLink | None,
    ) -> Toolbox:
        from bothy.engine.toolbox import RunScope, Toolbox

        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        mcp = None
        if profile is not None and profile.mcp_servers and not request.dream:
            from bothy.engine.mcp import McpHost  # heavy: imported only by runs that use it

            async def on_group(server: str, record: GroupRecord) -> None:
                await self.pool.attach_group(run_id, f"mcp:{server}", record)

            mcp = McpHost(profile.mcp_servers, cwd=self._cfg.workspace, environ=os.environ,
                          on_group=on_group)

        async def should_stop() -> str | None:
            if self.stopping.is_set():
                return "bothy is stopping"
            if await self.pool.cancel_requested(run_id):
                return "the run was cancelled"
            return None

        def hold_left_s() -> float:
            return max(0.0, deadline - asyncio.get_running_loop().time())

        # A dream is offered the memory read tools and its proposal tool, nothing else.
        granted = None if request.dream else profile
        scope = RunScope(run_id, request.subject, request.profile, granted, request.trusted,
                         request.can_hold)
        parts = self._tool_parts()
        return Toolbox(scope, audit=self._audit, board=parts.board, approvals=parts.approvals,
                       checklist=parts.checklist, mcp=mcp, asker=asker, alerts=self._alerts,
                       should_stop=should_stop, hold_left_s=hold_left_s, task=link,
                       memory=self._memory_session(run_id, request))

    def _tool_parts(self) -> _ToolParts:
        """The checklist, question board and approvals every run's tools share: made, with
        their modules, by the first run that reaches its worker."""
        if self._tools is None:
            from bothy.engine.checklist import Checklist
            from bothy.engine.questions import QuestionBoard
            from bothy.engine.verdicts import ApprovalStore

            self._tools = _ToolParts(Checklist(self._checklist_path),
                                     QuestionBoard(self._db, clock=self._clock),
                                     ApprovalStore(self._db, clock=self._clock))
        return self._tools

    def _memory_session(self, run_id: str, request: RunRequest) -> MemorySession | None:
        """The run's memory, if its profile has it on (bothy.memory owns what it does)."""
        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        store = self._memory.store(request.profile) if self._memory and request.profile else None
        if store is None or profile is None:
            return None
        from bothy.memory.session import MemorySession

        return MemorySession(store, run_id=run_id, trusted=request.trusted,
                             allow_from_untrusted=profile.allow_from_untrusted,
                             dream=request.dream)

    async def _converse(self, run_id: str, live: LiveRun, admitted: Admitted,
                        started: asyncio.Future[None],
                        initializing: asyncio.Future[Any] | None) -> RunEnd:
        """The run's conversation with codex. ``started`` is the run's start being made
        durable: codex's first steps go beside it; the run's tools and memory start, and
        anything of the run is recorded, only after it, and turn/start (the first step that
        can spend) only once it is done. ``initializing`` is a cold codex's initialize, asked
        already (None for a spare's, answered before the run took it)."""
        try:
            thread = await self._prepared(run_id, live, started, initializing)
        finally:
            await asyncio.shield(started)  # its failure (a broken register) outranks codex's
        return await self._turned(run_id, live, admitted, thread)

    async def _prepared(self, run_id: str, live: LiveRun, started: asyncio.Future[None],
                        initializing: asyncio.Future[Any] | None) -> ThreadInfo:
        """Codex initialized (when cold), its skill roots set and the run's thread started,
        resumed or taken (the spare's, started ahead): none of it spends, nor is recorded,
        before ``started``."""
        request, worker = live.request, live.worker
        if initializing is not None:  # the spare's was answered before the run took it
            await initializing
        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        if request.dream:
            profile = None  # a dream gets neither the profile's skills nor its sandbox
        if profile is not None and profile.skills:
            await worker.set_skill_roots([str(root) for root in profile.skills])
        if live.toolbox.starts_anything:  # memory and MCP record what they find
            await asyncio.shield(started)
        await live.toolbox.start()
        return await self._thread(run_id, request, worker, live.toolbox,
                                  profile.sandbox if profile else PLAIN_SANDBOX, started,
                                  tuple(str(root) for root in profile.skills)
                                  if profile is not None else ())

    async def _turned(self, run_id: str, live: LiveRun, admitted: Admitted,
                      thread: ThreadInfo) -> RunEnd:
        from bothy.engine.turn import Turn, TurnStream  # (loaded with LiveRun, in _work)

        request, worker = live.request, live.worker
        # The model the thread got is noted while its turn starts: the price gate, which
        # comes first, needs no commit, and codex starts the turn meanwhile.
        noting = asyncio.ensure_future(self.pool.note_model(run_id, thread.model))
        price = self.budget.price(thread.model)
        if isinstance(price, Refused):
            await noting
            await self._refused(run_id, request.subject, price)
            return RunEnd(Outcome.REFUSED, price.sentence())
        memory = live.toolbox.memory
        prompt = memory.prompt(request.prompt) if memory is not None else request.prompt
        try:
            turn_id = await worker.start_turn(thread.thread_id, prompt,
                                              traceparent=traceparent(run_id))
        finally:
            await asyncio.shield(noting)
        await self._turn_started(run_id, request.subject, thread.model, turn_id, worker,
                                 thread_id=thread.thread_id, thread=thread)
        if self._spare is not None:  # while the model works (engine/spare.py)
            self._spare.start_after(SPARE_AFTER_TURN_S)
        turn = Turn(run_id, request.subject, thread.thread_id, turn_id, price,
                    admitted.reserved_micros)
        self._meters[run_id] = turn.meter  # filled as Codex reports; recorded at the run's end
        stream = TurnStream(live, budget=self.budget, prices=self._prices, pool=self.pool,
                            stopping=self.stopping, max_turns=self._cfg.limits.max_turns)
        async with stream.watched(run_id):
            ended = await stream.follow(turn)
            if request.verify is None or ended.outcome is not Outcome.COMPLETED:
                return ended
            return await self._verify_loop(live, stream, turn, ended, model=thread.model)

    async def _thread(
        self, run_id: str, request: RunRequest, worker: Worker, toolbox: Toolbox, sandbox: str,
        started: asyncio.Future[None], skill_roots: tuple[str, ...],
    ) -> ThreadInfo:
        """Resume the conversation's kept thread if there is one, else take the thread the
        spare started ahead if it was started as this run's would be, else start a thread."""
        if request.resume_thread is not None:
            try:
                thread = await worker.resume_thread(
                    request.resume_thread, model=self._cfg.codex.model, sandbox=sandbox,
                    approval_policy=APPROVAL_POLICY,
                )
            except AppServerError as exc:
                await asyncio.shield(started)  # after `run started`, as AUDIT.md orders
                await self._audit.record("thread", "resume-failed", "failed",
                                         subject=request.subject, run_id=run_id,
                                         details={"thread": request.resume_thread,
                                                  "reason": str(exc)})
            else:
                self._threads[run_id] = thread.thread_id
                unused = None
                if worker.thread_ahead is not None:  # never used: the run continues its own
                    worker.thread_ahead = None
                    unused = "the run resumes its conversation's thread"
                return replace(thread, origin="resumed", ahead_unused=unused)
        params = ThreadParams(model=self._cfg.codex.model, sandbox=sandbox,
                              approval_policy=APPROVAL_POLICY, keep=request.keep_thread,
                              dynamic_tools=tuple(toolbox.dynamic_tools()),
                              skill_roots=skill_roots)
        if self._spare is not None:  # the next spare's thread is started as this one's
            self._spare.expect(self._launch_for(request), params)
        ahead = await worker.take_thread_ahead(params) if worker.thread_ahead else None
        if isinstance(ahead, ThreadInfo):
            thread = ahead
        else:
            thread = replace(await worker.start_thread(params), ahead_unused=ahead)
        if request.keep_thread:
            self._threads[run_id] = thread.thread_id
        return thread

    async def _verify_loop(
        self, live: LiveRun, stream: TurnStream, turn: Turn, ended: RunEnd, *, model: str
    ) -> RunEnd:
        """Check the run's own work; on failure, a new turn is told what failed (≤ N tries)."""
        from bothy.engine.verification import verification_failure  # (only runs that verify)

        check = live.request.verify
        assert check is not None
        for attempt in range(1, check.max_attempts + 1):
            failure = await verification_failure(check, ended.text, self._cfg.workspace,
                                                 env=self._launch.env)
            if failure is None:
                await self._audit.record("run", "verified", "ok", subject=turn.subject,
                                         run_id=turn.run_id, details={"attempt": attempt})
                return RunEnd(Outcome.VERIFIED, None, ended.text)
            await self._audit.record("run", "verification-failed", "failed",
                                     subject=turn.subject, run_id=turn.run_id,
                                     details={"attempt": attempt, "failure": failure})
            if attempt == check.max_attempts:
                break
            turn.turn_id = await live.worker.start_turn(turn.thread_id, (
                f"Verification of your work failed (attempt {attempt} of"
                f" {check.max_attempts}): {failure}\nFix it, then finish again."
            ), traceparent=traceparent(turn.run_id))
            await self._turn_started(turn.run_id, turn.subject, model, turn.turn_id,
                                     live.worker, thread_id=turn.thread_id)
            ended = await stream.follow(turn)
            if ended.outcome is not Outcome.COMPLETED:
                return ended
        reason = f"still failing verification after {check.max_attempts} attempts: {failure}"
        await self._alerts.raise_alert("unverified run", reason, subject=turn.subject,
                                       run_id=turn.run_id)
        return RunEnd(Outcome.UNVERIFIED, reason, ended.text)

    async def _turn_started(
        self, run_id: str, subject: str, model: str, turn_id: str, worker: Worker,
        *, thread_id: str, thread: ThreadInfo | None = None,
    ) -> None:
        """`turn started`, with where the run's time to it went; the run's first turn says how
        it came by its thread (``thread``: started, resumed, or ahead, started by the spare
        before the run took it, when the run asked codex for no thread at all)."""
        marks = worker.marks
        how: dict[str, Any] = {} if thread is None else {"thread": thread.origin}
        if thread is not None and thread.ahead_unused is not None:
            how["thread_ahead_unused"] = thread.ahead_unused
        await self._audit.record(
            "turn", "started", "ok", subject=subject, run_id=run_id,
            details={
                "model": model,
                "turn_id": turn_id,
                "thread_id": thread_id,
                # The app-server's own start-up, from spawn to its initialize answer.
                "initialize_ms": round((marks["initialized"] - marks["spawn"]) * 1000, 3),
                # From spawn (or, on the spare, from when the run took it) to turn/start sent,
                # and when that was (unix seconds).
                "to_turn_start_ms": round(
                    (marks["turn_start_sent"] - marks.get("taken", marks["spawn"])) * 1000, 3),
                "turn_start_sent_unix": marks["turn_start_sent_unix"],
                # Codex's own answers: to the run's thread/start (or resume; none for a thread
                # started ahead, before the run), to turn/start.
                "thread_start_ms": _between(marks, "thread_start_sent", "thread_started"),
                "turn_start_ms": _between(marks, "turn_start_sent", "turn_started"),
                **how,
            },
        )

    async def _settle(self, run_id: str, subject: str, ended: RunEnd) -> RunResult:
        kept = _truncate(ended.text)
        settlement = await self.budget.settle(
            run_id, outcome=ended.outcome, reason=ended.reason, final_text=kept
        )
        # Submitted together, in this order: one commit (one fsync) holds both, settled first.
        await asyncio.gather(self._audit.record(
            "budget", "settled", "ok", subject=subject, run_id=run_id,
            details={"cost_usd": format_usd(settlement.cost_micros, 6),
                     "reserved_usd": format_usd(settlement.reserved_micros, 6),
                     "released_usd": format_usd(settlement.released_micros, 6),
                     **settlement.figures},
        ), self._audit.record(
            "run", "finished", ended.outcome.recorded, subject=subject, run_id=run_id,
            details={"outcome": ended.outcome.value, "reason": ended.reason,
                     "cost_usd": format_usd(settlement.cost_micros, 6),
                     "final_chars": len(ended.text),
                     **_tokens(self._meters.pop(run_id, None))},
        ))
        return RunResult(run_id, ended.outcome, settlement.cost_micros, kept, ended.reason,
                         thread_id=self._threads.pop(run_id, None))


class _ToolParts:
    """What the tools of every run of one supervisor share."""

    def __init__(self, checklist: Checklist, board: QuestionBoard,
                 approvals: ApprovalStore) -> None:
        self.checklist = checklist
        self.board = board
        self.approvals = approvals


class _Closing:
    """How a run is closed, once: settled and recorded (`budget settled`, `run finished`),
    then told. As soon as its turn ends when it had a worker (the worker is stopped after),
    else in ``execute``'s ``finally``."""

    def __init__(self, settle: Callable[[RunEnd], Awaitable[RunResult]],
                 told: Told | None) -> None:
        self._settle = settle
        self._told = told
        self._settled: asyncio.Future[RunResult] | None = None

    async def settle(self, ended: RunEnd) -> RunResult:
        """The run's result, settled by the first call (a later one gets the same)."""
        if self._settled is None:
            self._settled = asyncio.ensure_future(self._settle(ended))
        return await self._settled

    @property
    def tells(self) -> bool:
        """Someone hears the run's end before ``execute`` returns (a chat thread)."""
        return self._told is not None

    async def tell(self, result: RunResult) -> None:
        if self._told is not None:
            await self._told(result)


def _between(marks: dict[str, float], since: str, until: str) -> float | None:
    """Milliseconds from one of a worker's marks to another; None if either is missing."""
    if since not in marks or until not in marks:
        return None
    return round((marks[until] - marks[since]) * 1000, 3)


def _tokens(meter: TokenMeter | None) -> dict[str, Any]:
    """The run's own tokens, in all and per turn (none reported: nothing)."""
    if meter is None or not meter.turns:
        return {}
    used = meter.used
    return {"input_tokens": used.input_tokens, "output_tokens": used.output_tokens,
            "turns": [{"turn_id": turn_id, "input_tokens": turn.input_tokens,
                       "output_tokens": turn.output_tokens}
                      for turn_id, turn in meter.turns.items()]}


def _truncate(text: str) -> str:
    if len(text) <= FINAL_TEXT_MAX_CHARS:
        return text
    dropped = len(text) - FINAL_TEXT_MAX_CHARS
    return text[:FINAL_TEXT_MAX_CHARS] + f"\n[truncated by bothy: {dropped} more characters]"
