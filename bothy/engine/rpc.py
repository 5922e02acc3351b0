"""JSON-RPC over the app-server's stdio: newline-delimited JSON, no ``"jsonrpc"`` field.

The connection owns one reader task. Responses resolve the futures of our requests; server
notifications and server requests go, in arrival order, to an events queue that the supervisor
drains (and into which it may put its own items, such as a stop request). When the stream
ends or carries a frame that is not JSON-RPC, every pending request fails and the events queue
gets a :class:`ConnectionLost` saying why: nothing waits forever on a dead worker.

With ``RECORD_CODEX_RPC`` set to a file path (the test harness sets it; off by default),
every frame sent and received is appended to that file as one JSON line naming its
direction, kind and method, so the tests can check the traffic against the JSON Schema the
pinned codex binary generates (``tests/codex_schema.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

from bothy.errors import AppServerError, RpcProtocolError

# One frame may carry a whole diff or command output; StreamReader's default is 64 KiB.
MAX_FRAME_BYTES = 16 * 1024 * 1024

# Names a file to append every frame to, for the schema check of the tests; unset in service.
RECORD_ENV = "RECORD_CODEX_RPC"
_connection_serial = itertools.count(1)


@dataclass(frozen=True)
class Notification:
    method: str
    params: dict[str, Any]


@dataclass(frozen=True)
class ServerRequest:
    """A request from the app-server that we must answer (approvals, tool calls...)."""

    request_id: int | str
    method: str
    params: dict[str, Any]


@dataclass(frozen=True)
class ConnectionLost:
    error: AppServerError


Incoming = Notification | ServerRequest | ConnectionLost


class RpcConnection:
    """A JSON-RPC client over a pair of asyncio streams."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        events: asyncio.Queue[Any],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.events = events
        self._next_id = 1
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._methods: dict[int, str] = {}  # our request ids -> method, for the recorder
        self._lost: AppServerError | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._recorder = _Recorder.from_env()

    def start(self) -> None:
        self._reader_task = asyncio.create_task(self._read_loop(), name="rpc-reader")

    async def close(self) -> None:
        """Close stdin (the app-server exits on EOF) and stop reading."""
        if not self._writer.is_closing():
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
            self._reader_task = None

    @property
    def lost(self) -> bool:
        """Whether the connection has failed (the stream ended, a bad frame, the peer died)."""
        return self._lost is not None

    def peer_exited(self, returncode: int) -> None:
        """The app-server's process is gone: fail now if its output has not ended already.

        Its output normally ends with it, and the reader reports that in order; but a child
        that inherited the pipe keeps it open, and the end of the stream would never come.
        """
        self._fail(AppServerError(
            f"the app-server exited with code {returncode}", exit_code=returncode
        ))

    async def request(self, method: str, params: dict[str, Any], *, timeout_s: float,
                      trace: dict[str, str] | None = None) -> Any:
        """Send a request and wait for its result; raise AppServerError on error or death.
        ``trace`` is the W3C trace context the request carries (``traceparent``)."""
        if self._lost is not None:
            raise AppServerError(f"Cannot send '{method}': {self._lost}", method=method)
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._methods[request_id] = method
        try:
            message: dict[str, Any] = {"id": request_id, "method": method, "params": params}
            if trace is not None:
                message["trace"] = trace
            await self._send(message, method)
            async with asyncio.timeout(timeout_s):
                reply = await future
        except TimeoutError:
            raise AppServerError(
                f"'{method}' got no answer within {timeout_s:g} s", method=method
            ) from None
        finally:
            self._pending.pop(request_id, None)
            self._methods.pop(request_id, None)
        if "error" in reply:
            error = reply["error"] if isinstance(reply["error"], dict) else {}
            raise AppServerError(
                f"'{method}' failed: {error.get('message', reply['error'])}", method=method
            )
        return reply.get("result")

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = params
        await self._send(message, method)

    async def respond(self, request_id: int | str, result: dict[str, Any]) -> None:
        await self._send({"id": request_id, "result": result}, "response")

    async def respond_error(self, request_id: int | str, code: int, message: str) -> None:
        await self._send({"id": request_id, "error": {"code": code, "message": message}}, "error")

    async def _send(self, message: dict[str, Any], what: str) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if self._recorder is not None:
            self._recorder.sent(message)
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise AppServerError(
                f"Cannot send '{what}': the app-server's stdin is closed ({exc})", method=what
            ) from exc

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    line = await self._reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:
                    if exc.partial.strip():
                        raise RpcProtocolError(
                            f"the app-server's output ended mid-frame ({len(exc.partial)} bytes"
                            " without a newline)"
                        ) from None
                    raise AppServerError("the app-server closed its output") from None
                except asyncio.LimitOverrunError:
                    raise RpcProtocolError(
                        f"a frame from the app-server exceeds {MAX_FRAME_BYTES} bytes"
                    ) from None
                if line.strip():
                    self._dispatch(_decode(line))
        except AppServerError as exc:
            self._fail(exc)

    def _dispatch(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        if self._recorder is not None:
            answered = message.get("id")
            self._recorder.received(message, self._methods.get(answered)
                                    if isinstance(answered, int) else None)
        if isinstance(method, str):
            params = message.get("params") or {}
            if not isinstance(params, dict):
                raise RpcProtocolError(f"'{method}' carries params that are not an object")
            if "id" in message:
                self.events.put_nowait(ServerRequest(message["id"], method, params))
            else:
                self.events.put_nowait(Notification(method, params))
            return
        request_id = message.get("id")
        future = self._pending.get(request_id) if isinstance(request_id, int) else None
        if future is None:
            raise RpcProtocolError(f"a response to a request we never sent (id {request_id!r})")
        if not future.done():
            future.set_result(message)

    def _fail(self, error: AppServerError) -> None:
        if self._lost is not None:
            return  # the first reason stands
        self._lost = error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self.events.put_nowait(ConnectionLost(error))


class _Recorder:
    """Appends each frame, with its direction, kind and method, to the ``RECORD_ENV`` file.

    One ``write`` per line on an ``O_APPEND`` descriptor, so the connections of several
    processes can share the file. The method of a response is the request's: ours for what
    we receive, Codex's for what we answer.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._connection = f"{os.getpid()}.{next(_connection_serial)}"
        self._server_methods: dict[int | str, str] = {}

    @classmethod
    def from_env(cls) -> _Recorder | None:
        path = os.environ.get(RECORD_ENV)
        return cls(path) if path else None

    def sent(self, message: dict[str, Any]) -> None:
        if "method" in message:
            kind = "request" if "id" in message else "notification"
            self._write("sent", kind, str(message["method"]), message)
        else:
            method = self._server_methods.pop(message["id"], None)
            self._write("sent", "error" if "error" in message else "response", method, message)

    def received(self, message: dict[str, Any], answered: str | None) -> None:
        method = message.get("method")
        if isinstance(method, str):
            if "id" in message:
                self._server_methods[message["id"]] = method
                self._write("received", "request", method, message)
            else:
                self._write("received", "notification", method, message)
        else:
            kind = "error" if "error" in message else "response"
            self._write("received", kind, answered, message)

    def _write(self, direction: str, kind: str, method: str | None,
               message: dict[str, Any]) -> None:
        line = json.dumps({"connection": self._connection, "direction": direction,
                           "kind": kind, "method": method, "message": message},
                          separators=(",", ":")).encode() + b"\n"
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        preview = line[:80].decode(errors="replace")
        raise RpcProtocolError(
            f"the app-server sent a frame that is not JSON: {preview!r}"
        ) from exc
    if not isinstance(message, dict):
        raise RpcProtocolError("the app-server sent a JSON frame that is not an object")
    return message
