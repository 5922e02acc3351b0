"""Signed webhooks (SPEC §5; rules 3, 4, 6): real HTTP against the real listener on loopback.

Each delivery is built and signed by ``tests.fakes.github`` exactly as GitHub would send it;
what is checked is what the sender hears (the status), what the operator reads (the audit
records) and what the dispatcher will find (the wake rows and the payload files).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import stat
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from bothy.config import WebhookJob, WebhookRoute
from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.state import StateDB
from bothy.errors import ListenerError, TemporaryFailure
from bothy.wakes.delivery import ignored_in
from bothy.wakes.httpserver import ReadDeadlines
from bothy.wakes.inbox import Inbox, WakeRow
from bothy.wakes.webhook import WebhookListener
from tests.fakes import github

OLD_SECRET = "It's a Secret to Everybody"
NEW_SECRET = "rotated-8d41e7b2-secret"
DEPLOY_SECRET = "deploy-hmac-secret"
LIMIT_BYTES = 16_384
_JOBS = [WebhookJob(event=event, prompt="Look at it.")
         for event in ("pull_request", "push", "issue_comment")]
ROUTES = {
    "github": WebhookRoute(kind="github", path="/hooks/github", jobs=_JOBS,
                           secret_env=["GH_SECRET", "GH_SECRET_NEXT"], max_body_bytes=LIMIT_BYTES),
    "deploys": WebhookRoute(kind="hmac", path="/hooks/deploys", secret_env=["DEPLOY_SECRET"],
                            jobs=[WebhookJob(event="deploy.finished", prompt="Check it.")]),
    "unset": WebhookRoute(kind="github", path="/hooks/unset",
                          secret_env=["UNSET_SECRET", "EMPTY_SECRET"]),
    "funnel": WebhookRoute(kind="github", path="/hooks/funnel", public=True,
                           secret_env=["GH_SECRET"]),
}
ENVIRON = {"GH_SECRET": OLD_SECRET, "GH_SECRET_NEXT": NEW_SECRET,
           "DEPLOY_SECRET": DEPLOY_SECRET, "EMPTY_SECRET": ""}
REQUEST_TIMEOUT_S = 10.0
DEADLINES = ReadDeadlines(headers_s=1.0, body_s=1.0)  # short, so slow senders show quickly


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 9, 24, 10, 14, 2, 118734, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class _Door:
    """One running listener with everything behind it."""

    client: httpx.AsyncClient
    listener: WebhookListener
    inbox: Inbox
    db: StateDB
    audit: AuditLog
    clock: _Clock
    inbox_dir: Path
    pokes: list[None] = field(default_factory=list)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        return await self.client.post(path, content=body, headers=headers)

    def records(self) -> list[AuditRecord]:
        return list(self.audit.records())

    async def wakes(self) -> list[WakeRow]:
        rows = await self.db.fetch_all("SELECT * FROM wakes ORDER BY id")
        return [WakeRow.from_row(row) for row in rows]

    def payload_files(self) -> list[Path]:
        if not self.inbox_dir.is_dir():
            return []
        return sorted(self.inbox_dir.iterdir())


@pytest.fixture
async def door(tmp_path: Path) -> AsyncIterator[_Door]:
    clock = _Clock()
    async with StateDB.open(tmp_path / "bothy.sqlite3") as db:
        audit = AuditLog(tmp_path / "audit.jsonl", clock=clock)
        inbox_dir = tmp_path / "inbox"
        inbox = Inbox(inbox_dir, db, clock=clock, audit=audit)
        pokes: list[None] = []
        listener = WebhookListener(ROUTES, public=False, inbox=inbox, audit=audit,
                                   environ=ENVIRON, clock=clock,
                                   on_accepted=lambda: pokes.append(None),
                                   deadlines=DEADLINES)
        port = await listener.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=REQUEST_TIMEOUT_S) as client:
                yield _Door(client, listener, inbox, db, audit, clock, inbox_dir, pokes)
        finally:
            await listener.stop()


def _pull_request(secret: str = OLD_SECRET, **overrides: Any) -> tuple[bytes, dict[str, str]]:
    body = github.encode(github.pull_request_opened(**overrides))
    return body, github.headers("pull_request", body, secret)


def _hmac_headers(body: bytes, *, event: str = "deploy.finished",
                  delivery: str = "dep-0001") -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Event": event, "X-Delivery-Id": delivery,
            "X-Signature-256": github.sign(DEPLOY_SECRET, body)}


# -- the signature ---------------------------------------------------------------------------


def test_sign_matches_githubs_official_test_vector() -> None:
    """The fake signs like GitHub: the documented secret and payload give the documented digest."""
    assert github.sign("It's a Secret to Everybody", b"Hello, World!") == (
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    )


# -- accepted --------------------------------------------------------------------------------


async def test_signed_pull_request_is_queued_durably_before_the_200(door: _Door) -> None:
    """A signed pull_request gets a 200 only once its file and its queued row exist."""
    body, headers = _pull_request()

    response = await door.post("/hooks/github", body, headers)

    assert response.status_code == 200
    assert response.json() == {"status": "queued", "delivery": headers["X-GitHub-Delivery"]}
    [wake] = await door.wakes()
    assert (wake.source, wake.route, wake.event, wake.action, wake.status, wake.attempts) == (
        "webhook", "github", "pull_request", "opened", "queued", 0)
    assert wake.key == f"{headers['X-GitHub-Delivery']}:{github.HOOK_ID}"
    [payload] = door.payload_files()
    assert payload.name == wake.file
    assert stat.S_IMODE(payload.stat().st_mode) == 0o600
    assert stat.S_IMODE(door.inbox_dir.stat().st_mode) == 0o700
    delivery = await door.inbox.load(wake)
    assert delivery.body == body
    assert delivery.headers["x-github-event"] == "pull_request"
    assert door.pokes == [None]
    assert door.records() == []  # the dispatcher records "wake received", not the listener


async def test_delivery_signed_with_the_rotated_secret_is_accepted(door: _Door) -> None:
    """During a rotation either configured secret is accepted."""
    body, headers = _pull_request(secret=NEW_SECRET)

    response = await door.post("/hooks/github", body, headers)

    assert response.status_code == 200
    assert len(await door.wakes()) == 1


async def test_redelivered_delivery_gets_200_and_is_queued_once(door: _Door) -> None:
    """A delivery seen before is answered 200 (the sender did nothing wrong), not queued again."""
    body, headers = _pull_request()

    first = await door.post("/hooks/github", body, headers)
    again = await door.post("/hooks/github", body, headers)

    assert (first.status_code, first.json()["status"]) == (200, "queued")
    assert (again.status_code, again.json()["status"]) == (200, "duplicate")
    assert len(await door.wakes()) == 1
    assert len(door.payload_files()) == 1
    assert door.pokes == [None]
    assert door.records() == []


async def test_simultaneous_copies_of_one_delivery_queue_one_wake(door: _Door) -> None:
    """Ten copies of one delivery racing each other: all get 200, exactly one is queued."""
    body, headers = _pull_request()

    responses = await asyncio.gather(*(door.post("/hooks/github", body, headers)
                                       for _ in range(10)))

    assert [r.status_code for r in responses] == [200] * 10
    assert sorted(r.json()["status"] for r in responses) == ["duplicate"] * 9 + ["queued"]
    assert len(await door.wakes()) == 1


async def test_a_delivery_no_job_wants_is_closed_ignored_at_intake(door: _Door) -> None:
    """A signed delivery of an event no job of its route takes is 200 `ignored` once durable
    and recorded `wake ignored` (naming it); its payload is not kept; nothing is queued and
    the dispatcher is not woken."""
    body = github.encode(github.push())
    headers = github.headers("release", body, OLD_SECRET)

    response = await door.post("/hooks/github", body, headers)

    assert response.status_code == 200
    assert response.json() == {"status": "ignored", "delivery": headers["X-GitHub-Delivery"],
                               "reason": "no job of route 'github' matches event release"}
    [wake] = await door.wakes()
    assert (wake.event, wake.status) == ("release", "ignored")
    assert wake.file == "" and wake.payload_at is None  # nothing will run it: no payload
    assert door.pokes == []
    [record] = door.records()
    assert record.human_line().split()[2:] == ["wake", "ignored", "refused", "github", "-"]
    assert [(d.key, d.reason) for d in ignored_in(record.details)] == [
        (wake.key, "no job of route 'github' matches event release")]
    again = await door.post("/hooks/github", body, headers)
    assert again.json()["status"] == "duplicate" and len(door.records()) == 1


async def test_one_event_sent_by_two_hooks_is_two_wakes(door: _Door) -> None:
    """GitHub's delivery GUID names the event, so the hook id is part of the dedupe key."""
    body = github.encode(github.push())
    guid = str(uuid.uuid4())

    for hook_id in ("111", "222"):
        response = await door.post("/hooks/github", body, github.headers(
            "push", body, OLD_SECRET, delivery=guid, hook_id=hook_id))
        assert response.json()["status"] == "queued"

    assert sorted(w.key for w in await door.wakes()) == [f"{guid}:111", f"{guid}:222"]


async def test_issue_comment_and_push_are_queued_with_their_event_and_action(
    door: _Door,
) -> None:
    """Each event is queued with its X-GitHub-Event and its payload's action (if any)."""
    for event, payload in (("issue_comment", github.issue_comment_created()),
                           ("push", github.push())):
        body = github.encode(payload)
        response = await door.post("/hooks/github", body, github.headers(event, body, OLD_SECRET))
        assert response.status_code == 200

    assert [(w.event, w.action) for w in await door.wakes()] == [
        ("issue_comment", "created"), ("push", None)]


async def test_ping_is_answered_and_audited_but_not_queued(door: _Door) -> None:
    """GitHub's ping (sent when the hook is created) gets a 200 and an audit record, no wake."""
    body = github.encode(github.ping())
    headers = github.headers("ping", body, OLD_SECRET)

    response = await door.post("/hooks/github", body, headers)

    assert response.status_code == 200
    [record] = door.records()
    assert (record.kind, record.event, record.outcome, record.subject) == (
        "webhook", "ping", "ok", "github")
    assert record.details["delivery"] == headers["X-GitHub-Delivery"]
    assert record.details["hook_id"] == github.HOOK_ID
    assert await door.wakes() == []
    assert door.payload_files() == []
    assert door.pokes == []


async def test_signed_hmac_route_delivery_is_queued_under_its_delivery_id(door: _Door) -> None:
    """A generic HMAC route reads its own event, delivery and signature headers."""
    body = json.dumps({"action": "finished", "service": "billing"}).encode()

    response = await door.post("/hooks/deploys", body, _hmac_headers(body))

    assert response.status_code == 200
    [wake] = await door.wakes()
    assert (wake.route, wake.key, wake.event, wake.action) == (
        "deploys", "dep-0001", "deploy.finished", "finished")


async def test_sender_that_expects_100_continue_is_told_to_go_on(door: _Door) -> None:
    """A sender that waits for "100 Continue" (curl, for bodies over 1 KiB) gets it, then a 200."""
    body, headers = _pull_request()
    port = door.client.base_url.port
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST /hooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
                     f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(body)
            final = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
        await writer.wait_closed()

    assert interim.startswith(b"HTTP/1.1 100 Continue")
    assert final.startswith(b"HTTP/1.1 200")
    assert len(await door.wakes()) == 1


# -- refused ---------------------------------------------------------------------------------


def _without(headers: dict[str, str], name: str) -> dict[str, str]:
    return {key: value for key, value in headers.items() if key != name}


def _bad_input_cases() -> list[Any]:
    body, headers = _pull_request()
    big = github.encode(github.pull_request_opened(body="x" * (LIMIT_BYTES + 4000)))
    tampered = body.replace(b"Fix the flaky retry", b"Drop the production db")
    form = b"payload=" + body
    array = b'[{"action": "opened"}]'
    hmac_body = b'{"service": "billing"}'
    return [
        pytest.param("POST", "/hooks/nowhere", body, headers, 404,
                     "no route at '/hooks/nowhere'", id="unknown-path"),
        pytest.param("GET", "/hooks/github", b"", headers, 405, "method GET is not POST",
                     id="wrong-method"),
        pytest.param("POST", "/hooks/github", body, _without(headers, "X-GitHub-Event"), 400,
                     "no X-GitHub-Event header", id="missing-event"),
        pytest.param("POST", "/hooks/github", body, _without(headers, "X-GitHub-Delivery"), 400,
                     "no X-GitHub-Delivery header", id="missing-delivery"),
        pytest.param("POST", "/hooks/github", body, {**headers, "X-GitHub-Event": "pull request"},
                     400, "malformed X-GitHub-Event header", id="malformed-event"),
        pytest.param("POST", "/hooks/github", big,
                     github.headers("pull_request", big, OLD_SECRET), 413,
                     f"body of {len(big):,} bytes is over the route's limit of 16,384",
                     id="declared-too-large"),
        pytest.param("POST", "/hooks/github", "chunked", github.headers(
                     "pull_request", big, OLD_SECRET), 413,
                     "over the route's limit of 16,384", id="chunked-too-large"),
        pytest.param("POST", "/hooks/github", body, _without(headers, "X-Hub-Signature-256"),
                     401, "no X-Hub-Signature-256 header", id="missing-signature"),
        pytest.param("POST", "/hooks/github", body, {**headers, "X-Hub-Signature-256": "sha1=ab"},
                     401, "signature is not of the form sha256=<64 hex>", id="malformed-signature"),
        pytest.param("POST", "/hooks/github", body, github.headers(
                     "pull_request", body, "not-the-secret"), 401,
                     "signature does not match the body", id="wrong-secret"),
        pytest.param("POST", "/hooks/github", tampered, headers, 401,
                     "signature does not match the body", id="tampered-body"),
        pytest.param("POST", "/hooks/github", form, github.headers(
                     "pull_request", form, OLD_SECRET), 400, "body is not JSON",
                     id="form-encoded"),
        pytest.param("POST", "/hooks/github", array, github.headers(
                     "pull_request", array, OLD_SECRET), 400,
                     "body is JSON but not an object (list)", id="json-array"),
        pytest.param("POST", "/hooks/deploys", hmac_body, _without(
                     _hmac_headers(hmac_body), "X-Event"), 400, "no X-Event header",
                     id="hmac-missing-event"),
        pytest.param("POST", "/hooks/deploys", hmac_body, {
                     **_hmac_headers(hmac_body), "X-Signature-256": github.sign("x", hmac_body)},
                     401, "signature does not match the body", id="hmac-bad-signature"),
    ]


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 1000):
        yield body[start:start + 1000]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "reason"),
                         _bad_input_cases())
async def test_bad_input_is_refused_with_its_status_and_one_audit_record(
    door: _Door, method: str, path: str, body: bytes | str, headers: dict[str, str],
    status: int, reason: str,
) -> None:
    """Each kind of bad delivery gets its exact 4xx, one audit record, and never a wake."""
    content: bytes | AsyncIterator[bytes]
    if body == "chunked":  # no Content-Length: the limit is found while reading
        big = github.encode(github.pull_request_opened(body="x" * (LIMIT_BYTES + 4000)))
        content = _chunks(big)
    else:
        assert isinstance(body, bytes)
        content = body

    response = await door.client.request(method, path, content=content, headers=headers)

    assert response.status_code == status
    assert "error" in response.json()
    [record] = door.records()
    assert (record.kind, record.event, record.outcome) == ("webhook", "refused", "refused")
    assert record.details["status"] == status
    assert reason in record.details["reason"]
    assert record.details["remote"] == "127.0.0.1"
    route = None if status == 404 else path.rsplit("/", 1)[1]
    assert (record.subject, record.details["route"]) == (route, route)
    if status == 405:
        assert response.headers["Allow"] == "POST"
    assert await door.wakes() == []
    assert door.payload_files() == []
    assert door.pokes == []
    _assert_no_secret_or_body_in(door.audit.path)


async def test_sender_that_hangs_up_mid_body_leaves_one_refusal_and_no_wake(door: _Door) -> None:
    """A body cut short by the sender is refused (audited as unreadable), never half-queued."""
    body, headers = _pull_request()
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    reader, writer = await asyncio.open_connection("127.0.0.1", door.client.base_url.port)
    writer.write(f"POST /hooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:100])
    writer.write_eof()
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        await reader.read()  # until the listener closes the connection
    writer.close()
    await writer.wait_closed()

    await door.listener.stop()  # waits for the request under way

    [record] = door.records()
    assert (record.event, record.details["status"]) == ("refused", 400)
    assert record.details["reason"].startswith("body could not be read")
    assert record.details["delivery"] == headers["X-GitHub-Delivery"]
    assert await door.wakes() == []


async def test_route_without_any_secret_set_answers_503_and_says_so(door: _Door) -> None:
    """A route whose secret variables are unset or empty cannot check anything: 503, audited."""
    body, headers = _pull_request()

    response = await door.post("/hooks/unset", body, headers)

    assert response.status_code == 503
    [record] = door.records()
    assert (record.kind, record.event, record.outcome, record.subject) == (
        "webhook", "misconfigured", "failed", "unset")
    assert record.details["reason"] == (
        "no secret is configured: none of UNSET_SECRET, EMPTY_SECRET is set")
    assert await door.wakes() == []


async def test_delivery_that_cannot_be_made_durable_gets_503_and_a_retry_succeeds(
    door: _Door,
) -> None:
    """When the payload cannot reach the disk the sender hears 503 (retry); nothing is queued."""
    door.inbox_dir.write_text("not a directory\n")  # root ignores modes; a file stops mkdir
    body, headers = _pull_request()

    refused = await door.post("/hooks/github", body, headers)

    assert refused.status_code == 503
    assert await door.wakes() == []
    [record] = door.records()
    assert (record.event, record.outcome, record.details["status"]) == ("refused", "failed", 503)
    assert "cannot be made durable" in record.details["reason"]
    assert record.details["delivery"] == headers["X-GitHub-Delivery"]
    assert door.pokes == []

    door.inbox_dir.unlink()
    retried = await door.post("/hooks/github", body, headers)

    assert (retried.status_code, retried.json()["status"]) == (200, "queued")
    assert len(await door.wakes()) == 1


async def test_flood_of_bad_signatures_is_audited_at_most_twenty_a_minute(door: _Door) -> None:
    """100 forged deliveries leave 20 refusal records, then one record counting the other 80."""
    body, headers = _pull_request(secret="forged")

    statuses = [(await door.post("/hooks/github", body, headers)).status_code
                for _ in range(100)]

    assert statuses == [401] * 100
    assert [r.event for r in door.records()] == ["refused"] * 20
    door.clock.advance(61)
    assert (await door.post("/hooks/github", body, headers)).status_code == 401
    records = door.records()
    assert [r.event for r in records] == ["refused"] * 20 + ["suppressed", "refused"]
    summary = records[20]
    assert (summary.kind, summary.outcome, summary.subject) == ("webhook", "refused", "github")
    assert (summary.details["suppressed"], summary.details["recorded"]) == (80, 20)
    assert await door.wakes() == []


async def test_suppressed_refusals_are_summarised_when_the_listener_stops(door: _Door) -> None:
    """Refusals still being counted when intake stops are summarised, not lost."""
    body, headers = _pull_request(secret="forged")
    for _ in range(25):
        await door.post("/hooks/github", body, headers)

    await door.listener.stop()

    records = door.records()
    assert [r.event for r in records] == ["refused"] * 20 + ["suppressed"]
    assert records[-1].details["suppressed"] == 5


async def test_each_listener_serves_only_its_own_side(door: _Door) -> None:
    """A public route is not found on the tailnet door, nor a tailnet route on the public one."""
    public = WebhookListener(ROUTES, public=True, inbox=door.inbox, audit=door.audit,
                             environ=ENVIRON, clock=door.clock)
    port = await public.start("127.0.0.1", 0)
    body, headers = _pull_request()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     timeout=REQUEST_TIMEOUT_S) as outside:
            on_public = await outside.post("/hooks/github", content=body, headers=headers)
            funnel_on_public = await outside.post("/hooks/funnel", content=body, headers=headers)
        funnel_on_tailnet = await door.post("/hooks/funnel", body, headers)
    finally:
        await public.stop()

    assert on_public.status_code == 404
    assert funnel_on_tailnet.status_code == 404
    assert funnel_on_public.status_code == 200
    [wake] = await door.wakes()
    assert wake.route == "funnel"


async def test_listener_that_cannot_bind_names_host_and_port(door: _Door) -> None:
    """A taken port is a temporary failure naming host:port, not an aiohttp exception."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        second = WebhookListener(ROUTES, public=False, inbox=door.inbox, audit=door.audit,
                                 environ=ENVIRON, clock=door.clock)

        with pytest.raises(ListenerError, match=f"127.0.0.1:{port}") as caught:
            await second.start("127.0.0.1", port)

    assert isinstance(caught.value, TemporaryFailure)
    assert (caught.value.host, caught.value.port) == ("127.0.0.1", port)


# --- bodies that are JSON but not acceptable (issue 10 item 3) ------------------------------


def _nested(levels: int) -> bytes:
    """A pull_request payload whose ``body`` holds ``levels`` - 1 nested lists (the payload
    object itself is the first level)."""
    inner = "[" * (levels - 2) + "1" + "]" * (levels - 2)
    return b'{"action": "opened", "body": [' + inner.encode() + b"]}"


@pytest.mark.parametrize(("body", "reason"), [
    pytest.param(_nested(1_000), "nested deeper than 100 levels", id="1000-levels"),
    pytest.param(_nested(8_000), "nested deeper than 100 levels", id="8000-levels"),
    pytest.param(_nested(101), "nested deeper than 100 levels", id="101-levels"),
    pytest.param(b'{"action": "opened", "title": "\\ud800"}',
                 "not Unicode (a lone surrogate)", id="lone-surrogate"),
    # json.loads decodes bytes with surrogatepass: a surrogate's three bytes, and UTF-16.
    pytest.param(b'{"action": "opened", "title": "\xed\xa0\x80"}',
                 "not Unicode (a lone surrogate)", id="surrogate-bytes"),
    pytest.param('{"action": "opened", "title": "\ud800"}'.encode("utf-16", "surrogatepass"),
                 "not Unicode (a lone surrogate)", id="utf-16-surrogate"),
    pytest.param(b'{"action": "opened", "title": "caf\xe9"}', "body is not JSON",
                 id="latin-1"),
    pytest.param(b'"opened"', "not an object (str)", id="json-string"),
    pytest.param(b"", "body is not JSON", id="empty"),
])
async def test_signed_body_that_is_no_acceptable_object_is_a_400_with_its_record(
    door: _Door, body: bytes, reason: str
) -> None:
    """A correctly signed body that is not an acceptable JSON object gets a 400 and one
    refusal record naming why and the delivery, never a 500 or a wake."""
    headers = github.headers("pull_request", body, OLD_SECRET)

    response = await door.post("/hooks/github", body, headers)

    assert response.status_code == 400, response.text
    [record] = door.records()
    assert (record.event, record.details["status"]) == ("refused", 400)
    assert reason in record.details["reason"]
    assert record.details["delivery"] == headers["X-GitHub-Delivery"]
    assert await door.wakes() == []


async def test_body_nested_exactly_one_hundred_levels_is_queued(door: _Door) -> None:
    """The nesting limit is 100 levels: a body at the limit is a delivery like any other."""
    body = _nested(100)

    response = await door.post("/hooks/github", body, github.headers("pull_request", body,
                                                                     OLD_SECRET))

    assert (response.status_code, response.json()["status"]) == (200, "queued")
    assert len(await door.wakes()) == 1


# --- refusal records name the delivery, summaries name the kinds (item 9) ---------------------


@pytest.mark.parametrize(("path", "drop", "status"), [
    pytest.param("/hooks/nowhere", None, 404, id="unknown-path"),
    pytest.param("/hooks/github", "X-GitHub-Event", 400, id="missing-event"),
    pytest.param("/hooks/github", "X-Hub-Signature-256", 401, id="missing-signature"),
    pytest.param("/hooks/github", "big", 413, id="declared-too-large"),
])
async def test_every_refusal_names_the_delivery_the_sender_sent(
    door: _Door, path: str, drop: str | None, status: int
) -> None:
    """404, 413 and missing-header refusals carry the delivery id too when one was sent."""
    body, headers = _pull_request()
    if drop == "big":
        body = github.encode(github.pull_request_opened(body="x" * (LIMIT_BYTES + 4000)))
        headers = github.headers("pull_request", body, OLD_SECRET)
    elif drop is not None:
        headers = _without(headers, drop)

    response = await door.post(path, body, headers)

    assert response.status_code == status
    [record] = door.records()
    assert record.details["delivery"] == headers["X-GitHub-Delivery"]


async def test_suppressed_record_counts_each_kind_it_folds_in(door: _Door) -> None:
    """A flood of mixed refusals is summarised by kind: which refusals, how many of each."""
    forged_body, forged = _pull_request(secret="forged")
    body, headers = _pull_request()
    for _ in range(30):
        await door.post("/hooks/github", forged_body, forged)
    for _ in range(7):
        await door.post("/hooks/github", body, _without(headers, "X-Hub-Signature-256"))
    await door.client.get("/hooks/github")

    await door.listener.stop()

    summary = door.records()[-1]
    assert summary.event == "suppressed"
    assert summary.details["suppressed"] == 18
    assert summary.details["kinds"] == {"401 bad signature": 10,
                                        "401 signature required": 7, "405 use POST": 1}


# --- slow senders and requests aiohttp rejects (item 8) ---------------------------------------


async def _raw(door: _Door, data: bytes, *, then_wait: bool = True) -> bytes:
    """Send ``data`` on a raw connection; return what the listener answered before closing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", door.client.base_url.port)
    writer.write(data)
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            return await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_sender_too_slow_with_its_headers_is_answered_408_and_cut_off(door: _Door) -> None:
    """Headers still incomplete at the deadline: 408, the connection closed, one record."""
    answer = await _raw(door, b"POST /hooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Git")

    assert answer.startswith(b"HTTP/1.1 408 ")
    await door.listener.stop()
    [record] = door.records()
    assert (record.event, record.details["status"], record.details["route"]) == (
        "refused", 408, None)
    assert record.details["reason"] == "request headers not received within 1 s"


async def test_sender_too_slow_with_its_body_is_answered_408_with_its_delivery(
    door: _Door,
) -> None:
    """A body still incomplete at its deadline: 408, closed, the refusal names the delivery."""
    body, headers = _pull_request()
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())

    answer = await _raw(door, f"POST /hooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
                        f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:100])

    assert answer.startswith(b"HTTP/1.1 408 ")
    [record] = door.records()
    assert (record.details["status"], record.details["reason"]) == (
        408, "body not received within 1 s")
    assert record.details["delivery"] == headers["X-GitHub-Delivery"]
    assert await door.wakes() == []


MALFORMED_REQUESTS = [
    pytest.param(b"POST /hooks/github HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_240
                 + b"\r\n\r\n", id="10kb-header"),
    pytest.param(b"POST /hooks/github HTTP/1.1\rHost: x\r\n\r\n", id="bare-cr"),
    pytest.param(b"POST /hooks/github HTTP/1.1\r\nHost: x\x00y\r\n\r\n", id="nul"),
    pytest.param(b"POST /hooks/\x00 HTTP/1.1\r\nHost: x\r\n\r\n", id="nul-in-path"),
]


@pytest.mark.parametrize("data", MALFORMED_REQUESTS)
async def test_request_the_parser_rejects_is_a_400_record_and_no_traceback(
    door: _Door, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A request aiohttp rejects before the handler is answered 400 and audited, and the log
    holds one line for it, never a traceback."""
    answers = [await _raw(door, data) for _ in range(5)]
    await door.listener.stop()

    assert all(answer.split(b" ", 2)[1] == b"400" for answer in answers), answers
    records = door.records()
    assert [(r.event, r.details["status"]) for r in records] == [("refused", 400)] * 5
    assert records[0].details["reason"].startswith("malformed request (")
    logged = [r for r in caplog.records if r.name.startswith(("aiohttp", "bothy"))]
    assert [r.exc_info for r in logged] == [None] * len(logged)
    assert len([r for r in logged if "before reading it:" in r.getMessage()]) == 1
    [summary] = [r.getMessage() for r in logged if "more requests refused" in r.getMessage()]
    assert "4 more requests refused before reading them" in summary


def _assert_no_secret_or_body_in(audit_path: Path) -> None:
    if not audit_path.exists():
        return
    text = audit_path.read_text()
    for secret in (OLD_SECRET, NEW_SECRET, DEPLOY_SECRET):
        assert secret not in text
    assert "Fix the flaky retry" not in text
    assert "Drop the production db" not in text
