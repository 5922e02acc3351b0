"""The webhook listener: signed deliveries in, durable wakes out (SPEC §5; rules 3, 4 and 6).

``bothy serve`` runs one listener for the tailnet door and, when a public route is configured,
a second one on its own port (Funnel applies to a port, not a path: there the signature is the
whole security). Each listener serves only the routes on its side.

What a sender hears, checked in this order:

====  ===============================================================================
408   request headers not all in within the door's deadline (10 s tailnet, 5 s public):
      answered and closed by ``bothy.wakes.httpserver`` before any route is looked at
400   a request aiohttp's parser rejects (a header line over 8 KB, a bare CR, a NUL...)
404   no route at this path (on this listener)
405   a method other than POST
413   a declared Content-Length over the route's ``max_body_bytes`` (nothing is read)
400   a missing or malformed event or delivery-id header
503   no secret is configured for the route (none of its ``secret_env`` variables is set)
401   no signature header
413   a body found, while reading it in chunks, to run past ``max_body_bytes``
408   a body not all in within the door's deadline (20 s tailnet, 10 s public)
400   a body cut short (the sender hung up)
401   a malformed or wrong signature (HMAC-SHA256 over the raw body, any configured secret)
400   a body that is not an acceptable JSON object: not JSON, not UTF-8, not an object,
      nested deeper than 100 levels, or holding a string no UTF-8 encoder takes
200   ``ping`` (GitHub): audited, not queued
200   queued: the delivery is durable (see ``bothy.wakes.inbox``); or ignored: durable, and
      closed at once because no job wants it (``wake ignored`` recorded, nothing queued);
      or a duplicate, not queued again (the sender did nothing wrong)
503   the delivery could not be made durable: the sender should retry (the only 5xx for
      anything a sender sent)
====  ===============================================================================

Every answer other than 200 leaves one audit record (``webhook refused``, or ``webhook
misconfigured`` for a missing secret) with the route, status, reason, delivery id (whenever
the sender sent a well-formed one, whatever the refusal) and remote address, at most
``_REFUSALS_PER_WINDOW`` per route per window; the rest are counted by kind (``"401 bad
signature": 78``) and summarised in one ``webhook suppressed`` record when the window rolls
(or the listener stops), so a flood cannot fill the disk. Requests refused before any route
is known (404, and those the parser rejects or that were too slow) share the ``-`` bucket;
those turned away before the handler are also logged, one line a window, never a traceback.
An accepted delivery is not audited here: the dispatcher records ``wake received`` from the
durable payload; one no job wants is recorded ``wake ignored`` by the inbox, in the commit
that makes it durable. Nothing here starts a run, and neither a secret nor a body is ever logged or
audited.

No aiohttp type or exception leaves this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from aiohttp import ClientPayloadError, web

from bothy.clock import Clock, to_us
from bothy.config import WebhookRoute
from bothy.engine.audit import AuditLog
from bothy.errors import BothyError, InboxError, ListenerError
from bothy.wakes.delivery import Delivery
from bothy.wakes.httpserver import HttpServer, ReadDeadlines, Rejected
from bothy.wakes.inbox import Accepted, Inbox
from bothy.wakes.jobs import Ignored, unwanted
from bothy.wakes.jsonbody import Unacceptable, parse_body
from bothy.wakes.refusals import Refusal, RefusalLimiter

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
_CLOSING_STATUSES = frozenset({408, 413})
# A sender that cannot get its headers out in seconds is not GitHub; the public (Funnel)
# door, open to anyone, is held to the shorter deadlines.
TAILNET_DEADLINES = ReadDeadlines(headers_s=10.0, body_s=20.0)
PUBLIC_DEADLINES = ReadDeadlines(headers_s=5.0, body_s=10.0)
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
class _Envelope:
    """What a delivery's headers say about it, before its body is trusted."""

    event: str
    delivery_id: str
    key: str
    hook_id: str | None
    signature: str | None


class Pages(Protocol):
    """Read-only pages sharing the tailnet door (``bothy.web``): the paths they own, once no
    webhook route has the path, are handed to them untouched and never audited here."""

    def owns(self, path: str) -> bool: ...

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse: ...


class WebhookListener:
    """An aiohttp listener serving the signed routes whose ``public`` flag matches its own
    (and, on the tailnet door only, ``pages``)."""

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
        deadlines: ReadDeadlines | None = None,
        pages: Pages | None = None,
    ) -> None:
        if public and pages is not None:
            raise ValueError("the pages are never served on the public (Funnel) listener")
        self._pages = pages
        self._routes = {route.path: (name, route) for name, route in routes.items()
                        if route.public == public}
        # Any delivery-id header a configured route reads, to name a delivery sent elsewhere.
        self._delivery_headers = tuple(dict.fromkeys(
            [_GITHUB_DELIVERY, *(route.delivery_header for route in routes.values()
                                 if route.kind != "github")]))
        self._public = public
        self._inbox = inbox
        self._audit = audit
        self._environ = environ
        self._clock = clock
        self._on_accepted = on_accepted
        self._deadlines = deadlines or (PUBLIC_DEADLINES if public else TAILNET_DEADLINES)
        self._limiter = RefusalLimiter(_REFUSALS_PER_WINDOW, _REFUSAL_WINDOW_US)
        self._log_limiter = RefusalLimiter(1, _REFUSAL_WINDOW_US)  # one log line a window
        self._pending: set[asyncio.Task[None]] = set()  # refusal records of rejected requests
        self._runner: web.ServerRunner | None = None
        self._state = _State.NEW

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0: any free port); return the port bound.

        Raises ListenerError naming host:port if it cannot bind.
        """
        if self._state is not _State.NEW:
            raise RuntimeError(f"Cannot start a webhook listener that is {self._state}")
        server = HttpServer(self._handle, headers_s=self._deadlines.headers_s,
                            on_rejected=self._rejected)
        runner = web.ServerRunner(server, shutdown_timeout=_SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise ListenerError(
                f"Cannot listen for webhooks ({self._door}) on {host}:{port}:"
                f" {exc.strerror or exc}", host=host, port=port,
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
        while self._pending:
            await asyncio.gather(*self._pending)
        now_us = to_us(self._clock())
        for bucket, summary in self._limiter.drain(now_us).items():
            await self._record_suppressed(bucket, summary)
        for summary in self._log_limiter.drain(now_us).values():
            self._log_rejections(summary)

    @property
    def _door(self) -> str:
        return "public" if self._public else "tailnet"

    # -- one request -----------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        received_at = self._clock()
        found = self._routes.get(request.path)
        if found is None and self._pages is not None and self._pages.owns(request.path):
            return await self._pages.handle(request)
        if found is None:
            path = request.path[:200]
            return await self._refuse(request, None, Refusal(
                404, f"no route at {path!r}", "no webhook route here",
                delivery=self._delivery_sent(request)))
        name, route = found
        answer = await self._receive(request, name, route, received_at)
        if isinstance(answer, Refusal):
            return await self._refuse(request, name, answer.naming(self._delivery_sent(request)))
        return answer

    def _delivery_sent(self, request: web.BaseRequest) -> str | None:
        """The delivery id the sender gave, under any header a route reads, if well formed."""
        for header in self._delivery_headers:
            value = request.headers.get(header)
            if value is not None and _DELIVERY_ID.fullmatch(value):
                return value
        return None

    async def _receive(
        self, request: web.BaseRequest, name: str, route: WebhookRoute, received_at: datetime
    ) -> web.StreamResponse | Refusal:
        """Check, read, verify, parse, then store: each step may refuse."""
        if request.method != "POST":
            return Refusal(405, f"method {request.method[:20]} is not POST", "use POST",
                           headers={"Allow": "POST"})
        declared = request.content_length
        if declared is not None and declared > route.max_body_bytes:
            return _too_large(declared, route)
        envelope = _envelope(route, request)
        if isinstance(envelope, Refusal):
            return envelope
        keys = _secrets(route, self._environ)
        if not keys:
            return Refusal(503, "no secret is configured: none of "
                           f"{', '.join(route.secret_env)} is set", "webhook not configured",
                           delivery=envelope.delivery_id, event="misconfigured")
        if envelope.signature is None:
            return Refusal(401, f"no {_signature_header(route)} header", "signature required",
                           delivery=envelope.delivery_id)
        await _continue(request)
        body = await _read_body(request, route, self._deadlines.body_s)
        if isinstance(body, Refusal):
            return body.naming(envelope.delivery_id)
        if len(body) > _THREAD_WORK_BYTES:
            payload = await asyncio.to_thread(_verify_and_parse, body, envelope, keys)
        else:
            payload = _verify_and_parse(body, envelope, keys)
        if isinstance(payload, Refusal):
            return payload.naming(envelope.delivery_id)
        if route.kind == "github" and envelope.event == "ping":
            return await self._ping(request, name, envelope)
        action = _action(payload)
        delivery = Delivery(route=name, key=envelope.key, event=envelope.event,
                            action=action, headers=_kept_headers(request),
                            body=body, received_at=received_at)
        return await self._store(delivery, envelope,
                                 unwanted(name, route, envelope.event, action, payload))

    async def _store(
        self, delivery: Delivery, envelope: _Envelope, ignored: Ignored | None
    ) -> web.StreamResponse | Refusal:
        """Durable, then 200: queued, closed as ignored (no job wants it), or a duplicate."""
        try:
            outcome = await self._inbox.accept(
                delivery, ignored=ignored.reason if ignored is not None else None)
        except InboxError as exc:
            return Refusal(503, f"cannot be made durable: {exc}", "not stored; retry later",
                           delivery=envelope.delivery_id)
        if isinstance(outcome, Accepted) and outcome.ignored is None:
            if self._on_accepted is not None:
                self._on_accepted()
            return web.json_response({"status": "queued", "delivery": envelope.delivery_id})
        if isinstance(outcome, Accepted):
            return web.json_response({"status": "ignored", "delivery": envelope.delivery_id,
                                      "reason": outcome.ignored})
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
        self, request: web.BaseRequest, name: str | None, refusal: Refusal
    ) -> web.StreamResponse:
        forwarded = request.headers.get("X-Forwarded-For")
        await self._audit_refusal(name, refusal, request.remote,
                                  forwarded[:200] if forwarded else None)
        response = web.json_response({"error": refusal.answer}, status=refusal.status,
                                     headers=dict(refusal.headers))
        if refusal.status in _CLOSING_STATUSES:  # do not wait on the rest of such a body
            response.force_close()
        return response

    async def _audit_refusal(
        self, name: str | None, refusal: Refusal, remote: str | None, forwarded: str | None
    ) -> None:
        bucket = name or _UNKNOWN_ROUTE
        write, rolled = self._limiter.admit(bucket, refusal.kind, to_us(self._clock()))
        if rolled is not None:
            await self._record_suppressed(bucket, rolled)
        if not write:
            return
        details: dict[str, Any] = {
            "route": name, "status": refusal.status, "reason": refusal.reason,
            "delivery": refusal.delivery, "remote": remote,
        }
        if forwarded:
            details["forwarded_for"] = forwarded
        await self._record(refusal.event, refusal.outcome, name, details)

    # -- requests aiohttp turned away before the handler ------------------------------------

    def _rejected(self, rejected: Rejected) -> None:
        """Count a request rejected before the handler: logged once a window, audited as any
        other refusal (under the limiter), never with aiohttp's traceback."""
        kind = "too slow" if rejected.status == 408 else rejected.reason  # names the error
        refusal = Refusal(rejected.status, rejected.reason, kind)
        write, rolled = self._log_limiter.admit(self._door, refusal.kind, to_us(self._clock()))
        if rolled is not None:
            self._log_rejections(rolled)
        if write:
            _log.warning("webhook listener (%s): refused a request from %s before reading it:"
                         " %s %s; more in the next %d s are counted, not logged", self._door,
                         rejected.remote, rejected.status, rejected.reason,
                         _REFUSAL_WINDOW_US // 1_000_000)
        task = asyncio.get_running_loop().create_task(
            self._audit_refusal(None, refusal, rejected.remote, None))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _log_rejections(self, summary: dict[str, Any]) -> None:
        kinds = ", ".join(f"{count} × {kind}" for kind, count in summary["kinds"].items())
        _log.warning("webhook listener (%s): %d more requests refused before reading them"
                     " since %s: %s", self._door, summary["suppressed"], summary["since"], kinds)

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


def _envelope(route: WebhookRoute, request: web.BaseRequest) -> _Envelope | Refusal:
    headers = request.headers
    if route.kind == "github":
        event_header, delivery_header = _GITHUB_EVENT, _GITHUB_DELIVERY
    else:
        event_header, delivery_header = route.event_header, route.delivery_header
    event = headers.get(event_header)
    delivery_id = headers.get(delivery_header)
    if event is None or delivery_id is None:
        missing = event_header if event is None else delivery_header
        return Refusal(400, f"no {missing} header", f"missing header {missing}")
    for header, value, pattern in ((event_header, event, _EVENT_NAME),
                                   (delivery_header, delivery_id, _DELIVERY_ID)):
        if not pattern.fullmatch(value):
            return Refusal(400, f"malformed {header} header", f"malformed header {header}")
    hook_id = headers.get(_GITHUB_HOOK_ID) if route.kind == "github" else None
    if hook_id is not None and not _DELIVERY_ID.fullmatch(hook_id):
        return Refusal(400, f"malformed {_GITHUB_HOOK_ID} header",
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


async def _read_body(
    request: web.BaseRequest, route: WebhookRoute, deadline_s: float
) -> bytes | Refusal:
    """The raw body, read in chunks, never past ``max_body_bytes`` + one chunk, and all of it
    within ``deadline_s`` (a sender trickling its body holds a connection no longer). A body
    already all in (a small delivery, as most are) is taken at once, without a timer."""
    chunks: list[bytes] = []
    size = 0
    try:
        if request.content.is_eof():
            whole = request.content.read_nowait(-1)
            if len(whole) > route.max_body_bytes:
                return _too_large(len(whole), route)
            return whole
        async with asyncio.timeout(deadline_s):
            while chunk := await request.content.read(_READ_CHUNK_BYTES):
                size += len(chunk)
                if size > route.max_body_bytes:
                    return _too_large(size, route, at_least=True)
                chunks.append(chunk)
    except TimeoutError:
        return Refusal(408, f"body not received within {deadline_s:g} s", "too slow")
    except (ClientPayloadError, ConnectionError, asyncio.IncompleteReadError) as exc:
        return Refusal(400, f"body could not be read: {type(exc).__name__}",
                       "body could not be read")
    return b"".join(chunks)


def _too_large(size: int, route: WebhookRoute, *, at_least: bool = False) -> Refusal:
    figure = f"at least {size:,}" if at_least else f"{size:,}"
    return Refusal(413, f"body of {figure} bytes is over the route's limit of"
                    f" {route.max_body_bytes:,}", "body too large")


def _verify_and_parse(
    body: bytes, envelope: _Envelope, keys: list[bytes]
) -> dict[str, Any] | Refusal:
    """Check the signature over the raw bytes received, and only then parse them."""
    match = _SIGNATURE.fullmatch(envelope.signature or "")
    if match is None:
        return Refusal(401, "signature is not of the form sha256=<64 hex>", "bad signature")
    given = bytes.fromhex(match.group(1))
    matched = False
    for key in keys:  # every key is tried: how many were tried does not show in the timing
        matched |= hmac.compare_digest(hmac.digest(key, body, "sha256"), given)
    if not matched:
        return Refusal(401, "signature does not match the body", "bad signature")
    return _parse(body)


def _parse(body: bytes) -> dict[str, Any] | Refusal:
    """The body as a JSON object every later step can handle, or why it is not one."""
    parsed = parse_body(body)
    if isinstance(parsed, Unacceptable):
        return _unacceptable(parsed)
    if not isinstance(parsed.value, dict):
        return Refusal(400, f"body is JSON but not an object ({type(parsed.value).__name__})",
                       "body is not a JSON object")
    return parsed.value


def _unacceptable(problem: Unacceptable) -> Refusal:
    match problem.kind:
        case "not json":
            return Refusal(400, "body is not JSON (is the webhook's content type"
                           " application/json?)", "body is not JSON")
        case "too deep":
            return Refusal(400, f"body {problem.text}", "body nested too deep")
        case "not unicode":
            return Refusal(400, f"body {problem.text}", "body is not valid JSON text")


def _action(payload: Mapping[str, Any]) -> str | None:
    action = payload.get("action")
    if isinstance(action, str) and 0 < len(action) <= _ACTION_MAX_CHARS:
        return action
    return None


def _kept_headers(request: web.BaseRequest) -> dict[str, str]:
    kept = {name.lower(): value for name, value in request.headers.items()}
    for name in _PRIVATE_HEADERS & kept.keys():
        del kept[name]
    return kept


def _subject(name: str | None) -> str | None:
    """The route name as the audit subject, if it is a single printable token."""
    if name and " " not in name and name.isprintable():
        return name
    return None
