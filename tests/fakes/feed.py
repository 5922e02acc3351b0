"""A polled HTTP source on loopback: a JSON list behind an ETag, as a real feed serves it.

``GET /feed`` answers ``200`` with the JSON body, an ``ETag`` (a hash of the body) and a
``Last-Modified``; a request whose ``If-None-Match`` names the current ETag gets ``304`` with
no body (RFC 9110 §13.1.2). The test changes what it serves and how it fails::

    async with FeedServer() as feed:
        feed.items = [{"id": 1, "title": "first"}]
        ...  # poll feed.url
        feed.append({"id": 2, "title": "second"})
        feed.fail_with = 503                # every answer is a 503 until set back to None
        feed.raw_body = b"<html>oops"       # served as is, instead of the JSON list
        feed.hang = True                    # requests wait until the server closes
        await feed.wait_for_requests(3)

Every request is kept (``requests``: the headers it carried), so a test can see the
conditional headers and the token the poller sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

LAST_MODIFIED = "Wed, 23 Sep 2026 10:00:00 GMT"


@dataclass(frozen=True)
class Seen:
    """One request as the feed saw it, and what it answered."""

    headers: dict[str, str]
    status: int

    @property
    def conditional(self) -> bool:
        return "if-none-match" in self.headers or "if-modified-since" in self.headers


class FeedServer:
    """A JSON feed at ``url`` with ETags, 304s, and failures on demand."""

    def __init__(self) -> None:
        self.items: Any = []
        self.etags = True
        self.fail_with: int | None = None
        self.raw_body: bytes | None = None
        self.hang = False
        self.requests: list[Seen] = []
        self._arrived = asyncio.Condition()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}/feed"

    def append(self, item: dict[str, Any]) -> None:
        self.items = [*self.items, item]

    @property
    def not_modified(self) -> int:
        """How many requests were answered 304."""
        return sum(1 for seen in self.requests if seen.status == 304)

    async def wait_for_requests(self, count: int, *, timeout_s: float = 10.0) -> None:
        """Wait until ``count`` requests have been answered (or are hanging)."""
        async with asyncio.timeout(timeout_s), self._arrived:
            await self._arrived.wait_for(lambda: len(self.requests) >= count)

    def body(self) -> bytes:
        if self.raw_body is not None:
            return self.raw_body
        return json.dumps(self.items).encode()

    def etag(self) -> str:
        return '"' + hashlib.sha256(self.body()).hexdigest()[:16] + '"'

    async def __aenter__(self) -> FeedServer:
        app = web.Application()
        app.router.add_get("/feed", self._handle)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0,
                               access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        self._port = runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        status = self._status(request)
        async with self._arrived:
            self.requests.append(Seen({k.lower(): v for k, v in request.headers.items()},
                                      status))
            self._arrived.notify_all()
        if self.hang:
            await self._closing.wait()
        if status == 304:
            return web.Response(status=304, headers={"ETag": self.etag()})
        if status != 200:
            return web.Response(status=status, text="the feed is having a bad day")
        headers = {"Last-Modified": LAST_MODIFIED, "Content-Type": "application/json"}
        if self.etags:
            headers["ETag"] = self.etag()
        return web.Response(body=self.body(), headers=headers)

    def _status(self, request: web.Request) -> int:
        if self.fail_with is not None:
            return self.fail_with
        if self.etags and request.headers.get("If-None-Match") == self.etag():
            return 304
        return 200
