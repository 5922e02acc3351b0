"""A loopback OTLP/HTTP receiver (``POST /v1/traces``, ``application/json``) that checks every
request with the OTLP/JSON rules before it takes it.

The rules are those of the OTLP specification, not protobuf's generic JSON mapping (which
reads hex ids as base64): the request must parse with ``opentelemetry-proto-json``'s
``ExportTraceServiceRequest.from_json`` (hex ids, integer enums), and, because that parser lets
some things through silently, :func:`problems` checks the raw JSON too: trace ids 32 hex
characters and span ids 16, every key lowerCamelCase, every 64-bit integer a decimal string,
every ``parentSpanId`` a span of the same request, kinds 0–5 and status codes 0–2 as integers.

A request breaking a rule is answered 400 with a ``google.rpc.Status``-shaped message naming
the first problem; a good one 200 ``{"partialSuccess": {}}`` (as the OpenTelemetry Collector
answers). ``answer`` lets a test make it answer a status, or a partial success rejecting spans.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto_json.collector.trace.v1.trace_service import ExportTraceServiceRequest

__all__ = ["OtlpReceiver", "problems"]

_HEX32 = re.compile(r"[0-9a-fA-F]{32}")
_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
_CAMEL = re.compile(r"[a-z][a-zA-Z0-9]*")
_INT64_KEYS = frozenset({"startTimeUnixNano", "endTimeUnixNano", "timeUnixNano", "intValue"})


def problems(document: Any) -> list[str]:
    """Every way ``document`` breaks the OTLP/JSON rules (empty when it keeps them)."""
    found: list[str] = []
    try:
        ExportTraceServiceRequest.from_json(json.dumps(document))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        found.append(f"opentelemetry-proto-json refuses it: {exc}")
    if not isinstance(document, dict) or not isinstance(document.get("resourceSpans"), list):
        return [*found, "no resourceSpans list"]
    _check_keys(document, "$", found)
    spans = [span for rs in document["resourceSpans"] for ss in rs.get("scopeSpans", [])
             for span in ss.get("spans", [])]
    if not spans:
        found.append("no spans: an empty envelope")
    ids = {span.get("spanId") for span in spans}
    for n, span in enumerate(spans):
        where = f"span {n} ({span.get('name')!r})"
        if not _HEX32.fullmatch(str(span.get("traceId", ""))):
            found.append(f"{where}: traceId {span.get('traceId')!r} is not 32 hex characters")
        if not _HEX16.fullmatch(str(span.get("spanId", ""))):
            found.append(f"{where}: spanId {span.get('spanId')!r} is not 16 hex characters")
        parent = span.get("parentSpanId")
        if parent not in (None, "") and parent not in ids:
            found.append(f"{where}: parentSpanId {parent!r} is no span of this request")
        if type(span.get("kind")) is not int or not 0 <= span["kind"] <= 5:
            found.append(f"{where}: kind {span.get('kind')!r} is not an integer 0-5")
        code = (span.get("status") or {}).get("code", 0)
        if type(code) is not int or not 0 <= code <= 2:
            found.append(f"{where}: status code {code!r} is not an integer 0-2")
        if int(span.get("endTimeUnixNano", 0)) < int(span.get("startTimeUnixNano", 0)):
            found.append(f"{where}: ends before it starts")
    if len(ids) != len(spans):
        found.append("two spans share a spanId")
    return found


def _check_keys(value: Any, path: str, found: list[str]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            if not _CAMEL.fullmatch(key):
                found.append(f"{path}.{key}: key is not lowerCamelCase")
            if key in _INT64_KEYS and not (isinstance(inner, str) and inner.isdigit()):
                found.append(f"{path}.{key}: a 64-bit integer must be a decimal string,"
                             f" not {inner!r}")
            _check_keys(inner, f"{path}.{key}", found)
    elif isinstance(value, list):
        for n, inner in enumerate(value):
            _check_keys(inner, f"{path}[{n}]", found)


@dataclass
class OtlpReceiver:
    """The receiver on 127.0.0.1, an ephemeral port; what it took is in ``received``."""

    answer: tuple[int, dict[str, Any]] | None = None  # (status, body) instead of checking
    received: list[dict[str, Any]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def __aenter__(self) -> OtlpReceiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)  # 0: any free port
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return self._refuse(415, f"Content-Type {request.content_type!r}, not application/json")
        try:
            document = json.loads(await request.read())
        except ValueError as exc:
            return self._refuse(400, f"not JSON: {exc}")
        if self.answer is not None:
            self.received.append(document)
            status, body = self.answer
            return web.json_response(body, status=status)
        if found := problems(document):
            return self._refuse(400, "; ".join(found))
        self.received.append(document)
        return web.json_response({"partialSuccess": {}})

    def _refuse(self, status: int, message: str) -> web.Response:
        self.refused.append(message)
        return web.json_response({"code": 3, "message": message}, status=status)
