"""A scripted OpenAI Responses API server on loopback, for driving the real Codex.

Codex (``codex app-server`` with a custom provider, ``wire_api = "responses"``) sends every
model call as ``POST {base_url}/responses`` with ``stream: true`` and reads server-sent
events back: ``event: <type>\\ndata: <json>\\n\\n``. This fake answers each POST with the
next reply from a FIFO script, so a test decides exactly what "the model" says::

    async with ModelServer() as server:
        server.script(tool_call("exec_command", {"cmd": "echo hi"}), text("done"))
        ...  # point codex at server.base_url
        await server.wait_for_requests(2, timeout_s=10)

Event shapes follow Codex's own parser (``codex-rs/codex-api/src/sse/responses.rs``): it
keys on the ``type`` field of each JSON payload, needs ``response.id`` on
``response.completed``, maps ``usage`` to its token counts, and reads rate limits from
``x-codex-{primary,secondary}-*`` response headers. A request beyond the script gets
HTTP 500 "script exhausted" and is counted in ``ModelServer.unscripted``.

Standalone (for the offline demo)::

    python -m tests.fakes.model_server --script FILE.json [--port N] [--host 127.0.0.1]

prints one line, ``listening http://127.0.0.1:PORT/v1``, and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

JSON = dict[str, Any]

# A stalled handler is released when the server closes; this bounds how long aiohttp waits
# for in-flight handlers after that (it cancels them afterwards).
_SHUTDOWN_GRACE_S = 2.0


# --- what a reply is ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Usage:
    """Token figures reported in ``response.completed`` (``total_tokens`` is derived).

    As in the Responses API, ``cached_tokens`` is a part of ``input_tokens`` and
    ``reasoning_tokens`` a part of ``output_tokens``.
    """

    input_tokens: int
    cached_tokens: int = 0
    output_tokens: int
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens, as the Responses API reports them."""
        return self.input_tokens + self.output_tokens

    def to_json(self) -> JSON:
        """The ``response.usage`` object Codex parses."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.total_tokens,
        }


DEFAULT_USAGE = Usage(input_tokens=120, cached_tokens=0, output_tokens=8, reasoning_tokens=0)


@dataclass(frozen=True)
class RateLimitWindow:
    """One rate-limit window as Codex reads it from ``x-codex-<window>-*`` headers."""

    used_percent: float
    window_minutes: int | None = None
    reset_at: int | None = None  # unix seconds


@dataclass(frozen=True)
class RateLimits:
    """Rate-limit headers to attach to a reply (Codex turns them into ``account/rateLimits``)."""

    primary: RateLimitWindow | None = None
    secondary: RateLimitWindow | None = None

    def headers(self) -> dict[str, str]:
        """The ``x-codex-primary-*`` / ``x-codex-secondary-*`` response headers."""
        headers: dict[str, str] = {}
        for name, window in (("primary", self.primary), ("secondary", self.secondary)):
            if window is None:
                continue
            headers[f"x-codex-{name}-used-percent"] = str(window.used_percent)
            if window.window_minutes is not None:
                headers[f"x-codex-{name}-window-minutes"] = str(window.window_minutes)
            if window.reset_at is not None:
                headers[f"x-codex-{name}-reset-at"] = str(window.reset_at)
        return headers


@dataclass(frozen=True, kw_only=True)
class TextReply:
    """An assistant message, streamed as ``chunks`` text deltas."""

    text: str
    usage: Usage | None = DEFAULT_USAGE
    chunks: int = 2
    rate_limits: RateLimits | None = None
    after: asyncio.Event | None = field(default=None, compare=False)


@dataclass(frozen=True, kw_only=True)
class ToolCallReply:
    """A ``function_call`` output item; ``arguments`` is the raw JSON string sent."""

    name: str
    arguments: str
    call_id: str
    usage: Usage | None = DEFAULT_USAGE
    rate_limits: RateLimits | None = None


@dataclass(frozen=True, kw_only=True)
class HttpErrorReply:
    """A plain HTTP error status instead of a stream."""

    status: int
    body: str
    rate_limits: RateLimits | None = None


@dataclass(frozen=True, kw_only=True)
class FailedReply:
    """A stream that ends in ``response.failed`` with ``error.code`` and ``error.message``."""

    message: str
    code: str = "server_error"
    rate_limits: RateLimits | None = None


@dataclass(frozen=True, kw_only=True)
class StallReply:
    """A stream that starts a message and then goes quiet until disconnect or shutdown."""

    text_before: str = ""
    rate_limits: RateLimits | None = None


Reply = TextReply | ToolCallReply | HttpErrorReply | FailedReply | StallReply


def text(
    text: str,
    *,
    usage: Usage | None = DEFAULT_USAGE,
    chunks: int = 2,
    rate_limits: RateLimits | None = None,
    after: asyncio.Event | None = None,
) -> TextReply:
    """An assistant message ``text``; ``usage=None`` omits usage from ``response.completed``.

    With ``after``, the reply starts its stream at once but sends the message only once the
    test sets that event (a slow model whose answer the test releases).
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, not {chunks}")
    return TextReply(text=text, usage=usage, chunks=chunks, rate_limits=rate_limits,
                     after=after)


def tool_call(
    name: str,
    arguments: JSON | str,
    *,
    call_id: str | None = None,
    usage: Usage | None = DEFAULT_USAGE,
    rate_limits: RateLimits | None = None,
) -> ToolCallReply:
    """A call of tool ``name``; a ``str`` is sent verbatim (to script malformed arguments)."""
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCallReply(
        name=name,
        arguments=raw,
        call_id=call_id or f"call_{uuid.uuid4().hex[:12]}",
        usage=usage,
        rate_limits=rate_limits,
    )


def http_error(
    status: int,
    body: str = '{"error": {"message": "scripted failure", "type": "server_error"}}',
    *,
    rate_limits: RateLimits | None = None,
) -> HttpErrorReply:
    """Answer the request with HTTP ``status`` and ``body`` (JSON content type)."""
    return HttpErrorReply(status=status, body=body, rate_limits=rate_limits)


def failed(
    message: str, *, code: str = "server_error", rate_limits: RateLimits | None = None
) -> FailedReply:
    """A stream ending in ``response.failed`` (Codex: "stream disconnected before completion")."""
    return FailedReply(message=message, code=code, rate_limits=rate_limits)


def stall(text_before: str = "", *, rate_limits: RateLimits | None = None) -> StallReply:
    """Start a message (plus ``text_before`` as one delta), then hold the stream open."""
    return StallReply(text_before=text_before, rate_limits=rate_limits)


# --- the SSE events for a reply -------------------------------------------------------


def _response_object(response_id: str, status: str, **extra: Any) -> JSON:
    return {"id": response_id, "object": "response", "status": status, **extra}


def _message_item(item_id: str, content: str | None) -> JSON:
    done = content is not None
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": "completed" if done else "in_progress",
        "content": [{"type": "output_text", "text": content, "annotations": []}] if done else [],
    }


def _split(text: str, chunks: int) -> list[str]:
    size = max(1, -(-len(text) // chunks))  # ceiling division
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _completed(response_id: str, output: list[JSON], usage: Usage | None) -> JSON:
    response = _response_object(response_id, "completed", output=output)
    if usage is not None:
        response["usage"] = usage.to_json()
    return {"type": "response.completed", "response": response}


def _added(item: JSON) -> JSON:
    return {"type": "response.output_item.added", "output_index": 0, "item": item}


def _done(item: JSON) -> JSON:
    return {"type": "response.output_item.done", "output_index": 0, "item": item}


def _delta(item_id: str, piece: str) -> JSON:
    return {"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
            "content_index": 0, "delta": piece}


def _text_events(reply: TextReply, response_id: str, item_id: str) -> list[JSON]:
    message = _message_item(item_id, reply.text)
    return [
        _added(_message_item(item_id, None)),
        *(_delta(item_id, piece) for piece in _split(reply.text, reply.chunks)),
        _done(message),
        _completed(response_id, [message], reply.usage),
    ]


def _tool_call_events(reply: ToolCallReply, response_id: str, item_id: str) -> list[JSON]:
    call = {"type": "function_call", "id": item_id, "call_id": reply.call_id,
            "name": reply.name, "arguments": reply.arguments, "status": "completed"}
    return [
        _added({**call, "arguments": "", "status": "in_progress"}),
        _done(call),
        _completed(response_id, [call], reply.usage),
    ]


def _failed_events(reply: FailedReply, response_id: str) -> list[JSON]:
    error = {"code": reply.code, "message": reply.message}
    return [{"type": "response.failed",
             "response": _response_object(response_id, "failed", error=error)}]


def _stall_events(reply: StallReply, item_id: str) -> list[JSON]:
    deltas = [_delta(item_id, reply.text_before)] if reply.text_before else []
    return [_added(_message_item(item_id, None)), *deltas]


def _encode(event: JSON) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


# --- the server -----------------------------------------------------------------------


def _require_loopback(host: str) -> None:
    """Raise ``ValueError`` unless ``host`` is a loopback IP literal."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to listen on {host!r}: the fake model server only binds a loopback "
            "IP address (127.0.0.0/8 or ::1)"
        )


class ModelServer:
    """A loopback Responses API server that answers each POST with the next scripted reply.

    Attributes a test reads: ``base_url`` (for the Codex provider), ``requests`` (every
    received JSON body, in order), ``unscripted`` (POSTs that found the script empty and got
    HTTP 500 "script exhausted"), ``stalled`` (set once a ``stall`` reply has written its
    events — written, not yet necessarily read by Codex: wait for the client's
    ``item/agentMessage/delta`` to know the partial message arrived) and ``hung_up`` (set
    when the client closes a stalled stream, as Codex does on ``turn/interrupt``).
    ``timings`` holds, per answered request, when it arrived and when its reply was written
    (``time.monotonic()``): the model's own time, for benchmarks that leave it out.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        _require_loopback(host)
        self._host = host
        self._port = port
        self._script: collections.deque[Reply] = collections.deque()
        self._arrived = asyncio.Condition()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._closed = False
        self._served = 0
        self.requests: list[JSON] = []
        self.timings: list[tuple[float, float]] = []
        self.unscripted = 0
        self.stalled = asyncio.Event()
        self.hung_up = asyncio.Event()

    @property
    def port(self) -> int:
        """The TCP port it listens on (known once started)."""
        if self._runner is None:
            raise RuntimeError("ModelServer.port is only known once the server has started")
        return self._port

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``; Codex appends ``/responses``."""
        if self._runner is None:
            raise RuntimeError("ModelServer.base_url is only known once the server has started")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}/v1"

    def script(self, *replies: Reply) -> None:
        """Queue ``replies``; each POST consumes the oldest one."""
        self._script.extend(replies)

    def discard_pending(self) -> int:
        """Drop the replies nobody asked for (a run stopped early); return how many."""
        dropped = len(self._script)
        self._script.clear()
        return dropped

    @property
    def pending(self) -> int:
        """How many scripted replies have not been consumed yet."""
        return len(self._script)

    async def wait_for_requests(self, count: int, *, timeout_s: float = 10.0) -> list[JSON]:
        """Wait until ``count`` requests have arrived; return the first ``count`` bodies."""
        try:
            async with asyncio.timeout(timeout_s), self._arrived:
                await self._arrived.wait_for(lambda: len(self.requests) >= count)
        except TimeoutError:
            raise TimeoutError(
                f"waited {timeout_s}s for {count} model requests; {len(self.requests)} arrived"
            ) from None
        return self.requests[:count]

    async def start(self) -> None:
        """Bind and start serving."""
        if self._runner is not None:
            raise RuntimeError("ModelServer is already started")
        app = web.Application()
        app.router.add_post("/v1/responses", self._handle_responses)
        # handler_cancellation: a client that hangs up (Codex on turn/interrupt) cancels the
        # handler, which is how a stalled stream learns that nobody is listening any more.
        runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_GRACE_S, access_log=None
        )
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        self._port = runner.addresses[0][1]

    async def close(self) -> None:
        """Release stalled streams, then stop serving (idempotent)."""
        self._closing.set()
        if self._runner is not None and not self._closed:
            self._closed = True
            await self._runner.cleanup()

    async def __aenter__(self) -> ModelServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _record(self, request: web.Request) -> JSON:
        body = await request.json()
        async with self._arrived:
            self.requests.append(body)
            self._arrived.notify_all()
        return body  # type: ignore[no-any-return]  # request.json() is typed Any

    async def _handle_responses(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        await self._record(request)
        if not self._script:
            self.unscripted += 1
            return web.Response(
                status=500,
                text=f"script exhausted: request {len(self.requests)} has no scripted reply",
            )
        reply = self._script.popleft()
        self._served += 1
        serial = self._served  # ids stay distinct while several streams are open
        headers = reply.rate_limits.headers() if reply.rate_limits else {}
        if isinstance(reply, HttpErrorReply):
            return web.Response(
                status=reply.status, text=reply.body, content_type="application/json",
                headers=headers,
            )
        response = await self._stream(request, reply, headers, serial)
        self.timings.append((arrived, time.monotonic()))
        return response

    async def _stream(
        self, request: web.Request, reply: Reply, headers: dict[str, str], serial: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers},
        )
        await response.prepare(request)
        response_id = f"resp_{serial}"
        await response.write(_encode({
            "type": "response.created",
            "response": _response_object(response_id, "in_progress"),
        }))
        match reply:
            case TextReply():
                events = _text_events(reply, response_id, f"msg_{serial}")
            case ToolCallReply():
                events = _tool_call_events(reply, response_id, f"fc_{serial}")
            case FailedReply():
                events = _failed_events(reply, response_id)
            case StallReply():
                events = _stall_events(reply, f"msg_{serial}")
            case _:
                raise AssertionError(f"unexpected reply {reply!r}")
        if isinstance(reply, TextReply) and reply.after is not None:
            await reply.after.wait()
        for event in events:
            await response.write(_encode(event))
        if isinstance(reply, StallReply):
            await self._hold()
        return response

    async def _hold(self) -> None:
        """Keep a stalled stream open until the server closes or the client hangs up."""
        self.stalled.set()
        try:
            await self._closing.wait()
        except asyncio.CancelledError:
            # handler_cancellation: the client closed the connection (Codex on interrupt).
            self.hung_up.set()
            raise


# --- standalone mode ------------------------------------------------------------------


def _usage_from_json(raw: Any) -> Usage | None:
    return None if raw is None else Usage(**raw)


def _rate_limits_from_json(raw: JSON) -> RateLimits:
    windows = {name: RateLimitWindow(**raw[name]) for name in ("primary", "secondary")
               if raw.get(name) is not None}
    return RateLimits(**windows)


_KINDS: dict[str, Callable[..., Reply]] = {
    "text": text, "tool_call": tool_call, "http_error": http_error,
    "failed": failed, "stall": stall,
}


def reply_from_json(raw: JSON) -> Reply:
    """Build a reply from ``{"kind": "text" | "tool_call" | ..., <constructor args>}``."""
    fields = dict(raw)
    kind = fields.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"reply kind must be one of {sorted(_KINDS)}, not {kind!r}")
    if "usage" in fields:
        fields["usage"] = _usage_from_json(fields["usage"])
    if fields.get("rate_limits") is not None:
        fields["rate_limits"] = _rate_limits_from_json(fields["rate_limits"])
    try:
        reply: Reply = _KINDS[kind](**fields)
    except TypeError as exc:
        raise ValueError(f"bad {kind!r} reply {raw!r}: {exc}") from None
    return reply


def load_script(path: Path) -> list[Reply]:
    """Read a JSON list of reply objects (see ``reply_from_json``)."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, list):
        raise ValueError(f"{path}: the script must be a JSON list of replies")
    replies = []
    for index, entry in enumerate(raw):
        try:
            replies.append(reply_from_json(entry))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: reply {index}: {exc}") from None
    return replies


async def _serve(replies: list[Reply], host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with ModelServer(host=host, port=port) as server:
        server.script(*replies)
        print(f"listening {server.base_url}", flush=True)
        await stop.wait()
    print(
        f"model server: {len(server.requests)} requests, {server.pending} replies unused, "
        f"{server.unscripted} unscripted",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """Serve a script file until SIGTERM/SIGINT; exit status 0 on a clean stop."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.model_server",
        description="Serve a scripted OpenAI Responses API on loopback, for Codex.",
    )
    parser.add_argument("--script", type=Path, required=True, help="JSON list of replies")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1", help="a loopback IP address")
    args = parser.parse_args(argv)
    try:
        _require_loopback(args.host)
        replies = load_script(args.script)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    asyncio.run(_serve(replies, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
