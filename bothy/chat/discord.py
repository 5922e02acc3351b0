"""Discord over the gateway, with discord.py (SPEC §5 "Chat"; contracts.md §3).

:class:`DiscordAdapter` keeps one gateway connection (a ``discord.Client`` made inside the
running loop) and hands Bothy the messages meant for it as :class:`ChatMessage` values:

* a message that mentions the bot, anywhere it can read;
* a message in a thread the bot is in (a thread it started, one it was mentioned in, or one
  Discord says it is a member of), mentioned or not.

Everything else is dropped: the bot's own messages (Discord echoes them back), other bots' and
webhooks' messages (no bot loops), system messages (thread created, pins, joins…).
Replies that do not mention the bot carry text only with the privileged MESSAGE_CONTENT intent
(``message_content_intent``, on by default); without it they arrive empty and are dropped.

What the fields hold: ``dedupe_key`` and ``message_id`` are the message's id (a snowflake,
unique across Discord); ``channel`` is where it was posted (a channel id, or a thread id for a
message in a thread); ``thread`` is the conversation: the thread's id for a message in a
thread, else the message's own id — which is also the id of the thread :meth:`open_thread`
starts from it (contracts.md §3.4), so the conversation key does not change when the thread
is opened. ``text`` is the content without the bot's mention.

Discord has no acknowledgement and no redelivery: discord.py has taken an event off the socket
(and advanced the sequence number a RESUME would replay from) before its handler runs. The
adapter awaits ``on_message`` for each message, one at a time in arrival order, and
:meth:`stop` lets the calls in flight finish (within ``stop_grace_s``) after closing the
gateway. A message whose ``on_message`` raises cannot be had again: it is logged and handed
to ``on_lost`` (which audits and alerts), so its loss is heard. One Discord sends while the
session cannot be resumed (op 9 ``d: false``) never reaches Bothy at all. Reconnecting and
resuming are discord.py's: a dropped socket, a resumable close code, op 7 or op 9 ``d: true``
lead to a RESUME on READY's ``resume_gateway_url``, and Discord replays what was missed.

Liveness (``bothy/chat/liveness.py`` watches it): :meth:`DiscordAdapter.heard` says when the
gateway was last READY or RESUMED, when it last dispatched an event and when it last
acknowledged a heartbeat (discord.py's debug events show both). :meth:`~DiscordAdapter.reconnect`
first closes the socket with 4000, which discord.py answers by reconnecting with a RESUME
(Discord replays what was missed); if nothing comes back, it starts a new client.

Outgoing text goes through ``chat/formatting.py`` (:func:`discord_pieces`: ``@everyone`` and
``@here`` defused, pieces of at most 2,000 characters) and each
piece carries a fresh ``nonce`` with ``enforce_nonce`` (discord.py sends both): when discord.py
retries a request whose response was lost (a 5xx), Discord returns the message it already made
instead of posting it twice. Nothing the bot posts pings anyone (``AllowedMentions.none()``,
sent as ``{"parse": []}``): an answer quoting ``@everyone`` or ``<@id>`` stays text.

Presses of Bothy's approval buttons (components drawn by ``discord_buttons.py``) arrive as
``INTERACTION_CREATE``; each goes to ``on_press``, which records the decision, and only then is
the interaction answered. A replay of a press (after a RESUME) reaches ``on_press`` again and
changes nothing there.

No ``discord`` or ``aiohttp`` exception leaves this module (:func:`translate_error`): a refused
token (401, close 4004) or a refused intent (4013, 4014) is :class:`ChatAuthError`, an
unreachable or failing Discord (connection errors, timeouts, 5xx, 429) is
:class:`ChatUnavailable`, anything else :class:`ChatError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Literal

import aiohttp

from bothy.chat.base import DISCORD_MAX_CHARS, ChatMessage, OnLost, OnMessage, OnPress
from bothy.chat.discord_buttons import is_ours, press_of, question_view
from bothy.chat.formatting import discord_pieces
from bothy.chat.liveness import Heard
from bothy.chat.recent import RecentIds
from bothy.config import DiscordConfig
from bothy.errors import ChatAuthError, ChatError, ChatUnavailable

with warnings.catch_warnings():
    # discord.py's voice player imports audioop, deprecated by PEP 594 and warned about on
    # import by Python 3.11 and 3.12. Bothy has no voice; the warning would only be noise
    # (and an error under the tests' filterwarnings = error).
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

_log = logging.getLogger(__name__)

PLATFORM = "discord"

# Close codes after which the gateway must not be retried because the configuration is wrong
# (contracts.md §3.1): authentication failed, invalid intents, disallowed (privileged) intents.
_AUTH_CLOSE_CODES = {4004: "authentication failed", 4013: "invalid intents",
                     4014: "disallowed intents"}
_THREAD_ALREADY_CREATED = 160004  # JSON error code: a message has at most one thread
_THREAD_NAME_MAX = 100  # contracts.md §3.4: 1–100 characters
_THREAD_ARCHIVE_MIN: Literal[10080] = 10080  # a week: the thread stays listed while runs ask
_THREADS_REMEMBERED = 10_000  # a busy site's weeks of threads; the set stays under ~1 MB
_NONCE_HEX_BYTES = 12  # 24 characters; Discord accepts at most 25
_MAX_RATELIMIT_WAIT_S = 60.0  # a longer Retry-After is an error (ChatUnavailable), not a wait
_NO_PINGS = discord.AllowedMentions.none()  # sent as formatting's DISCORD_NO_PINGS
# The router names reactions as Slack does; Discord wants the character itself and answers a
# bare name with 400 Unknown Emoji (code 10014).
_EMOJI = {"eyes": "\N{EYES}"}
_PERSON_MESSAGE_TYPES = (discord.MessageType.default, discord.MessageType.reply)
_HEARTBEAT_ACK = 11  # gateway opcode
_SHORT_FRAME = 128  # a heartbeat ACK is a few dozen characters; longer frames are not one
_RESUMABLE_CLOSE = 4000  # a close discord.py answers by reconnecting and resuming

_State = Literal["new", "starting", "ready", "stopping", "stopped"]


class DiscordAdapter:
    """One gateway connection to Discord for one bot (a :class:`~bothy.chat.base.ChatAdapter`).

    ``connector`` makes the aiohttp connector discord.py uses (called inside the running loop;
    tests point the Discord hosts at a loopback fake with it). ``guild_ready_s`` is how long
    discord.py waits for guilds after READY before it is ready (0.5 s, not discord.py's 2 s: a
    bot that answers in threads by id needs no member lists, and start-up is on the clock) —
    a fallback only: :meth:`start` returns as soon as every guild READY named has arrived;
    ``heartbeat_timeout_s`` how long without a heartbeat ACK before it reconnects;
    ``ready_timeout_s`` bounds :meth:`start`; ``stop_grace_s`` how long :meth:`stop` waits for
    ``on_message`` calls.
    """

    platform = PLATFORM

    def __init__(
        self,
        cfg: DiscordConfig,
        *,
        environ: Mapping[str, str] | None = None,
        connector: Callable[[], aiohttp.BaseConnector] | None = None,
        guild_ready_s: float = 0.5,
        heartbeat_timeout_s: float = 60.0,
        ready_timeout_s: float = 30.0,
        stop_grace_s: float = 5.0,
    ) -> None:
        self._cfg = cfg
        self._environ = environ
        self._connector = connector
        self._guild_ready_s = guild_ready_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._ready_timeout_s = ready_timeout_s
        self._stop_grace_s = stop_grace_s
        self._state: _State = "new"
        self._client: _Gateway | None = None
        self._connection: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._failure: ChatError | None = None
        self._on_message: OnMessage | None = None
        self._on_lost: OnLost | None = None
        self._on_press: OnPress | None = None
        self._me = 0
        self._mention: re.Pattern[str] | None = None
        # Threads this process started or was mentioned in, the newest of them: an older one
        # is still recognised by its owner or its membership (_chat_message).
        self._threads = RecentIds(_THREADS_REMEMBERED)
        self._in_order = asyncio.Lock()  # one on_message at a time, in arrival order
        self._handlers: set[asyncio.Task[object]] = set()
        self._stopped = asyncio.Event()
        self._token_value = ""
        self._connected_at: float | None = None
        self._last_event_at: float | None = None
        self._last_ping_at: float | None = None
        self._back = asyncio.Event()  # set by each READY or RESUMED
        self._guilds_due: set[str] | None = None  # READY's guilds not yet arrived (connecting)

    # ---------------------------------------------------------------- lifecycle

    @property
    def bot_user_id(self) -> str:
        """The bot's own user id, known once started ("" before)."""
        return str(self._me) if self._me else ""

    async def start(
        self, on_message: OnMessage, *, on_lost: OnLost | None = None,
        on_press: OnPress | None = None,
    ) -> None:
        """Log in, connect the gateway, return once Discord says READY.

        Raises ChatAuthError for a missing or refused token or a refused privileged intent,
        ChatUnavailable when Discord cannot be reached or is not ready in ``ready_timeout_s``.
        """
        if self._state != "new":
            raise RuntimeError(f"DiscordAdapter.start() called when {self._state}")
        self._state = "starting"
        self._on_press = on_press
        try:
            async with asyncio.timeout(self._ready_timeout_s):
                await self._start(on_message, on_lost)
        except BaseException as exc:
            await self._shutdown()
            self._state = "stopped"
            self._stopped.set()
            if isinstance(exc, TimeoutError):
                raise ChatUnavailable(
                    f"Cannot connect to Discord: not ready within {self._ready_timeout_s:g} s",
                    platform=PLATFORM) from None
            raise
        self._state = "ready"
        _log.info("Discord: connected as bot %s", self._me)

    async def stop(self) -> None:
        """Close the gateway and REST session, let in-flight ``on_message`` calls finish
        (cancelling those past ``stop_grace_s``); idempotent."""
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            return
        if self._state == "stopping":
            await self._stopped.wait()
            return
        self._state = "stopping"
        try:
            await self._shutdown()
        finally:
            self._state = "stopped"
            self._stopped.set()

    async def wait_closed(self) -> None:
        """Return once the gateway connection has ended; raise the ChatError that ended it
        if it ended by itself (e.g. ChatAuthError: the token was reset while running)."""
        if self._connection is not None:
            await asyncio.wait({self._connection})
        if self._failure is not None:
            raise self._failure

    async def _start(self, on_message: OnMessage, on_lost: OnLost | None) -> None:
        self._token_value = self._token()
        self._on_message = on_message
        self._on_lost = on_lost
        await self._connect()

    async def _connect(self) -> None:
        """A new client: log in, connect the gateway, return once READY."""
        self._ready = asyncio.get_running_loop().create_future()
        self._guilds_due = None
        self._failure = None
        self._client = client = _Gateway(
            intents=discord.Intents(guilds=True, guild_messages=True,
                                    message_content=self._cfg.message_content_intent),
            connector=None if self._connector is None else self._connector(),
            guild_ready_s=self._guild_ready_s,
            heartbeat_timeout_s=self._heartbeat_timeout_s,
            on_ready=self._on_ready,
            on_message=self._receive,
            on_interaction=self._interaction,
            on_frame=self._heard_frame,
            on_event=self._heard_event,
        )
        with _boundary("log in to Discord"):
            await client.login(self._token_value)
            assert client.user is not None  # login() sets it from GET /users/@me
            self._me = client.user.id
        self._mention = re.compile(rf"\s*<@!?{self._me}>\s*")
        if not self._cfg.message_content_intent:
            _log.warning("Discord: message_content_intent is off; replies in threads that do "
                         "not mention the bot arrive empty and are ignored")
        self._connection = asyncio.create_task(self._run(client), name="bothy: discord gateway")
        await asyncio.wait({self._ready, self._connection}, return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.done():
            raise self._failure or ChatUnavailable(
                "Cannot connect to Discord: the gateway connection ended before READY",
                platform=PLATFORM)

    def _token(self) -> str:
        environ = os.environ if self._environ is None else self._environ
        token = environ.get(self._cfg.token_env, "").strip()
        if not token:
            raise ChatAuthError(
                f"Cannot log in to Discord: environment variable {self._cfg.token_env} "
                "(chat.discord.token_env) is not set", platform=PLATFORM)
        return token

    async def _run(self, client: _Gateway) -> None:
        """The gateway loop (discord.py reconnects and resumes inside it)."""
        attempted = "stay connected to Discord's gateway"
        try:
            await client.connect(reconnect=True)
        except Exception as exc:
            failure = translate_error(exc, attempted)
            if type(failure) is ChatError and not (self._ready and self._ready.done()):
                # discord.py 2.7.1 cannot retry a first connection that failed: after the
                # backoff it reads the sequence of a socket it never had (AttributeError),
                # with the connection error as context. The gateway was not reachable.
                cause = exc.__context__ if isinstance(exc.__context__, Exception) else exc
                failure = ChatUnavailable(f"Cannot connect to Discord's gateway: "
                                          f"{_reason(cause)}", platform=PLATFORM)
            self._failure = failure
            if self._state == "ready":
                _log.error("Discord: the connection ended: %s", failure)

    def _on_ready(self) -> None:
        """READY (after IDENTIFY) or RESUMED: the gateway is back."""
        self._connected_at = time.time()
        self._back.set()
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def _heard_frame(self, frame: str) -> None:
        """Every gateway frame (discord.py's debug event): notes heartbeat ACKs, and READY's
        guilds arriving while the connection is not yet ready."""
        if len(frame) > _SHORT_FRAME:
            if self._ready is not None and not self._ready.done():
                self._guilds_arriving(frame)
            return
        with contextlib.suppress(ValueError):
            parsed = json.loads(frame)
            if isinstance(parsed, dict) and parsed.get("op") == _HEARTBEAT_ACK:
                self._last_ping_at = time.time()

    def _guilds_arriving(self, frame: str) -> None:
        """READY names the bot's guilds; once each has come (GUILD_CREATE) the gateway is
        ready, without discord.py's fixed ``guild_ready_s`` wait after the last one (which
        stays as the fallback). discord.py has parsed a frame before this debug event runs, so
        the guilds are in its cache by then."""
        with contextlib.suppress(ValueError):
            parsed = json.loads(frame)
            if not isinstance(parsed, dict) or not isinstance(parsed.get("d"), dict):
                return
            event, data = parsed.get("t"), parsed["d"]
            if event == "READY":
                self._guilds_due = {str(g.get("id")) for g in data.get("guilds") or []
                                    if isinstance(g, dict)}
            elif event == "GUILD_CREATE" and self._guilds_due is not None:
                self._guilds_due.discard(str(data.get("id")))
            else:
                return
            if self._guilds_due is not None and not self._guilds_due:
                self._guilds_due = None
                self._on_ready()

    def _heard_event(self) -> None:
        self._last_event_at = time.time()

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                # A peer that never answers the close handshake must not hold the stop.
                async with asyncio.timeout(self._stop_grace_s):
                    await client.close()
            except Exception:  # closing is best effort; nothing is left to report it to
                _log.warning("Discord: closing the client failed", exc_info=True)
        connection = self._connection
        if connection is not None:
            # After close() discord.py's loop ends by itself, except when it is asleep in a
            # reconnect backoff (which grows to minutes): do not wait for that.
            connection.cancel()
            await asyncio.wait({connection})

    async def _shutdown(self) -> None:
        await self._close_client()
        handlers = {task for task in self._handlers if not task.done()}
        if handlers:
            _, late = await asyncio.wait(handlers, timeout=self._stop_grace_s)
            for task in late:
                _log.warning("Discord: cancelling on_message still running after %g s",
                             self._stop_grace_s)
                task.cancel()
            if late:
                await asyncio.wait(late)

    # ---------------------------------------------------------------- liveness

    def heard(self) -> Heard:
        """When the gateway was last READY or RESUMED, last dispatched an event and last
        acknowledged a heartbeat."""
        return Heard(self._connected_at, self._last_event_at, self._last_ping_at)

    async def probe(self) -> None:
        """Nothing to do: discord.py heartbeats at the interval Discord sets (HELLO)."""

    async def reconnect(self, *, within_s: float) -> None:
        """A new gateway socket within ``within_s``: first one that RESUMEs the session
        (Discord replays what was missed), in half the time; if none is back, a new client
        (a new session: what Discord sent meanwhile is gone) in the rest.

        Raises ChatAuthError for a refused token, ChatUnavailable when neither works."""
        if self._state != "ready":
            raise RuntimeError(f"DiscordAdapter.reconnect() called when {self._state}")
        rest_s = within_s
        if self._client is not None and self._client.ws is not None:
            if await self._resume(within_s / 2):
                _log.info("Discord: reconnected and resumed")
                return
            rest_s = within_s / 2
        try:
            async with asyncio.timeout(rest_s):
                await self._close_client()
                await self._connect()
        except BaseException as exc:
            await self._close_client()
            if isinstance(exc, TimeoutError):
                raise ChatUnavailable(f"Cannot reconnect to Discord: not ready within "
                                      f"{within_s:g} s", platform=PLATFORM) from None
            raise
        _log.info("Discord: reconnected with a new session")

    async def _resume(self, within_s: float) -> bool:
        """Close the gateway socket with 4000 and wait for RESUMED (or READY)."""
        assert self._client is not None
        socket = self._client.ws
        self._back.clear()
        try:
            async with asyncio.timeout(within_s):
                await socket.close(code=_RESUMABLE_CLOSE)
                await self._back.wait()
        except TimeoutError:
            return False
        except Exception as exc:  # a socket that will not even close: start a new client
            _log.warning("Discord: could not close the gateway socket: %r", exc)
            return False
        return True

    # ---------------------------------------------------------------- incoming

    async def _receive(self, message: discord.Message) -> None:
        """discord.py's on_message, run in a task of its own per message."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        chat = None
        try:
            chat = self._chat_message(message)
            if chat is None or self._on_message is None:
                return
            async with self._in_order:
                await self._on_message(chat)
        except Exception as exc:  # the router's failure must not end the connection
            _log.exception("Discord: on_message failed for message %s", message.id)
            if chat is not None:
                # Discord will not send it again (the gateway has moved past it): say so.
                await self._report_lost(chat, f"{type(exc).__name__}: {exc}")
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _interaction(self, interaction: discord.Interaction) -> None:
        """discord.py's on_interaction: a press of one of Bothy's buttons is recorded
        (``on_press``) before the interaction is answered; a press whose recording failed is
        left unanswered (Discord tells the presser it failed; they may press again)."""
        if not is_ours(interaction) or self._client is None:
            return
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            client = self._client
            press = press_of(interaction, me=self._me, application_id=client.application_id,
                             guilds={guild.id for guild in client.guilds})
            notice = None
            if self._on_press is not None:
                notice = (await self._on_press(press)).notice
            if press.forged is None:
                await self._respond(interaction, notice)
        except Exception:  # the router's failure must not end the connection
            _log.exception("Discord: a button press (interaction %s) failed", interaction.id)
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _respond(self, interaction: discord.Interaction, notice: str | None) -> None:
        """Answer a press: privately when there is something to tell, else a deferred update
        (the message itself is replaced once its question is settled)."""
        try:
            if notice is None:
                await interaction.response.defer()
            else:
                await interaction.response.send_message(notice, ephemeral=True)
        except (discord.HTTPException, discord.InteractionResponded) as exc:
            # A replayed press (after a RESUME) was answered the first time: Discord refuses
            # a second answer (40060). Its decision is recorded either way.
            _log.info("Discord: could not answer interaction %s: %s", interaction.id, exc)

    async def _report_lost(self, chat: ChatMessage, reason: str) -> None:
        if self._on_lost is None:
            return
        try:
            await self._on_lost(chat, reason)
        except Exception:  # nothing is left to report it to but the log
            _log.exception("Discord: could not report the loss of message %s", chat.message_id)

    def _chat_message(self, message: discord.Message) -> ChatMessage | None:
        """The message as Bothy sees it, or None when it is not for Bothy."""
        author = message.author
        if author.id == self._me or author.bot or message.webhook_id is not None:
            return None
        if message.type not in _PERSON_MESSAGE_TYPES:
            return None
        channel = message.channel
        thread = channel if isinstance(channel, discord.Thread) else None
        mentioned = any(user.id == self._me for user in message.mentions)
        in_thread = thread is not None or channel.id in self._threads
        member = channel.id in self._threads or (
            thread is not None and (thread.owner_id == self._me or thread.me is not None))
        if not mentioned and not member:
            return None
        assert self._mention is not None
        text = self._mention.sub(" ", message.content).strip()
        if not mentioned and not text:
            _log.debug("Discord: ignoring message %s without text", message.id)
            return None
        if mentioned and in_thread:
            self._threads.add(channel.id)
        return ChatMessage(
            platform=PLATFORM,
            dedupe_key=str(message.id),
            channel=str(channel.id),
            thread=str(channel.id) if in_thread else str(message.id),
            message_id=str(message.id),
            user=str(author.id),
            text=text,
            mentioned=mentioned,
            in_thread=in_thread,
        )

    # ---------------------------------------------------------------- outgoing

    async def react(self, message: ChatMessage, emoji: str) -> None:
        """Add ``emoji`` (a unicode emoji, ``name:id``, or a name from :data:`_EMOJI` such
        as the router's ``eyes``) to the message."""
        client = self._connected()
        channel_id = _snowflake(message.channel, "channel")
        message_id = _snowflake(message.message_id, "message")
        with _boundary(f"react to Discord message {message_id}"):
            partial = client.get_partial_messageable(channel_id).get_partial_message(message_id)
            await partial.add_reaction(_EMOJI.get(emoji.strip(":"), emoji))

    async def open_thread(self, message: ChatMessage) -> str:
        """The thread to answer ``message`` in: the thread it was posted in, or a new one
        started from it (named after its text). Asking twice gives the same thread."""
        channel_id = _snowflake(message.channel, "channel")
        if message.in_thread:
            self._threads.add(channel_id)
            return message.channel
        client = self._connected()
        message_id = _snowflake(message.message_id, "message")
        with _boundary(f"start a thread from Discord message {message_id}"):
            channel = client.get_channel(channel_id) or await client.fetch_channel(channel_id)
            if isinstance(channel, discord.Thread):  # a thread discord.py had not cached
                self._threads.add(channel.id)
                return str(channel.id)
            if not isinstance(channel, discord.TextChannel):
                raise ChatError(
                    f"Cannot start a thread from Discord message {message_id}: channel "
                    f"{channel_id} is a {type(channel).__name__}, not a text channel",
                    platform=PLATFORM)
            try:
                thread = await channel.get_partial_message(message_id).create_thread(
                    name=_thread_name(message.text), auto_archive_duration=_THREAD_ARCHIVE_MIN)
                thread_id = thread.id
            except discord.HTTPException as exc:
                if exc.code != _THREAD_ALREADY_CREATED:
                    raise
                thread_id = message_id  # the thread started from a message has its id
        self._threads.add(thread_id)
        return str(thread_id)

    async def post(self, channel: str, thread: str, text: str) -> list[str]:
        """Post ``text`` in ``thread`` (a Discord thread is a channel; without a thread, in
        ``channel``), in pieces of at most 2,000 characters; returns the message ids."""
        target = thread or channel
        return await self._send(_snowflake(target, "thread"), text, f"post in Discord {target}")

    async def post_alert(self, channel: str, text: str) -> list[str]:
        """Post ``text`` in ``channel`` (default: the configured ``alert_channel``)."""
        target = channel or self._cfg.alert_channel or ""
        return await self._send(_snowflake(target, "alert channel"), text,
                                f"post an alert in Discord channel {target}")

    async def post_question(self, channel: str, thread: str, text: str, value: str) -> str:
        """Post ``text`` in ``thread`` with Approve / Decline buttons; returns its id."""
        client = self._connected()
        target = thread or channel
        destination = client.get_partial_messageable(_snowflake(target, "thread"))
        view = question_view(value)
        with _boundary(f"post a question in Discord {target}"):
            message = await destination.send(
                discord_pieces(text)[0], view=view,
                nonce=secrets.token_hex(_NONCE_HEX_BYTES), allowed_mentions=_NO_PINGS)
        view.stop()  # presses are read in on_interaction, not by discord.py's view store
        return str(message.id)

    async def settle_question(
        self, channel: str, thread: str, message_id: str, text: str, verdict: str
    ) -> None:
        """Replace the question ``message_id`` with ``text`` and ``verdict`` and no buttons
        (an edit; the verdict's mention pings nobody)."""
        # The question as posted (formatted), cut to leave room for Bothy's own verdict.
        text = f"{discord_pieces(text)[0][: DISCORD_MAX_CHARS - len(verdict) - 1]}\n{verdict}"
        client = self._connected()
        target = thread or channel
        partial = client.get_partial_messageable(_snowflake(target, "thread")).get_partial_message(
            _snowflake(message_id, "message"))
        with _boundary(f"update the question {message_id} in Discord {target}"):
            await partial.edit(content=text, view=None,
                               allowed_mentions=_NO_PINGS)

    async def link(self, channel: str, thread: str) -> str | None:
        """The thread's jump URL (``https://discord.com/channels/{guild}/{thread}``); for a
        mention whose thread was never started, the message's
        (``…/{guild}/{channel}/{message}``); None if Discord does not say which guild."""
        client = self._connected_or_none()
        if client is None or not (_is_snowflake(channel) and _is_snowflake(thread)):
            return None
        for target, tail in ((thread, thread), (channel, f"{channel}/{thread}")):
            try:
                with _boundary(f"link to Discord channel {target}"):
                    found = (client.get_channel(int(target))
                             or await client.fetch_channel(int(target)))
            except ChatError:
                continue  # a mention's id is not a channel until its thread is started
            guild = getattr(found, "guild", None)
            if guild is not None:
                return f"https://discord.com/channels/{guild.id}/{tail}"
        return None

    def _connected_or_none(self) -> _Gateway | None:
        try:
            return self._connected()
        except ChatUnavailable:
            return None

    async def _send(self, channel_id: int, text: str, attempted: str) -> list[str]:
        client = self._connected()
        destination = client.get_partial_messageable(channel_id)
        sent: list[str] = []
        with _boundary(attempted):
            for piece in discord_pieces(text):  # the one place text becomes a Discord post
                message = await destination.send(
                    piece, nonce=secrets.token_hex(_NONCE_HEX_BYTES), allowed_mentions=_NO_PINGS)
                sent.append(str(message.id))
        return sent

    def _connected(self) -> _Gateway:
        if self._state != "ready" or self._client is None:
            raise ChatUnavailable(f"Discord is not connected (the adapter is {self._state})",
                                  platform=PLATFORM)
        if self._failure is not None:
            raise ChatUnavailable(f"Discord is not connected: {self._failure}",
                                  platform=PLATFORM)
        return self._client


class _Gateway(discord.Client):
    """A discord.Client whose events call back into the adapter."""

    def __init__(
        self,
        *,
        intents: discord.Intents,
        connector: aiohttp.BaseConnector | None,
        guild_ready_s: float,
        heartbeat_timeout_s: float,
        on_ready: Callable[[], None],
        on_message: Callable[[discord.Message], Awaitable[None]],
        on_interaction: Callable[[discord.Interaction], Awaitable[None]],
        on_frame: Callable[[str], None],
        on_event: Callable[[], None],
    ) -> None:
        super().__init__(
            intents=intents,
            connector=connector,
            guild_ready_timeout=guild_ready_s,
            heartbeat_timeout=heartbeat_timeout_s,
            max_messages=None,  # no message cache: Bothy keeps its own records
            chunk_guilds_at_startup=False,
            member_cache_flags=discord.MemberCacheFlags.none(),
            max_ratelimit_timeout=_MAX_RATELIMIT_WAIT_S,
            allowed_mentions=_NO_PINGS,
            enable_debug_events=True,  # on_socket_raw_receive: heartbeat ACKs, for liveness
        )
        self._ready_hook = on_ready
        self._message_hook = on_message
        self._interaction_hook = on_interaction
        self._frame_hook = on_frame
        self._event_hook = on_event

    async def close(self) -> None:
        """Close, and end discord.py's guild wait if it is still running: the adapter is ready
        before it ends (DiscordAdapter._guilds_arriving), and discord.py's own close leaves it
        pending, to dispatch ``ready`` into a closed client."""
        await super().close()
        waiting = self._connection._ready_task  # discord.py 2.7's _delay_ready task, or None
        if waiting is not None and not waiting.done():
            waiting.cancel()
            await asyncio.wait({waiting})  # (never raises: our own cancellation stays ours)

    async def on_ready(self) -> None:
        """Discord's READY and the guilds after it have arrived (again after a re-IDENTIFY)."""
        self._ready_hook()

    async def on_resumed(self) -> None:
        """RESUMED: the session goes on on a new socket."""
        self._ready_hook()

    async def on_socket_raw_receive(self, frame: str) -> None:
        """Every frame the gateway sent, decompressed (a debug event)."""
        self._frame_hook(frame)

    async def on_socket_event_type(self, event_type: str) -> None:
        """Every event the gateway dispatched (a debug event)."""
        self._event_hook()

    async def on_message(self, message: discord.Message) -> None:
        """A MESSAGE_CREATE, in a task of its own."""
        await self._message_hook(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        """An INTERACTION_CREATE (a button pressed), in a task of its own."""
        await self._interaction_hook(interaction)


# ---------------------------------------------------------------- foreign errors


@contextlib.contextmanager
def _boundary(attempted: str) -> Iterator[None]:
    """Let ChatErrors through and translate every other exception (not cancellation)."""
    try:
        yield
    except ChatError:
        raise
    except Exception as exc:
        raise translate_error(exc, attempted) from exc


def translate_error(exc: Exception, attempted: str) -> ChatError:
    """The ChatError that says what ``exc`` (from discord.py, aiohttp or the OS) means for
    Bothy, worded as "Cannot <attempted>: <reason>". Total: every exception maps."""
    if isinstance(exc, ChatError):
        return exc
    prefix = f"Cannot {attempted}: "
    if isinstance(exc, discord.PrivilegedIntentsRequired):
        return ChatAuthError(
            prefix + "Discord refused the privileged MESSAGE_CONTENT intent (close 4014). "
            "Enable “Message Content Intent” on the bot's page in the Discord Developer Portal, "
            "or set chat.discord.message_content_intent to false (replies that do not mention "
            "the bot are then not seen)", platform=PLATFORM)
    if isinstance(exc, discord.LoginFailure):
        return ChatAuthError(prefix + "Discord refused the bot token (401 Unauthorized); "
                             "check chat.discord.token_env", platform=PLATFORM)
    if isinstance(exc, discord.ConnectionClosed):
        code = getattr(exc, "code", None)
        if code in _AUTH_CLOSE_CODES:
            return ChatAuthError(prefix + f"the gateway closed with {code} "
                                 f"({_AUTH_CLOSE_CODES[code]})", platform=PLATFORM)
        return ChatUnavailable(prefix + f"the gateway closed with {code}", platform=PLATFORM)
    if isinstance(exc, discord.HTTPException):
        status = getattr(exc, "status", 0)
        if status == 401:
            return ChatAuthError(prefix + _reason(exc), platform=PLATFORM)
        if status == 429 or status >= 500:
            return ChatUnavailable(prefix + _reason(exc), platform=PLATFORM)
        return ChatError(prefix + _reason(exc), platform=PLATFORM)
    if isinstance(exc, discord.RateLimited | discord.GatewayNotFound | OSError
                  | aiohttp.ClientError):  # TimeoutError is an OSError
        return ChatUnavailable(prefix + _reason(exc), platform=PLATFORM)
    return ChatError(prefix + _reason(exc), platform=PLATFORM)


def _reason(exc: Exception) -> str:
    try:
        text = str(exc)
    except Exception:  # a foreign __str__ that fails must not hide the original error
        text = ""
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def _is_snowflake(value: str) -> bool:
    return re.fullmatch(r"[0-9]{1,20}", value) is not None


def _snowflake(value: str, what: str) -> int:
    if not re.fullmatch(r"[0-9]{1,20}", value):
        raise ChatError(f"{what} {value!r} is not a Discord id", platform=PLATFORM)
    return int(value)


def _thread_name(text: str) -> str:
    """A thread name from a message's text: whitespace collapsed, 1–100 characters."""
    name = " ".join(text.split()) or "Bothy"
    if len(name) > _THREAD_NAME_MAX:
        name = name[: _THREAD_NAME_MAX - 1].rstrip() + "…"
    return name
