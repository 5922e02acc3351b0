"""One record of the register and its line on disk: the canonical form the hash covers.

File format: JSON Lines, one record per line, ASCII only, no insignificant whitespace::

    {"seq":1,"ts":"2026-09-24T10:14:02.118734+00:00","kind":"wake","event":"received",
     "outcome":"ok","subject":"pr:42","run_id":null,"details":{},"prev":"000…000",
     "hash":"<64 hex>"}

(one line on disk). Canonical form: the *body* is the record without ``hash``, serialised with
the top-level keys in the order above, keys inside ``details`` sorted, ``separators=(",", ":")``
and ``ensure_ascii=True``. ``hash`` is the sha256 hex digest of the body's bytes, and the line
on disk is the body with ``,"hash":"<digest>"`` spliced in before its closing brace. So a
verifier recovers the exact hashed bytes by cutting the fixed-width 75-byte hash field off the
end of the line and putting the ``}`` back: it never re-serialises, which keeps verification
fast and independent of how any JSON library formats floats or orders keys. Re-serialising
with the rules above gives the same bytes, so other tools can verify the chain too.

Why the hash covers ``prev``: each record's digest then commits to the digest before it, and
so, transitively, to every earlier record. Editing, deleting, inserting or reordering any
record breaks every link after it unless the rest of the chain is rewritten too; a record
can't be silently dropped or moved, only the whole tail re-forged (which an anchored copy of
a recent hash, e.g. in a chat alert, would expose).

:class:`~bothy.engine.audit.AuditLog` writes these lines, :mod:`bothy.engine.auditchain`
verifies them, :mod:`bothy.engine.auditformat` renders them for people.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

__all__ = [
    "FIELDS",
    "GENESIS_HASH",
    "AuditRecord",
    "body_of",
    "canonical_details_json",
    "flat_details",
    "format_ts",
    "head_of",
    "names_json",
    "new_record",
    "parse_fields",
    "parse_line",
    "quote",
    "serialise_body",
    "serialise_chained",
    "stamped_before",
    "with_hash",
]

GENESIS_HASH = "0" * 64
"""The ``prev`` of record 1: there is no record before it."""

FIELDS = ("seq", "ts", "kind", "event", "outcome", "subject", "run_id", "details", "prev")
"""The top-level keys of a record's body, in their order on disk (``hash`` follows them)."""
_HASH_PREFIX = b',"hash":"'
_HASH_FIELD_LEN = len(_HASH_PREFIX) + 64 + len(b'"}')  # 75 bytes at the end of every line
_HASH_FIELD = re.compile(rb',"hash":"([0-9a-f]{64})"\}')
_HEAD = re.compile(rb'\{"seq":([0-9]{1,18}),"ts":"([^"\\]{1,64})","kind":"([^"\\]{1,64})",')
_TS_LEN = len("2026-09-24T10:14:02.118734+00:00")  # format_ts's form
_DECODER = json.JSONDecoder()
# One encoder, built once: json.dumps with any option builds a new one on every call.
_CANONICAL = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), sort_keys=True,
                              allow_nan=False)


@dataclass(frozen=True)
class AuditRecord:
    """One entry of the register, as written to disk (``hash`` covers everything else)."""

    seq: int
    ts: datetime
    kind: str
    event: str
    outcome: str
    subject: str | None
    run_id: str | None
    details: Mapping[str, Any] = field(hash=False)
    prev: str
    hash: str

    def human_line(self) -> str:
        """The greppable one-line form of SPEC §2 (see :mod:`bothy.engine.auditformat`)."""
        from bothy.engine.auditformat import human_line  # the human form has its own module

        return human_line(self)

    def to_json(self) -> str:
        """The record as one line of canonical JSON, hash included (``bothy audit --json``)."""
        body = serialise_body(
            seq=self.seq,
            ts=format_ts(self.ts),
            kind=self.kind,
            event=self.event,
            outcome=self.outcome,
            subject=self.subject,
            run_id=self.run_id,
            details=self.details,
            prev=self.prev,
        )
        return with_hash(body, self.hash).decode("ascii")


def parse_line(line: bytes) -> AuditRecord | str:
    """A line (without its newline) as a record, or why it is not one (a phrase).

    Checks the shape only: whether the hash matches the content is the caller's question.
    """
    fields = parse_fields(line)
    if isinstance(fields, str):
        return fields
    return AuditRecord(**fields)


def head_of(line: bytes) -> tuple[int, datetime, str] | None:
    """The seq, timestamp and kind at the start of a line, read without decoding the rest:
    what a reader that wants a few kinds, or a recent stretch, looks at before it parses a
    record (a batch ``wake ignored`` runs to ~30 KB). None when the line does not begin as a
    canonical record does; such a line is the full parse's to judge.

    Only the first keys are read: a line whose head says a kind or a time the reader skips
    is skipped unchecked (whether the whole line is a record is ``verify``'s question)."""
    head = _HEAD.match(line)
    if head is None:
        return None
    try:
        ts = datetime.fromisoformat(head[2].decode("ascii"))
    except ValueError:
        return None
    if ts.tzinfo is None:
        return None
    return int(head[1]), ts, head[3].decode("ascii")


def stamped_before(line: bytes, cutoff: bytes) -> bool | None:
    """Whether a line's head says it was stamped before ``cutoff`` (a time in
    :func:`format_ts`'s form, as bytes), read from the bytes alone: two stamps in that form
    (UTC, to the microsecond) compare as bytes as their times do. None when the line does not
    begin as a canonical record does, or its stamp is in another form: :func:`head_of` and
    the full parse judge it then. What a reader of a recent stretch of a long register asks
    of every line before it (the decoding and parsing of each stamp was most of that read)."""
    head = _HEAD.match(line)
    if head is None:
        return None
    ts = head[2]
    if len(ts) != _TS_LEN or not ts.endswith(b"+00:00"):
        return None
    return ts < cutoff


def parse_fields(line: bytes) -> dict[str, Any] | str:
    """The fields of a line (``ts`` as an aware datetime), or why it is not a record.

    The fast path of ``verify``: one regex match, one C-level JSON decode, a few type checks.
    """
    if not line:
        return "is empty"
    start = len(line) - _HASH_FIELD_LEN
    suffix = _HASH_FIELD.fullmatch(line, start) if start > 0 else None
    if suffix is None:
        return "is unparsable: it does not end with a hash field"
    try:
        text = body_of(line).decode("ascii")
        fields, end = _DECODER.raw_decode(text)
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for non-ASCII bytes
        return f"is unparsable: {exc}"
    if end != len(text) or type(fields) is not dict or tuple(fields) != FIELDS:
        return "is unparsable: its fields are not " + ", ".join(FIELDS) + ", hash"
    problem = _field_type_problem(fields)
    if problem:
        return f"is unparsable: {problem}"
    try:
        fields["ts"] = datetime.fromisoformat(fields["ts"])
    except ValueError:
        return f"is unparsable: ts is not an ISO-8601 timestamp: {fields['ts']!r}"
    if fields["ts"].tzinfo is None:
        return "is unparsable: ts has no UTC offset"
    fields["hash"] = suffix[1].decode("ascii")
    return fields


def _field_type_problem(body: dict[str, Any]) -> str:
    seq = body["seq"]
    if type(seq) is not int or seq < 1:
        return f"seq is not a positive integer: {seq!r}"
    for name in ("ts", "kind", "event", "outcome", "prev"):
        if type(body[name]) is not str:
            return f"{name} is not a string"
    for name in ("subject", "run_id"):
        if body[name] is not None and type(body[name]) is not str:
            return f"{name} is neither a string nor null"
    if type(body["details"]) is not dict:
        return "details is not an object"
    return ""


def body_of(line: bytes) -> bytes:
    """The hashed bytes: the line with its trailing hash field cut off and the brace restored."""
    return line[:-_HASH_FIELD_LEN] + b"}"


def with_hash(body: bytes, digest: str) -> bytes:
    return body[:-1] + _HASH_PREFIX + digest.encode("ascii") + b'"}'


def serialise_body(
    *,
    seq: int,
    ts: str,
    kind: str,
    event: str,
    outcome: str,
    subject: str | None,
    run_id: str | None,
    details: Mapping[str, Any],
    prev: str,
    details_json: str | None = None,
) -> bytes:
    """The canonical body: fixed key order, sorted details keys, compact, ASCII only.

    ``details_json``: ``details`` already in that form (:func:`canonical_details_json`), so a
    writer that made it to check the details does not make it twice.
    """
    if details_json is None:
        details_json = canonical_details_json(details)
    names = names_json(_quote(kind), _quote(event), _quote(outcome), _optional(subject),
                       _optional(run_id))
    return (f'{{"seq":{int(seq)},"ts":{_quote(ts)},{names},"details":{details_json},'
            f'"prev":{_quote(prev)}}}').encode("ascii")


def names_json(kind: str, event: str, outcome: str, subject: str | None,
               run_id: str | None) -> str:  # (a name: never empty, so `or` means None)
    """The body's ``kind`` … ``run_id`` members, from each one already quoted (:func:`quote`:
    a writer quotes each token once, not once per record); None for a null."""
    return (f'"kind":{kind},"event":{event},"outcome":{outcome},'
            f'"subject":{subject or "null"},"run_id":{run_id or "null"}')


def serialise_chained(seq: int, ts: str, names: str, details_json: str, prev: str) -> bytes:
    """:func:`serialise_body`'s bytes, for the register's writer: ``ts`` from
    :func:`format_ts` and ``prev`` a hex digest (neither has anything to escape), ``names``
    from :func:`names_json`, ``details_json`` from :func:`canonical_details_json`."""
    return f'{{"seq":{seq},"ts":"{ts}",{names},"details":{details_json},"prev":"{prev}"}}'.encode(
        "ascii")


def quote(value: str) -> str:
    """``value`` as a JSON string, every non-ASCII character escaped (what json.dumps does
    with ensure_ascii, spelled out: about four times cheaper)."""
    return _quote(value)


def new_record(seq: int, ts: datetime, kind: str, event: str, outcome: str,
               subject: str | None, run_id: str | None, details: Mapping[str, Any],
               prev: str, digest: str) -> AuditRecord:
    """``AuditRecord(...)`` for the writer, which makes one per record: the same fields, set
    at half the cost (a frozen dataclass's ``__init__`` sets each through
    ``object.__setattr__``; nothing else runs in it): its ``__dict__`` is given whole."""
    record: AuditRecord = _new(AuditRecord)
    _set(record, "__dict__", {"seq": seq, "ts": ts, "kind": kind, "event": event,
                              "outcome": outcome, "subject": subject, "run_id": run_id,
                              "details": details, "prev": prev, "hash": digest})
    return record


_new = object.__new__
_set = object.__setattr__  # (the frozen dataclass's own refuses every name)


def canonical_details_json(details: Mapping[str, Any]) -> str:
    """``details`` as the register stores it: keys sorted at every level, compact, ASCII."""
    return _CANONICAL.encode(dict(details))


def flat_details(details: Mapping[str, Any]) -> tuple[dict[str, Any], str] | None:
    """For ``details`` whose keys are text and whose values are text, whole numbers, booleans
    or null (most records'): a sorted copy and its canonical JSON, spelled out (about half
    the cost of the encoder, which is built afresh for each call); None for anything else.
    The bytes are those :func:`canonical_details_json` gives."""
    try:
        keys = sorted(details)
    except TypeError:  # keys of several types: not text
        return None
    copied: dict[str, Any] = {}
    parts: list[str] = []
    for key in keys:
        if type(key) is not str:
            return None
        value = details[key]
        kind = type(value)
        if kind is str:
            text = _quote(value)
        elif kind is int:
            text = int.__repr__(value)
        elif kind is bool:
            text = "true" if value else "false"
        elif value is None:
            text = "null"
        else:
            return None
        copied[key] = value
        parts.append(f"{_quote(key)}:{text}")
    return copied, "{" + ",".join(parts) + "}"


def _optional(value: str | None) -> str:
    return "null" if value is None else _quote(value)


def format_ts(ts: datetime) -> str:
    """``ts`` in UTC, ISO 8601 with microseconds (``2026-09-24T10:14:02.118734+00:00``)."""
    if ts.tzinfo is not UTC:
        ts = ts.astimezone(UTC)
    if ts.microsecond:  # isoformat() writes them then; with timespec it costs half as much again
        return ts.isoformat()
    return ts.isoformat(timespec="microseconds")
