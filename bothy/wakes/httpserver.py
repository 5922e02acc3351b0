"""The HTTP server under the webhook listener: aiohttp's low-level server, with deadlines.

aiohttp by itself waits for a request's headers as long as a sender cares to trickle them
(slowloris), and writes a full traceback to the log for every request its parser rejects
before any handler runs (a 10 KB header line, a bare CR, a NUL). :class:`HttpServer` bounds
the first: a connection whose first request's headers are not all in within ``headers_s`` is
answered 408 and closed, and so is an idle keep-alive connection after the same delay. It
turns the second into values: every request rejected before the handler, and every slow
sender cut off, is reported to ``on_rejected`` as a :class:`Rejected`, and nothing is logged
by aiohttp for it. Deciding what to log and audit is the listener's.

No aiohttp type leaves this module other than through the listener that builds on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

_IDLE_AFTER_S = 1.0
_LINGER_S = 2.0  # how long an unread body may still be drained after the answer
_TIMED_OUT_BODY = b'{"error": "request headers too slow"}'
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(_TIMED_OUT_BODY), _TIMED_OUT_BODY))


@dataclass(frozen=True)
class ReadDeadlines:
    """How long a sender may take over a request's headers, and then over its body."""

    headers_s: float
    body_s: float


@dataclass(frozen=True)
class Rejected:
    """A request turned away before Bothy's handler saw it."""

    status: int
    reason: str  # the parser's error class, or what was too slow; never request content
    remote: str | None


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class HttpServer(web.Server):
    """A low-level aiohttp server whose connections keep to a header deadline."""

    def __init__(
        self, handler: Handler, *, headers_s: float, on_rejected: Callable[[Rejected], None],
    ) -> None:
        # aiohttp's own idle timer closes keep-alive connections between requests; for the
        # first request it runs a little later than ours, so ours answers and reports.
        super().__init__(_began(handler), access_log=None,
                         keepalive_timeout=headers_s + _IDLE_AFTER_S,
                         lingering_time=_LINGER_S, auto_decompress=False,
                         logger=logging.getLogger(__name__))
        self._headers_s = headers_s
        self._on_rejected = on_rejected

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, headers_s=self._headers_s,
                           on_rejected=self._on_rejected, **self._kwargs)


def _began(handler: Handler) -> Handler:
    async def began(request: web.BaseRequest) -> web.StreamResponse:
        if isinstance(request.protocol, _Connection):
            request.protocol.headers_arrived()
        return await handler(request)
    return began


class _Connection(RequestHandler):
    """One connection: a deadline on its first headers, and rejections reported, not logged."""

    def __init__(
        self, manager: web.Server, *, headers_s: float,
        on_rejected: Callable[[Rejected], None], **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._headers_s = headers_s
        self._report = on_rejected
        self._headers_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._headers_timer = asyncio.get_running_loop().call_later(
            self._headers_s, self._headers_overdue)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.headers_arrived()
        super().connection_lost(exc)

    def headers_arrived(self) -> None:
        """The first request is in (or the connection is gone): its deadline no longer runs."""
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_overdue(self) -> None:
        self._headers_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._report(Rejected(408, f"request headers not received within {self._headers_s:g} s",
                              _peer(transport)))
        with contextlib.suppress(OSError, RuntimeError):
            transport.write(_TIMED_OUT)
        self.force_close()

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (4xx) or a handler that raised."""
        self.headers_arrived()
        if status >= 500:  # a handler that raised is a bug in Bothy: keep aiohttp's traceback
            return super().handle_error(request, status, exc, message)
        reason = f"malformed request ({type(exc).__name__ if exc else 'unreadable'})"
        self._report(Rejected(status, reason, request.remote))
        response = web.json_response({"error": "malformed request"}, status=status)
        response.force_close()
        return response


def _peer(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return None
