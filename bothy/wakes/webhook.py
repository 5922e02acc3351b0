"""The webhook listener: signed deliveries in, durable wakes out (SPEC §5; rules 3, 4 and 6).

``bothy serve`` runs one listener for the tailnet door and, when a public route is configured,
a second one on its own port (Funnel applies to a port, not a path: there the signature is the
whole security). Each listener serves only the routes on its side.

What a sender hears, checked in this order:

====  ===============================================================================
404   no route at this path (on this listener)
405   a method other than POST
413   a declared Content-Length over the route's ``max_body_bytes`` (nothing is read)
400   a missing or malformed event or delivery-id header
503   no secret is configured for the route (none of its ``secret_env`` variables is set)
401   no signature header
413   a body found, while reading it in chunks, to run past ``max_body_bytes``
400   a body cut short (the sender hung up)
401   a malformed or wrong signature (HMAC-SHA256 over the raw body, any configured secret)
400   a body that is not a JSON object
200   ``ping`` (GitHub): audited, not queued
200   queued: the delivery is durable (see ``bothy.wakes.inbox``) — or a duplicate, not queued
      again (the sender did nothing wrong)
503   the delivery could not be made durable: the sender should retry
====  ===============================================================================

Every answer other than 200 leaves one audit record (``webhook refused``, or ``webhook
misconfigured`` for a missing secret) with the route, status, reason, delivery id and remote
address, at most ``_REFUSALS_PER_WINDOW`` per route per window; the rest are counted and
summarised in one ``webhook suppressed`` record when the window rolls (or the listener
stops), so a flood cannot fill the disk. An accepted delivery is not audited here: the
dispatcher records ``wake received`` from the durable file. Nothing here starts a run, and
neither a secret nor a body is ever logged or audited.

No aiohttp type or exception leaves this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aiohttp import ClientPayloadError, web

from bothy.clock import Clock, from_us, to_us
from bothy.config import WebhookRoute
from bothy.engine.audit import AuditLog
from bothy.errors import BothyError, InboxError, ListenerError
from bothy.wakes.inbox import Accepted, Delivery, Inbox

_UNKNOWN_ROUTE = "-"  # one refusal bucket for every path that names no route
_REFUSALS_PER_WINDOW = 20
_REFUSAL_WINDOW_US = 60 * 1_000_000
_READ_CHUNK_BYTES = 64 * 1024
_THREAD_WORK_BYTES = 256 * 1024  # hash and parse bigger bodies off the event loop
_SHUTDOWN_S = 10.0  # GitHub gives up on a delivery after 10 s anyway (contracts.md §1.3)
_SIGNATURE = re.compile(r"sha256=([0-9a-fA-F]{64})")
_DELIVERY_ID = re.compile(r"[\x21-\x7e]{1,200}")  # visible ASCII: a GUID, or a sender's id
_EVENT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_ACTION_MAX_CHARS = 100
_PRIVATE_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
_GITHUB_EVENT = "X-GitHub-Event"
_GITHUB_DELIVERY = "X-GitHub-Delivery"
_GITHUB_HOOK_ID = "X-GitHub-Hook-ID"
_GITHUB_SIGNATURE = "X-Hub-Signature-256"

_log = logging.getLogger(__name__)


class _State(enum.StrEnum):
    NEW = "new"
    LISTENING = "listening"
    STOPPED = "stopped"


@dataclass(frozen=True)
class _Refusal:
    """Why a delivery is turned away: what the audit says and what the sender hears."""

    status: int
    reason: str
    answer: str
    delivery: str | None = None
    event: str = "refused"
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        return "failed" if self.status >= 500 else "refused"


@dataclass(frozen=True)
class _Envelope:
    """What a delivery's headers say about it, before its body is trusted."""

    event: str
    delivery_id: str
    key: str
    hook_id: str | None
    signature: str | None


@dataclass
class _Window:
    started_us: int
    recorded: int = 0
    suppressed: int = 0


class _RefusalLimiter:
    """At most ``limit`` refusal records per bucket per fixed window; the rest are counted."""

    def __init__(self, limit: int, window_us: int) -> None:
        self._limit = limit
        self._window_us = window_us
        self._windows: dict[str, _Window] = {}

    def admit(self, bucket: str, now_us: int) -> tuple[bool, dict[str, Any] | None]:
        """Whether to record this refusal, and the summary of a window that just rolled."""
        window = self._windows.get(bucket)
        summary = None
        if window is None or now_us - window.started_us >= self._window_us:
            if window is not None:
                summary = self._summary(window, now_us)
            window = self._windows[bucket] = _Window(now_us)
        if window.recorded < self._limit:
            window.recorded += 1
            return True, summary
        window.suppressed += 1
        return False, summary

    def drain(self, now_us: int) -> dict[str, dict[str, Any]]:
        """Summaries of every window with suppressed refusals; forget all windows."""
        summaries = {bucket: self._summary(window, now_us)
                     for bucket, window in self._windows.items()}
        self._windows.clear()
        return {bucket: summary for bucket, summary in summaries.items() if summary is not None}

    def _summary(self, window: _Window, now_us: int) -> dict[str, Any] | None:
        if not window.suppressed:
            return None
        return {"suppressed": window.suppressed, "recorded": window.recorded,
                "since": from_us(window.started_us).isoformat(),
                "until": from_us(now_us).isoformat()}


class WebhookListener:
    """An aiohttp listener serving the signed routes whose ``public`` flag matches its own."""

    def __init__(
        self,
        routes: Mapping[str, WebhookRoute],
        *,
        public: bool,
        inbox: Inbox,
        audit: AuditLog,
        environ: Mapping[str, str],
        clock: Clock,
        on_accepted: Callable[[], None] | None = None,
    ) -> None:
        self._routes = {route.path: (name, route) for name, route in routes.items()
                        if route.public == public}
        self._public = public
        self._inbox = inbox
        self._audit = audit
        self._environ = environ
        self._clock = clock
        self._on_accepted = on_accepted
        self._limiter = _RefusalLimiter(_REFUSALS_PER_WINDOW, _REFUSAL_WINDOW_US)
        self._runner: web.ServerRunner | None = None
        self._state = _State.NEW

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0: any free port); return the port bound.

        Raises ListenerError naming host:port if it cannot bind.
        """
        if self._state is not _State.NEW:
            raise RuntimeError(f"Cannot start a webhook listener that is {self._state}")
        runner = web.ServerRunner(web.Server(self._handle, access_log=None),
                                  shutdown_timeout=_SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            door = "public" if self._public else "tailnet"
            raise ListenerError(
                f"Cannot listen for webhooks ({door}) on {host}:{port}: {exc.strerror or exc}",
                host=host, port=port,
            ) from exc
        self._runner = runner
        self._state = _State.LISTENING
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop intake: finish requests under way (bounded), then summarise suppressed refusals."""
        if self._state is not _State.LISTENING or self._runner is None:
            return
        self._state = _State.STOPPED
        await self._runner.cleanup()
        self._runner = None
        for bucket, summary in self._limiter.drain(to_us(self._clock())).items():
            await self._record_suppressed(bucket, summary)

    # -- one request -----------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        received_at = self._clock()
        found = self._routes.get(request.path)
        if found is None:
            path = request.path[:200]
            return await self._refuse(request, None, _Refusal(
                404, f"no route at {path!r}", "no webhook route here"))
        name, route = found
        answer = await self._receive(request, name, route, received_at)
        if isinstance(answer, _Refusal):
            return await self._refuse(request, name, answer)
        return answer

    async def _receive(
        self, request: web.BaseRequest, name: str, route: WebhookRoute, received_at: datetime
    ) -> web.StreamResponse | _Refusal:
        """Check, read, verify, parse, then store: each step may refuse."""
        if request.method != "POST":
            return _Refusal(405, f"method {request.method[:20]} is not POST", "use POST",
                            headers={"Allow": "POST"})
        declared = request.content_length
        if declared is not None and declared > route.max_body_bytes:
            return _too_large(declared, route)
        envelope = _envelope(route, request)
        if isinstance(envelope, _Refusal):
            return envelope
        keys = _secrets(route, self._environ)
        if not keys:
            return _Refusal(503, "no secret is configured: none of "
                            f"{', '.join(route.secret_env)} is set", "webhook not configured",
                            delivery=envelope.delivery_id, event="misconfigured")
        if envelope.signature is None:
            return _Refusal(401, f"no {_signature_header(route)} header", "signature required",
                            delivery=envelope.delivery_id)
        await _continue(request)
        body = await _read_body(request, route)
        if isinstance(body, _Refusal):
            return _with_delivery(body, envelope.delivery_id)
        if len(body) > _THREAD_WORK_BYTES:
            payload = await asyncio.to_thread(_verify_and_parse, body, envelope, keys)
        else:
            payload = _verify_and_parse(body, envelope, keys)
        if isinstance(payload, _Refusal):
            return _with_delivery(payload, envelope.delivery_id)
        if route.kind == "github" and envelope.event == "ping":
            return await self._ping(request, name, envelope)
        delivery = Delivery(route=name, key=envelope.key, event=envelope.event,
                            action=_action(payload), headers=_kept_headers(request),
                            body=body, received_at=received_at)
        return await self._store(delivery, envelope)

    async def _store(
        self, delivery: Delivery, envelope: _Envelope
    ) -> web.StreamResponse | _Refusal:
        try:
            outcome = await self._inbox.accept(delivery)
        except InboxError as exc:
            return _Refusal(503, f"cannot be made durable: {exc}", "not stored; retry later",
                            delivery=envelope.delivery_id)
        if isinstance(outcome, Accepted):
            if self._on_accepted is not None:
                self._on_accepted()
            return web.json_response({"status": "queued", "delivery": envelope.delivery_id})
        return web.json_response({"status": "duplicate", "delivery": envelope.delivery_id})

    async def _ping(
        self, request: web.BaseRequest, name: str, envelope: _Envelope
    ) -> web.StreamResponse:
        await self._record("ping", "ok", name, {
            "route": name, "delivery": envelope.delivery_id, "hook_id": envelope.hook_id,
            "remote": request.remote,
        })
        return web.json_response({"status": "ok", "event": "ping"})

    async def _refuse(
        self, request: web.BaseRequest, name: str | None, refusal: _Refusal
    ) -> web.StreamResponse:
        bucket = name or _UNKNOWN_ROUTE
        write, rolled = self._limiter.admit(bucket, to_us(self._clock()))
        if rolled is not None:
            await self._record_suppressed(bucket, rolled)
        if write:
            details: dict[str, Any] = {
                "route": name, "status": refusal.status, "reason": refusal.reason,
                "delivery": refusal.delivery, "remote": request.remote,
            }
            forwarded = request.headers.get("X-Forwarded-For")
            if forwarded:
                details["forwarded_for"] = forwarded[:200]
            await self._record(refusal.event, refusal.outcome, name, details)
        return web.json_response({"error": refusal.answer}, status=refusal.status,
                                 headers=dict(refusal.headers))

    async def _record_suppressed(self, bucket: str, summary: dict[str, Any]) -> None:
        name = None if bucket == _UNKNOWN_ROUTE else bucket
        await self._record("suppressed", "refused", name, {"route": name, **summary})

    async def _record(
        self, event: str, outcome: str, name: str | None, details: dict[str, Any]
    ) -> None:
        """Audit, but never let a failing register turn a refusal into a 500."""
        try:
            await self._audit.record("webhook", event, outcome, subject=_subject(name),
                                     details=details)
        except BothyError as exc:
            _log.error("webhook: cannot audit %s %s for route %s: %s", event, outcome, name, exc)


# -- steps (pure, or reading the request) ------------------------------------------------------


def _envelope(route: WebhookRoute, request: web.BaseRequest) -> _Envelope | _Refusal:
    headers = request.headers
    if route.kind == "github":
        event_header, delivery_header = _GITHUB_EVENT, _GITHUB_DELIVERY
    else:
        event_header, delivery_header = route.event_header, route.delivery_header
    event = headers.get(event_header)
    delivery_id = headers.get(delivery_header)
    if event is None or delivery_id is None:
        missing = event_header if event is None else delivery_header
        return _Refusal(400, f"no {missing} header", f"missing header {missing}")
    for header, value, pattern in ((event_header, event, _EVENT_NAME),
                                   (delivery_header, delivery_id, _DELIVERY_ID)):
        if not pattern.fullmatch(value):
            return _Refusal(400, f"malformed {header} header", f"malformed header {header}")
    hook_id = headers.get(_GITHUB_HOOK_ID) if route.kind == "github" else None
    if hook_id is not None and not _DELIVERY_ID.fullmatch(hook_id):
        return _Refusal(400, f"malformed {_GITHUB_HOOK_ID} header",
                        f"malformed header {_GITHUB_HOOK_ID}", delivery=delivery_id)
    # The GUID names the event, shared by every hook it is sent to (contracts.md §1.5).
    key = f"{delivery_id}:{hook_id or '-'}" if route.kind == "github" else delivery_id
    return _Envelope(event=event, delivery_id=delivery_id, key=key, hook_id=hook_id,
                     signature=headers.get(_signature_header(route)))


def _signature_header(route: WebhookRoute) -> str:
    return _GITHUB_SIGNATURE if route.kind == "github" else route.signature_header


def _secrets(route: WebhookRoute, environ: Mapping[str, str]) -> list[bytes]:
    """The route's secrets that are set; an unset or empty variable is no secret."""
    return [value.encode() for name in route.secret_env if (value := environ.get(name, ""))]


async def _continue(request: web.BaseRequest) -> None:
    """Answer ``Expect: 100-continue`` (curl sends it for bodies over 1 KiB) once the headers
    have passed, so the sender need not wait a second before sending the body. The bare
    low-level server does not do it for us, unlike aiohttp's router."""
    if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
        with contextlib.suppress(ConnectionError):  # then reading the body says so
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


async def _read_body(request: web.BaseRequest, route: WebhookRoute) -> bytes | _Refusal:
    """The raw body, read in chunks and never past ``max_body_bytes`` + one chunk."""
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.read(_READ_CHUNK_BYTES):
            size += len(chunk)
            if size > route.max_body_bytes:
                return _too_large(size, route, at_least=True)
            chunks.append(chunk)
    except (ClientPayloadError, ConnectionError, asyncio.IncompleteReadError) as exc:
        return _Refusal(400, f"body could not be read: {type(exc).__name__}",
                        "body could not be read")
    return b"".join(chunks)


def _too_large(size: int, route: WebhookRoute, *, at_least: bool = False) -> _Refusal:
    figure = f"at least {size:,}" if at_least else f"{size:,}"
    return _Refusal(413, f"body of {figure} bytes is over the route's limit of"
                    f" {route.max_body_bytes:,}", "body too large")


def _verify_and_parse(
    body: bytes, envelope: _Envelope, keys: list[bytes]
) -> dict[str, Any] | _Refusal:
    """Check the signature over the raw bytes received, and only then parse them."""
    match = _SIGNATURE.fullmatch(envelope.signature or "")
    if match is None:
        return _Refusal(401, "signature is not of the form sha256=<64 hex>", "bad signature")
    given = match.group(1).lower().encode("ascii")
    matched = False
    for key in keys:  # every key is tried: how many were tried does not show in the timing
        expected = hmac.new(key, body, hashlib.sha256).hexdigest().encode("ascii")
        matched |= hmac.compare_digest(expected, given)
    if not matched:
        return _Refusal(401, "signature does not match the body", "bad signature")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return _Refusal(400, "body is not JSON (is the webhook's content type"
                        " application/json?)", "body is not JSON")
    if not isinstance(payload, dict):
        return _Refusal(400, f"body is JSON but not an object ({type(payload).__name__})",
                        "body is not a JSON object")
    return payload


def _action(payload: Mapping[str, Any]) -> str | None:
    action = payload.get("action")
    if isinstance(action, str) and 0 < len(action) <= _ACTION_MAX_CHARS:
        return action
    return None


def _kept_headers(request: web.BaseRequest) -> dict[str, str]:
    return {name.lower(): value for name, value in request.headers.items()
            if name.lower() not in _PRIVATE_HEADERS}


def _with_delivery(refusal: _Refusal, delivery_id: str) -> _Refusal:
    return _Refusal(refusal.status, refusal.reason, refusal.answer, delivery=delivery_id,
                    event=refusal.event, headers=refusal.headers)


def _subject(name: str | None) -> str | None:
    """The route name as the audit subject, if it is a single printable token."""
    if name and " " not in name and name.isprintable():
        return name
    return None
