"""A thousand malformed requests against the real ``bothy serve`` (issue 10, items 3, 8, 9).

Through a real daemon subprocess on loopback: bad and missing signatures, a wrong secret,
truncated, non-JSON, arrays, huge, deeply nested, invalid UTF-8, bad headers, requests the
HTTP parser rejects, unknown routes and methods, slow senders on the public door, fifty at
once. What is checked is what a sender hears (each kind its own status), what the register
keeps (every refusal recorded, or counted by kind in a ``webhook suppressed`` record), that
nothing ran, that the log holds no traceback, and that the daemon still serves a valid
delivery afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fakes import github
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import DEADLINE_S, Shell
from tests.fakes.site import Site
from tests.test_serve import (
    HOOK_PATH,
    SECRET,
    delivery_of,
    free_port,
    queued,
    records,
    serve_site,
    start_serve,
    until_count,
)

LIMIT_BYTES = 16_384
PUBLIC_PATH = "/hooks/public"
CONCURRENCY = 50


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", SECRET)


@dataclass(frozen=True)
class Kind:
    """One kind of bad request: how many to send, and the status each must hear."""

    name: str
    count: int
    status: int  # the status recorded
    send: Callable[[int], Awaitable[int]]  # port -> the status heard (0: no answer)
    heard: int | None = None  # when the sender cannot hear ``status``

    @property
    def answer(self) -> int:
        return self.status if self.heard is None else self.heard


def _signed(body: bytes, **changes: str | None) -> dict[str, str]:
    headers = github.headers("pull_request", body, SECRET)
    for name, value in changes.items():
        header = name.replace("_", "-")
        if value is None:
            headers.pop(header)
        else:
            headers[header] = value
    return headers


async def _raw(port: int, data: bytes, *, hang_up: bool = False) -> int:
    """Send ``data`` on a raw connection; the status of the answer (0 if none came)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if hang_up:
            writer.write_eof()
        async with asyncio.timeout(DEADLINE_S):
            answer = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _kinds(client: httpx.AsyncClient, tailnet: int, public: int) -> list[Kind]:
    valid = github.encode(github.pull_request_opened(7))
    nested = b'{"action": "opened", "x": ' + b"[" * 1_000 + b"]" * 1_000 + b"}"
    huge = github.encode(github.pull_request_opened(7, body="x" * (LIMIT_BYTES + 1)))

    def post(body: bytes, headers: Callable[[], dict[str, str]], *, path: str = HOOK_PATH,
             method: str = "POST") -> Callable[[int], Awaitable[int]]:
        async def send(port: int) -> int:
            answer = await client.request(method, f"http://127.0.0.1:{port}{path}",
                                          content=body, headers=headers())
            return answer.status_code
        return send

    def signed(body: bytes) -> Callable[[int], Awaitable[int]]:
        return post(body, lambda: _signed(body))

    async def chunked(port: int) -> int:
        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(huge), 4096):
                yield huge[start:start + 4096]
        answer = await client.post(f"http://127.0.0.1:{port}{HOOK_PATH}", content=chunks(),
                                   headers=_signed(huge))
        return answer.status_code

    def head(body_length: int, path: str = HOOK_PATH) -> bytes:
        lines = "".join(f"{k}: {v}\r\n" for k, v in _signed(valid).items())
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{lines}"
                f"Content-Length: {body_length}\r\n\r\n").encode()

    async def truncated(port: int) -> int:
        return await _raw(port, head(len(valid)) + valid[:50], hang_up=True)

    def parser(data: bytes) -> Callable[[int], Awaitable[int]]:
        async def send(port: int) -> int:
            return await _raw(port, data)
        return send

    async def slow_headers(_: int) -> int:
        return await _raw(public, b"POST /hooks/public HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Git")

    async def slow_body(_: int) -> int:
        return await _raw(public, head(len(valid), PUBLIC_PATH) + valid[:50])

    request_line = b"POST /hooks/github HTTP/1.1\r\n"
    return [
        Kind("wrong secret", 160, 401,
             post(valid, lambda: github.headers("pull_request", valid, "not-the-secret"))),
        Kind("missing signature", 60, 401, post(valid, lambda: _signed(
            valid, X_Hub_Signature_256=None))),
        Kind("malformed signature", 60, 401, post(valid, lambda: _signed(
            valid, X_Hub_Signature_256="sha256=zz"))),
        Kind("tampered body", 40, 401, post(valid.replace(b"Fix", b"Fux"), lambda: _signed(
            valid))),
        Kind("truncated (the sender hangs up)", 40, 400, truncated, heard=0),
        Kind("not JSON", 60, 400, signed(b"payload=%7B%7D")),
        Kind("array", 60, 400, signed(b'[{"action": "opened"}]')),
        Kind("invalid UTF-8", 60, 400, signed(b'{"action": "opened", "t": "\xff\xfe"}')),
        Kind("nested 1,000 deep", 80, 400, signed(nested)),
        Kind("huge, declared", 30, 413, signed(huge)),
        Kind("huge, chunked", 20, 413, chunked),
        Kind("missing event", 50, 400, post(valid, lambda: _signed(valid, X_GitHub_Event=None))),
        Kind("malformed delivery", 40, 400, post(valid, lambda: _signed(
            valid, X_GitHub_Delivery="has space"))),
        Kind("unknown route", 80, 404, post(valid, lambda: _signed(valid),
                                           path="/hooks/nowhere")),
        Kind("wrong method", 60, 405, post(b"", lambda: _signed(valid), method="PUT")),
        Kind("10 KB header", 40, 400, parser(request_line + b"X-Big: " + b"a" * 10_240
                                             + b"\r\n\r\n")),
        Kind("bare CR", 30, 400, parser(b"POST /hooks/github HTTP/1.1\rHost: x\r\n\r\n")),
        Kind("NUL in a header", 30, 400, parser(request_line + b"Host: a\x00b\r\n\r\n")),
        Kind("slow headers (public door)", 3, 408, slow_headers),
        Kind("slow body (public door)", 3, 408, slow_body),
    ]


@pytest.mark.codex
@pytest.mark.timeout(180)
async def test_a_thousand_malformed_requests_run_nothing_and_leave_serve_serving(
    server: ModelServer, tmp_path: Path
) -> None:
    """~1,000 malformed requests, fifty at once: each kind hears its status, every refusal is
    recorded or counted by kind, nothing runs, no traceback is logged, and a valid delivery
    afterwards runs to completion."""
    public_port = free_port()
    site = serve_site(tmp_path, server, listen={"public_port": public_port},
                      webhooks={"public": {"path": PUBLIC_PATH, "public": True,
                                           "secret_env": ["GH_SECRET"], "jobs": []}})
    site.config["webhooks"]["github"]["max_body_bytes"] = LIMIT_BYTES
    site.write_config(site.config)
    server.script(text("Reviewed."))
    gate = asyncio.Semaphore(CONCURRENCY)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as client:
            kinds = _kinds(client, serving.port, public_port)

            async def one(kind: Kind) -> tuple[str, int]:
                async with gate:
                    return kind.name, await kind.send(serving.port)

            heard = await asyncio.gather(*(one(kind) for kind in kinds
                                           for _ in range(kind.count)))
        delivery = await queued(serving, github.pull_request_opened(8), str(uuid.uuid4()))
        [finished] = await until_count(site, "run", "finished", "ok", 1)
        code = await serving.stop()
        done = await serving.command.finish()

    assert sum(kind.count for kind in kinds) >= 1_000
    assert Counter(heard) == Counter({(kind.name, kind.answer): kind.count for kind in kinds})
    assert code == 0
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) < 20, done.stderr
    assert delivery_of(site) == {str(finished.run_id): delivery}
    assert len(records(site, "run", "started")) == 1
    sent = Counter[int]()
    for kind in kinds:
        sent[kind.status] += kind.count
    assert _refusals_by_status(site) == sent


def _refusals_by_status(site: Site) -> Counter[int]:
    """Refusals the register accounts for: one record each, or a count in a summary."""
    counted = Counter[int]()
    for record in records(site, "webhook", "refused"):
        counted[int(record.details["status"])] += 1  # type: ignore[call-overload]
    for summary in records(site, "webhook", "suppressed"):
        kinds = summary.details["kinds"]
        assert isinstance(kinds, dict)
        for kind, count in kinds.items():
            counted[int(kind.split(" ", 1)[0])] += count
    return counted
