"""One turn of a working run: what the worker says, drained until the turn ends.

:class:`TurnStream` reads the worker's events (notifications, server requests, a lost
connection) and the stops a watcher or a limit puts among them, fills the run's reservation
with what is measured, and says how the turn ended as a :class:`~bothy.engine.run.RunEnd`.
A limit crossed, a stop or a cancel interrupts the turn before the end is returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from bothy.config import Price
from bothy.engine.budget import BudgetGate
from bothy.engine.pool import WorkerPool
from bothy.engine.prices import PriceTable, TokenUsage
from bothy.engine.rpc import ConnectionLost, Notification, ServerRequest
from bothy.engine.run import Outcome, Progress, RunEnd, RunRequest
from bothy.engine.toolbox import Toolbox
from bothy.engine.turncap import TurnCap
from bothy.engine.worker import Worker
from bothy.errors import RpcProtocolError
from bothy.money import format_usd

_WATCH_INTERVAL_S = 0.25
_REFRESH_EVERY_S = 5.0


@dataclass(frozen=True)
class _Stop:
    """A request, from the watcher or a limit, to end the turn with this outcome."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class LiveRun:
    """What one working run is made of, handed from step to step."""

    request: RunRequest
    worker: Worker
    events: asyncio.Queue[Any]  # what the worker says, and the stops put among it
    progress: Progress
    toolbox: Toolbox
    deadline: float  # loop time at which the wall clock runs out


@dataclass
class Turn:
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
    # Turn id -> (input, output) tokens of that turn alone (for the trace's gen_ai.usage.*).
    usage: dict[str, tuple[int, int]] = field(default_factory=dict)
    totals_at_start: dict[str, tuple[int, int]] = field(default_factory=dict)  # the thread's
    totals_seen: tuple[int, int] | None = None  # the thread's totals last reported
    answering: set[str] = field(default_factory=set)  # turns whose model output has begun


def _count_turn(turn: Turn, total: TokenUsage, last: TokenUsage | None) -> None:
    """What this turn used: the thread's totals now, less what they were when it began.

    Codex reports the thread's running totals (``total``, which a resumed thread carries over
    from earlier runs) and the latest response's own (``last``). A report before the turn's
    model output has begun is where the thread stands (Codex repeats a resumed thread's totals
    at a turn's start). Otherwise a turn begins where the one before it ended, and before the
    run's first report the thread stood at ``total - last``.
    """
    now = (total.input_tokens, total.output_tokens)
    if turn.turn_id not in turn.answering:
        turn.totals_at_start[turn.turn_id] = now
        turn.totals_seen = now
        return
    if turn.turn_id not in turn.totals_at_start:
        if turn.totals_seen is not None:
            turn.totals_at_start[turn.turn_id] = turn.totals_seen
        elif last is not None:
            turn.totals_at_start[turn.turn_id] = (max(0, now[0] - last.input_tokens),
                                          max(0, now[1] - last.output_tokens))
        else:
            turn.totals_at_start[turn.turn_id] = (0, 0)
    before = turn.totals_at_start[turn.turn_id]
    turn.usage[turn.turn_id] = (max(0, now[0] - before[0]), max(0, now[1] - before[1]))
    turn.totals_seen = now


class TurnStream:
    """Drains one run's worker events, turn by turn, under the run's limits."""

    def __init__(
        self,
        live: LiveRun,
        *,
        budget: BudgetGate,
        prices: PriceTable,
        pool: WorkerPool,
        stopping: asyncio.Event,
        max_turns: int | None = None,
    ) -> None:
        self._live = live
        self._cap = TurnCap(max_turns)  # one per run: the turns of a verify loop count too
        self._budget = budget
        self._prices = prices
        self._pool = pool
        self._stopping = stopping

    @contextlib.asynccontextmanager
    async def watched(self, run_id: str) -> AsyncIterator[None]:
        """Inside, `bothy cancel` from other shells and a stop are heard, and the run's
        reservation is kept alive."""
        watcher = asyncio.create_task(self._watch(run_id))
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch(self, run_id: str) -> None:
        loop = asyncio.get_running_loop()
        refreshed_at = loop.time()
        events = self._live.events
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self._stopping.is_set():
                events.put_nowait(_Stop(Outcome.CANCELLED, "bothy received a stop signal"))
                return
            if await self._pool.cancel_requested(run_id):
                events.put_nowait(_Stop(Outcome.CANCELLED, "cancelled by `bothy cancel`"))
                return
            if loop.time() - refreshed_at >= _REFRESH_EVERY_S:
                await self._budget.refresh(run_id)
                refreshed_at = loop.time()

    async def follow(self, turn: Turn) -> RunEnd:
        """Drain what the worker says until the turn ends, a limit is crossed or a stop."""
        live = self._live
        worker = live.worker
        while True:
            try:
                async with asyncio.timeout_at(live.deadline):
                    item = await live.events.get()
            except TimeoutError:
                limit = live.request.wall_clock_s
                item = _Stop(Outcome.TIMED_OUT, f"wall clock of {limit} s reached")
            if isinstance(item, _Stop):
                await worker.interrupt(turn.thread_id, turn.turn_id)
                return RunEnd(item.outcome, item.reason, turn.text)
            if isinstance(item, ConnectionLost):
                # A bad frame from a live peer is not a death: say which it was.
                what = "broke the protocol" if isinstance(item.error, RpcProtocolError) else "died"
                reason = f"the app-server {what} mid-turn: {item.error}"
                return RunEnd(Outcome.FAILED, worker.failure(reason), turn.text)
            if isinstance(item, ServerRequest):
                if over := self._cap.request(item.method, item.params):
                    await live.toolbox.decline(item, worker, over.reason())
                    await worker.interrupt(turn.thread_id, turn.turn_id)
                    return RunEnd(Outcome.TURN_LIMIT, over.reason(), turn.text)
                await live.toolbox.handle(item, worker)
                if self._stopping.is_set():
                    # A stop that ended a held question must stop the run now: the watcher's
                    # next look could come after the turn has run on to "completed".
                    await worker.interrupt(turn.thread_id, turn.turn_id)
                    return RunEnd(Outcome.CANCELLED, "bothy received a stop signal", turn.text)
                continue
            if item.method == "item/started":
                self._cap.started(item.params)
            elif over := self._cap.notice(item.method):
                # The tool call past the cap runs inside Codex, asking nobody: stop the turn.
                await worker.interrupt(turn.thread_id, turn.turn_id)
                return RunEnd(Outcome.TURN_LIMIT, over.reason(), turn.text)
            ended = await self._notice(turn, item)
            if isinstance(ended, _Stop):
                # A limit crossed is acted on at once, ahead of anything queued behind it
                # (a turn/completed in the same burst must not hide the overrun).
                await worker.interrupt(turn.thread_id, turn.turn_id)
                return RunEnd(ended.outcome, ended.reason, turn.text)
            if ended is not None:
                return ended

    async def _notice(self, turn: Turn, note: Notification) -> RunEnd | _Stop | None:
        params = note.params
        if note.method == "item/agentMessage/delta":
            self._live.progress.text(str(params.get("delta", "")))
        elif note.method == "item/started":
            if (params.get("item") or {}).get("type") != "userMessage":
                turn.answering.add(turn.turn_id)  # a token report after this is a response's
        elif note.method == "item/completed":
            item = params.get("item") or {}
            if item.get("type") == "agentMessage":
                turn.text = str(item.get("text", ""))
                self._live.progress.message_end()
            else:
                await self._live.toolbox.item_done(item)
        elif note.method == "thread/tokenUsage/updated":
            return await self._measure(turn, params)
        elif note.method == "account/rateLimits/updated":
            stop = await self._budget.observe(turn.run_id, params)
            return _Stop(Outcome.BUDGET_LIMIT, stop) if stop else None
        elif note.method == "error":
            error = params.get("error") or {}
            if not params.get("willRetry"):
                turn.error = _error_text(error)
        elif note.method == "turn/completed":
            return _turn_end(turn, params)
        return None

    async def _measure(self, turn: Turn, params: dict[str, Any]) -> _Stop | None:
        """Fill the reservation with what was measured; say which limit, if any, is crossed."""
        request = self._live.request
        reported = params.get("tokenUsage") or {}
        try:
            usage = TokenUsage.from_codex(reported.get("total") or {})
            last = TokenUsage.from_codex(reported["last"]) if reported.get("last") else None
        except ValueError as exc:
            turn.notes.append(f"ignored a malformed token usage report: {exc}")
            return None
        _count_turn(turn, usage, last)
        turn.tokens = usage.total_tokens
        turn.cost_micros = self._prices.cost_micros(turn.price, usage)
        await self._budget.fill(turn.run_id, turn.cost_micros, turn.tokens)
        self._live.progress.usage(turn.tokens, turn.cost_micros)
        if request.max_tokens is not None and usage.total_tokens > request.max_tokens:
            return _Stop(Outcome.TOKEN_LIMIT,
                         f"used {usage.total_tokens} tokens, limit {request.max_tokens}")
        if self._budget.reserves_dollars and turn.cost_micros >= turn.reserved_micros:
            return _Stop(
                Outcome.BUDGET_LIMIT,
                f"spent {format_usd(turn.cost_micros, 4)} usd of its "
                f"{format_usd(turn.reserved_micros, 4)} usd reservation",
            )
        return None


def _turn_end(turn: Turn, params: dict[str, Any]) -> RunEnd | None:
    completed = params.get("turn") or {}
    if completed.get("id") not in (None, turn.turn_id):
        return None
    status = completed.get("status")
    if status == "completed":
        return RunEnd(Outcome.COMPLETED, None, turn.text)
    error = completed.get("error") or {}
    message = _error_text(error) if isinstance(error, dict) and error.get("message") else None
    reason = message or turn.error or f"the turn ended with status {status!r}"
    return RunEnd(Outcome.FAILED, str(reason), turn.text)


def _error_text(error: dict[str, Any]) -> str:
    """Codex's message and its error code (an HTTP 500 reads "high demand" without the code)."""
    message = str(error.get("message") or "unknown error")
    info = error.get("codexErrorInfo")
    if not info:
        return message
    code = info if isinstance(info, str) else json.dumps(info, separators=(",", ":"))
    return f"{message} (codex error: {code})"
