"""The Slack adapter: the real slack-bolt and slack_sdk against a fake Slack on loopback.

Nothing here is mocked: ``SlackAdapter`` builds its ``AsyncApp`` and ``AsyncSocketModeHandler``
as in production, pointed at :class:`tests.fakes.slack.FakeSlack` through ``api_url``. The
``on_message`` callback stands in for the router: it records what it is handed and can block
or fail, as a durable write would. Waits are on events the fake and the recorder set.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bothy.chat.base import SLACK_MAX_CHARS, ChatMessage
from bothy.chat.slack import SlackAdapter
from bothy.config import SlackConfig
from bothy.errors import ChatAuthError, ChatError, ChatUnavailable, InboxError
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, FakeSlack

BOT_ENV = "BOTHY_TEST_SLACK_BOT_TOKEN"
APP_ENV = "BOTHY_TEST_SLACK_APP_TOKEN"
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens under the configured names; no proxy (slack_sdk would send loopback calls to it)."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(BOT_ENV, BOT_TOKEN)
    monkeypatch.setenv(APP_ENV, APP_TOKEN)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=0.5) as fake:
        yield fake


class Router:
    """The test's on_message: records each call; can hold it on a gate or fail it."""

    def __init__(self, *, gate: asyncio.Event | None = None, failures: int = 0) -> None:
        self.gate = gate
        self.failures = failures
        self.calls: list[ChatMessage] = []
        self.accepted: list[ChatMessage] = []
        self.entered = asyncio.Event()
        self.returned_at: list[float] = []
        self._changed = asyncio.Event()

    async def __call__(self, message: ChatMessage) -> None:
        self.calls.append(message)
        self.entered.set()
        self._change()
        if self.gate is not None:
            await self.gate.wait()
        if self.failures > 0:
            self.failures -= 1
            raise InboxError("disk full (the test's on_message failed)")
        self.accepted.append(message)
        self.returned_at.append(time.monotonic())
        self._change()

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await self._changed.wait()

    async def wait_accepted(self, count: int = 1) -> None:
        await self.wait_for(lambda: len(self.accepted) >= count)


def _config(api_url: str) -> SlackConfig:
    return SlackConfig(bot_token_env=BOT_ENV, app_token_env=APP_ENV, api_url=api_url)


@contextlib.asynccontextmanager
async def running(
    slack: FakeSlack, router: Router | None = None, **knobs: Any
) -> AsyncIterator[SlackAdapter]:
    adapter = SlackAdapter(_config(slack.api_url), ping_interval_s=1.0, **knobs)
    await adapter.start(router or Router())
    try:
        yield adapter
    finally:
        await adapter.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# ---------------------------------------------------------------- incoming


async def test_a_mention_is_acked_only_after_on_message_returned(slack: FakeSlack) -> None:
    """A mention reaches on_message, and no copy of it is acked until on_message returns."""
    gate = asyncio.Event()
    router = Router(gate=gate)
    async with running(slack, router):
        ts = slack.send_mention("U1", "C1", "what changed this week?")
        await asyncio.wait_for(router.entered.wait(), 10)
        # A whole ack window passes with on_message still running: Slack redelivers, no ack.
        first = slack.envelopes_of(ts)[0]
        await slack.wait_for_delivery(first, attempt=1)
        assert not any(e in slack.acked for e in slack.envelopes_of(ts))

        gate.set()
        await slack.wait_for(lambda: slack.envelopes_acked(ts))

    returned = router.returned_at[0]
    acks = [a for a in slack.acks if a.envelope_id in slack.envelopes_of(ts)]
    assert acks and all(a.at > returned for a in acks)
    assert [m.dedupe_key for m in router.accepted] == [f"C1:{ts}"]
    message = router.accepted[0]
    assert (message.platform, message.channel, message.user) == ("slack", "C1", "U1")
    assert (message.message_id, message.thread) == (ts, ts)
    assert message.text == "what changed this week?"
    assert message.mentioned and not message.in_thread


async def test_twins_and_retries_carry_one_dedupe_key(slack: FakeSlack) -> None:
    """A mention's twins and Slack's retries all carry channel:ts; it is accepted once."""
    router = Router(failures=1)  # the first durable write fails: no ack, Slack retries
    async with running(slack, router):
        ts = slack.send_mention("U1", "C1", "deploy status?")
        await slack.wait_for(lambda: slack.envelopes_acked(ts))

    assert len(slack.envelopes_of(ts)) == 2  # the twins
    assert any(
        d.attempt >= 1 and d.sent
        for d in slack.deliveries
        if d.envelope_id in slack.envelopes_of(ts)
    )  # and at least one retry
    assert len(router.calls) >= 2
    assert {m.dedupe_key for m in router.calls} == {f"C1:{ts}"}
    assert [m.dedupe_key for m in router.accepted] == [f"C1:{ts}"]


async def test_a_thread_reply_without_mention_is_in_thread_and_not_mentioned(
    slack: FakeSlack,
) -> None:
    """A reply in the mention's thread: in_thread, not mentioned, thread = the parent's ts."""
    router = Router()
    async with running(slack, router):
        parent = slack.send_mention("U1", "C1", "start")
        await router.wait_accepted(1)
        reply = slack.send_message("U1", "C1", "and the logs too", thread_ts=parent)
        await router.wait_accepted(2)
        again = slack.send_mention("U2", "C1", "me too", thread_ts=parent)
        await router.wait_accepted(3)

    plain, mention = router.accepted[1], router.accepted[2]
    assert (plain.message_id, plain.thread, plain.text) == (reply, parent, "and the logs too")
    assert plain.in_thread and not plain.mentioned
    assert (mention.message_id, mention.thread, mention.text) == (again, parent, "me too")
    assert mention.in_thread and mention.mentioned


async def test_own_messages_and_other_events_are_acked_and_not_handed_over(
    slack: FakeSlack,
) -> None:
    """The bot's echoed posts, edits and unused event types are acked on first delivery."""
    router = Router()
    async with running(slack, router) as adapter:
        [own] = await adapter.post_alert("C1", "an alert")
        reaction = slack.send_event(
            {
                "type": "reaction_added",
                "user": "U1",
                "reaction": "eyes",
                "item": {"type": "message", "channel": "C1", "ts": own},
            }
        )
        edit = slack.send_event(
            {
                "type": "message",
                "subtype": "message_changed",
                "channel": "C1",
                "ts": "1.000001",
                "message": {},
            }
        )
        await slack.wait_for(lambda: slack.envelopes_acked(own))
        await slack.wait_for_ack(reaction)
        await slack.wait_for_ack(edit)

    assert router.calls == []
    assert all(d.attempt == 0 for d in slack.deliveries)  # acked in time: never redelivered


@pytest.mark.parametrize("drop", ["server close", "disconnect message"])
async def test_after_the_socket_drops_a_later_mention_still_arrives(
    slack: FakeSlack, drop: str
) -> None:
    """Slack closes the socket or asks for a reconnect: the adapter reconnects by itself."""
    router = Router()
    async with running(slack, router):
        await slack.wait_for_connections(1)
        if drop == "server close":
            slack.close_socket(1000)
        else:
            slack.disconnect("refresh_requested")
        await slack.wait_for_connections(2)
        ts = slack.send_mention("U1", "C1", "still there?")
        await slack.wait_for(lambda: slack.envelopes_acked(ts))

    assert [m.dedupe_key for m in router.accepted] == [f"C1:{ts}"]
    assert len(slack.calls_to("apps.connections.open")) >= 2  # a fresh URL for the new socket


# ---------------------------------------------------------------- outgoing


async def test_a_12000_character_answer_is_split_in_order_in_the_thread(slack: FakeSlack) -> None:
    """Every piece ≤ 4,000 characters, posted in the thread, in order, no word lost."""
    words = [f"word{i:05d}" for i in range(1250)]
    text = "\n".join(" ".join(words[i : i + 30]) for i in range(0, len(words), 30))
    assert len(text) >= 12_000
    async with running(slack) as adapter:
        ids = await adapter.post("C1", "1700000000.000001", text)

    assert len(slack.posts) >= 3
    assert ids == [p.ts for p in slack.posts]
    assert all(len(p.text) <= SLACK_MAX_CHARS for p in slack.posts)
    assert all((p.channel, p.thread_ts) == ("C1", "1700000000.000001") for p in slack.posts)
    assert " ".join(p.text for p in slack.posts).split() == words


async def test_a_rate_limited_post_is_retried_after_retry_after(slack: FakeSlack) -> None:
    """HTTP 429 with Retry-After: 1 → the same post is sent again after ≥ 1 s, posted once."""
    async with running(slack) as adapter:
        slack.rate_limit_posts(1, retry_after_s=1)
        ids = await adapter.post("C1", "1700000000.000001", "hello")

    attempts = slack.calls_to("chat.postMessage")
    assert [c.status for c in attempts] == [429, 200]
    assert attempts[1].at - attempts[0].at >= 1.0
    assert [p.text for p in slack.posts] == ["hello"] and ids == [slack.posts[0].ts]


async def test_react_adds_a_reaction_and_already_reacted_is_fine(slack: FakeSlack) -> None:
    """react() uses reactions.add on the message; reacting twice is not an error."""
    router = Router()
    async with running(slack, router) as adapter:
        ts = slack.send_mention("U1", "C1", "hi")
        await router.wait_accepted()
        message = router.accepted[0]
        await adapter.react(message, ":eyes:")
        await adapter.react(message, "eyes")
        assert await adapter.open_thread(message) == ts

    assert slack.reactions == [("C1", ts, "eyes")]


# ---------------------------------------------------------------- start-up and failures


@pytest.mark.parametrize(
    ("env", "token", "error"),
    [
        (BOT_ENV, "xoxb-revoked", "invalid_auth"),
        (APP_ENV, "xapp-revoked", "invalid_auth"),
        (APP_ENV, BOT_TOKEN, "not_allowed_token_type"),
    ],
    ids=["bot-token-refused", "app-token-refused", "bot-token-as-app-token"],
)
async def test_a_refused_token_is_a_chat_auth_error(
    slack: FakeSlack, monkeypatch: pytest.MonkeyPatch, env: str, token: str, error: str
) -> None:
    """A token Slack refuses fails start() with ChatAuthError (exit 78) and opens no socket."""
    monkeypatch.setenv(env, token)
    adapter = SlackAdapter(_config(slack.api_url), ping_interval_s=1.0)
    with pytest.raises(ChatAuthError, match=error):
        await adapter.start(Router())
    assert slack.connections == 0


async def test_a_missing_token_variable_is_a_chat_auth_error_naming_it(
    slack: FakeSlack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unset token variable fails start() with ChatAuthError naming the variable."""
    monkeypatch.delenv(APP_ENV)
    with pytest.raises(ChatAuthError, match=APP_ENV):
        await SlackAdapter(_config(slack.api_url)).start(Router())
    assert slack.calls == []


async def test_an_unreachable_api_is_chat_unavailable() -> None:
    """Nothing listens at the API URL: start() fails with ChatUnavailable (exit 75)."""
    adapter = SlackAdapter(_config(f"http://127.0.0.1:{_closed_port()}/api/"))
    with pytest.raises(ChatUnavailable, match="unreachable") as caught:
        await adapter.start(Router())
    assert type(caught.value.__cause__).__module__.startswith("aiohttp")


async def test_a_socket_that_never_opens_is_chat_unavailable(slack: FakeSlack) -> None:
    """The websocket is refused: start() gives up after connect_timeout_s with ChatUnavailable."""
    slack.refuse_sockets = True
    adapter = SlackAdapter(_config(slack.api_url), ping_interval_s=0.2, connect_timeout_s=1.0)
    with pytest.raises(ChatUnavailable, match="not connected within"):
        await adapter.start(Router())


def _fail_with_api_error(slack: FakeSlack) -> None:
    slack.fail_method("chat.postMessage", error="channel_not_found")


def _fail_with_html_502(slack: FakeSlack) -> None:
    slack.fail_method(
        "chat.postMessage",
        status=502,
        content_type="text/html",
        body="<html><body>Bad Gateway</body></html>",
    )


def _fail_with_plain_503(slack: FakeSlack) -> None:
    slack.fail_method(
        "chat.postMessage", status=503, content_type="text/plain", body="upstream unavailable"
    )


def _fail_with_a_json_list(slack: FakeSlack) -> None:
    # slack_sdk itself breaks on this body (AttributeError): the catch-all branch.
    slack.fail_method("chat.postMessage", body="[1]")


def _fail_with_a_rate_limit_that_persists(slack: FakeSlack) -> None:
    slack.rate_limit_posts(10, retry_after_s=0)


def _fail_with_a_hang(slack: FakeSlack) -> None:
    slack.hang_method("chat.postMessage")


@pytest.mark.parametrize(
    ("provoke", "expected"),
    [
        (_fail_with_api_error, ChatError),
        (_fail_with_html_502, ChatUnavailable),
        (_fail_with_plain_503, ChatUnavailable),
        (_fail_with_a_json_list, ChatError),
        (_fail_with_a_rate_limit_that_persists, ChatUnavailable),
        (_fail_with_a_hang, ChatUnavailable),
    ],
    ids=[
        "api-error",
        "html-502",
        "plain-text-503",
        "json-list",
        "rate-limit-persists",
        "no-answer",
    ],
)
async def test_every_failure_of_a_call_is_a_chat_error(
    slack: FakeSlack, provoke: Callable[[FakeSlack], None], expected: type[ChatError]
) -> None:
    """Each kind of foreign failure reaches the caller as the ChatError it maps to, nothing else."""
    async with running(slack, call_timeout_s=1) as adapter:
        provoke(slack)
        with pytest.raises(ChatError) as caught:
            await adapter.post("C1", "1700000000.000001", "hello")

    error = caught.value
    assert type(error) is expected
    assert error.platform == "slack" and "post in C1" in str(error)
    assert error.__cause__ is not None and not isinstance(error.__cause__, ChatError)


# ---------------------------------------------------------------- shutdown


async def test_stop_is_idempotent_and_leaves_no_task_running(slack: FakeSlack) -> None:
    """stop() twice is fine; afterwards no slack_sdk, slack_bolt or adapter task is left."""
    before = asyncio.all_tasks()
    router = Router(gate=asyncio.Event())  # a mention is still in on_message at stop()
    adapter = SlackAdapter(_config(slack.api_url), ping_interval_s=1.0)
    await adapter.start(router)
    slack.send_mention("U1", "C1", "long one")
    await asyncio.wait_for(router.entered.wait(), 10)
    assert [t for t in asyncio.all_tasks() - before if _is_ours(t)]  # the check can see them

    await adapter.stop()
    await adapter.stop()

    left = [t for t in asyncio.all_tasks() - before if not t.done() and _is_ours(t)]
    assert left == []
    with pytest.raises(RuntimeError, match="stopped"):
        await adapter.post("C1", "1.1", "too late")


def _is_ours(task: asyncio.Task[Any]) -> bool:
    code = getattr(task.get_coro(), "cr_code", None)
    filename = code.co_filename if code is not None else ""
    return any(part in filename for part in ("slack_sdk", "slack_bolt", "bothy"))
