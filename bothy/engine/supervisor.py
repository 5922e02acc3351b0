"""A run, end to end: wake → gates → worker → supervise → settle → record.

Each step is a method of :class:`Supervisor`; the audit record that closes a run and its
budget settlement are written in ``finally`` so that no exit path (limit, cancel, crash of the
worker, our own cancellation) leaves a reservation or an unfinished trace behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bothy.clock import Clock
from bothy.config import Config, Price
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.budget import Admitted, BudgetGate, Refused, Ticket
from bothy.engine.checklist import Checklist
from bothy.engine.launch import Launch
from bothy.engine.pool import Waiting, Withdrawn, WorkerPool
from bothy.engine.prices import PriceTable, TokenUsage
from bothy.engine.procgroup import GroupRecord, process_start_time
from bothy.engine.questions import QuestionBoard
from bothy.engine.recovery import Recovery
from bothy.engine.rpc import ConnectionLost, Notification, ServerRequest
from bothy.engine.run import Progress, RunRequest, RunResult, SilentProgress, new_run_id
from bothy.engine.state import StateDB
from bothy.engine.toolbox import RunScope, Toolbox
from bothy.engine.verdicts import ApprovalStore
from bothy.engine.verification import verification_failure
from bothy.engine.worker import ThreadInfo, Worker
from bothy.errors import AppServerError, ProcessGroupError, RpcProtocolError
from bothy.money import format_usd

FINAL_TEXT_MAX_CHARS = 20_000
_WATCH_INTERVAL_S = 0.25
_REFRESH_EVERY_S = 5.0


@dataclass(frozen=True)
class _Stop:
    """A request, from the watcher or a limit, to end the turn with this outcome."""

    outcome: str
    reason: str


@dataclass(frozen=True)
class _Live:
    """What one working run is made of, handed from step to step."""

    request: RunRequest
    worker: Worker
    inbox: asyncio.Queue[Any]
    progress: Progress
    toolbox: Toolbox
    deadline: float  # loop time at which the wall clock runs out


@dataclass
class _Turn:
    """What the supervisor has learnt about the running turn so far."""

    run_id: str
    subject: str
    thread_id: str
    turn_id: str
    price: Price
    reserved_micros: int
    text: str = ""
    tokens: int = 0
    cost_micros: int = 0
    error: str | None = None
    notes: list[str] = field(default_factory=list)


class Supervisor:
    """Runs one request at a time under every gate; share one per process."""

    def __init__(
        self,
        cfg: Config,
        *,
        db: StateDB,
        audit: AuditLog,
        launch: Launch,
        clock: Clock,
        checklist_path: Path,
    ) -> None:
        self._cfg = cfg
        self._checklist = Checklist(checklist_path)
        self._board = QuestionBoard(db, clock=clock)
        self._approvals = ApprovalStore(db, clock=clock)
        self._db = db
        self._audit = audit
        self._launch = launch
        self._clock = clock
        self._prices = PriceTable(cfg.budget.prices)
        self.budget = BudgetGate(db, cfg.budget, self._prices, clock=clock)
        self.pool = WorkerPool(db, cfg.pool, clock=clock)
        self.recovery = Recovery(db, audit, clock=clock, grace_s=cfg.limits.stop_grace_s)
        self.alerts = Alerts(audit, site=cfg.site, clock=clock)
        self._threads: dict[str, str] = {}  # run id -> kept Codex thread id
        self._owner_start = process_start_time(os.getpid())
        # Set by the owner (a signal handler) to stop every run of this process gracefully.
        self.stopping = asyncio.Event()

    async def execute(self, request: RunRequest, progress: Progress | None = None) -> RunResult:
        """Take one wake through the gates and, if admitted, through a worker."""
        shown = progress or SilentProgress()
        run_id = request.run_id or new_run_id(self._clock)
        await self._audit.record(
            "wake", "received", "ok", subject=request.subject, run_id=run_id,
            details={"source": request.source, "prompt_chars": len(request.prompt),
                     "trusted": request.trusted, **request.wake_details},
        )
        decision = await self.budget.admit(
            Ticket(run_id, request.subject, request.source, request.max_usd_micros,
                   os.getpid(), self._owner_start, self._cfg.codex.model)
        )
        if isinstance(decision, Refused):
            return await self._refused(run_id, request.subject, decision)
        await self._admitted(run_id, request.subject, decision)
        shown.admitted(run_id)
        outcome, text = "failed", ""
        reason: str | None = "the run ended unexpectedly"
        try:
            outcome, reason, text = await self._claim_and_work(run_id, request, decision, shown)
        except asyncio.CancelledError:
            outcome, reason = "cancelled", "bothy was stopped while the run worked"
            raise
        finally:
            settling = self._settle(run_id, request.subject, outcome, reason, text)
            result = await asyncio.shield(settling)
        return result

    async def _refused(self, run_id: str, subject: str, refusal: Refused) -> RunResult:
        await self._audit.record(
            "run", "refused", "refused", subject=subject, run_id=run_id,
            details={"gate": refusal.gate, "message": refusal.message, **refusal.figures},
        )
        return RunResult(run_id, "refused", 0, "", refusal.sentence())

    async def _admitted(self, run_id: str, subject: str, admitted: Admitted) -> None:
        await self._audit.record(
            "run", "admitted", "ok", subject=subject, run_id=run_id,
            details={
                "reserved_usd": format_usd(admitted.reserved_micros, 6),
                "used_usd": format_usd(admitted.used_micros, 6),
                "already_reserved_usd": format_usd(admitted.already_reserved_micros, 6),
                "ceiling_usd": format_usd(admitted.ceiling_micros, 6),
            },
        )

    async def _claim_and_work(
        self, run_id: str, request: RunRequest, admitted: Admitted, progress: Progress
    ) -> tuple[str, str | None, str]:
        async def between_tries() -> None:
            if self.stopping.is_set():
                await self.pool.request_cancel(run_id)
            await self.recovery.sweep()
            await self.budget.refresh(run_id)

        claim = await self.pool.wait_for_slot(
            run_id, between_tries=between_tries, on_wait=lambda w: self._waiting(w, progress)
        )
        if isinstance(claim, Withdrawn):
            return "cancelled", claim.reason, ""
        return await self._work(run_id, request, admitted, progress)

    def _waiting(self, waiting: Waiting, progress: Progress) -> None:
        progress.waiting(waiting.reason)

    async def _work(
        self, run_id: str, request: RunRequest, admitted: Admitted, progress: Progress
    ) -> tuple[str, str | None, str]:
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        worker = Worker(self._launch, cwd=self._cfg.workspace, inbox=inbox)
        deadline = asyncio.get_running_loop().time() + request.wall_clock_s
        toolbox = self._toolbox(run_id, request, progress, deadline)
        try:
            record = await worker.start()
        except (OSError, ProcessGroupError) as exc:
            return "failed", f"the worker could not start: {exc}", ""
        try:
            await self.pool.attach_worker(run_id, record, None)
            await self._audit.record(
                "run", "started", "ok", subject=request.subject, run_id=run_id,
                details={"pgid": record.pgid, "leader_pid": record.leader_pid,
                         "leader_start": record.leader_start, "command": self._launch.argv[0]},
            )
            progress.started(run_id, record.leader_pid)
            await toolbox.start()
            return await self._converse(
                run_id, request, admitted, worker, inbox, progress, toolbox, deadline
            )
        except AppServerError as exc:
            return "failed", _with_stderr(str(exc), worker), ""
        finally:
            report = await asyncio.shield(worker.stop(grace_s=self._cfg.limits.stop_grace_s))
            await asyncio.shield(toolbox.stop())
            await self._audit.record(
                "worker", "stopped", "failed" if report and report.survivors else "ok",
                subject=request.subject, run_id=run_id,
                details={"how": report.describe() if report else "never started",
                         "exit_code": worker.exit_code()},
            )

    def _toolbox(
        self, run_id: str, request: RunRequest, progress: Progress, deadline: float
    ) -> Toolbox:
        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        mcp = None
        if profile is not None and profile.mcp_servers:
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

        scope = RunScope(run_id, request.subject, request.profile, profile, request.trusted,
                         request.can_hold)
        return Toolbox(scope, audit=self._audit, board=self._board, approvals=self._approvals,
                       checklist=self._checklist, mcp=mcp, asker=progress, alerts=self.alerts,
                       should_stop=should_stop, hold_left_s=hold_left_s)

    async def _converse(
        self,
        run_id: str,
        request: RunRequest,
        admitted: Admitted,
        worker: Worker,
        inbox: asyncio.Queue[Any],
        progress: Progress,
        toolbox: Toolbox,
        deadline: float,
    ) -> tuple[str, str | None, str]:
        await worker.initialize()
        profile = self._cfg.profiles.get(request.profile) if request.profile else None
        if profile is not None and profile.skills:
            await worker.set_skill_roots([str(root) for root in profile.skills])
        thread = await self._thread(run_id, request, worker, toolbox,
                                    profile.sandbox if profile else "read-only")
        await self.pool.attach_worker(run_id, worker.record, thread.model)
        refusal = self.budget.price_refusal(thread.model)
        price = self._prices.lookup(thread.model)
        if refusal is not None or price is None:
            assert refusal is not None
            await self._audit.record(
                "run", "refused", "refused", subject=request.subject, run_id=run_id,
                details={"gate": refusal.gate, "message": refusal.message, **refusal.figures},
            )
            return "refused", refusal.sentence(), ""
        turn_id = await worker.start_turn(thread.thread_id, request.prompt)
        await self._turn_started(run_id, request.subject, thread.model, turn_id, worker)
        turn = _Turn(run_id, request.subject, thread.thread_id, turn_id, price,
                     admitted.reserved_micros)
        live = _Live(request, worker, inbox, progress, toolbox, deadline)
        watcher = asyncio.create_task(self._watch(run_id, inbox))
        try:
            ended = await self._stream(live, turn)
            if request.verify is None or ended[0] != "completed":
                return ended
            return await self._verify_loop(live, turn, ended)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _thread(
        self, run_id: str, request: RunRequest, worker: Worker, toolbox: Toolbox, sandbox: str
    ) -> ThreadInfo:
        """Resume the conversation's kept thread if there is one, else start a thread."""
        if request.resume_thread is not None:
            try:
                thread = await worker.resume_thread(
                    request.resume_thread, model=self._cfg.codex.model, sandbox=sandbox,
                    approval_policy="on-request",
                )
            except AppServerError as exc:
                await self._audit.record("thread", "resume-failed", "failed",
                                         subject=request.subject, run_id=run_id,
                                         details={"thread": request.resume_thread,
                                                  "reason": str(exc)})
            else:
                self._threads[run_id] = thread.thread_id
                return thread
        thread = await worker.start_thread(
            model=self._cfg.codex.model, sandbox=sandbox, approval_policy="on-request",
            dynamic_tools=toolbox.dynamic_tools(), keep=request.keep_thread,
        )
        if request.keep_thread:
            self._threads[run_id] = thread.thread_id
        return thread

    async def _verify_loop(
        self, live: _Live, turn: _Turn, ended: tuple[str, str | None, str]
    ) -> tuple[str, str | None, str]:
        """Check the run's own work; on failure, a new turn is told what failed (≤ N tries)."""
        check = live.request.verify
        assert check is not None
        for attempt in range(1, check.max_attempts + 1):
            failure = await verification_failure(check, ended[2], self._cfg.workspace,
                                                 env=self._launch.env)
            if failure is None:
                await self._audit.record("run", "verified", "ok", subject=turn.subject,
                                         run_id=turn.run_id, details={"attempt": attempt})
                return "verified", None, ended[2]
            await self._audit.record("run", "verification-failed", "failed",
                                     subject=turn.subject, run_id=turn.run_id,
                                     details={"attempt": attempt, "failure": failure})
            if attempt == check.max_attempts:
                break
            turn.turn_id = await live.worker.start_turn(turn.thread_id, (
                f"Verification of your work failed (attempt {attempt} of"
                f" {check.max_attempts}): {failure}\nFix it, then finish again."
            ))
            ended = await self._stream(live, turn)
            if ended[0] != "completed":
                return ended
        reason = f"still failing verification after {check.max_attempts} attempts: {failure}"
        await self.alerts.raise_alert("unverified run", reason, subject=turn.subject,
                                      run_id=turn.run_id)
        return "unverified", reason, ended[2]

    async def _turn_started(
        self, run_id: str, subject: str, model: str, turn_id: str, worker: Worker
    ) -> None:
        marks = worker.marks
        await self._audit.record(
            "turn", "started", "ok", subject=subject, run_id=run_id,
            details={
                "model": model,
                "turn_id": turn_id,
                # The app-server's own start-up, from spawn to its initialize answer.
                "initialize_ms": round((marks["initialized"] - marks["spawn"]) * 1000, 3),
                # From spawn to turn/start sent, and when that was (unix seconds).
                "to_turn_start_ms": round((marks["turn_start_sent"] - marks["spawn"]) * 1000, 3),
                "turn_start_sent_unix": marks["turn_start_sent_unix"],
            },
        )

    async def _watch(self, run_id: str, inbox: asyncio.Queue[Any]) -> None:
        """Poll for `bothy cancel` from other shells; keep the reservation alive."""
        loop = asyncio.get_running_loop()
        refreshed_at = loop.time()
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self.stopping.is_set():
                inbox.put_nowait(_Stop("cancelled", "bothy received a stop signal"))
                return
            if await self.pool.cancel_requested(run_id):
                inbox.put_nowait(_Stop("cancelled", "cancelled by `bothy cancel`"))
                return
            if loop.time() - refreshed_at >= _REFRESH_EVERY_S:
                await self.budget.refresh(run_id)
                refreshed_at = loop.time()

    async def _stream(self, live: _Live, turn: _Turn) -> tuple[str, str | None, str]:
        """Drain what the worker says until the turn ends, a limit is crossed or a stop."""
        worker = live.worker
        while True:
            try:
                async with asyncio.timeout_at(live.deadline):
                    item = await live.inbox.get()
            except TimeoutError:
                limit = live.request.wall_clock_s
                item = _Stop("timed_out", f"wall clock of {limit} s reached")
            if isinstance(item, _Stop):
                await worker.interrupt(turn.thread_id, turn.turn_id)
                return item.outcome, item.reason, turn.text
            if isinstance(item, ConnectionLost):
                # A bad frame from a live peer is not a death: say which it was.
                what = "broke the protocol" if isinstance(item.error, RpcProtocolError) else "died"
                reason = f"the app-server {what} mid-turn: {item.error}"
                return "failed", _with_stderr(reason, worker), turn.text
            if isinstance(item, ServerRequest):
                await live.toolbox.handle(item, worker)
                if self.stopping.is_set():
                    # A stop that ended a held question must stop the run now: the watcher's
                    # next look could come after the turn has run on to "completed".
                    await worker.interrupt(turn.thread_id, turn.turn_id)
                    return "cancelled", "bothy received a stop signal", turn.text
                continue
            ended = await self._notice(live, turn, item)
            if isinstance(ended, _Stop):
                # A limit crossed is acted on at once, ahead of anything queued behind it
                # (a turn/completed in the same burst must not hide the overrun).
                await worker.interrupt(turn.thread_id, turn.turn_id)
                return ended.outcome, ended.reason, turn.text
            if ended is not None:
                return ended

    async def _notice(
        self, live: _Live, turn: _Turn, note: Notification
    ) -> tuple[str, str | None, str] | _Stop | None:
        params = note.params
        if note.method == "item/agentMessage/delta":
            live.progress.text(str(params.get("delta", "")))
        elif note.method == "item/completed":
            item = params.get("item") or {}
            if item.get("type") == "agentMessage":
                turn.text = str(item.get("text", ""))
        elif note.method == "thread/tokenUsage/updated":
            return await self._measure(live, turn, params)
        elif note.method == "error":
            error = params.get("error") or {}
            if not params.get("willRetry"):
                turn.error = _error_text(error)
        elif note.method == "turn/completed":
            return self._turn_end(turn, params)
        return None

    async def _measure(self, live: _Live, turn: _Turn, params: dict[str, Any]) -> _Stop | None:
        """Fill the reservation with what was measured; say which limit, if any, is crossed."""
        request, progress = live.request, live.progress
        try:
            usage = TokenUsage.from_codex((params.get("tokenUsage") or {}).get("total") or {})
        except ValueError as exc:
            turn.notes.append(f"ignored a malformed token usage report: {exc}")
            return None
        turn.tokens = usage.total_tokens
        turn.cost_micros = self._prices.cost_micros(turn.price, usage)
        await self.budget.fill(turn.run_id, turn.cost_micros, turn.tokens)
        progress.usage(turn.tokens, turn.cost_micros)
        if request.max_tokens is not None and usage.total_tokens > request.max_tokens:
            return _Stop(
                "token_limit", f"used {usage.total_tokens} tokens, limit {request.max_tokens}"
            )
        if turn.cost_micros >= turn.reserved_micros:
            return _Stop(
                "budget_limit",
                f"spent {format_usd(turn.cost_micros, 4)} usd of its "
                f"{format_usd(turn.reserved_micros, 4)} usd reservation",
            )
        return None

    def _turn_end(self, turn: _Turn, params: dict[str, Any]) -> tuple[str, str | None, str] | None:
        completed = params.get("turn") or {}
        if completed.get("id") not in (None, turn.turn_id):
            return None
        status = completed.get("status")
        if status == "completed":
            return "completed", None, turn.text
        error = completed.get("error") or {}
        message = _error_text(error) if isinstance(error, dict) and error.get("message") else None
        reason = message or turn.error or f"the turn ended with status {status!r}"
        return "failed", str(reason), turn.text

    async def _settle(
        self, run_id: str, subject: str, outcome: str, reason: str | None, text: str
    ) -> RunResult:
        kept = _truncate(text)
        settlement = await self.budget.settle(
            run_id, outcome=outcome, reason=reason, final_text=kept
        )
        await self._audit.record(
            "budget", "settled", "ok", subject=subject, run_id=run_id,
            details={"cost_usd": format_usd(settlement.cost_micros, 6),
                     "reserved_usd": format_usd(settlement.reserved_micros, 6),
                     "released_usd": format_usd(settlement.released_micros, 6)},
        )
        await self._audit.record(
            "run", "finished", outcome, subject=subject, run_id=run_id,
            details={"reason": reason, "cost_usd": format_usd(settlement.cost_micros, 6),
                     "final_chars": len(text)},
        )
        return RunResult(run_id, outcome, settlement.cost_micros, kept, reason,
                         thread_id=self._threads.pop(run_id, None))


def _error_text(error: dict[str, Any]) -> str:
    """Codex's message and its error code (an HTTP 500 reads "high demand" without the code)."""
    message = str(error.get("message") or "unknown error")
    info = error.get("codexErrorInfo")
    if not info:
        return message
    code = info if isinstance(info, str) else json.dumps(info, separators=(",", ":"))
    return f"{message} (codex error: {code})"


def _truncate(text: str) -> str:
    if len(text) <= FINAL_TEXT_MAX_CHARS:
        return text
    dropped = len(text) - FINAL_TEXT_MAX_CHARS
    return text[:FINAL_TEXT_MAX_CHARS] + f"\n[truncated by bothy: {dropped} more characters]"


_CONTROL_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x1f\x7f]")


def _with_stderr(reason: str, worker: Worker) -> str:
    tail = worker.stderr_tail().strip()
    code = worker.exit_code()
    parts = [reason]
    if code is not None:
        parts.append(f"exit code {code}")
    if tail:
        # Codex colours its log even into a pipe: the reason is shown and audited as plain text.
        last = _CONTROL_SEQUENCE.sub("", tail.splitlines()[-1])
        parts.append(f"stderr: {last[:300]}")
    return "; ".join(parts)


def workspace_problem(workspace: Path) -> str | None:
    """Why the configured workspace cannot host a run, or None."""
    if not workspace.is_dir():
        return f"workspace {workspace} does not exist or is not a directory"
    return None
