"""Slack over Socket Mode, with slack-bolt (SPEC §5 "Chat"; contracts.md §2).

:class:`SlackAdapter` keeps one outbound websocket (``AsyncApp`` + ``AsyncSocketModeHandler``)
and hands every user message it sees to ``on_message`` as a :class:`ChatMessage`.

Acknowledgement follows durability. The app runs with ``process_before_response=True``, so
slack-bolt acks an envelope only after its listener returned — and the listener returns only
after ``on_message`` returned. ``on_message`` makes the message durable (fsync) first; if it
raises, the envelope is not acked and Slack delivers it again (``retry_attempt`` 1, 2, …).
Slack's ack deadline is 3 s (contracts.md §2.1), so ``on_message`` must only record, never run.

One mention arrives several times: as an ``app_mention`` and a ``message`` event (different
``event_id``, same channel and ``ts``) and again as Slack's retries. Every copy carries the same
``dedupe_key`` (``channel:ts``). The adapter hands a key to ``on_message`` once per process: a
copy arriving while the first is still in ``on_message`` waits for it and is acked with it (or
not acked, if it failed); a copy arriving later is acked at once. The router's durable dedupe
covers restarts.

What is handed over: plain user messages (no subtype, ``thread_broadcast``, ``file_share``) and
mentions, in channels, threads and DMs, mentioned or not — the router decides what they mean.
Dropped (and acked): the bot's own messages, other bots' messages (``bot_id``: no bot loops),
edits, deletions, joins and every other event type (a no-op listener matches them all, since
bolt leaves an event with no listener un-acked and Slack would keep retrying it).

Button presses (``block_actions`` in an ``interactive`` envelope) on Bothy's approval buttons
(drawn by ``slack_buttons.py``) go to ``on_press``, which records the decision before it returns;
only then is the envelope acked, so a press whose recording failed is delivered again. The
presser's private notice (``chat.postEphemeral``) follows the ack.

No ``slack_sdk``, ``slack_bolt`` or ``aiohttp`` exception leaves this module: a refused token is
:class:`ChatAuthError`, an unreachable or overloaded Slack (connection errors, timeouts, 5xx,
rate limits still hit after retries) is :class:`ChatUnavailable`, anything else
:class:`ChatError`. Rate limits are retried after ``Retry-After`` by slack_sdk's
``AsyncRateLimitErrorRetryHandler``.

Liveness (``bothy/chat/liveness.py`` watches it): :meth:`SlackAdapter.heard` says when the
socket opened, when Slack last sent anything on it and when it last answered a ping;
:meth:`~SlackAdapter.probe` pings it now; :meth:`~SlackAdapter.reconnect` closes the socket and
only then opens a new one — never two at once, as Slack spreads events over every open
connection and a stale one loses its share (research-next-wave.md E.3).

Proxy note: slack_sdk reads ``HTTPS_PROXY``/``HTTP_PROXY`` (ignoring ``NO_PROXY``) for both the
Web API and the socket (chat-testing.md pitfall 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.async_app import AsyncApp
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import (
    AsyncConnectionErrorRetryHandler,
    AsyncRateLimitErrorRetryHandler,
)
from slack_sdk.web.async_client import AsyncWebClient

from bothy.chat.base import ChatAdapter, ChatMessage, OnLost, OnMessage, OnPress, Press
from bothy.chat.buttons import ACTION_PREFIX
from bothy.chat.formatting import slack_pieces
from bothy.chat.liveness import Heard, Watched
from bothy.chat.slack_buttons import press_of, question_blocks, settled_blocks
from bothy.config import SlackConfig
from bothy.errors import ChatAuthError, ChatError, ChatUnavailable

_log = logging.getLogger(__name__)

PLATFORM = "slack"
_SLACK_API_URL = "https://slack.com/api/"

# Web API error codes that mean "fix the token or the app's configuration" (exit 78).
_AUTH_ERRORS = frozenset(
    {
        "not_authed",
        "invalid_auth",
        "account_inactive",
        "token_revoked",
        "token_expired",
        "not_allowed_token_type",
        "missing_scope",
        "no_permission",
        "team_access_not_granted",
        "ekm_access_denied",
        "org_login_required",
    }
)
# Web API error codes that mean "Slack cannot serve this now" (exit 75 at start-up).
_TRANSIENT_ERRORS = frozenset(
    {
        "ratelimited",
        "internal_error",
        "fatal_error",
        "service_unavailable",
        "request_timeout",
    }
)
# Message subtypes written by a person; everything else (edits, joins, bots…) is dropped.
_USER_SUBTYPES = frozenset({"thread_broadcast", "file_share"})
_RATE_LIMIT_RETRIES = 3  # each waits Retry-After (contracts.md §2.3: ~1 post/s per channel)
# Keys handed over, kept in memory: Slack redelivers an unacknowledged envelope within about
# five minutes, and the 2,000 newest cover that at up to ~7 messages a second in the bot's
# channels. A mention or a reply in a conversation is also deduplicated durably by the router;
# a copy of another message arriving later still would be handed over again. (10,000 held
# ~1.5 MB once a serve had seen as many messages.)
_REMEMBERED_KEYS = 2_000
_CLOSE_S = 5.0

_State = Literal["new", "starting", "ready", "stopped"]


class SlackAdapter:
    """One Socket Mode connection to a Slack workspace (a :class:`ChatAdapter`)."""

    platform = PLATFORM

    def __init__(
        self,
        cfg: SlackConfig,
        *,
        ping_interval_s: float = 10.0,
        call_timeout_s: int = 30,
        connect_timeout_s: float = 30.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._cfg = cfg
        self._ping_interval_s = ping_interval_s
        self._call_timeout_s = call_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._environ = environ
        self._state: _State = "new"
        self._web: AsyncWebClient | None = None
        self._handler: AsyncSocketModeHandler | None = None
        self._on_message: OnMessage | None = None
        self._on_press: OnPress | None = None
        self._bot_user_id = ""
        self._team_id = ""
        self._app_id: str | None = None
        self._mention: re.Pattern[str] | None = None
        self._inflight: dict[str, asyncio.Future[bool]] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._listeners: set[asyncio.Task[Any]] = set()
        self._app_token = ""
        self._connected_at: float | None = None
        self._last_event_at: float | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def bot_user_id(self) -> str:
        """The bot's own user id (``U…``), known once started."""
        return self._bot_user_id

    async def start(
        self, on_message: OnMessage, *, on_lost: OnLost | None = None,
        on_press: OnPress | None = None,
    ) -> None:
        """Check both tokens, connect the socket, return once it is open.

        Raises ChatAuthError for a token that is missing or refused, ChatUnavailable when Slack
        cannot be reached (or the socket is not open within ``connect_timeout_s``). ``on_lost``
        is never called: an envelope whose ``on_message`` failed is not acked, and Slack sends
        it again.
        """
        if self._state != "new":
            raise RuntimeError(f"SlackAdapter.start() called when {self._state}")
        self._state = "starting"
        self._on_press = on_press
        try:
            await self._start(on_message)
        except BaseException:
            await self.stop()
            raise
        self._state = "ready"

    async def _start(self, on_message: OnMessage) -> None:
        bot_token = self._token(self._cfg.bot_token_env)
        app_token = self._token(self._cfg.app_token_env)
        self._on_message = on_message
        self._web = web = AsyncWebClient(
            token=bot_token,
            base_url=self._cfg.api_url or _SLACK_API_URL,
            timeout=self._call_timeout_s,
            retry_handlers=[
                AsyncConnectionErrorRetryHandler(),
                AsyncRateLimitErrorRetryHandler(max_retry_count=_RATE_LIMIT_RETRIES),
            ],
        )
        self._app_token = app_token
        # The two tokens are checked side by side: auth.test (the bot token) and
        # apps.connections.open (the app token) do not depend on each other, so start-up
        # waits for one round trip to Slack, not two. A refused bot token is still the one
        # reported when both are refused.
        identity, opened = await _both(
            self._call("check the bot token (auth.test)", web.auth_test()),
            self._open_url(web),
        )
        self._bot_user_id = _field(identity, "user_id", "auth.test")
        # What a genuine button press names (slack_buttons.press_of): this workspace, and
        # this app when auth.test says which (it does for a bot token; the field is optional).
        self._team_id = _field(identity, "team_id", "auth.test")
        app_id = identity.get("app_id")
        self._app_id = app_id if isinstance(app_id, str) and app_id else None
        self._mention = re.compile(rf"<@{re.escape(self._bot_user_id)}(?:\|[^>]*)?>[ \t]?")
        self._handler = await self._open_socket(web, self._connect_timeout_s, opened=opened)
        _log.info("slack: connected as %s", self._bot_user_id)

    async def _open_url(self, web: AsyncWebClient) -> Mapping[str, Any]:
        """A fresh Socket Mode URL (apps.connections.open). Asking for it here (rather than
        inside the handler, which retries every failure forever) is what turns a refused app
        token into ChatAuthError."""
        return await self._call(
            "open a Socket Mode connection (apps.connections.open)",
            web.apps_connections_open(app_token=self._app_token),
        )

    async def _open_socket(
        self, web: AsyncWebClient, within_s: float, *, opened: Mapping[str, Any] | None = None
    ) -> AsyncSocketModeHandler:
        """A new Socket Mode connection, open, on the URL ``opened`` issued (a fresh one if
        None); nothing of it is left running on failure."""
        if opened is None:
            opened = await self._open_url(web)
        handler = AsyncSocketModeHandler(
            self._app(web), self._app_token, logger=_log, ping_interval=self._ping_interval_s
        )
        # The handler fetches a URL itself when it has none; handing it the one just issued
        # avoids a second call to a Tier 1 method (about one per minute) on every start.
        handler.client.wss_uri = _field(opened, "url", "apps.connections.open")
        # Every frame Slack sends (hello, events, disconnect) is a sign of life.
        handler.client.on_message_listeners.append(self._heard_frame)
        try:
            async with asyncio.timeout(within_s):
                await handler.connect_async()  # type: ignore[no-untyped-call]  # bolt leaves it unannotated
        except BaseException as exc:
            await _close_handler(handler)
            if isinstance(exc, TimeoutError):
                raise ChatUnavailable(
                    f"Cannot open the Slack socket: not connected within {within_s:g} s",
                    platform=PLATFORM,
                ) from None
            raise
        self._connected_at = time.time()
        return handler

    async def _heard_frame(self, message: object) -> None:
        self._last_event_at = time.time()

    # ---------------------------------------------------------------- liveness

    def heard(self) -> Heard:
        """When the socket opened, when Slack last sent on it, when it last answered a ping.

        The ping time is slack_sdk's ``last_ping_pong_time``: when the last ping whose pong
        came back was sent (slack_sdk also starts it at "now" on its first ping)."""
        client = None if self._handler is None else self._handler.client
        ping = None if client is None else client.last_ping_pong_time
        return Heard(self._connected_at, self._last_event_at, ping)

    async def probe(self) -> None:
        """Ping the socket now. The payload is in slack_sdk's own form, so the pong lands in
        ``last_ping_pong_time`` as its pings' do; a ping that cannot be sent shows as silence."""
        session = None if self._handler is None else self._handler.client.current_session
        if session is None or session.closed:
            return
        try:
            await session.ping(f"sdk-ping-pong:{time.time()}".encode())
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:
            _log.debug("slack: ping not sent: %r", exc)

    async def reconnect(self, *, within_s: float) -> None:
        """Close the socket, then open a new one within ``within_s`` (never both open).

        Raises ChatAuthError when Slack refuses the app token, ChatUnavailable when no socket
        opens in time; the adapter then has no socket (the Web API still works) until a later
        reconnect succeeds."""
        if self._state != "ready" or self._web is None:
            raise RuntimeError(f"SlackAdapter.reconnect() called when {self._state}")
        old, self._handler = self._handler, None
        if old is not None:
            await _close_handler(old)
        handler = await self._open_socket(self._web, within_s)
        if self._state != "ready":  # stopped meanwhile: stop() saw no socket to close
            await _close_handler(handler)
            raise ChatUnavailable("Slack adapter stopped while reconnecting", platform=PLATFORM)
        self._handler = handler
        _log.info("slack: reconnected")

    def _token(self, env: str) -> str:
        environ = os.environ if self._environ is None else self._environ
        token = environ.get(env, "").strip()
        if not token:
            raise ChatAuthError(
                f"Cannot connect to Slack: the environment variable {env} is not set",
                platform=PLATFORM,
            )
        return token

    def _app(self, web: AsyncWebClient) -> AsyncApp:
        app = AsyncApp(
            # Named, or bolt names the app after its caller's file through inspect.stack(),
            # which reads the source of every frame: tens of ms of every start and reconnect.
            name="bothy",
            client=web,
            logger=_log,
            process_before_response=True,  # ack after on_message returned: fsync, then ack
            request_verification_enabled=False,  # Socket Mode is pre-authenticated
            ssl_check_enabled=False,
            url_verification_enabled=False,
        )
        app.event("app_mention")(self._on_event)
        app.event("message")(self._on_event)
        # Listeners are tried in order; this one acks every other event type.
        app.event(re.compile(r".*"))(self._ignore)
        # Button presses: Bothy's are recorded before the ack; any other action is acked
        # only (bolt leaves an unmatched one un-acked, and Slack shows the presser an error).
        app.action(re.compile("^" + re.escape(ACTION_PREFIX)))(self._on_action)
        app.action(re.compile(r".*"))(self._ignore_action)
        return app

    async def stop(self) -> None:
        """Close the socket and end the tasks it ran; idempotent."""
        if self._state == "stopped":
            return
        self._state = "stopped"
        handler, self._handler = self._handler, None
        current = asyncio.current_task()
        listeners = [t for t in self._listeners if t is not current]
        for task in listeners:
            task.cancel()
        if handler is not None:
            await _close_handler(handler)
        if listeners:
            await asyncio.wait(listeners, timeout=_CLOSE_S)

    # ---------------------------------------------------------------- incoming

    async def _ignore(self) -> None:
        """Ack an event Bothy does not use."""

    async def _ignore_action(self, ack: Callable[[], Awaitable[Any]]) -> None:
        """Ack a press of a button that is not Bothy's."""
        await ack()

    async def _on_action(self, ack: Callable[[], Awaitable[Any]], body: dict[str, Any]) -> None:
        """A press of one of Bothy's buttons. ``on_press`` records it first; if it raises
        nothing is acked and Slack delivers the press again. The presser is told privately
        after the ack, never before (the ack waits for this listener to return)."""
        press = press_of(body, team_id=self._team_id, app_id=self._app_id)
        notice = None
        if self._on_press is not None:
            notice = (await self._on_press(press)).notice
        await ack()
        if notice is not None:
            task = asyncio.create_task(self._tell(press, notice))
            self._listeners.add(task)
            task.add_done_callback(self._listeners.discard)

    async def _tell(self, press: Press, text: str) -> None:
        """Tell the presser something only they see (chat.postEphemeral), best effort."""
        if self._state != "ready" or self._web is None:
            return  # stopping: the press itself is recorded; only the notice is lost
        try:
            await self._call(
                f"tell {press.user} in {press.channel} (chat.postEphemeral)",
                self._web.chat_postEphemeral(channel=press.channel, user=press.user,
                                             text=text, thread_ts=press.thread))
        except ChatError as exc:  # the press itself is recorded; only the notice is lost
            _log.warning("slack: %s", exc)

    async def _on_event(self, event: dict[str, Any]) -> None:
        message = self._to_message(event)
        if message is None:
            return
        task = asyncio.current_task()
        if task is not None:
            self._listeners.add(task)
        try:
            await self._hand_over(message)
        finally:
            if task is not None:
                self._listeners.discard(task)

    def _to_message(self, event: Mapping[str, Any]) -> ChatMessage | None:
        """The ChatMessage for a person's message or mention; None for anything to drop."""
        kind = event.get("type")
        subtype = event.get("subtype")
        user, channel, ts = event.get("user"), event.get("channel"), event.get("ts")
        if subtype is not None and subtype not in _USER_SUBTYPES:
            return None
        if event.get("bot_id") or not isinstance(user, str) or user == self._bot_user_id:
            return None
        if not isinstance(channel, str) or not isinstance(ts, str):
            return None
        raw = event.get("text")
        text = raw if isinstance(raw, str) else ""
        assert self._mention is not None
        mentioned = kind == "app_mention" or self._mention.search(text) is not None
        thread_ts = event.get("thread_ts")
        thread = thread_ts if isinstance(thread_ts, str) and thread_ts else ts
        return ChatMessage(
            platform=PLATFORM,
            dedupe_key=f"{channel}:{ts}",
            channel=channel,
            thread=thread,
            message_id=ts,
            user=user,
            text=self._mention.sub("", text).strip(),
            mentioned=mentioned,
            in_thread=thread != ts,
        )

    async def _hand_over(self, message: ChatMessage) -> None:
        """Give ``message`` to on_message once per key; raise (no ack) if that failed."""
        key = message.dedupe_key
        if key in self._done:
            return
        pending = self._inflight.get(key)
        if pending is not None:
            if not await asyncio.shield(pending):
                raise ChatError(
                    f"Not acknowledging {key}: another copy of it was not accepted",
                    platform=PLATFORM,
                )
            return
        accepted = asyncio.get_running_loop().create_future()
        self._inflight[key] = accepted
        ok = False
        try:
            assert self._on_message is not None
            await self._on_message(message)
            ok = True
            self._remember(key)
        finally:
            accepted.set_result(ok)
            del self._inflight[key]

    def _remember(self, key: str) -> None:
        self._done[key] = None
        while len(self._done) > _REMEMBERED_KEYS:
            self._done.popitem(last=False)

    # ---------------------------------------------------------------- outgoing

    async def react(self, message: ChatMessage, emoji: str) -> None:
        """Add ``emoji`` (a name, colons optional) to ``message``; already there is fine."""
        web = self._ready()
        await self._call(
            f"react to {message.dedupe_key}",
            web.reactions_add(
                channel=message.channel, timestamp=message.message_id, name=emoji.strip(":")
            ),
            fine={"already_reacted"},
        )

    async def open_thread(self, message: ChatMessage) -> str:
        """The mention's thread: its ``thread_ts`` if it is a reply, else its own ``ts``."""
        return message.thread

    async def post(self, channel: str, thread: str, text: str) -> list[str]:
        """Post ``text`` (Markdown) in ``thread`` as mrkdwn that pings nobody
        (``chat/formatting.py``), split at ≤ 4,000 characters; returns each piece's ts."""
        return await self._post(channel, thread, text)

    async def post_alert(self, channel: str, text: str) -> list[str]:
        """Post ``text`` in ``channel`` itself (not a thread); returns each piece's ts."""
        return await self._post(channel, None, text)

    async def _post(self, channel: str, thread: str | None, text: str) -> list[str]:
        web = self._ready()
        where = f"{channel} thread {thread}" if thread else channel
        posted: list[str] = []
        for piece in slack_pieces(text):  # the one place text becomes a Slack post
            response = await self._call(
                f"post in {where} (piece {len(posted) + 1}, {len(posted)} posted)",
                web.chat_postMessage(channel=channel, text=piece, thread_ts=thread),
            )
            posted.append(str(response.get("ts")))
        return posted

    async def post_question(self, channel: str, thread: str, text: str, value: str) -> str:
        """Post ``text`` (as mrkdwn that pings nobody, ``chat/formatting.py``) in ``thread``
        with Approve / Decline buttons; returns its ts."""
        shown = slack_pieces(text)[0]
        response = await self._call(
            f"post a question in {channel} thread {thread}",
            self._open_web().chat_postMessage(channel=channel, thread_ts=thread, text=shown,
                                              blocks=question_blocks(shown, value)),
        )
        return _field(response, "ts", "chat.postMessage")

    async def settle_question(
        self, channel: str, thread: str, message_id: str, text: str, verdict: str
    ) -> None:
        """Replace the question ``message_id`` with ``text`` (formatted as it was posted)
        and ``verdict`` (Bothy's own, its ``<@id>`` kept a mention) and no buttons
        (chat.update)."""
        shown = slack_pieces(text)[0]
        await self._call(
            f"update the question {message_id} in {channel}",
            self._open_web().chat_update(channel=channel, ts=message_id,
                                         text=f"{shown}\n{verdict}",
                                         blocks=settled_blocks(shown, verdict)),
        )

    def _open_web(self) -> AsyncWebClient:
        """The Web API client, or ChatUnavailable once stopped (a question's message may be
        settled after `bothy serve` closed its chat connections)."""
        if self._state != "ready" or self._web is None:
            raise ChatUnavailable(f"Slack is not connected (the adapter is {self._state})",
                                  platform=PLATFORM)
        return self._web

    async def link(self, channel: str, thread: str) -> str | None:
        """The thread's permalink (``chat.getPermalink``), or None if Slack gives none."""
        try:
            response = await self._call(f"link to {channel} thread {thread}",
                                        self._ready().chat_getPermalink(channel=channel,
                                                                        message_ts=thread))
        except (ChatError, RuntimeError):
            return None
        permalink = response.get("permalink")
        return permalink if isinstance(permalink, str) and permalink else None

    def _ready(self) -> AsyncWebClient:
        if self._state != "ready" or self._web is None:
            raise RuntimeError(f"SlackAdapter used when {self._state}, not ready")
        return self._web

    # ---------------------------------------------------------------- errors

    async def _call(
        self, action: str, call: Awaitable[Any], *, fine: set[str] | None = None
    ) -> Mapping[str, Any]:
        """Await one Web API call; every failure becomes a ChatError naming ``action``."""
        try:
            response = await call
        except SlackApiError as exc:
            if fine and _api_error(exc)[0] in fine:
                return {}
            raise _translate(exc, action) from exc
        except Exception as exc:
            raise _translate(exc, action) from exc
        data = getattr(response, "data", None)
        return data if isinstance(data, dict) else {}


async def _close_handler(handler: AsyncSocketModeHandler) -> None:
    """Close one Socket Mode connection and wait for the tasks it ran (bounded)."""
    client = handler.client
    try:
        async with asyncio.timeout(_CLOSE_S):
            await handler.close_async()  # type: ignore[no-untyped-call]  # unannotated in bolt
    except Exception as exc:  # closing is best effort: the process may be going down
        _log.warning("slack: closing the socket failed: %r", exc)
    # close() cancels these but does not wait for them; wait so none outlives the close.
    tasks = [t for t in (client.message_processor, client.current_session_monitor,
                         client.message_receiver) if t is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=_CLOSE_S)


async def _both(
    first: Awaitable[Mapping[str, Any]], second: Awaitable[Mapping[str, Any]]
) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """Two Web API calls awaited side by side; if either failed, the first one's failure is
    raised (after both have ended: neither is left running)."""
    outcomes: list[Mapping[str, Any] | BaseException] = list(
        await asyncio.gather(first, second, return_exceptions=True))
    answers = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        answers.append(outcome)
    return answers[0], answers[1]


def _field(response: Mapping[str, Any], name: str, method: str) -> str:
    """A string field Bothy cannot work without; its absence is Slack misbehaving."""
    value = response.get(name)
    if not isinstance(value, str) or not value:
        raise ChatError(f"Slack's {method} answer has no {name}", platform=PLATFORM)
    return value


def _api_error(exc: SlackApiError) -> tuple[str | None, int | None]:
    """The ``error`` code and HTTP status of a refused call (either may be unknown)."""
    response = exc.response
    data = getattr(response, "data", None)
    error = data.get("error") if isinstance(data, dict) else None
    status = getattr(response, "status_code", None) or getattr(response, "status", None)
    return (
        error if isinstance(error, str) else None,
        status if isinstance(status, int) else None,
    )


def _translate(exc: BaseException, action: str) -> ChatError:
    """Map any exception from slack_sdk, slack_bolt or aiohttp to Bothy's ChatError tree."""
    if isinstance(exc, SlackApiError):
        error, status = _api_error(exc)
        said = f"Slack answered {error or 'an error'} (HTTP {status})"
        if error in _AUTH_ERRORS:
            return ChatAuthError(f"Cannot {action}: {said}", platform=PLATFORM)
        if error in _TRANSIENT_ERRORS or (status is not None and (status == 429 or status >= 500)):
            return ChatUnavailable(f"Cannot {action}: {said}", platform=PLATFORM)
        return ChatError(f"Cannot {action}: {said}", platform=PLATFORM)
    if isinstance(exc, TimeoutError):  # before OSError: aiohttp's timeouts are both
        return ChatUnavailable(f"Cannot {action}: Slack did not answer in time", platform=PLATFORM)
    if isinstance(exc, aiohttp.ClientError | OSError):
        return ChatUnavailable(
            f"Cannot {action}: Slack is unreachable ({type(exc).__name__}: {exc})",
            platform=PLATFORM,
        )
    return ChatError(f"Cannot {action}: {type(exc).__name__}: {exc}", platform=PLATFORM)


if TYPE_CHECKING:  # mypy proves SlackAdapter satisfies the protocols
    _protocol_check: type[ChatAdapter] = SlackAdapter
    _watched_check: type[Watched] = SlackAdapter
