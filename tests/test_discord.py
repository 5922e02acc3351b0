"""The Discord adapter: the real discord.py against a fake Discord on loopback.

discord.py runs unpatched: its aiohttp connector resolves discord.com and the gateway hosts to
the fake and trusts a throwaway CA (tests/fakes/discord.py; chat-testing.md option B), so
nothing process-global is changed and nothing needs restoring between tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from bothy.chat.base import DISCORD_MAX_CHARS, ChatMessage, split_text
from bothy.chat.discord import DiscordAdapter, translate_error
from bothy.config import DiscordConfig
from bothy.errors import ChatAuthError, ChatError, ChatUnavailable
from tests.fakes.discord import (
    ALERT_CHANNEL_ID,
    ALICE_ID,
    BOB_ID,
    BOT_ID,
    BOT_TOKEN,
    CHANNEL_ID,
    GATEWAY_HOST,
    GUILD_MESSAGES,
    GUILDS,
    MESSAGE_CONTENT,
    REST_HOST,
    RESUME_HOST,
    Certificates,
    FakeDiscord,
)

with warnings.catch_warnings():  # the audioop DeprecationWarning: see bothy/chat/discord.py
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

pytestmark = pytest.mark.timeout(20)


class Inbox:
    """The router's side: records what ``on_message`` is handed, in order."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self._arrived = asyncio.Condition()

    async def __call__(self, message: ChatMessage) -> None:
        async with self._arrived:
            self.messages.append(message)
            self._arrived.notify_all()

    async def wait_for(self, count: int, *, timeout_s: float = 5.0) -> list[ChatMessage]:
        """Wait until ``count`` messages have been handed over; returns them all."""
        async with asyncio.timeout(timeout_s), self._arrived:
            await self._arrived.wait_for(lambda: len(self.messages) >= count)
        return list(self.messages)


def make_adapter(fake: FakeDiscord, *, message_content: bool = True,
                 token: str | None = BOT_TOKEN, **knobs: Any) -> DiscordAdapter:
    """An adapter for the fake, with test-speed knobs."""
    cfg = DiscordConfig(message_content_intent=message_content, alert_channel=ALERT_CHANNEL_ID)
    environ = {} if token is None else {"DISCORD_BOT_TOKEN": token}
    knobs.setdefault("ready_timeout_s", 5.0)
    knobs.setdefault("guild_ready_s", 0.05)
    return DiscordAdapter(cfg, environ=environ, connector=fake.connector, **knobs)


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates.create(Path(tmp_path_factory.mktemp("discord-tls")))


@pytest.fixture
async def fake(certificates: Certificates) -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(certificates) as server:
        yield server


@pytest.fixture
async def inbox() -> Inbox:
    return Inbox()


@pytest.fixture
async def adapter(fake: FakeDiscord, inbox: Inbox) -> AsyncIterator[DiscordAdapter]:
    started = make_adapter(fake)
    await started.start(inbox)
    try:
        yield started
    finally:
        await started.stop()


def _discord_tasks() -> list[asyncio.Task[Any]]:
    """Tasks still running code of discord.py or of the adapter."""
    current = asyncio.current_task()
    found = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        filename = "" if code is None else code.co_filename
        if task is not current and ("/discord/" in filename or "chat/discord" in filename
                                    or task.get_name().startswith(("discord", "bothy"))):
            found.append(task)
    return found


# --- connecting ---------------------------------------------------------------------------


async def test_start_returns_once_ready_over_the_real_hosts(
    fake: FakeDiscord, adapter: DiscordAdapter
) -> None:
    """start() logs in over REST, IDENTIFYs with the configured intents and returns at READY."""
    connection = await fake.wait_ready()
    assert adapter.bot_user_id == BOT_ID
    assert {r.host for r in fake.requests} == {REST_HOST}
    assert [r.path for r in fake.requests][:2] == ["/api/v10/users/@me",
                                                   "/api/v10/oauth2/applications/@me"]
    assert connection.host == GATEWAY_HOST
    assert connection.query == {"v": "10", "encoding": "json", "compress": "zlib-stream"}
    assert connection.identify is not None
    assert connection.identify["intents"] == GUILDS | GUILD_MESSAGES | MESSAGE_CONTENT


async def test_start_does_not_wait_out_discord_py_guild_delay_once_the_guilds_arrived(
    fake: FakeDiscord, inbox: Inbox
) -> None:
    """start() returns once every guild READY named has come, not after discord.py's own wait
    (an hour here: were it waited for, start() would give up at its 5 s bound)."""
    adapter = make_adapter(fake, guild_ready_s=3600.0)
    await adapter.start(inbox)
    try:
        message_id = await fake.send_mention(ALICE_ID, CHANNEL_ID, "ready?")
        [message] = await inbox.wait_for(1)
        assert (message.message_id, message.text) == (message_id, "ready?")
    finally:
        await adapter.stop()


async def test_a_wrong_token_is_a_chat_auth_error(fake: FakeDiscord) -> None:
    """A token Discord refuses (401 on /users/@me) fails start() with ChatAuthError."""
    fake.token = "a-different-token"
    adapter = make_adapter(fake)
    with pytest.raises(ChatAuthError, match="refused the bot token"):
        await adapter.start(Inbox())
    assert fake.connections == []
    await adapter.stop()


async def test_a_missing_token_is_a_chat_auth_error_naming_the_variable(fake: FakeDiscord) -> None:
    """No token in the environment fails start() before any request, naming the variable."""
    adapter = make_adapter(fake, token=None)
    with pytest.raises(ChatAuthError, match="DISCORD_BOT_TOKEN"):
        await adapter.start(Inbox())
    assert fake.requests == []


async def test_a_token_the_gateway_refuses_is_a_chat_auth_error(fake: FakeDiscord) -> None:
    """Close 4004 (authentication failed) on IDENTIFY fails start() with ChatAuthError."""
    fake.refuse_identify = True
    adapter = make_adapter(fake)
    with pytest.raises(ChatAuthError, match="4004"):
        await adapter.start(Inbox())
    assert [c.close_code for c in fake.connections] == [4004]


async def test_a_disallowed_message_content_intent_is_a_chat_auth_error_that_says_what_to_do(
    fake: FakeDiscord,
) -> None:
    """Close 4014 (privileged intent not enabled) fails start() with ChatAuthError and advice."""
    fake.allow_message_content = False
    adapter = make_adapter(fake)
    with pytest.raises(ChatAuthError, match="Message Content Intent") as raised:
        await adapter.start(Inbox())
    assert "message_content_intent" in str(raised.value)
    assert [c.close_code for c in fake.connections] == [4014]


async def test_without_the_message_content_intent_mentions_still_arrive(
    fake: FakeDiscord, inbox: Inbox
) -> None:
    """With message_content_intent off the bot connects without the intent and hears mentions."""
    fake.allow_message_content = False
    adapter = make_adapter(fake, message_content=False)
    await adapter.start(inbox)
    try:
        connection = await fake.wait_ready()
        assert connection.identify is not None
        assert connection.identify["intents"] == GUILDS | GUILD_MESSAGES
        await fake.send_mention(ALICE_ID, CHANNEL_ID, "status?")
        [message] = await inbox.wait_for(1)
        assert message.text == "status?"
    finally:
        await adapter.stop()


async def test_an_unreachable_discord_is_chat_unavailable(certificates: Certificates) -> None:
    """Nothing listening where Discord should be fails start() with ChatUnavailable."""
    async with FakeDiscord(certificates) as gone:
        pass
    adapter = make_adapter(gone)
    with pytest.raises(ChatUnavailable, match="log in to Discord"):
        await adapter.start(Inbox())
    assert _discord_tasks() == []


async def test_a_gateway_that_never_gets_ready_is_chat_unavailable(fake: FakeDiscord) -> None:
    """REST answers but the gateway refuses the upgrade: start() gives up after its bound."""
    fake.gateway_available = False
    adapter = make_adapter(fake, ready_timeout_s=1.0)
    with pytest.raises(ChatUnavailable, match=r"not ready within 1 s|gateway: WSServerHandshake"):
        await adapter.start(Inbox())
    assert _discord_tasks() == []


# --- incoming -------------------------------------------------------------------------------


async def test_a_mention_is_handed_over_with_the_mention_removed(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """A mention in a channel reaches on_message: mentioned, not in a thread, keyed by its id."""
    message_id = await fake.send_mention(ALICE_ID, CHANNEL_ID, "what changed in /srv/work?")
    [message] = await inbox.wait_for(1)
    assert message == ChatMessage(
        platform="discord", dedupe_key=message_id, channel=CHANNEL_ID, thread=message_id,
        message_id=message_id, user=ALICE_ID, text="what changed in /srv/work?",
        mentioned=True, in_thread=False)


async def test_only_messages_for_the_bot_are_handed_over(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """Channel chatter without a mention and the bot's own echoed posts are not handed over."""
    await fake.send_message(BOB_ID, CHANNEL_ID, "lunch anyone?")
    await adapter.post_alert(CHANNEL_ID, "the bot talking")  # Discord echoes it back
    last = await fake.send_mention(ALICE_ID, CHANNEL_ID, "hello")
    messages = await inbox.wait_for(1)  # handed over in arrival order: the others came first
    assert [m.message_id for m in messages] == [last]


async def test_messages_are_handed_over_one_at_a_time_in_arrival_order(
    fake: FakeDiscord, inbox: Inbox
) -> None:
    """A slow on_message holds the next one back: calls never overlap and keep their order."""
    entered, release = asyncio.Event(), asyncio.Event()
    running: list[str] = []
    overlaps: list[int] = []

    async def slow(message: ChatMessage) -> None:
        running.append(message.text)
        overlaps.append(len(running))
        if message.text == "first":
            entered.set()
            await release.wait()
        running.remove(message.text)
        await inbox(message)

    adapter = make_adapter(fake)
    await adapter.start(slow)
    try:
        for text in ("first", "second", "third"):
            await fake.send_mention(ALICE_ID, CHANNEL_ID, text)
        async with asyncio.timeout(5):
            await entered.wait()
        await fake.caught_up()  # "second" and "third" are in discord.py's hands now
        assert running == ["first"]
        release.set()
        messages = await inbox.wait_for(3)
        assert [m.text for m in messages] == ["first", "second", "third"]
        assert overlaps == [1, 1, 1]
    finally:
        await adapter.stop()


async def test_a_message_on_message_could_not_take_is_reported_lost(fake: FakeDiscord) -> None:
    """Discord will not send it again, so the adapter hands it and the reason to on_lost."""
    lost: list[tuple[ChatMessage, str]] = []
    reported = asyncio.Event()

    async def fails(message: ChatMessage) -> None:
        raise OSError(28, "No space left on device")

    async def on_lost(message: ChatMessage, reason: str) -> None:
        lost.append((message, reason))
        reported.set()

    adapter = make_adapter(fake)
    await adapter.start(fails, on_lost=on_lost)
    try:
        await fake.send_mention(ALICE_ID, CHANNEL_ID, "are you there?")
        async with asyncio.timeout(5):
            await reported.wait()
        [(message, reason)] = lost
        assert message.text == "are you there?" and message.user == str(ALICE_ID)
        assert reason == "OSError: [Errno 28] No space left on device"
    finally:
        await adapter.stop()


async def test_a_failing_on_message_does_not_break_the_connection(fake: FakeDiscord) -> None:
    """on_message raising for one message is logged; the next message still arrives."""
    inbox = Inbox()

    async def fails_once(message: ChatMessage) -> None:
        if message.text == "boom":
            raise RuntimeError("router failed")
        await inbox(message)

    adapter = make_adapter(fake)
    await adapter.start(fails_once)
    try:
        await fake.send_mention(ALICE_ID, CHANNEL_ID, "boom")
        await fake.send_mention(ALICE_ID, CHANNEL_ID, "after")
        [message] = await inbox.wait_for(1)
        assert message.text == "after"
    finally:
        await adapter.stop()


# --- threads --------------------------------------------------------------------------------


async def test_open_thread_starts_a_thread_from_the_mention_and_post_answers_in_it(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """A mention in a channel gets a thread started from it (same id), named after its text."""
    message_id = await fake.send_mention(ALICE_ID, CHANNEL_ID, "what changed\nin /srv/work?")
    [mention] = await inbox.wait_for(1)
    thread = await adapter.open_thread(mention)
    assert thread == message_id == mention.thread
    [started] = fake.threads
    assert (started.channel_id, started.thread_id) == (CHANNEL_ID, message_id)
    assert started.name == "what changed in /srv/work?"
    ids = await adapter.post(mention.channel, thread, "Three commits since Monday.")
    assert [(p.channel_id, p.message_id, p.content) for p in fake.posts] == [
        (thread, ids[0], "Three commits since Monday.")]


async def test_open_thread_twice_gives_the_same_thread(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """Opening the thread of a mention again (a retry, a restart) returns the thread it has."""
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "deploy")
    [mention] = await inbox.wait_for(1)
    first = await adapter.open_thread(mention)
    assert await adapter.open_thread(mention) == first
    assert len(fake.threads) == 1


async def test_a_thread_name_is_cut_to_100_characters(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """A long mention names its thread with its first 99 characters and an ellipsis."""
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "why " * 60)
    [mention] = await inbox.wait_for(1)
    await adapter.open_thread(mention)
    [started] = fake.threads
    assert len(started.name) == 100
    assert started.name.endswith("…")


async def test_a_reply_in_the_bots_thread_arrives_without_a_mention(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """A reply in the bot's thread is handed over (in a thread, not mentioned); its own is not."""
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "deploy?")
    [mention] = await inbox.wait_for(1)
    thread = await adapter.open_thread(mention)
    await adapter.post(mention.channel, thread, "Deploy to production?")  # echoed, not handed
    reply_id = await fake.send_message(ALICE_ID, thread, "yes")
    reply = (await inbox.wait_for(2))[1]
    assert reply == ChatMessage(
        platform="discord", dedupe_key=reply_id, channel=thread, thread=thread,
        message_id=reply_id, user=ALICE_ID, text="yes", mentioned=False, in_thread=True)


async def test_a_mention_inside_a_thread_is_answered_in_that_thread(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """A mention already inside a thread opens no new thread: the answer goes to that thread."""
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "first question")
    [first] = await inbox.wait_for(1)
    thread = await adapter.open_thread(first)
    await fake.send_mention(BOB_ID, thread, "and another")
    second = (await inbox.wait_for(2))[1]
    assert (second.in_thread, second.mentioned, second.thread) == (True, True, thread)
    assert await adapter.open_thread(second) == thread
    assert len(fake.threads) == 1


async def test_a_restarted_adapter_still_hears_replies_in_its_threads(
    fake: FakeDiscord, inbox: Inbox
) -> None:
    """After a restart, a reply in a thread the bot started earlier still arrives."""
    before = make_adapter(fake)
    await before.start(inbox)
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "long job")
    [mention] = await inbox.wait_for(1)
    thread = await before.open_thread(mention)
    await before.stop()

    after_restart = Inbox()
    adapter = make_adapter(fake)
    await adapter.start(after_restart)
    try:
        await fake.send_message(ALICE_ID, thread, "any news?")
        [reply] = await after_restart.wait_for(1)
        assert (reply.thread, reply.in_thread, reply.mentioned) == (thread, True, False)
    finally:
        await adapter.stop()


# --- outgoing -------------------------------------------------------------------------------


async def test_a_12000_character_answer_is_split_in_order_with_nothing_lost(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """A 12,000-character answer becomes ordered messages of at most 2,000 characters."""
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "the full report please")
    [mention] = await inbox.wait_for(1)
    thread = await adapter.open_thread(mention)
    lines = [f"line {n:04d}: " + "x" * (n % 70) for n in range(400)]
    answer = "\n".join(lines)
    assert len(answer) >= 12_000
    ids = await adapter.post(mention.channel, thread, answer)
    posted = fake.posts_in(thread)
    assert [p.message_id for p in posted] == ids
    assert [p.content for p in posted] == split_text(answer, DISCORD_MAX_CHARS)
    assert all(len(p.content) <= DISCORD_MAX_CHARS for p in posted)
    assert "\n".join(p.content for p in posted) == answer  # cut only at line breaks here
    assert len(posted) >= 6


async def test_every_piece_carries_its_own_enforced_nonce(
    fake: FakeDiscord, adapter: DiscordAdapter
) -> None:
    """Each message is sent with a distinct nonce of at most 25 characters and enforce_nonce."""
    await adapter.post_alert(ALERT_CHANNEL_ID, "a\n" * 2500)
    nonces = [p.nonce for p in fake.posts]
    assert len(nonces) >= 3
    assert all(p.enforce_nonce for p in fake.posts)
    assert all(n is not None and 0 < len(n) <= 25 for n in nonces)
    assert len(set(nonces)) == len(nonces)


async def test_a_lost_response_is_retried_without_posting_twice(
    fake: FakeDiscord, adapter: DiscordAdapter
) -> None:
    """A 500 after the message was made: discord.py retries with the same nonce, one post."""
    fake.fail_next("create_message", 500, after_commit=True)
    ids = await adapter.post(CHANNEL_ID, "", "exactly once")
    statuses = [r.status for r in fake.requests if r.path.endswith("/messages")]
    assert statuses == [500, 200]
    assert [(p.message_id, p.content) for p in fake.posts] == [(ids[0], "exactly once")]


async def test_react_and_post_alert(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox
) -> None:
    """react() adds the emoji to the message; post_alert() posts in the channel, no thread."""
    message_id = await fake.send_mention(ALICE_ID, CHANNEL_ID, "ping")
    [mention] = await inbox.wait_for(1)
    await adapter.react(mention, "👀")
    ids = await adapter.post_alert("", "! **WARNING** `acme-mini` — run:pr:42")
    assert [(r.channel_id, r.message_id, r.emoji) for r in fake.reactions] == [
        (CHANNEL_ID, message_id, "👀")]
    assert [(p.channel_id, p.message_id) for p in fake.posts] == [(ALERT_CHANNEL_ID, ids[0])]
    assert fake.threads == []


# --- reconnecting ---------------------------------------------------------------------------

DISRUPTIONS: dict[str, Callable[[FakeDiscord], Awaitable[None]]] = {
    "close 4000": lambda fake: fake.close_gateway(4000, "unknown error"),
    "close 1000 by Discord": lambda fake: fake.close_gateway(1000),
    "op 7 reconnect": lambda fake: fake.reconnect(),
    "op 9 resumable": lambda fake: fake.invalidate_session(resumable=True),
    "TCP abort": lambda fake: fake.abort_gateway(),
}


@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_a_dropped_gateway_resumes_and_replays_what_was_missed(
    fake: FakeDiscord, adapter: DiscordAdapter, inbox: Inbox, disruption: str
) -> None:
    """After a drop discord.py RESUMEs the same session; a mention sent meanwhile arrives once."""
    first = await fake.wait_ready(1)
    fake.hold_resumes()
    await DISRUPTIONS[disruption](fake)
    missed = await fake.send_mention(ALICE_ID, CHANNEL_ID, "still there?")
    fake.release_resumes()
    [message] = await inbox.wait_for(1)
    assert message.message_id == missed
    second = await fake.wait_ready(2)
    assert (second.resumed, second.session_id, second.host) == (True, first.session_id,
                                                                 RESUME_HOST)
    assert missed in second.replayed_ids
    assert 2 not in second.ops  # no new IDENTIFY
    after = await fake.send_mention(ALICE_ID, CHANNEL_ID, "and now?")
    assert [m.message_id for m in await inbox.wait_for(2)] == [missed, after]


# --- errors and stopping ---------------------------------------------------------------------


async def test_failures_of_calls_are_chat_errors(
    fake: FakeDiscord, adapter: DiscordAdapter
) -> None:
    """A refused call (unknown channel, bad id) raises ChatError, never a discord.py error."""
    with pytest.raises(ChatError, match="Cannot post in Discord 999") as raised:
        await adapter.post("999", "", "hello")
    assert type(raised.value) is ChatError
    assert isinstance(raised.value.__cause__, discord.NotFound)
    with pytest.raises(ChatError, match="not a Discord id"):
        await adapter.post(CHANNEL_ID, "C0123", "hello")
    stranger = ChatMessage(platform="discord", dedupe_key="5", channel=CHANNEL_ID, thread="5",
                           message_id="5", user=ALICE_ID, text="x", mentioned=True,
                           in_thread=False)
    with pytest.raises(ChatError, match="start a thread"):
        await adapter.open_thread(stranger)
    with pytest.raises(ChatError, match="react"):
        await adapter.react(stranger, "👀")


def _foreign_exception_classes() -> list[type[Exception]]:
    roots: list[type[Exception]] = [discord.DiscordException, aiohttp.ClientError, OSError]
    seen: list[type[Exception]] = []
    while roots:
        cls = roots.pop()
        if cls not in seen:
            seen.append(cls)
            roots.extend(cls.__subclasses__())
    return [*seen, ValueError, TypeError, KeyError, RuntimeError, AttributeError]


@pytest.mark.parametrize("cls", _foreign_exception_classes(), ids=lambda cls: cls.__qualname__)
def test_every_foreign_exception_maps_to_a_chat_error(cls: type[Exception]) -> None:
    """Every discord.py, aiohttp and OS exception class translates to a ChatError."""
    exc = cls.__new__(cls)  # attributes a constructor would set are absent: the worst case
    translated = translate_error(exc, "do the thing")
    assert isinstance(translated, ChatError)
    assert str(translated).startswith("Cannot do the thing: ")
    assert translated.platform == "discord"


def _http_error(status: int) -> discord.HTTPException:
    response: Any = SimpleNamespace(status=status, reason="Reason")  # all HTTPException reads
    return discord.HTTPException(response, {"message": "m", "code": 0})


def _closed(code: int) -> discord.ConnectionClosed:
    socket: Any = SimpleNamespace(close_code=code)  # all ConnectionClosed reads of a socket
    return discord.ConnectionClosed(socket, shard_id=None)


@pytest.mark.parametrize(("exc", "expected"), [
    (discord.LoginFailure("Improper token has been passed."), ChatAuthError),
    (discord.PrivilegedIntentsRequired(None), ChatAuthError),
    (_closed(4004), ChatAuthError),
    (_closed(4013), ChatAuthError),
    (_closed(4010), ChatUnavailable),
    (_http_error(401), ChatAuthError),
    (_http_error(403), ChatError),
    (_http_error(429), ChatUnavailable),
    (_http_error(503), ChatUnavailable),
    (discord.RateLimited(120.0), ChatUnavailable),
    (discord.GatewayNotFound(), ChatUnavailable),
    (TimeoutError(), ChatUnavailable),
    (ConnectionResetError(104, "reset"), ChatUnavailable),
    (aiohttp.ServerDisconnectedError(), ChatUnavailable),
    (ValueError("bad"), ChatError),
], ids=lambda value: value.__name__ if isinstance(value, type) else type(value).__name__)
def test_foreign_exceptions_map_by_what_they_mean(exc: Exception,
                                                  expected: type[ChatError]) -> None:
    """Refused credentials → ChatAuthError, outages → ChatUnavailable, the rest → ChatError."""
    assert type(translate_error(exc, "do the thing")) is expected


async def test_stop_is_idempotent_and_leaves_nothing_running(fake: FakeDiscord) -> None:
    """stop() twice closes the socket; no task or heartbeat thread of discord.py is left."""
    inbox = Inbox()
    adapter = make_adapter(fake)
    await adapter.stop()  # before start: nothing to do
    adapter = make_adapter(fake)
    await adapter.start(inbox)
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "hi")
    await inbox.wait_for(1)
    await adapter.stop()
    await adapter.stop()
    assert _discord_tasks() == []
    await fake.wait_for(lambda: not fake.open_connections, "the gateway socket closed")
    for thread in threading.enumerate():
        if thread.name.startswith("keep-alive-handler"):
            await asyncio.to_thread(thread.join, 2.0)
            assert not thread.is_alive(), "a discord.py heartbeat thread outlived stop()"
    with pytest.raises(ChatUnavailable, match="not connected"):
        await adapter.post(CHANNEL_ID, "", "too late")
    await adapter.wait_closed()


async def test_stop_lets_an_in_flight_on_message_finish(fake: FakeDiscord) -> None:
    """stop() closes the gateway first, then waits for the on_message call in progress."""
    entered, release = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def slow(message: ChatMessage) -> None:
        entered.set()
        await release.wait()
        finished.append(message.text)

    adapter = make_adapter(fake)
    await adapter.start(slow)
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "make it durable")
    async with asyncio.timeout(5):
        await entered.wait()
    stopping = asyncio.create_task(adapter.stop())
    await fake.wait_for(lambda: not fake.open_connections, "the gateway socket closed")
    assert not stopping.done()
    release.set()
    await stopping
    assert finished == ["make it durable"]


async def test_an_on_message_past_the_grace_is_cancelled(fake: FakeDiscord) -> None:
    """An on_message still running stop_grace_s after stop() began is cancelled."""
    entered = asyncio.Event()
    outcome: list[str] = []

    async def stuck(message: ChatMessage) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    adapter = make_adapter(fake, stop_grace_s=0.1)
    await adapter.start(stuck)
    await fake.send_mention(ALICE_ID, CHANNEL_ID, "hang")
    async with asyncio.timeout(5):
        await entered.wait()
    await adapter.stop()
    assert outcome == ["cancelled"]
    assert _discord_tasks() == []


class _LogSeen(logging.Handler):
    """Sets ``seen`` when a record containing ``needle`` is logged."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()


async def test_stop_does_not_wait_out_a_reconnect_backoff(
    fake: FakeDiscord, adapter: DiscordAdapter
) -> None:
    """stop() while discord.py sleeps before retrying an unreachable gateway returns at once."""
    await fake.wait_ready()
    backoff = _LogSeen("Attempting a reconnect in")  # logged just before discord.py's sleep
    logging.getLogger("discord.client").addHandler(backoff)
    try:
        fake.gateway_available = False
        await fake.close_gateway(4000)
        async with asyncio.timeout(5):
            await backoff.seen.wait()
    finally:
        logging.getLogger("discord.client").removeHandler(backoff)
    async with asyncio.timeout(0.5):  # the sleep lasts up to 2 s, then 4, 8 … 1024
        await adapter.stop()
    assert _discord_tasks() == []


async def test_a_connection_ended_by_discord_is_reported_by_wait_closed(
    fake: FakeDiscord, adapter: DiscordAdapter
) -> None:
    """A close 4004 while running (a reset token) ends it: wait_closed() and calls say so."""
    await fake.wait_ready()
    await fake.close_gateway(4004, "Authentication failed.")
    with pytest.raises(ChatAuthError, match="4004"):
        await asyncio.wait_for(adapter.wait_closed(), 5)
    with pytest.raises(ChatUnavailable, match=r"not connected.*4004"):
        await adapter.post(CHANNEL_ID, "", "hello?")
