"""Bothy as the MCP client of a profile's granted servers (SPEC §7; issue 3, part 3).

:class:`McpHost` starts every server a profile grants, lists its tools, forwards calls, and
ends it. Each server is a process Bothy spawns itself, through :class:`ProcessGroup`, so that
it lives in its own process group which Bothy records (``on_group``, for orphan recovery) and
ends whole (SPEC §11 rules 2 and 5) — the SDK's ``stdio_client`` would spawn it out of our
sight. Between the process and the official SDK's :class:`ClientSession` sits a small bridge,
the same one ``mcp.client.stdio`` builds over anyio, rebuilt over asyncio pipes::

    server stdout ──lines──▶ _pump_stdout ──SessionMessage──▶ read stream  ──▶ ClientSession
    server stdin  ◀─lines─── _pump_stdin  ◀──SessionMessage── write stream ◀──
    server stderr ──bytes──▶ _pump_stderr (keeps the tail, for problem messages)

Frames are newline-delimited JSON-RPC. Per server, one owner coroutine (:meth:`_Server.run`)
holds a ``TaskGroup`` of the three pumps and the session; :class:`McpHost` runs the owners in
one ``TaskGroup`` inside the one task it owns, and :meth:`McpHost.stop` ends that task. The
session must be entered and left in one task (its anyio cancel scope demands it), which is
why it lives in the owner and not in the caller of :meth:`McpHost.start`.

Faults are values, never exceptions: a server that cannot be spawned, hangs, or answers
garbage during start becomes an :class:`McpProblem` and its group is stopped; a server that
dies, closes its input, or writes a line that is not JSON-RPC mid-run (the stdio transport
forbids anything else on stdout) is *lost*: its problem is recorded, the call in flight and
every later call get a :class:`ToolResult` saying so, and its group is stopped. A call that
outlives ``call_timeout_s`` is abandoned (the SDK sends the courtesy cancellation) and the
server stays up. No ``mcp``, ``anyio`` or ``pydantic`` exception leaves this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import anyio
import mcp.types as mcp_types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from bothy import __version__
from bothy.config import McpServerConfig
from bothy.engine.procgroup import GroupRecord, ProcessGroup
from bothy.errors import ProcessGroupError

__all__ = ["HostedTool", "McpHost", "McpProblem", "OnGroup", "ToolResult"]

OnGroup = Callable[[str, GroupRecord], Awaitable[None]]
"""Called with (server name, group record) right after a server is spawned."""

# What every server gets from Bothy's environment besides the names its config lists: enough
# to find executables and speak the locale, nothing that could be a credential.
_BASELINE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
_FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"
_MAX_FRAME_BYTES = 16 * 1024 * 1024  # one tool result may carry a whole document
_MAX_TOOL_PAGES = 100  # tools/list pages; a server whose cursor never ends is not believed
_STDERR_TAIL_BYTES = 4096
_STDERR_TAIL_LINES = 3
_EOF_GRACE_S = 0.5  # a healthy server exits when its stdin closes (MCP lifecycle, shutdown)
_TERM_GRACE_S = 2.0
_KILL_WAIT_S = 2.0
_EXIT_WAIT_S = 1.0  # for the child watcher to reap a server whose output ended
_POLL_S = 0.01
_QUOTE_CHARS = 120  # how much of a garbage line a message quotes
_CLIENT_INFO = mcp_types.Implementation(name="bothy", version=__version__)


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave the model: success, and the text it reads either way."""

    success: bool
    text: str


@dataclass(frozen=True)
class HostedTool:
    """A tool offered by a started MCP server.

    ``read_only`` is the server's ``readOnlyHint`` annotation, failing closed: a tool that does
    not say it is read-only is treated as one that writes.
    """

    server: str
    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool

    @property
    def qualified(self) -> str:
        """``server.name``, the name profiles grant (``gmail.search``)."""
        return f"{self.server}.{self.name}"


@dataclass(frozen=True)
class McpProblem:
    """A server that could not start, or was lost mid-run; ``message`` names it and says why."""

    server: str
    message: str


class _ServerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"  # never started, or lost mid-run: see the problem
    STOPPED = "stopped"  # stopped by Bothy


class _HostState(StrEnum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"


def _server_environment(config: McpServerConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a server: a harmless baseline plus the names its config lists.

    Anything else in ``environ`` — another server's token, Bothy's own secrets — is withheld.
    A listed name absent from ``environ`` is simply absent.
    """
    env = {name: environ[name] for name in _BASELINE_ENV if name in environ}
    env.setdefault("PATH", _FALLBACK_PATH)
    env.update({name: environ[name] for name in config.env if name in environ})
    return env


async def _poll_until(done: Callable[[], bool], *, within_s: float) -> None:
    """Wait until ``done()`` or ``within_s`` passes, whichever is first.

    For a child's exit: asyncio's child watcher sets ``returncode`` with no event to await, and
    ``process.wait()`` (3.11) also waits for every pipe to close, which a grandchild may delay
    for ever (as ``ProcessGroup`` explains).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not done() and loop.time() < deadline:  # noqa: ASYNC110 - no event exists: see above
        await asyncio.sleep(_POLL_S)


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _describe_content(item: mcp_types.ContentBlock) -> str:
    """Text items verbatim; anything else as one short bracketed line the model can read."""
    if isinstance(item, mcp_types.TextContent):
        return item.text
    if isinstance(item, mcp_types.ImageContent | mcp_types.AudioContent):
        kind = "image" if isinstance(item, mcp_types.ImageContent) else "audio"
        size_bytes = len(item.data) * 3 // 4 - item.data[-2:].count("=")  # base64
        return f"[{kind}: {item.mime_type}, {size_bytes} bytes, not shown]"
    if isinstance(item, mcp_types.ResourceLink):
        return f"[resource link: {item.uri}]"
    resource = item.resource
    if isinstance(resource, mcp_types.TextResourceContents):
        return f"[resource {resource.uri}]\n{resource.text}"
    return f"[resource {resource.uri}: {resource.mime_type or 'binary'}, not shown]"


def _result_text(result: mcp_types.CallToolResult) -> str:
    parts = [_describe_content(item) for item in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class _Server:
    """One MCP server: its process group, the bridge to the SDK's session, and its life."""

    def __init__(
        self,
        name: str,
        config: McpServerConfig,
        *,
        cwd: Path,
        env: Mapping[str, str],
        on_group: OnGroup | None,
    ) -> None:
        self.name = name
        self.config = config
        self._cwd = cwd
        self._env = env
        self._on_group = on_group
        self.state = _ServerState.STARTING
        self.tools: list[HostedTool] = []
        self.problems: list[McpProblem] = []
        self.settled = asyncio.Event()  # start finished, one way or the other
        self._failure: str | None = None  # why the server is lost, once it is
        self._stopping = False  # Bothy is ending it: what follows is not a fault
        self._wake = asyncio.Event()  # the owner should end the session: stop or loss
        self._session: ClientSession | None = None
        self._group: ProcessGroup | None = None
        self._stderr_tail = b""
        self._stderr_done = asyncio.Event()
        self._deadline_s = 0.0  # loop time by which the start must be done
        self._start_timeout: asyncio.Timeout | None = None  # expired early by request_stop

    # --- The owner: start, serve, end ---------------------------------------------------

    async def run(self) -> None:
        """Start, serve until asked to stop or lost, then end the group. Never raises a fault."""
        self._deadline_s = asyncio.get_running_loop().time() + self.config.start_timeout_s
        try:
            group = await self._spawn()
            if group is not None:
                await self._serve(group)
        finally:
            self._session = None
            if self.state in (_ServerState.STARTING, _ServerState.READY):
                self.state = _ServerState.STOPPED
            self.settled.set()

    def request_stop(self) -> None:
        """Ask the owner to close the session and end the group; the owner does the work.

        A start still under way is cut short: its timeout is made to expire now.
        """
        self._stopping = True
        self._wake.set()
        if self._start_timeout is not None and not self._start_timeout.expired():
            self._start_timeout.reschedule(asyncio.get_running_loop().time())

    @contextlib.asynccontextmanager
    async def _within_start(self) -> AsyncIterator[None]:
        """Bound a step of the start by the start's deadline (or by a stop, if one comes)."""
        deadline_s = asyncio.get_running_loop().time() if self._stopping else self._deadline_s
        async with asyncio.timeout_at(deadline_s) as timeout:
            self._start_timeout = timeout
            try:
                yield
            finally:
                self._start_timeout = None

    async def _spawn(self) -> ProcessGroup | None:
        argv = [self.config.command, *self.config.args]
        try:
            group = await ProcessGroup.spawn(
                argv, env=self._env, cwd=self._cwd, limit=_MAX_FRAME_BYTES
            )
        except ProcessGroupError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.filename is not None:
                why = f"{cause.strerror or cause}: {cause.filename!r}"
            else:
                why = str(exc)
            self._fail(f"could not be started ({self.config.command!r}): {why}")
            return None
        self._group = group
        return group

    async def _record_group(self, group: ProcessGroup) -> bool:
        if self._on_group is None:
            return True
        try:
            async with self._within_start():
                await self._on_group(self.name, group.record)
        except TimeoutError:
            self._fail(
                f"was stopped: recording its process group took longer than"
                f" {self.config.start_timeout_s:g} s"
            )
            return False
        except Exception as exc:  # Bothy could not persist it: an unrecorded group must not run
            self._fail(f"was stopped: its process group could not be recorded ({_brief(exc)})")
            return False
        return True

    async def _serve(self, group: ProcessGroup) -> None:
        process = group.process
        assert process.stdin and process.stdout and process.stderr  # spawned with pipes
        from_server, session_reads = anyio.create_memory_object_stream[SessionMessage | Exception](
            0
        )
        session_writes, to_server = anyio.create_memory_object_stream[SessionMessage](0)
        try:
            async with asyncio.TaskGroup() as pumps:
                tasks = [
                    pumps.create_task(self._pump_stdout(process.stdout, from_server)),
                    pumps.create_task(self._pump_stdin(to_server, process.stdin)),
                    pumps.create_task(self._pump_stderr(process.stderr)),
                ]
                try:
                    if await self._record_group(group):
                        await self._converse(session_reads, session_writes)
                finally:
                    await self._end(group)
                    # A member that escaped the group could hold a pipe open: never wait on it.
                    for task in tasks:
                        task.cancel()
        finally:
            for stream in (from_server, session_reads, session_writes, to_server):
                stream.close()

    async def _converse(
        self,
        reads: MemoryObjectReceiveStream[SessionMessage | Exception],
        writes: MemoryObjectSendStream[SessionMessage],
    ) -> None:
        try:
            async with ClientSession(reads, writes, client_info=_CLIENT_INFO) as session:
                if not await self._handshake(session):
                    return
                self._session = session
                self.state = _ServerState.READY
                self.settled.set()
                await self._wake.wait()
                self._session = None
        except Exception as exc:  # the SDK failing inside itself: a lost server, not a crash
            self._fail(f"failed inside the MCP client ({_brief(exc)})")

    async def _handshake(self, session: ClientSession) -> bool:
        step = "initialize"
        try:
            async with self._within_start():
                await session.initialize()
                step = "tools/list"
                self.tools = await self._list_tools(session)
        except TimeoutError:
            self._fail(f"did not answer {step!r} within {self.config.start_timeout_s:g} s")
        except MCPError as exc:
            # Connection closed because the pump saw the server die: that reason stands.
            self._fail(f"refused {step!r}: {exc.message}")
        except (ValidationError, ValueError, RuntimeError) as exc:
            self._fail(f"gave an answer to {step!r} that is not valid MCP ({_brief(exc)})")
        else:
            return True
        return False

    async def _list_tools(self, session: ClientSession) -> list[HostedTool]:
        tools: dict[str, HostedTool] = {}
        cursor: str | None = None
        for _ in range(_MAX_TOOL_PAGES):
            params = None if cursor is None else mcp_types.PaginatedRequestParams(cursor=cursor)
            page = await session.list_tools(params=params)
            for tool in page.tools:
                annotations = tool.annotations
                tools.setdefault(
                    tool.name,
                    HostedTool(
                        server=self.name,
                        name=tool.name,
                        description=tool.description or "",
                        input_schema=tool.input_schema,
                        read_only=annotations is not None and annotations.read_only_hint is True,
                    ),
                )
            cursor = page.next_cursor
            if cursor is None:
                return list(tools.values())
        raise ValueError(f"tools/list still had more pages after {_MAX_TOOL_PAGES}")

    async def _end(self, group: ProcessGroup) -> None:
        """Close stdin (the MCP shutdown sequence), then end the whole group, bounded."""
        healthy = self._failure is None
        self._stopping = True
        stdin = group.process.stdin
        if stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                stdin.close()
        if healthy:
            await _poll_until(lambda: group.process.returncode is not None, within_s=_EOF_GRACE_S)
        try:
            report = await group.stop(grace_s=_TERM_GRACE_S, kill_wait_s=_KILL_WAIT_S)
        except ProcessGroupError as exc:
            self.problems.append(McpProblem(self.name, f"MCP server {self.name!r}: {exc}"))
            return
        if report.survivors:
            self.problems.append(
                McpProblem(
                    self.name,
                    f"MCP server {self.name!r} left processes that survived SIGKILL:"
                    f" {list(report.survivors)} in {group.record.describe()}",
                )
            )

    # --- The bridge ---------------------------------------------------------------------

    async def _pump_stdout(
        self,
        stdout: asyncio.StreamReader,
        to_session: MemoryObjectSendStream[SessionMessage | Exception],
    ) -> None:
        """Server lines → parsed JSON-RPC messages → the session. Anything else loses the server."""
        with to_session:  # closing it tells the session the connection ended
            while True:
                try:
                    line = await stdout.readline()
                except ValueError:  # StreamReader's limit: a frame too long to be believed
                    self._fail(f"sent a frame longer than {_MAX_FRAME_BYTES} bytes")
                    return
                if not line:
                    self._fail(await self._ending_description("closed its output"))
                    return
                if not line.strip():
                    continue
                try:
                    message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValidationError:
                    quoted = line.decode("utf-8", "replace").strip()[:_QUOTE_CHARS]
                    self._fail(f"wrote a line that is not JSON-RPC: {quoted!r}")
                    return
                try:
                    await to_session.send(SessionMessage(message))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the session is gone: nobody is listening

    async def _pump_stdin(
        self, from_session: MemoryObjectReceiveStream[SessionMessage], stdin: asyncio.StreamWriter
    ) -> None:
        """Session messages → one JSON line each → the server's stdin."""
        try:
            with from_session:
                async for outgoing in from_session:
                    frame = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
                    stdin.write(frame.encode() + b"\n")
                    await stdin.drain()
        except (ConnectionError, OSError) as exc:
            # Most often the server has died: its exit status says more than the broken pipe.
            self._fail(await self._ending_description(f"stopped reading its input ({_brief(exc)})"))
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                stdin.close()

    async def _pump_stderr(self, stderr: asyncio.StreamReader) -> None:
        """Drain stderr (a full pipe would block the server) and keep its tail for messages."""
        try:
            while chunk := await stderr.read(65536):
                self._stderr_tail = (self._stderr_tail + chunk)[-_STDERR_TAIL_BYTES:]
        finally:
            self._stderr_done.set()

    async def _ending_description(self, still_running: str) -> str:
        """Why the server's pipe broke: its exit status and last words, waited for briefly.

        ``still_running`` is what to say if the process has not exited after all.
        """
        if self._stopping or self._group is None:
            return "was stopped"
        process = self._group.process
        await _poll_until(
            lambda: process.returncode is not None and self._stderr_done.is_set(),
            within_s=_EXIT_WAIT_S,
        )
        code = process.returncode
        if code is None:
            how = f"{still_running} but is still running"
        elif code < 0:
            how = f"stopped unexpectedly (killed by signal {-code})"
        else:
            how = f"stopped unexpectedly (exit code {code})"
        lines = [
            line.strip()
            for line in self._stderr_tail.decode("utf-8", "replace").splitlines()
            if line.strip()
        ]
        last_words = " | ".join(lines[-_STDERR_TAIL_LINES:])
        return f"{how}; its last output on stderr: {last_words}" if last_words else how

    def _fail(self, reason: str) -> None:
        """Record the first reason the server is lost, unless Bothy itself is stopping it."""
        if self._failure is not None or self._stopping:
            return
        self._failure = reason
        self.state = _ServerState.FAILED
        self.problems.append(McpProblem(self.name, f"MCP server {self.name!r} {reason}"))
        self._wake.set()

    # --- Calls --------------------------------------------------------------------------

    def _unavailable(self, tool: str) -> ToolResult:
        if self._failure is not None:
            why = self._failure
        elif self._stopping:
            why = "was stopped"
        else:
            why = "is not running"
        return ToolResult(
            False, f"MCP tool '{self.name}.{tool}' is unavailable: server {self.name!r} {why}."
        )

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Forward one call, bounded by ``call_timeout_s``; every fault becomes a ToolResult."""
        session = self._session
        if session is None or self._failure is not None or self._stopping:
            return self._unavailable(tool)
        qualified = f"{self.name}.{tool}"
        if tool not in {hosted.name for hosted in self.tools}:
            return ToolResult(False, f"MCP server {self.name!r} has no tool {tool!r}.")
        if not isinstance(arguments, dict):
            kind = type(arguments).__name__
            return ToolResult(
                False, f"Arguments for MCP tool '{qualified}' must be a JSON object, not {kind}."
            )
        try:
            async with asyncio.timeout(self.config.call_timeout_s):
                result = await session.call_tool(tool, arguments)
        except TimeoutError:
            return ToolResult(
                False, f"MCP tool '{qualified}' timed out after {self.config.call_timeout_s:g} s."
            )
        except MCPError as exc:
            if self._failure is not None or self._stopping:
                return self._unavailable(tool)
            return ToolResult(False, f"MCP tool '{qualified}' failed: {exc.message}")
        except Exception as exc:  # the adapter boundary: no SDK or pydantic error escapes
            if self._failure is not None or self._stopping:
                return self._unavailable(tool)
            return ToolResult(
                False,
                f"MCP tool '{qualified}' failed: its answer is not valid MCP ({_brief(exc)}).",
            )
        text = _result_text(result)
        if result.is_error:
            return ToolResult(False, f"MCP tool '{qualified}' reported an error: {text}")
        return ToolResult(True, text)


class McpHost:
    """The MCP servers of one run: started together, called by name, stopped together.

    Call :meth:`start` once, then :meth:`call` as often as needed, and always :meth:`stop`
    (in a ``finally``): the host owns one task, which holds every server's owner, and only
    :meth:`stop` ends it.
    """

    def __init__(
        self,
        servers: Mapping[str, McpServerConfig],
        *,
        cwd: Path,
        environ: Mapping[str, str],
        on_group: OnGroup | None = None,
    ) -> None:
        self._servers = {
            name: _Server(
                name,
                config,
                cwd=cwd,
                env=_server_environment(config, environ),
                on_group=on_group,
            )
            for name, config in servers.items()
        }
        self._state = _HostState.NEW
        self._owner: asyncio.Task[None] | None = None

    async def start(self) -> list[McpProblem]:
        """Start every server concurrently, each within its ``start_timeout_s``.

        Returns the problems of the servers that did not start (their groups are stopped);
        the others are ready for :meth:`call`. Calling it twice is a programming error.
        """
        if self._state is not _HostState.NEW:
            raise RuntimeError(f"McpHost.start() was called on a host that is {self._state}")
        self._state = _HostState.STARTING
        self._owner = asyncio.create_task(self._run_servers(), name="bothy-mcp-host")
        try:
            for server in self._servers.values():
                await server.settled.wait()
        except asyncio.CancelledError:
            await self.stop()  # cuts every start short: bounded
            raise
        if self._owner.done() and not self._owner.cancelled():
            self._owner.result()  # a bug in a server's owner surfaces here, not never
        self._state = _HostState.RUNNING
        return self.problems()

    async def _run_servers(self) -> None:
        try:
            async with asyncio.TaskGroup() as owners:
                for name, server in self._servers.items():
                    owners.create_task(server.run(), name=f"bothy-mcp-{name}")
        finally:
            # An owner cancelled before it ever ran has no ``finally`` of its own: start()
            # must not wait for it for ever.
            for server in self._servers.values():
                server.settled.set()

    def tools(self) -> list[HostedTool]:
        """The tools of the servers that are up (started, not lost, not stopped)."""
        return [
            tool
            for server in self._servers.values()
            if server.state is _ServerState.READY
            for tool in server.tools
        ]

    async def call(self, server: str, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Call ``server``'s ``tool``; every fault comes back as ``ToolResult(False, why)``."""
        hosted = self._servers.get(server)
        if hosted is None:
            return ToolResult(False, f"No MCP server named {server!r} is available in this run.")
        return await hosted.call(tool, arguments)

    def problems(self) -> list[McpProblem]:
        """Every server that did not start or was lost mid-run, in configuration order."""
        return [problem for server in self._servers.values() for problem in server.problems]

    async def stop(self) -> None:
        """Close every session and end every server's process group. Idempotent.

        Bounded: a start still under way is cut short; each healthy server gets a short grace
        after its stdin closes, then SIGTERM and SIGKILL go to its group, each with a bounded
        wait. Calls in flight fail with "was stopped"; later calls fail at once.
        """
        self._state = _HostState.STOPPED
        for server in self._servers.values():
            server.request_stop()
        if self._owner is None:
            return
        if not self._owner.done():
            # If stop() is cancelled here, the owner is cancelled too, and its ``finally``
            # blocks end every group before the cancellation reaches our caller.
            await self._owner
        elif not self._owner.cancelled():
            self._owner.result()  # a bug in an owner is raised, not swallowed
