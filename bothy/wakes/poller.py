"""Pollers: outbound polls that wake a run when something new appears (SPEC §5, "Polling").

A :class:`Poller` fetches one source every ``interval_s`` — a URL through the daemon's shared
``httpx.AsyncClient``, or an argv command in a process group of its own — and decides what is
new in what it got:

* ``"changed"``: the whole body, when it differs from the last body seen. Its wake's key is
  ``<change number>:<sha256 of the body>``; the change number counts changes, so a body that
  flips back (A, B, A) wakes each time, while a re-poll of a body already queued does not.
* items (``{"items": "dotted.path", "id": "field"}``): the body is JSON holding a list; each
  item whose id was not in the last list seen wakes one run. Its wake's key is the id.

Each new thing becomes a wake in the :class:`~bothy.wakes.inbox.Inbox` (source ``poll``, route
the poller's name, event ``poll``) and only then is ``on_accepted`` called. Order is what
makes this safe across crashes: the wakes are made durable first and the cursor is advanced
after. A crash in between leaves the old cursor, the next poll finds the same things, and the
inbox's dedupe on (source, route, key) answers "seen before": nothing wakes twice. The cursor
is never advanced past something that is not durable — an ETag saved before its items would
turn the next poll into a 304 and lose them.

The cursor (ETag, Last-Modified, the last body's hash, the ids of the last list, the change
count, the failure streak, when the next poll is due) is one row of the ``pollers`` table, so
it survives restarts. ``If-None-Match`` and ``If-Modified-Since`` are sent from it; a 304 is
"nothing new".

A failure (no connection, no answer within ``timeout_s``, a status other than 2xx or 304, a
body that is too large, or not the JSON list items mode needs — JSON as
:mod:`bothy.wakes.jsonbody` accepts it, nested no deeper than 100 levels — a command that
fails, a wake that cannot be made durable) is a value, not an exception: it is counted, audited
(``poll failed failed``), and the next poll waits ``interval_s × 2^failures``, at most
``max_backoff_s``. The ``alert_after_failures``-th failure in a row writes one
``alert undelivered failed`` record (no alert route exists yet); the first success after
failures writes ``poll recovered ok``.

Header values named by ``headers_env`` are secrets: they are sent, never logged, audited or
put in a failure's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bothy.clock import Clock, to_us
from bothy.config import PollerConfig, PollItems
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.procgroup import ProcessGroup
from bothy.engine.state import StateDB
from bothy.errors import InboxError, ProcessGroupError
from bothy.wakes.delivery import POLL, Delivery
from bothy.wakes.inbox import Accepted, Inbox
from bothy.wakes.jobs import lookup
from bothy.wakes.jsonbody import Unacceptable, parse_body

if TYPE_CHECKING:
    import httpx

__all__ = ["EVENT", "SOURCE", "PollReport", "Poller"]

SOURCE = POLL
"""``Delivery.source`` of every wake a poller queues."""
EVENT = "poll"
"""``Delivery.event`` of every wake a poller queues."""

_COMMAND_ENV = ("PATH", "HOME", "LANG")  # all a command poller inherits
_STDERR_KEEP_BYTES = 4096
_REASON_STDERR_CHARS = 200
_STOP_GRACE_S = 2.0
_MAX_BACKOFF_EXPONENT = 40  # 2^40 × 0.05 s is far past any cap: no float overflow
_MAX_ID_CHARS = 512

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PollReport:
    """What one poll did. A failure is reported here, never raised.

    ``new`` counts the wakes this poll queued (wakes the inbox had seen before are not
    counted). ``not_modified`` is True when there was nothing to look at: a 304, or a body
    identical to the last one. ``failure`` is None on success, else why the poll failed;
    ``consecutive_failures`` is the streak, this poll included (0 after a success).
    ``next_delay_s`` is how long :meth:`Poller.run` waits before the next poll.
    """

    poller: str
    next_delay_s: float
    new: int = 0
    not_modified: bool = False
    failure: str | None = None
    consecutive_failures: int = 0
    skipped_items: int = 0  # items mode: items without a usable id

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class _Cursor:
    """One row of the ``pollers`` table: where the last poll left off."""

    etag: str | None = None
    last_modified: str | None = None
    body_sha256: str | None = None
    seen_ids: frozenset[str] | None = None  # items mode: the ids of the last list
    changes: int = 0  # "changed" mode: how many changes have been queued
    failures: int = 0
    last_failure: str | None = None
    next_due_us: int = 0


@dataclass(frozen=True)
class _Body:
    """A fetched body, with the validators to send next time (HTTP only)."""

    data: bytes
    etag: str | None = None
    last_modified: str | None = None


@dataclass(frozen=True)
class _NotModified:
    """The server answered 304."""


@dataclass(frozen=True)
class _Failed:
    reason: str


@dataclass(frozen=True)
class _New:
    """What is new in a body, and the cursor to save once it is durable."""

    wakes: list[tuple[str, bytes]] = field(default_factory=list)  # (key, body) per wake
    cursor: _Cursor = field(default_factory=_Cursor)
    skipped: int = 0


class Poller:
    """One configured poller: :meth:`poll_once` for a single poll, :meth:`run` for the loop.

    ``http`` is the daemon's shared client (used by URL pollers); ``environ`` is where
    ``headers_env`` and a command's PATH, HOME and LANG are read; ``cwd`` is where a command
    runs. ``on_accepted`` is called once per wake queued (the dispatcher's ``poke``).
    """

    def __init__(
        self,
        name: str,
        cfg: PollerConfig,
        *,
        inbox: Inbox,
        db: StateDB,
        audit: AuditLog,
        clock: Clock,
        http: httpx.AsyncClient,
        environ: Mapping[str, str],
        cwd: Path,
        on_accepted: Callable[[], None],
        alerts: Alerts | None = None,
    ) -> None:
        self.name = name
        self._alerts = alerts or Alerts(audit, site="-", clock=clock)
        self._cfg = cfg
        self._inbox = inbox
        self._db = db
        self._audit = audit
        self._clock = clock
        self._http = http
        self._environ = environ
        self._cwd = cwd
        self._on_accepted = on_accepted
        self._subject = f"{SOURCE}:{name}"  # of its audit records, as schedules use schedule:NAME

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set: wait, poll, wait ``interval_s`` or the back-off, repeat.

        The first poll is due when the persisted cursor says (at once for a new poller), so a
        restart neither hammers a failing source nor forgets a back-off. A poll under way is
        not interrupted by ``stop`` (it is bounded by ``timeout_s``); cancel the task for that.
        Raises only what nobody can plan around: the state database or the audit log failing.
        """
        cursor = await self._load()
        due_in_s = (cursor.next_due_us - to_us(self._clock())) / 1_000_000
        delay_s = min(max(due_in_s, 0.0), self._cfg.max_backoff_s)
        while not await _stopped_within(stop, delay_s):
            report = await self.poll_once()
            delay_s = report.next_delay_s

    # -- one poll ----------------------------------------------------------------------------

    async def poll_once(self) -> PollReport:
        """Fetch, find what is new, make each new thing a durable wake, advance the cursor."""
        cursor = await self._load()
        fetched = await self._fetch(cursor)
        if isinstance(fetched, _Failed):
            return await self._failed(cursor, fetched.reason)
        if isinstance(fetched, _NotModified):
            return await self._succeeded(cursor, cursor, not_modified=True)
        digest = hashlib.sha256(fetched.data).hexdigest()
        seen = replace(cursor, etag=fetched.etag, last_modified=fetched.last_modified)
        if digest == cursor.body_sha256:
            return await self._succeeded(cursor, seen, not_modified=True)
        found = self._find_new(replace(seen, body_sha256=digest), fetched.data, digest)
        if isinstance(found, _Failed):
            return await self._failed(cursor, found.reason)
        queued = 0
        for key, body in found.wakes:
            try:
                outcome = await self._inbox.accept(Delivery(
                    source=SOURCE, route=self.name, key=key, event=EVENT, action=None,
                    headers={}, body=body, received_at=self._clock()))
            except InboxError as exc:
                return await self._failed(cursor, str(exc), new=queued)
            if isinstance(outcome, Accepted):
                queued += 1
                self._on_accepted()
        return await self._succeeded(cursor, found.cursor, new=queued, skipped=found.skipped)

    # -- fetching ----------------------------------------------------------------------------

    async def _fetch(self, cursor: _Cursor) -> _Body | _NotModified | _Failed:
        if self._cfg.command is not None:
            return await self._run_command(self._cfg.command)
        import httpx  # loaded by the daemon's client already; kept off every other start-up
        assert self._cfg.url is not None  # config: exactly one of url and command
        headers = self._secret_headers()
        if isinstance(headers, _Failed):
            return headers
        conditional = dict(headers)
        if cursor.etag is not None:
            conditional["If-None-Match"] = cursor.etag
        if cursor.last_modified is not None:
            conditional["If-Modified-Since"] = cursor.last_modified
        try:
            async with asyncio.timeout(self._cfg.timeout_s):
                return await self._get(self._cfg.url, conditional)
        except TimeoutError:
            return _Failed(f"no answer within {self._cfg.timeout_s:g}s")
        except httpx.TimeoutException:
            return _Failed(f"no answer within {self._cfg.timeout_s:g}s")
        except httpx.ConnectError as exc:
            return _Failed(_redact(f"cannot connect: {exc}", headers.values()))
        except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL) as exc:
            # Translated here: no httpx exception leaves this module.
            return _Failed(_redact(f"{type(exc).__name__}: {exc}", headers.values()))

    def _secret_headers(self) -> dict[str, str] | _Failed:
        """The ``headers_env`` headers, read now: a rotated token needs no restart."""
        headers = {}
        for header, variable in self._cfg.headers_env.items():
            value = self._environ.get(variable)
            if not value:
                return _Failed(f"header {header}: environment variable {variable} is not set")
            if not _valid_header_value(value):
                # Never echo it: httpx and h11 would put the value in their error message.
                return _Failed(f"header {header}: the value of {variable} is not a valid"
                               " header value (control or non-ASCII characters)")
            headers[header] = value
        return headers

    async def _get(self, url: str, headers: dict[str, str]) -> _Body | _NotModified | _Failed:
        request = self._http.build_request("GET", url, headers=headers,
                                           timeout=self._cfg.timeout_s)
        response = await self._http.send(request, stream=True, follow_redirects=False)
        try:
            status = response.status_code
            if status == 304:
                return _NotModified()
            if not 200 <= status < 300:
                hint = " (redirects are not followed: set url to the final address)" if (
                    300 <= status < 400) else ""
                return _Failed(f"HTTP {status} {response.reason_phrase}{hint}".rstrip())
            data = await _read_capped(response.aiter_bytes(), self._cfg.max_body_bytes)
            if data is None:
                return _Failed(f"the body is larger than {self._cfg.max_body_bytes} bytes")
            return _Body(data, response.headers.get("etag"), response.headers.get("last-modified"))
        finally:
            await response.aclose()

    async def _run_command(self, argv: list[str]) -> _Body | _Failed:
        """Run ``argv`` in its own process group with a scrubbed environment; stdout is the body."""
        env = {name: self._environ[name] for name in _COMMAND_ENV if name in self._environ}
        try:
            group = await ProcessGroup.spawn(
                argv, env=env, cwd=self._cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except ProcessGroupError as exc:
            return _Failed(str(exc))
        process = group.process
        assert process.stdout is not None and process.stderr is not None
        stderr_task = asyncio.create_task(_read_tail(process.stderr, _STDERR_KEEP_BYTES))
        try:
            async with asyncio.timeout(self._cfg.timeout_s):
                data = await _read_capped(_chunks(process.stdout), self._cfg.max_body_bytes)
                if data is None:
                    return _Failed(f"the command wrote more than {self._cfg.max_body_bytes}"
                                   " bytes")
                stderr = await stderr_task
                code = await process.wait()
        except TimeoutError:
            return _Failed(f"the command did not finish within {self._cfg.timeout_s:g}s")
        finally:
            stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stderr_task
            # Whatever it left behind in its group (a background child) ends with it.
            await group.stop(grace_s=_STOP_GRACE_S, kill_wait_s=_STOP_GRACE_S)
        if code != 0:
            said = " ".join(stderr.decode(errors="replace").split())[-_REASON_STDERR_CHARS:]
            return _Failed(f"the command exited with code {code}" + (f": {said}" if said else ""))
        return _Body(data)

    # -- what is new -------------------------------------------------------------------------

    def _find_new(self, seen: _Cursor, data: bytes, digest: str) -> _New | _Failed:
        rule = self._cfg.new
        if not isinstance(rule, PollItems):
            change = seen.changes + 1
            return _New([(f"{change}:{digest}", data)], replace(seen, changes=change))
        parsed = parse_body(data)
        if isinstance(parsed, Unacceptable):
            return _Failed(f"the body {parsed.text}")
        document = parsed.value
        items = lookup(document, rule.items) if rule.items else document
        if not isinstance(items, list):
            where = f"'{rule.items}'" if rule.items else "the body"
            return _Failed(f"{where} is not a JSON list (found {_json_type(items)})")
        wakes: list[tuple[str, bytes]] = []
        ids: set[str] = set()
        skipped = 0
        for item in items:
            ident = _item_id(item, rule.id)
            if ident is None:
                skipped += 1
                continue
            ids.add(ident)
            if seen.seen_ids is None or ident not in seen.seen_ids:
                wakes.append((ident, _encode_item(item)))
        if skipped:
            _log.warning("poller %s: %d item(s) without a string or integer %r were skipped",
                         self.name, skipped, rule.id)
        return _New(wakes, replace(seen, seen_ids=frozenset(ids)), skipped)

    # -- settling ----------------------------------------------------------------------------

    async def _succeeded(
        self, before: _Cursor, after: _Cursor, *, new: int = 0, not_modified: bool = False,
        skipped: int = 0,
    ) -> PollReport:
        delay_s = self._cfg.interval_s
        await self._save(replace(after, failures=0, last_failure=None,
                                 next_due_us=self._due_us(delay_s)))
        if before.failures:
            await self._audit.record("poll", "recovered", "ok", subject=self._subject, details={
                "after_failures": before.failures, "last_failure": before.last_failure,
            })
        return PollReport(self.name, delay_s, new=new, not_modified=not_modified,
                          skipped_items=skipped)

    async def _failed(self, before: _Cursor, reason: str, *, new: int = 0) -> PollReport:
        failures = before.failures + 1
        delay_s = self.backoff_s(failures)
        # The cursor stays where it was: nothing after the failure is treated as seen.
        await self._save(replace(before, failures=failures, last_failure=reason,
                                 next_due_us=self._due_us(delay_s)))
        await self._audit.record("poll", "failed", "failed", subject=self._subject, details={
            "reason": reason, "consecutive_failures": failures, "retry_in_s": delay_s,
        })
        if failures == self._cfg.alert_after_failures:  # once per streak
            await self._alerts.raise_alert(
                f"poller {self.name}", f"{failures} polls failed in a row; the last: {reason}",
                subject=self._subject,
            )
        return PollReport(self.name, delay_s, new=new, failure=reason,
                          consecutive_failures=failures)

    def backoff_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row: interval × 2^n, capped."""
        exponent = min(failures, _MAX_BACKOFF_EXPONENT)
        delay_s: float = self._cfg.interval_s * 2**exponent
        return min(delay_s, self._cfg.max_backoff_s)

    def _due_us(self, delay_s: float) -> int:
        return to_us(self._clock()) + int(delay_s * 1_000_000)

    # -- the cursor --------------------------------------------------------------------------

    async def _load(self) -> _Cursor:
        row = await self._db.fetch_one("SELECT * FROM pollers WHERE name = ?", (self.name,))
        if row is None:
            return _Cursor()
        seen_ids = None
        if row["seen_ids"] is not None:
            seen_ids = frozenset(str(ident) for ident in json.loads(row["seen_ids"]))
        return _Cursor(
            etag=row["etag"], last_modified=row["last_modified"],
            body_sha256=row["body_sha256"], seen_ids=seen_ids, changes=int(row["changes"]),
            failures=int(row["failures"]), last_failure=row["last_failure"],
            next_due_us=int(row["next_due_us"]),
        )

    async def _save(self, cursor: _Cursor) -> None:
        seen_ids = None if cursor.seen_ids is None else json.dumps(sorted(cursor.seen_ids))
        await self._db.atomic(
            "INSERT INTO pollers (name, etag, last_modified, body_sha256, seen_ids, changes,"
            " failures, last_failure, next_due_us, polled_us)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET etag = excluded.etag,"
            " last_modified = excluded.last_modified, body_sha256 = excluded.body_sha256,"
            " seen_ids = excluded.seen_ids, changes = excluded.changes,"
            " failures = excluded.failures, last_failure = excluded.last_failure,"
            " next_due_us = excluded.next_due_us, polled_us = excluded.polled_us",
            (self.name, cursor.etag, cursor.last_modified, cursor.body_sha256, seen_ids,
             cursor.changes, cursor.failures, cursor.last_failure, cursor.next_due_us,
             to_us(self._clock())),
        )


# -- helpers -----------------------------------------------------------------------------------


async def _stopped_within(stop: asyncio.Event, delay_s: float) -> bool:
    """Wait up to ``delay_s`` for ``stop``; True if it is set."""
    if stop.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay_s):
            await stop.wait()
    return stop.is_set()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(65_536):
        yield chunk


async def _read_capped(chunks: AsyncIterable[bytes], limit_bytes: int) -> bytes | None:
    """Everything ``chunks`` yields, or None as soon as it passes ``limit_bytes``."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit_bytes:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def _read_tail(reader: asyncio.StreamReader, keep_bytes: int) -> bytes:
    """Read ``reader`` to its end; keep the last ``keep_bytes``."""
    tail = b""
    while chunk := await reader.read(65_536):
        tail = (tail + chunk)[-keep_bytes:]
    return tail


def _item_id(item: Any, dotted: str) -> str | None:
    value = lookup(item, dotted)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    ident = str(value)
    return ident if 0 < len(ident) <= _MAX_ID_CHARS else None


def _encode_item(item: Any) -> bytes:
    return json.dumps(item, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()


def _json_type(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "an object", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _valid_header_value(value: str) -> bool:
    # RFC 9110 §5.5: visible ASCII, spaces and tabs; no CR, LF or NUL.
    return all(char == "\t" or " " <= char <= "~" for char in value)


def _redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return text
