"""One worker: a ``codex app-server`` in its own process group, spoken to over JSON-RPC.

The worker knows the protocol's request/response calls (initialize, thread/start, turn/start,
turn/interrupt) and nothing about budgets or policy; what the app-server says on its own
(notifications, approval requests) lands in the events queue the supervisor drains. A thread
can be started before any run has the worker (the spare's, :class:`ThreadAhead`): a run takes
it only if it would have started a thread with the same :class:`ThreadParams`, and nothing
codex reads into a thread as it starts it (:class:`ThreadInputs`: the workspace's AGENTS.md)
changed since.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bothy import __version__
from bothy.engine.launch import Launch
from bothy.engine.procgroup import GroupRecord, ProcessGroup, StopReport
from bothy.engine.rpc import MAX_FRAME_BYTES, RpcConnection
from bothy.errors import AppServerError

if TYPE_CHECKING:  # (loaded by the first thread started ahead: not on the way to a spawn)
    from bothy.engine.threadinputs import ThreadInputs

_INIT_TIMEOUT_S = 60.0
_CALL_TIMEOUT_S = 30.0
_INTERRUPT_TIMEOUT_S = 3.0
_STDERR_TAIL_LINES = 20
_EXIT_POLL_S = 0.25
# After the leader exits, how long its output may stay open (still draining) before the
# connection is declared lost; normally the output ends at once and the reader says so.
_EXIT_DRAIN_S = 1.0
_CONTROL_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x1f\x7f]")
# How codex keeps a new thread's history (``thread/start.historyMode``, an experimental field
# of the v2 protocol: ``codex app-server generate-json-schema --experimental`` of 0.171.0,
# v2/ThreadStartParams.json, "Persisted thread history contract to use for this new thread",
# ``legacy | paginated``). Left unset, codex 0.171.0 starts a ``paginated`` thread: beside its
# rollout file it indexes every item into CODEX_HOME's thread_history sqlite (journal, fsyncs)
# and reads the rollout back after each append, on the way to the model request and again
# before ``turn/completed`` (strace of a turn; thread-store/src/local/live_writer.rs spans,
# 10-16 ms busy of the turn under RUST_LOG=trace). Paginated history serves codex's own
# clients (thread/turns/list, thread/items/list, which Bothy never calls); ``legacy`` keeps the
# plain rollout that thread/resume reads (app-server-protocol ThreadHistoryMode; the TUI falls
# back to it when a server lacks pagination). The model is asked exactly the same: both modes'
# requests were compared byte for byte, a first turn and a resumed second one. Measured with
# the skill_search knob (launch.py), alternated against main in `bench chat`: codex's turn/start
# to the model request 76 -> 62 ms (median) on the spare's thread, 92 -> 72 on a thread of its
# own; the answer's ``turn/completed`` a few ms sooner.
_HISTORY_MODE = "legacy"
# A run's thread without a profile's sandbox, and every thread's approval policy (each asked
# question comes to Bothy's toolbox).
PLAIN_SANDBOX = "read-only"
APPROVAL_POLICY = "on-request"


@dataclass(frozen=True)
class ThreadInfo:
    """A thread codex answered with; ``origin`` says how the run came by it: ``started``,
    ``resumed``, or ``ahead`` (the spare started it before the run took it); ``ahead_unused``
    why a thread started ahead on the same worker was not the run's."""

    thread_id: str
    model: str
    origin: str = "started"
    ahead_unused: str | None = None


@dataclass(frozen=True)
class ThreadParams:
    """What a new thread is started with (``thread/start``, and the skill roots set before
    it): two threads started with equal params are alike, whenever they were started."""

    model: str | None
    sandbox: str
    approval_policy: str
    keep: bool  # saved under CODEX_HOME so that a later run can resume it
    dynamic_tools: tuple[dict[str, Any], ...] = ()
    skill_roots: tuple[str, ...] = ()  # set on the app-server before the thread starts

    @classmethod
    def plain(cls, model: str | None, *, keep: bool) -> ThreadParams:
        """The thread a run without a profile starts (a thread started ahead is at first
        started so: the spare's, a `bothy run`'s head start's)."""
        return cls(model=model, sandbox=PLAIN_SANDBOX, approval_policy=APPROVAL_POLICY,
                   keep=keep)

    def differences(self, other: ThreadParams) -> list[str]:
        """The names of the params in which ``other`` differs from these."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class ThreadAhead:
    """A thread started on an app-server before any run had it, with what, and what codex
    read into it then (read just before its thread/start)."""

    params: ThreadParams
    info: ThreadInfo
    inputs: ThreadInputs


class Worker:
    """A supervised codex app-server. ``start`` → ``initialize`` → threads and turns → ``stop``."""

    def __init__(self, launch: Launch, *, cwd: Path, events: asyncio.Queue[Any]) -> None:
        self._launch = launch
        self._cwd = cwd
        self.events = events  # what the app-server says on its own, in arrival order
        self._group: ProcessGroup | None = None
        self._rpc: RpcConnection | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._stderr_task: asyncio.Task[None] | None = None
        self._exit_task: asyncio.Task[None] | None = None
        self._initialized = False
        self.thread_ahead: ThreadAhead | None = None  # started before a run had the worker
        self.exited = asyncio.Event()  # set once the leader has exited (and been reaped)
        # Monotonic marks of the protocol's first steps, for the trace and the benchmarks.
        self.marks: dict[str, float] = {}

    @property
    def record(self) -> GroupRecord:
        return self._running_group().record

    @property
    def initialized(self) -> bool:
        """Whether ``initialize`` was answered (a spare's was, before its run took it)."""
        return self._initialized

    def is_alive(self) -> bool:
        """Started, its leader not exited, and a live member in its group (one read of the
        process table while the leader lives)."""
        group = self._group
        return (group is not None and group.process.returncode is None
                and not self._connection().lost and group.is_alive())

    async def start(self) -> GroupRecord:
        """Spawn the app-server in a new session (its own process group)."""
        self.marks["spawn"] = time.monotonic()
        self._group = await ProcessGroup.spawn(
            self._launch.argv,
            env=self._launch.env,
            cwd=self._cwd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=MAX_FRAME_BYTES,
        )
        process = self._group.process
        assert process.stdout is not None and process.stdin is not None
        assert process.stderr is not None
        self._rpc = RpcConnection(process.stdout, process.stdin, self.events)
        self._rpc.start()
        self._stderr_task = asyncio.create_task(self._drain_stderr(process.stderr))
        self._exit_task = asyncio.create_task(self._watch_exit(process, self._rpc))
        return self._group.record

    async def initialize(self) -> dict[str, Any]:
        result = await self._call(
            "initialize",
            {
                "clientInfo": {"name": "bothy", "title": "Bothy", "version": __version__},
                "capabilities": {"experimentalApi": True},
            },
            timeout_s=_INIT_TIMEOUT_S,
        )
        self.marks["initialized"] = time.monotonic()
        await self._connection().notify("initialized")
        self._initialized = True
        return result if isinstance(result, dict) else {}

    async def start_thread(self, params: ThreadParams) -> ThreadInfo:
        """A new thread; ``params.keep`` saves it under CODEX_HOME so that a later run can
        resume it (its skill roots are the caller's to set first: a resumed thread needs them
        too)."""
        body: dict[str, Any] = {
            "cwd": str(self._cwd),
            "approvalPolicy": params.approval_policy,
            "sandbox": params.sandbox,
            "ephemeral": not params.keep,
            "historyMode": _HISTORY_MODE,
        }
        if params.model is not None:
            body["model"] = params.model
        if params.dynamic_tools:
            body["dynamicTools"] = list(params.dynamic_tools)
        self.marks["thread_start_sent"] = time.monotonic()
        result = await self._call("thread/start", body)
        self.marks["thread_started"] = time.monotonic()
        thread = result.get("thread") if isinstance(result, dict) else None
        if not isinstance(thread, dict) or not isinstance(thread.get("id"), str):
            raise AppServerError(
                "'thread/start' answered without a thread id", method="thread/start"
            )
        return ThreadInfo(thread["id"], str(thread.get("model") or params.model or "unknown"))

    async def start_thread_ahead(self, params: ThreadParams) -> ThreadAhead:
        """A thread started before any run has this worker (the spare's): the run that takes
        the worker takes it only if it would start a thread with equal params
        (:meth:`take_thread_ahead`) and nothing codex reads into a thread changed since."""
        inputs = await self._thread_inputs()  # before: a change meanwhile counts as one
        info = await self.start_thread(params)
        self.thread_ahead = ThreadAhead(params, replace(info, origin="ahead"), inputs)
        return self.thread_ahead

    async def take_thread_ahead(self, params: ThreadParams) -> ThreadInfo | str:
        """The thread started ahead, if it was started with ``params`` and what codex read into
        it is still so (the workspace's AGENTS.md, the date); else why not. Either way it is
        offered once: a later thread of this worker is started as asked."""
        ahead, self.thread_ahead = self.thread_ahead, None
        if ahead is None:
            return "no thread was started ahead"
        differ = ahead.params.differences(params)
        if differ:
            return f"the run's thread differs from the one started ahead in {', '.join(differ)}"
        stale = (await self._thread_inputs()).changed_since(ahead.inputs)
        if stale is not None:
            return stale
        # The run sent no thread/start: none of its turns is timed against the one made ahead.
        self.marks.pop("thread_start_sent", None)
        self.marks.pop("thread_started", None)
        return ahead.info

    async def _thread_inputs(self) -> ThreadInputs:
        # A few dozen stats (bothy/engine/threadinputs.py): 0.1-0.3 ms here, more on a
        # workspace on a network filesystem; off the event loop, as every disk read.
        from bothy.engine.threadinputs import ThreadInputs

        return await asyncio.to_thread(ThreadInputs.read, self._cwd, self._launch.argv)

    async def resume_thread(
        self, thread_id: str, *, model: str | None, sandbox: str, approval_policy: str
    ) -> ThreadInfo:
        """Continue a kept thread: Codex reloads its history from CODEX_HOME."""
        params: dict[str, Any] = {"threadId": thread_id, "cwd": str(self._cwd),
                                  "approvalPolicy": approval_policy, "sandbox": sandbox}
        if model is not None:
            params["model"] = model
        self.marks["thread_start_sent"] = time.monotonic()
        result = await self._call("thread/resume", params)
        self.marks["thread_started"] = time.monotonic()
        thread = result.get("thread") if isinstance(result, dict) else None
        if not isinstance(thread, dict) or not isinstance(thread.get("id"), str):
            raise AppServerError(
                "'thread/resume' answered without a thread id", method="thread/resume"
            )
        return ThreadInfo(thread["id"], str(thread.get("model") or model or "unknown"))

    async def set_skill_roots(self, roots: list[str]) -> None:
        """Make extra skill roots visible to Codex (a profile's ``skills``)."""
        await self._call("skills/extraRoots/set", {"extraRoots": roots})

    async def start_turn(self, thread_id: str, text: str, *,
                         traceparent: str | None = None) -> str:
        """Start a turn; ``traceparent`` (W3C) makes Codex's own spans join the run's trace."""
        self.marks["turn_start_sent"] = time.monotonic()
        self.marks["turn_start_sent_unix"] = time.time()
        result = await self._connection().request(
            "turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": text}]},
            timeout_s=_CALL_TIMEOUT_S,
            trace={"traceparent": traceparent} if traceparent else None,
        )
        self.marks["turn_started"] = time.monotonic()
        turn = result.get("turn") if isinstance(result, dict) else None
        if not isinstance(turn, dict) or not isinstance(turn.get("id"), str):
            raise AppServerError("'turn/start' answered without a turn id", method="turn/start")
        return str(turn["id"])

    async def interrupt(self, thread_id: str, turn_id: str) -> bool:
        """Ask the turn to stop; False if the app-server could not be told."""
        try:
            await self._call(
                "turn/interrupt",
                {"threadId": thread_id, "turnId": turn_id},
                timeout_s=_INTERRUPT_TIMEOUT_S,
            )
        except AppServerError:
            return False
        return True

    async def respond(self, request_id: int | str, result: dict[str, Any]) -> None:
        await self._connection().respond(request_id, result)

    async def respond_error(self, request_id: int | str, code: int, message: str) -> None:
        await self._connection().respond_error(request_id, code, message)

    def exit_code(self) -> int | None:
        return self._group.process.returncode if self._group is not None else None

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr_tail)

    def failure(self, reason: str) -> str:
        """``reason``, with the app-server's exit code and last line of stderr when known."""
        tail = self.stderr_tail().strip()
        code = self.exit_code()
        parts = [reason]
        if code is not None:
            parts.append(f"exit code {code}")
        if tail:
            # Codex colours its log even into a pipe: the reason is shown and audited as plain
            # text.
            last = _CONTROL_SEQUENCE.sub("", tail.splitlines()[-1])
            parts.append(f"stderr: {last[:300]}")
        return "; ".join(parts)

    async def stop(self, *, grace_s: float) -> StopReport | None:
        """Close stdin, then stop the whole group (TERM, bounded wait, KILL)."""
        if self._exit_task is not None:
            self._exit_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._exit_task
        if self._rpc is not None:
            await self._rpc.close()
        report = await self._group.stop(grace_s=grace_s) if self._group is not None else None
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr_task
        return report

    async def _call(
        self, method: str, params: dict[str, Any], *, timeout_s: float = _CALL_TIMEOUT_S
    ) -> Any:
        return await self._connection().request(method, params, timeout_s=timeout_s)

    def _connection(self) -> RpcConnection:
        if self._rpc is None:
            raise AppServerError("the worker was used before it was started")
        return self._rpc

    def _running_group(self) -> ProcessGroup:
        if self._group is None:
            raise AppServerError("the worker has no process group yet")
        return self._group

    async def _watch_exit(self, process: asyncio.subprocess.Process, rpc: RpcConnection) -> None:
        # ``returncode`` is set when the leader is reaped, whoever still holds its pipes; there
        # is no event for that (``process.wait()`` also waits for the pipes to close).
        while process.returncode is None:  # noqa: ASYNC110
            await asyncio.sleep(_EXIT_POLL_S)
        self.exited.set()
        await asyncio.sleep(_EXIT_DRAIN_S)
        rpc.peer_exited(process.returncode)

    async def _drain_stderr(self, stderr: asyncio.StreamReader) -> None:
        # The app-server logs to stderr; an undrained pipe would block it once full.
        while line := await stderr.readline():
            self._stderr_tail.append(line.decode(errors="replace").rstrip())
