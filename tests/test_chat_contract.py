"""One contract, both adapters: what the router relies on holds for Slack and for Discord.

Each case runs twice, against the real slack-bolt with a fake Slack and against the real
discord.py with a fake Discord (both on loopback). A `Platform` hides only how each fake is
driven; the assertions are the same.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bothy.chat.base import DISCORD_MAX_CHARS, SLACK_MAX_CHARS, ChatAdapter, ChatMessage
from bothy.chat.slack import SlackAdapter
from bothy.config import DiscordConfig, SlackConfig
from bothy.errors import ChatAuthError
from tests.fakes import discord as fake_discord
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, FakeSlack

with warnings.catch_warnings():  # the audioop DeprecationWarning: see bothy/chat/discord.py
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    from bothy.chat.discord import DiscordAdapter

pytestmark = pytest.mark.timeout(30)
USER = "U0PERATOR"


class Heard:
    """The router's side: every message handed over, in order."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self._arrived = asyncio.Condition()

    async def __call__(self, message: ChatMessage) -> None:
        async with self._arrived:
            self.messages.append(message)
            self._arrived.notify_all()

    async def wait_for(self, count: int) -> list[ChatMessage]:
        async with asyncio.timeout(10), self._arrived:
            await self._arrived.wait_for(lambda: len(self.messages) >= count)
        return list(self.messages)


@dataclass
class Platform:
    """How the contract drives one fake platform."""

    name: str
    limit: int
    adapter: Callable[[str], ChatAdapter]  # token -> a fresh adapter
    mention: Callable[[str], Awaitable[str]]  # text -> message id
    reply: Callable[[str, str], Awaitable[str]]  # (thread, text) -> message id
    posts_in: Callable[[str], list[str]]  # thread -> texts posted there, in order
    drop: Callable[[], Awaitable[None]]  # the platform drops the connection


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> fake_discord.Certificates:
    return fake_discord.Certificates.create(Path(tmp_path_factory.mktemp("contract-tls")))


@pytest.fixture(params=["slack", "discord"])
async def platform(
    request: pytest.FixtureRequest, certificates: fake_discord.Certificates,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Platform]:
    if request.param == "slack":
        for name in [n for n in os.environ if n.lower().endswith("_proxy")]:
            monkeypatch.delenv(name)
        async with FakeSlack(ack_timeout_s=2.0) as slack:
            yield _slack(slack)
    else:
        async with fake_discord.FakeDiscord(certificates) as discord:
            yield _discord(discord)


def _slack(fake: FakeSlack) -> Platform:
    def adapter(token: str) -> ChatAdapter:
        return SlackAdapter(SlackConfig(api_url=fake.api_url), ping_interval_s=1.0,
                            environ={"SLACK_BOT_TOKEN": token, "SLACK_APP_TOKEN": APP_TOKEN})

    async def mention(text: str) -> str:
        return fake.send_mention(USER, "CWORK", text)

    async def reply(thread: str, text: str) -> str:
        return fake.send_message(USER, "CWORK", text, thread_ts=thread)

    async def drop() -> None:
        before = fake.connections
        fake.close_socket(1011)
        await fake.wait_for_connections(before + 1)

    return Platform("slack", SLACK_MAX_CHARS, adapter, mention, reply,
                    lambda thread: [p.text for p in fake.posts if p.thread_ts == thread], drop)


def _discord(fake: fake_discord.FakeDiscord) -> Platform:
    def adapter(token: str) -> ChatAdapter:
        return DiscordAdapter(DiscordConfig(), environ={"DISCORD_BOT_TOKEN": token},
                              connector=fake.connector, guild_ready_s=0.05, ready_timeout_s=5.0)

    async def mention(text: str) -> str:
        return await fake.send_mention(fake_discord.ALICE_ID, fake_discord.CHANNEL_ID, text)

    async def reply(thread: str, text: str) -> str:
        return await fake.send_message(fake_discord.ALICE_ID, thread, text)

    async def drop() -> None:
        await fake.close_gateway(4000)

    return Platform("discord", DISCORD_MAX_CHARS, adapter, mention, reply,
                    lambda thread: [p.content for p in fake.posts_in(thread)], drop)


def _token(platform: Platform) -> str:
    return BOT_TOKEN if platform.name == "slack" else fake_discord.BOT_TOKEN


@pytest.fixture
async def connected(platform: Platform) -> AsyncIterator[tuple[ChatAdapter, Heard]]:
    heard = Heard()
    adapter = platform.adapter(_token(platform))
    await adapter.start(heard)
    try:
        yield adapter, heard
    finally:
        await adapter.stop()


async def test_a_mention_arrives_stripped_and_is_answered_in_its_thread(
    platform: Platform, connected: tuple[ChatAdapter, Heard]
) -> None:
    """The router gets the mention without the bot's name, and a post lands in its thread."""
    adapter, heard = connected
    await platform.mention("what changed?")
    (message,) = await heard.wait_for(1)
    assert (message.platform, message.mentioned, message.in_thread) == (platform.name, True,
                                                                        False)
    assert message.text == "what changed?"
    thread = await adapter.open_thread(message)
    await adapter.post(message.channel, thread, "Nothing changed.")
    assert platform.posts_in(thread) == ["Nothing changed."]


async def test_a_reply_in_the_thread_is_handed_over_as_in_thread(
    platform: Platform, connected: tuple[ChatAdapter, Heard]
) -> None:
    """A reply without a mention, inside the bot's thread, reaches the router as in_thread."""
    adapter, heard = connected
    await platform.mention("start")
    (first,) = await heard.wait_for(1)
    thread = await adapter.open_thread(first)
    await adapter.post(first.channel, thread, "Started.")
    await platform.reply(thread, "yes")
    reply = (await heard.wait_for(2))[1]
    assert (reply.text, reply.mentioned, reply.in_thread, reply.thread) == ("yes", False, True,
                                                                            thread)


async def test_a_long_answer_is_split_within_the_platform_limit(
    platform: Platform, connected: tuple[ChatAdapter, Heard]
) -> None:
    """12,000 characters arrive whole, in order, each piece within the platform's limit."""
    adapter, heard = connected
    await platform.mention("write a lot")
    (message,) = await heard.wait_for(1)
    thread = await adapter.open_thread(message)
    words = " ".join(f"w{n}" for n in range(3000))
    await adapter.post(message.channel, thread, words)
    pieces = platform.posts_in(thread)
    assert len(pieces) >= 12_000 // platform.limit
    assert all(len(piece) <= platform.limit for piece in pieces)
    assert " ".join(pieces).split() == words.split()


async def test_a_dropped_connection_comes_back_and_hears_the_next_mention(
    platform: Platform, connected: tuple[ChatAdapter, Heard]
) -> None:
    """After the platform drops the connection, a later mention still reaches the router."""
    _, heard = connected
    await platform.drop()
    await platform.mention("are you there?")
    (message,) = await heard.wait_for(1)
    assert message.text == "are you there?"


async def test_a_refused_token_is_a_configuration_error(platform: Platform) -> None:
    """A token the platform refuses raises ChatAuthError (exit 78), and nothing is left."""
    adapter = platform.adapter("xoxb-wrong" if platform.name == "slack" else "wrong.token")
    with pytest.raises(ChatAuthError):
        await adapter.start(Heard())
    await adapter.stop()
    await adapter.stop()  # idempotent
