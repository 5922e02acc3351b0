"""A run's whole story, from the register: a tree of spans (``bothy trace RUN``), the same tree as
OTLP/JSON (``--json``), and sent once to an OTLP/HTTP receiver (``--otlp URL``).

The register is the only source: every span is one record, or a pair of records that open and
close it (the worker from ``run started`` to ``worker stopped``, a turn until the next turn or
the worker's end, a question from ``run question`` to its answer, timeout or stop). Ids are
derived from the run id, so the same run always gives the same trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bothy.engine.auditrecord import AuditRecord
from bothy.engine.traceids import span_id, trace_id

__all__ = ["OtlpRefused", "Span", "build_spans", "otlp_answer", "otlp_request", "render_tree",
           "send_otlp", "span_id", "trace_id"]

SPAN_KIND_INTERNAL = 1
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2

_OK_OUTCOMES = frozenset({"ok", "verified"})
_QUESTION_ENDS = frozenset({"answered", "timed_out", "stopped", "declined"})
_SERVICE = "bothy"


@dataclass
class Span:
    """One step of the run: what it was, when, how it ended, and the figures that mattered."""

    key: str  # stable within the run: the span id is derived from it
    name: str
    start: datetime
    end: datetime
    parent: str | None = None
    outcome: str = "ok"
    kind: int = SPAN_KIND_INTERNAL
    attributes: dict[str, Any] = field(default_factory=dict)
    summary: str = ""  # what the tree line says after the name
    # The summary holds what a person or the model wrote (a question, a command, a reason):
    # held back from an export unless its content is asked for (config ``otel.include_content``).
    content: bool = False

    @property
    def status(self) -> int:
        if self.outcome in _OK_OUTCOMES:
            return STATUS_OK
        if self.outcome in ("pending", "unknown"):
            return STATUS_UNSET
        return STATUS_ERROR

    @property
    def seconds(self) -> float:
        return max(0.0, (self.end - self.start).total_seconds())


def build_spans(run_id: str, records: Sequence[AuditRecord]) -> list[Span]:
    """The run's spans, the root first, in the order their records were written."""
    if not records:
        return []
    builder = _Builder(run_id, records)
    for record in records:
        builder.feed(record)
    return builder.finish()


class _Builder:
    def __init__(self, run_id: str, records: Sequence[AuditRecord]) -> None:
        self._run_id = run_id
        self._records = records
        self.root = Span("run", f"run {run_id}", records[0].ts, records[-1].ts,
                         outcome="pending", kind=SPAN_KIND_SERVER,
                         attributes={"bothy.run.id": run_id,
                                     "gen_ai.operation.name": "invoke_agent"})
        self.spans: list[Span] = [self.root]
        self._worker: Span | None = None
        self._turn: Span | None = None
        self._question: Span | None = None
        self._answered: Span | None = None  # the last question an answer ended
        self._turns = 0
        self._turn_spans: dict[str, Span] = {}  # by Codex's turn id
        self._finished: datetime | None = None
        self._counts: dict[str, int] = {}

    def _key(self, stem: str) -> str:
        n = self._counts.get(stem, 0) + 1
        self._counts[stem] = n
        return f"{stem}.{n}"

    def _add(self, span: Span) -> Span:
        self.spans.append(span)
        return span

    def _inside(self) -> str:
        """The span new steps belong to: the turn under way, else the worker, else the run."""
        for span in (self._turn, self._worker):
            if span is not None:
                return span.key
        return "run"

    def feed(self, r: AuditRecord) -> None:
        d = r.details
        pair = (r.kind, r.event)
        if r.subject and "bothy.subject" not in self.root.attributes:
            self.root.attributes["bothy.subject"] = r.subject
        if pair == ("wake", "received"):
            self._instant(r, "wake", f"wake {d.get('source', '?')}",
                          _attrs("bothy.wake", d, "wake_id", "source", "trusted",
                                 "prompt_chars", "delivery", "attempt"),
                          f"{d.get('wake_id', '')} from {d.get('source', '?')}")
        elif pair in (("run", "admitted"), ("run", "refused")):
            gate = str(d.get("gate", "budget"))
            attrs: dict[str, Any] = {"bothy.gate": gate, "bothy.verdict": r.event}
            for name in ("reserved_usd", "used_usd", "already_reserved_usd", "ceiling_usd"):
                if name in d:
                    attrs[f"bothy.{name[:-4]}_micros"] = _micros(d[name])
            if "message" in d:
                attrs["bothy.refused_because"] = str(d["message"])
            summary = (f"reserved {d['reserved_usd']} usd of {d.get('ceiling_usd', '?')}"
                       if "reserved_usd" in d and r.event == "admitted"
                       else str(d.get("message", "")))
            self._instant(r, "gate", f"gate {gate} {r.event}", attrs, summary)
        elif pair == ("run", "started"):
            self._worker = self._add(Span(self._key("worker"), "worker", r.ts, r.ts,
                                          "run", attributes=_attrs("bothy.worker", d, "pgid",
                                                                   "leader_pid")))
        elif pair == ("turn", "started"):
            self._close_turn(r.ts)
            self._turns += 1
            model = str(d.get("model", ""))
            self._turn = self._add(Span(
                self._key("turn"), f"turn {self._turns}", r.ts, r.ts,
                self._worker.key if self._worker else "run", kind=SPAN_KIND_CLIENT,
                attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": model,
                            "bothy.turn.id": str(d.get("turn_id", "")),
                            **({"gen_ai.conversation.id": str(d["thread_id"])}
                               if "thread_id" in d else {})},
                summary=f"model {model}"))
            self._turn_spans[str(d.get("turn_id", ""))] = self._turn
            self.root.attributes.setdefault("gen_ai.request.model", model)
        elif pair == ("run", "question"):
            tool = str(d.get("tool", ""))
            self._question = self._add(Span(
                self._key("question"), f"question {d.get('kind', '')} {tool}".strip(),
                r.ts, r.ts, self._inside(), outcome="pending",
                attributes=_attrs("bothy.question", d, "kind", "tool", "hold_s"),
                summary=str(d.get("question", "")), content=True))
        elif r.kind == "question" and r.event in _QUESTION_ENDS:
            span = self._question or self._instant(r, "question", "question", {}, "")
            span.end, span.outcome = r.ts, r.outcome
            span.attributes["bothy.question.end"] = r.event
            if r.event == "answered":
                span.attributes["bothy.answer.by"] = str(d.get("by", ""))
                span.summary = f"{span.summary} → answered by {d.get('by', '?')}"
            else:
                span.summary = f"{span.summary} → {r.event}"
            self._answered = span if r.event == "answered" else None
            self._question = None
        elif pair == ("answer", "received") and (self._question or self._answered):
            # The answer that reached the held question: its record may come just before the
            # question's end record or just after it; either way it belongs to that question.
            held = self._question or self._answered
            if held is not None:
                held.attributes["bothy.answer.received_by"] = str(d.get("by", ""))
        elif pair == ("answer", "late"):
            self._instant(r, "late_answer", "late answer", {"bothy.answer.by": str(d.get("by", "")),
                                                             "bothy.late": True},
                          f"from {d.get('by', '?')}: {d.get('note', 'the run had moved on')}",
                          parent="run", content=True)
        elif r.kind == "tool" and r.event in ("allowed", "refused"):
            tool = str(d.get("tool", ""))
            attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool,
                     "bothy.verdict": r.event}
            if "code" in d:
                attrs["bothy.refused_because"] = str(d["code"])
            why = d.get("why") or d.get("reason") or ""
            self._instant(r, "tool", f"tool {tool} {r.event}", attrs, str(why), content=True)
        elif pair == ("tool", "ran"):
            ms = d.get("duration_ms")
            start = r.ts
            if isinstance(ms, int) and ms >= 0:
                from datetime import timedelta
                start = r.ts - timedelta(milliseconds=ms)
            what = str(d.get("item", "tool"))
            name = {"commandExecution": "command", "fileChange": "file change",
                    "mcpToolCall": f"mcp {d.get('server', '')}.{d.get('tool', '')}"}.get(what, what)
            attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": what,
                     **_attrs("bothy.tool", d, "status", "exit_code", "item_id")}
            summary = str(d.get("command") or ", ".join(d.get("paths") or []) or "")
            if d.get("exit_code") is not None:
                summary += f" (exit {d['exit_code']})"
            self._add(Span(self._key("ran"), f"{name} ran", start, r.ts, self._inside(),
                           outcome=r.outcome, attributes=attrs, summary=summary, content=True))
        elif r.kind == "run" and r.event in ("verified", "verification-failed"):
            self._instant(r, "verification", f"verification {r.event}",
                          _attrs("bothy.verification", d, "attempt"),
                          str(d.get("failure") or d.get("reason") or ""), content=True)
        elif pair == ("worker", "stopped"):
            self._close_turn(r.ts)
            if self._worker is not None:
                self._worker.end, self._worker.outcome = r.ts, r.outcome
                self._worker.attributes["bothy.worker.exit_code"] = d.get("exit_code")
                self._worker.summary = str(d.get("how", ""))
                self._worker = None
            if self._finished is not None and r.ts > self._finished:
                self._finished = r.ts  # a chat run answers before its worker stops: it lasts
                # until it has stopped
        elif pair == ("budget", "settled"):
            attrs = {f"bothy.{name[:-4]}_micros": _micros(d[name])
                     for name in ("cost_usd", "reserved_usd", "released_usd") if name in d}
            summary = f"cost {d.get('cost_usd', '?')} usd, released {d.get('released_usd', '?')}"
            self._close_turn(r.ts)  # the run's, even when its worker is still stopping
            self._instant(r, "settlement", "settlement", attrs, summary, parent="run")
        elif pair == ("run", "finished"):
            self._close_turn(r.ts)
            self._finished = r.ts
            self.root.outcome = r.outcome
            self.root.attributes["bothy.outcome"] = str(d.get("outcome", r.outcome))
            if d.get("reason"):
                self.root.attributes["bothy.reason"] = str(d["reason"])
            if "cost_usd" in d:
                self.root.attributes["bothy.cost_micros"] = _micros(d["cost_usd"])
            for used in d.get("turns") or []:  # what each turn used, as Codex reported it
                if isinstance(used, dict) and str(used.get("turn_id")) in self._turn_spans:
                    turn = self._turn_spans[str(used["turn_id"])]
                    turn.summary = ", ".join(filter(None, (turn.summary, _usage(turn, used))))
            tokens = _usage(self.root, d)
            self.root.summary = (f"{d.get('outcome', r.outcome)} cost {d.get('cost_usd', '?')} usd"
                                 + (f", {tokens}" if tokens else "")
                                 + (f": {d['reason']}" if d.get("reason") else ""))
        else:
            self._instant(r, f"{r.kind}_{r.event}", f"{r.kind} {r.event}",
                          {"bothy.record": f"{r.kind} {r.event}"}, "")

    def _instant(self, r: AuditRecord, stem: str, name: str, attrs: dict[str, Any],
                 summary: str, *, parent: str | None = None, content: bool = False) -> Span:
        return self._add(Span(self._key(stem), name, r.ts, r.ts, parent or self._inside(),
                              outcome=r.outcome, attributes=attrs, summary=summary,
                              content=content))

    def _close_turn(self, ts: datetime) -> None:
        if self._turn is not None:
            self._turn.end = ts
            self._turn = None

    def finish(self) -> list[Span]:
        if self._finished is not None:
            self.root.end = self._finished
        last = self._records[-1].ts
        for span in (self._turn, self._worker, self._question):
            if span is not None and span.end < last:
                span.end = last  # still open in the register: it lasts as far as we know
        return self.spans


def _usage(span: Span, counts: Mapping[str, Any]) -> str:
    """Set ``gen_ai.usage.input_tokens`` / ``output_tokens`` (GenAI conventions) from recorded
    counts; what the tree says of them ("" when none were recorded)."""
    found = {}
    for ours, theirs in (("input_tokens", "gen_ai.usage.input_tokens"),
                         ("output_tokens", "gen_ai.usage.output_tokens")):
        value = counts.get(ours)
        if isinstance(value, int) and not isinstance(value, bool):
            span.attributes[theirs] = found[ours] = value
    if not found:
        return ""
    return f"{found.get('input_tokens', 0)} in, {found.get('output_tokens', 0)} out tokens"


def _attrs(prefix: str, details: Mapping[str, Any], *names: str) -> dict[str, Any]:
    return {f"{prefix}.{name}": details[name] for name in names
            if name in details and details[name] is not None}


def _micros(usd: Any) -> int:
    from decimal import Decimal, InvalidOperation

    try:
        return int(Decimal(str(usd)) * 1_000_000)
    except InvalidOperation:
        return 0


# --- the tree ---------------------------------------------------------------------------


def render_tree(spans: Sequence[Span]) -> list[str]:
    """One line per span, indented under its parent: name, outcome, duration, figures."""
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        children.setdefault(span.parent, []).append(span)
    lines: list[str] = []

    def walk(span: Span, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        line = f"{prefix}{branch}{span.name} {span.outcome} {_duration(span.seconds)}"
        if span.summary:
            line += f"  {span.summary}"
        lines.append(line)
        kids = children.get(span.key, [])
        inner = prefix if depth == 0 else prefix + ("   " if last else "│  ")
        for i, kid in enumerate(kids):
            walk(kid, inner, i == len(kids) - 1, depth + 1)

    for root in children.get(None, []):
        walk(root, "", True, 0)
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


# --- OTLP/JSON --------------------------------------------------------------------------


def otlp_request(run_id: str, spans: Iterable[Span], *, site: str | None = None,
                 version: str = "", include_content: bool = True) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` in OTLP/JSON: hex ids, integer enums, lowerCamelCase
    keys, 64-bit integers as decimal strings.

    Without ``include_content``, a span whose summary holds what a person or the model wrote
    (a question, a command, a reason) carries neither it nor a status message made of it."""
    tid = trace_id(run_id)
    resource = [_kv("service.name", _SERVICE)]
    if site:
        resource.append(_kv("bothy.site", site))
    out = []
    for span in spans:
        said = span.summary if include_content or not span.content else ""
        item: dict[str, Any] = {
            "traceId": tid,
            "spanId": span_id(run_id, span.key),
            "name": span.name,
            "kind": span.kind,
            "startTimeUnixNano": str(_nanos(span.start)),
            "endTimeUnixNano": str(_nanos(span.end)),
            "attributes": [_kv(k, v) for k, v in span.attributes.items() if v is not None],
            "status": {"code": span.status}
            | ({"message": said or span.outcome} if span.status == STATUS_ERROR else {}),
        }
        if span.parent is not None:
            item["parentSpanId"] = span_id(run_id, span.parent)
        if said and span.status != STATUS_ERROR:
            item["attributes"].append(_kv("bothy.summary", said))
        out.append(item)
    return {"resourceSpans": [{
        "resource": {"attributes": resource},
        "scopeSpans": [{"scope": {"name": "bothy.trace", "version": version}, "spans": out}],
    }]}


def _nanos(ts: datetime) -> int:
    return int(ts.timestamp()) * 1_000_000_000 + ts.microsecond * 1000


def _kv(key: str, value: Any) -> dict[str, Any]:
    return {"key": key, "value": _any_value(value)}


def _any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    return {"stringValue": str(value)}


# --- OTLP/HTTP --------------------------------------------------------------------------


class OtlpRefused(Exception):
    """The receiver did not take the whole trace: its status and its own message."""


def send_otlp(url: str, request: Mapping[str, Any], *, timeout_s: float = 10.0,
              headers: Mapping[str, str] | None = None) -> str:
    """POST the request once; what the receiver said on success, else :class:`OtlpRefused`."""
    import urllib.error  # here: a trace shown on a terminal needs no HTTP client
    import urllib.request

    body = json.dumps(request).encode()
    http = urllib.request.Request(url, data=body, method="POST",
                                  headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        raise OtlpRefused(f"{url} answered {exc.code}: {_message(exc.read())}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OtlpRefused(f"cannot reach {url}: {reason}") from None
    return otlp_answer(url, status, raw)


def otlp_answer(url: str, status: int, raw: bytes) -> str:
    """What an OTLP/HTTP receiver's answer means: what it said when it took the whole trace,
    else :class:`OtlpRefused` (a non-2xx status, or a partial success rejecting spans)."""
    if not 200 <= status < 300:
        raise OtlpRefused(f"{url} answered {status}: {_message(raw)}")
    try:
        answer_json = json.loads(raw) if raw.strip() else {}
    except ValueError:
        answer_json = {}
    partial = answer_json.get("partialSuccess") if isinstance(answer_json, dict) else None
    if isinstance(partial, dict):
        rejected = int(partial.get("rejectedSpans") or 0)
        message = str(partial.get("errorMessage") or "")
        if rejected > 0:
            raise OtlpRefused(f"{url} rejected {rejected} span(s): {message or 'no reason given'}")
        if message:
            return f"accepted, with a warning: {message}"
    return "accepted"


def _message(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:500] or "no message"
    if isinstance(parsed, dict) and parsed.get("message"):
        return str(parsed["message"])[:500]
    return text[:500] or "no message"
