"""What every chat adapter offers Bothy, and what Bothy hands it (SPEC §5 "Chat", §6).

An adapter (``slack.py``, ``discord.py``) keeps one outbound connection, turns the platform's
events into :class:`ChatMessage` values and hands each to ``on_message``. It acknowledges the
platform's delivery only after ``on_message`` has returned: that callback makes the message
durable (fsync) first, so an acknowledged mention is never lost. Everything it sends (reactions,
thread replies, alerts) goes through :class:`ChatAdapter` methods, which split long text within
the platform's limits and honour its rate limits (``Retry-After``).

No ``slack_sdk``, ``slack_bolt`` or ``discord`` exception or type leaves an adapter: failures
are :class:`~bothy.errors.ChatError` (or its subclasses), and a test proves the mapping.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

# What a platform accepts in one message (contracts.md §2.3 and §3.5): Slack recommends at
# most 4,000 characters (and truncates past 40,000); Discord refuses more than 2,000.
SLACK_MAX_CHARS = 4000
DISCORD_MAX_CHARS = 2000


@dataclass(frozen=True)
class ChatMessage:
    """One message the bot can see, as the router needs it."""

    platform: str  # "slack" | "discord"
    dedupe_key: str  # stable across the platform's retries and twins (Slack: channel:ts)
    channel: str  # where it was posted (Slack channel id; Discord channel or thread id)
    thread: str  # the conversation: Slack thread_ts (or ts); Discord thread id (or message id)
    message_id: str  # Slack ts; Discord message id
    user: str  # the author's platform id
    text: str  # the text, with the bot's own mention removed
    mentioned: bool  # the bot was mentioned in it
    in_thread: bool  # it is a reply inside an existing thread


OnMessage = Callable[[ChatMessage], Awaitable[None]]
OnLost = Callable[[ChatMessage, str], Awaitable[None]]
"""Told of a message taken off the platform that ``on_message`` could not take (the reason),
when the platform will not deliver it again: it is lost, and somebody should know."""


class ChatAdapter(Protocol):
    """One platform connection."""

    platform: str

    async def start(self, on_message: OnMessage, *, on_lost: OnLost | None = None) -> None:
        """Connect and return once ready. Raise ChatAuthError for a token the platform
        refuses (a configuration error) and ChatUnavailable when it cannot be reached.
        ``on_lost`` hears of each message that ``on_message`` failed and the platform will
        not redeliver (Discord; Slack redelivers an envelope that was not acknowledged)."""

    async def stop(self) -> None:
        """Close the connection; idempotent."""

    async def react(self, message: ChatMessage, emoji: str) -> None:
        """Add a reaction to a message (e.g. to say "seen")."""

    async def open_thread(self, message: ChatMessage) -> str:
        """The thread to answer a mention in: Slack the mention's ts; Discord a new thread
        started from the message (or the thread it is already in). Returns its id."""

    async def post(self, channel: str, thread: str, text: str) -> list[str]:
        """Post ``text`` in a thread, split into as many messages as the platform's limit
        needs (never mid-character, preferring line breaks); returns the message ids."""

    async def post_alert(self, channel: str, text: str) -> list[str]:
        """Post an alert in a channel (not in a thread)."""

    async def link(self, channel: str, thread: str) -> str | None:
        """A link a person can open to the thread (Slack permalink, Discord jump URL), or
        None when the platform cannot give one now. Never raises: an alert goes out without."""


def split_text(text: str, limit: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``limit`` characters, at line breaks when possible,
    else at spaces, else hard; no piece is empty and nothing is lost but the cut whitespace."""
    pieces: list[str] = []
    rest = text.strip()
    while len(rest) > limit:
        cut = rest.rfind("\n", 0, limit + 1)
        if cut <= limit // 2:
            cut = rest.rfind(" ", 0, limit + 1)
        if cut <= limit // 2:
            cut = limit
        pieces.append(rest[:cut].rstrip())
        rest = rest[cut:].lstrip()
    if rest:
        pieces.append(rest)
    return pieces
