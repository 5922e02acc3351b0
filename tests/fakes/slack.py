"""A Slack on loopback: the Web API and a Socket Mode websocket, for the real slack-bolt.

The real ``AsyncWebClient`` reaches it through its public ``base_url`` (``fake.api_url``); the
Socket Mode client connects to the URL ``apps.connections.open`` returns
(``ws://127.0.0.1:PORT/link/?ticket=…``). See ``/work/shared/chat-testing.md``::

    async with FakeSlack() as slack:
        ts = slack.send_mention("U1", "C1", "what changed?")   # app_mention + message twins
        await slack.wait_for(lambda: slack.envelopes_acked(ts))
        slack.rate_limit_posts(1, retry_after_s=1)               # the next post answers 429
        slack.fail_method("reactions.add", error="channel_not_found")
        slack.close_socket()                                     # server-side close
        slack.disconnect("refresh_requested")                    # Slack's "please reconnect"
        slack.refuse_sockets = True                              # the websocket answers 503
        slack.silence()               # the current socket stays open but answers nothing

Web API: ``auth.test``, ``apps.connections.open``, ``chat.postMessage`` (blocks kept),
``chat.update``, ``chat.postEphemeral`` (kept in ``ephemerals``), ``chat.getPermalink``,
``reactions.add``, ``conversations.replies``, ``users.info``. Every call is recorded in
``calls`` (method, token, arguments); a token other than ``bot_token`` (``app_token`` for
``apps.connections.open``) is answered ``invalid_auth``, as Slack does (HTTP 200,
``ok: false``). Posts are kept in ``posts``; by default each one is echoed back over the
socket as a ``message`` event from the bot, as Slack does for an app subscribed to
``message.channels``, so the bot's self-filter is exercised.

Socket Mode: each socket gets ``hello`` first; events go out as ``events_api`` envelopes to
the newest open socket. A mention is two envelopes (``app_mention`` and ``message``, with
different ``event_id`` and the same ``channel``/``ts``), as real Slack sends when the app
subscribes to both. An envelope not acked within ``ack_timeout_s`` is sent again with
``retry_attempt`` 1, 2, … and ``retry_reason: "timeout"``, up to ``max_retries`` (the same
``envelope_id``); an attempt made while no socket is open is lost, as on real Slack. Acks
land in ``acked`` and, with their time, in ``acks``.

Buttons: :meth:`press_button` sends a ``block_actions`` payload (the button's own value, or a
forged team / app / value) in an ``interactive`` envelope, retried like an event until acked;
:meth:`replay` sends an envelope again; ``lose_acks`` drops the socket as the next ack arrives
(the ack is lost, the press is sent again on the next socket).
Liveness: the fake answers websocket pings itself (``pongs`` counts them) until
:meth:`FakeSlack.silence` makes the current socket a ghost — open, but answering no ping and
carrying no envelope (an attempt meant for it is lost, as on a dead connection Slack still
delivers to). ``open_sockets`` is how many sockets are open now and ``peak_open_sockets`` the
most that were ever open at once: a client that opens a new socket before closing the old
one shows 2.

Everything a test waits for is a predicate over this object, checked after every change
(:meth:`wait_for`) — no sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import WSMsgType, web

from tests.fakes.site import without_proxies

BOT_TOKEN = "xoxb-fake-bot-token"
APP_TOKEN = "xapp-fake-app-token"

BOT_USER_ID = "UBOTHY01"
BOT_ID = "BBOTHY01"
TEAM_ID = "TFAKE001"
APP_ID = "AFAKE001"
PERMALINK_BASE = "https://fake.slack.example"


def slack_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a `bothy serve` talking to this fake needs in its environment: the two tokens, and
    no proxy that could hijack loopback (chat-testing.md, pitfall 1)."""
    without_proxies(monkeypatch)
    monkeypatch.setenv("SLACK_BOT_TOKEN", BOT_TOKEN)
    monkeypatch.setenv("SLACK_APP_TOKEN", APP_TOKEN)


@dataclass(frozen=True)
class ApiCall:
    """One Web API request as the fake saw it."""

    method: str
    token: str | None
    args: dict[str, Any]
    at: float  # time.monotonic()
    status: int  # the HTTP status answered


@dataclass
class Post:
    """A message the bot posted (``chat.postMessage``), possibly updated since."""

    channel: str
    text: str
    ts: str
    thread_ts: str | None
    at: float
    blocks: list[dict[str, Any]] | None = None  # Block Kit blocks (buttons), if any


@dataclass(frozen=True)
class Ephemeral:
    """A message only one person sees (``chat.postEphemeral``)."""

    channel: str
    user: str
    text: str
    thread_ts: str | None


@dataclass(frozen=True)
class Ack:
    """An acknowledgement frame from the client."""

    envelope_id: str
    at: float
    payload: Any


@dataclass(frozen=True)
class Delivery:
    """One attempt to send an envelope; ``sent`` is false when no socket was open."""

    envelope_id: str
    attempt: int
    at: float
    sent: bool


@dataclass
class _Failure:
    status: int
    error: str
    count: int | None  # None: every call until cleared
    content_type: str = "application/json"
    body: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Envelope:
    envelope_id: str
    payload: dict[str, Any]
    event_ts: str | None
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    kind: str = "events_api"  # or "interactive" (a button press)


class FakeSlack:
    """Slack's Web API and Socket Mode on 127.0.0.1, recording everything it sees."""

    def __init__(
        self,
        *,
        bot_token: str = BOT_TOKEN,
        app_token: str = APP_TOKEN,
        ack_timeout_s: float = 1.0,
        max_retries: int = 3,
        echo_own_posts: bool = True,
    ) -> None:
        self.bot_token = bot_token
        self.app_token = app_token
        self.bot_user_id = BOT_USER_ID
        self.bot_id = BOT_ID
        self.team_id = TEAM_ID
        self.ack_timeout_s = ack_timeout_s
        self.max_retries = max_retries
        self.echo_own_posts = echo_own_posts
        self.refuse_sockets = False  # the websocket endpoint answers 503 while set

        self.calls: list[ApiCall] = []
        self.posts: list[Post] = []
        self.updates: list[dict[str, Any]] = []
        self.ephemerals: list[Ephemeral] = []
        self.lost_acks: list[str] = []  # envelope ids whose ack was lost
        self.lose_acks = 0  # the next N acks are lost: the socket drops as they arrive
        self.reactions: list[tuple[str, str, str]] = []  # (channel, ts, name)
        self.acks: list[Ack] = []
        self.acked: set[str] = set()
        self.deliveries: list[Delivery] = []
        self.envelopes: dict[str, _Envelope] = {}
        self.connections = 0  # sockets accepted so far
        self.peak_open_sockets = 0  # the most sockets open at once
        self.pongs = 0  # pings answered

        self._failures: dict[str, list[_Failure]] = {}
        self._hanging: set[str] = set()
        self._messages: dict[str, list[dict[str, Any]]] = {}  # channel -> messages
        self._tickets: set[str] = set()
        self._sockets: list[web.WebSocketResponse] = []
        self._silent: set[web.WebSocketResponse] = set()
        self._ts = itertools.count(1)
        self._changed = asyncio.Event()
        self._closing = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._port = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def api_url(self) -> str:
        """What ``AsyncWebClient(base_url=...)`` needs."""
        return f"http://127.0.0.1:{self._port}/api/"

    async def __aenter__(self) -> FakeSlack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._api)
        app.router.add_get("/link/", self._link)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None)
        assert sockets
        self._port = sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._closing.set()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for ws in list(self._sockets):
            await ws.close(code=1001, message=b"going away")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------- waiting

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; it is checked after every change the fake sees."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await self._changed.wait()

    async def wait_for_ack(self, envelope_id: str, *, timeout_s: float = 10.0) -> None:
        await self.wait_for(lambda: envelope_id in self.acked, timeout_s=timeout_s)

    async def wait_for_posts(self, count: int, *, timeout_s: float = 10.0) -> None:
        await self.wait_for(lambda: len(self.posts) >= count, timeout_s=timeout_s)

    async def wait_for_connections(self, count: int, *, timeout_s: float = 10.0) -> None:
        """Wait until ``count`` sockets have been accepted and one of them is open."""
        await self.wait_for(
            lambda: self.connections >= count and self.open_sockets > 0, timeout_s=timeout_s
        )

    async def wait_for_delivery(
        self, envelope_id: str, attempt: int, *, timeout_s: float = 10.0
    ) -> None:
        """Wait until ``envelope_id`` has been sent (to an open socket) with ``attempt``."""
        await self.wait_for(
            lambda: any(
                d.envelope_id == envelope_id and d.attempt >= attempt and d.sent
                for d in self.deliveries
            ),
            timeout_s=timeout_s,
        )

    # ---------------------------------------------------------------- views

    @property
    def open_sockets(self) -> int:
        return sum(1 for ws in self._sockets if not ws.closed)

    def envelopes_of(self, ts: str) -> list[str]:
        """The envelope ids carrying the message ``ts`` (two for a mention: the twins)."""
        return [e.envelope_id for e in self.envelopes.values() if e.event_ts == ts]

    def envelopes_acked(self, ts: str) -> bool:
        """Every envelope carrying ``ts`` has been acked."""
        ids = self.envelopes_of(ts)
        return bool(ids) and all(i in self.acked for i in ids)

    def calls_to(self, method: str) -> list[ApiCall]:
        return [c for c in self.calls if c.method == method]

    # ---------------------------------------------------------------- programming failures

    def rate_limit_posts(self, count: int, *, retry_after_s: int = 1) -> None:
        """The next ``count`` ``chat.postMessage`` calls answer HTTP 429 with ``Retry-After``."""
        self._failures.setdefault("chat.postMessage", []).append(
            _Failure(
                status=429,
                error="ratelimited",
                count=count,
                headers={"Retry-After": str(retry_after_s)},
            )
        )

    def fail_method(
        self,
        method: str,
        *,
        error: str = "internal_error",
        status: int = 200,
        count: int | None = 1,
        content_type: str = "application/json",
        body: str | None = None,
    ) -> None:
        """The next ``count`` calls of ``method`` (every call if None) answer this failure.

        ``body`` replaces the JSON ``{"ok": false, "error": ...}`` (e.g. an HTML error page).
        """
        self._failures.setdefault(method, []).append(
            _Failure(status=status, error=error, count=count, content_type=content_type, body=body)
        )

    def hang_method(self, method: str) -> None:
        """Calls of ``method`` get no answer until the fake closes."""
        self._hanging.add(method)

    def clear_failures(self) -> None:
        self._failures.clear()
        self._hanging.clear()

    # ---------------------------------------------------------------- Web API

    async def _api(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        args = await _arguments(request)
        token = _bearer(request) or args.pop("token", None)
        if method in self._hanging:
            self._record(method, token, args, 0)
            await self._closing.wait()
            return web.Response(status=503)
        failure = self._take_failure(method)
        if failure is not None:
            self._record(method, token, args, failure.status)
            return _failure_response(failure)
        expected = self.app_token if method == "apps.connections.open" else self.bot_token
        if token is None:
            return self._answer(method, token, args, {"ok": False, "error": "not_authed"})
        if token != expected:
            kind = token.startswith("xapp-") != expected.startswith("xapp-")
            error = "not_allowed_token_type" if kind else "invalid_auth"
            return self._answer(method, token, args, {"ok": False, "error": error})
        handler = self._methods().get(method)
        if handler is None:
            return self._answer(method, token, args, {"ok": False, "error": "unknown_method"})
        return self._answer(method, token, args, handler(args))

    def _methods(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {
            "auth.test": self._auth_test,
            "apps.connections.open": self._connections_open,
            "chat.postMessage": self._post_message,
            "chat.update": self._update,
            "chat.postEphemeral": self._post_ephemeral,
            "chat.getPermalink": self._permalink,
            "reactions.add": self._reactions_add,
            "conversations.replies": self._replies,
            "users.info": self._users_info,
        }

    def _take_failure(self, method: str) -> _Failure | None:
        queue = self._failures.get(method)
        if not queue:
            return None
        failure = queue[0]
        if failure.count is not None:
            failure.count -= 1
            if failure.count <= 0:
                queue.pop(0)
        return failure

    def _record(self, method: str, token: str | None, args: dict[str, Any], status: int) -> None:
        self.calls.append(ApiCall(method, token, args, time.monotonic(), status))
        self._change()

    def _answer(
        self, method: str, token: str | None, args: dict[str, Any], body: dict[str, Any]
    ) -> web.Response:
        self._record(method, token, args, 200)
        return web.json_response(body)

    def _auth_test(self, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "url": "https://fake.slack.example/",
            "team": "Fake",
            "user": "bothy",
            "team_id": self.team_id,
            "user_id": self.bot_user_id,
            "bot_id": self.bot_id,
            "app_id": APP_ID,
            "is_enterprise_install": False,
        }

    def _connections_open(self, args: dict[str, Any]) -> dict[str, Any]:
        ticket = uuid.uuid4().hex
        self._tickets.add(ticket)
        return {"ok": True, "url": f"ws://127.0.0.1:{self._port}/link/?ticket={ticket}"}

    def _post_message(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = str(args.get("channel", ""))
        if not channel:
            return {"ok": False, "error": "channel_not_found"}
        text = str(args.get("text", ""))
        if not text:
            return {"ok": False, "error": "no_text"}
        thread_ts = args.get("thread_ts") or None
        ts = self._next_ts()
        self.posts.append(Post(channel, text, ts, thread_ts, time.monotonic(),
                               _blocks(args.get("blocks"))))
        message = {
            "type": "message",
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
            "text": text,
            "ts": ts,
            "channel": channel,
        }
        if thread_ts:
            message["thread_ts"] = thread_ts
        self._messages.setdefault(channel, []).append(message)
        if self.echo_own_posts:
            self._send_event(dict(message, channel_type="channel", event_ts=ts), ts)
        return {"ok": True, "channel": channel, "ts": ts, "message": message}

    def _permalink(self, args: dict[str, Any]) -> dict[str, Any]:
        channel, ts = str(args.get("channel", "")), str(args.get("message_ts", ""))
        if not channel or not ts:
            return {"ok": False, "error": "message_not_found"}
        return {"ok": True, "channel": channel,
                "permalink": f"{PERMALINK_BASE}/archives/{channel}/p{ts.replace('.', '')}"}

    def _update(self, args: dict[str, Any]) -> dict[str, Any]:
        ts = str(args.get("ts", ""))
        for post in self.posts:
            if post.ts == ts and post.channel == args.get("channel"):
                post.text = str(args.get("text", ""))
                if "blocks" in args:
                    post.blocks = _blocks(args.get("blocks"))
                self.updates.append(args)
                return {"ok": True, "channel": post.channel, "ts": ts, "text": post.text}
        return {"ok": False, "error": "message_not_found"}

    def _post_ephemeral(self, args: dict[str, Any]) -> dict[str, Any]:
        channel, user = str(args.get("channel", "")), str(args.get("user", ""))
        if not channel or not user:
            return {"ok": False, "error": "channel_not_found" if not channel else "user_not_found"}
        text = str(args.get("text", ""))
        if not text:
            return {"ok": False, "error": "no_text"}
        self.ephemerals.append(Ephemeral(channel, user, text, args.get("thread_ts") or None))
        return {"ok": True, "message_ts": self._next_ts()}

    def _reactions_add(self, args: dict[str, Any]) -> dict[str, Any]:
        key = (str(args.get("channel")), str(args.get("timestamp")), str(args.get("name")))
        if key in self.reactions:
            return {"ok": False, "error": "already_reacted"}
        self.reactions.append(key)
        return {"ok": True}

    def _replies(self, args: dict[str, Any]) -> dict[str, Any]:
        channel, ts = str(args.get("channel")), str(args.get("ts"))
        thread = [
            m for m in self._messages.get(channel, []) if m["ts"] == ts or m.get("thread_ts") == ts
        ]
        if not thread:
            return {"ok": False, "error": "thread_not_found"}
        return {"ok": True, "messages": thread, "has_more": False}

    def _users_info(self, args: dict[str, Any]) -> dict[str, Any]:
        user = str(args.get("user"))
        is_bot = user == self.bot_user_id
        return {"ok": True, "user": {"id": user, "name": user.lower(), "is_bot": is_bot}}

    # ---------------------------------------------------------------- Socket Mode

    async def _link(self, request: web.Request) -> web.StreamResponse:
        ticket = request.query.get("ticket", "")
        if self.refuse_sockets:
            return web.Response(status=503, text="socket refused by the test")
        if ticket not in self._tickets:
            return web.Response(status=401, text="invalid ticket")
        self._tickets.discard(ticket)
        ws = web.WebSocketResponse(autoping=False)  # pings answered below, unless silent
        await ws.prepare(request)
        self._sockets.append(ws)
        self.connections += 1
        self.peak_open_sockets = max(self.peak_open_sockets, self.open_sockets)
        await ws.send_json(
            {
                "type": "hello",
                "num_connections": self.open_sockets,
                "debug_info": {"host": "fake", "approximate_connection_time": 3600},
                "connection_info": {"app_id": APP_ID},
            }
        )
        self._change()
        try:
            async for frame in ws:
                if frame.type == WSMsgType.TEXT:
                    self._receive(frame.data)
                elif frame.type == WSMsgType.PING and ws not in self._silent:
                    with contextlib.suppress(ConnectionError, RuntimeError):
                        await ws.pong(frame.data)
                        self.pongs += 1
                        self._change()
        finally:
            self._change()
        return ws

    def _receive(self, data: str) -> None:
        try:
            frame = json.loads(data)
        except json.JSONDecodeError:
            return
        envelope_id = frame.get("envelope_id") if isinstance(frame, dict) else None
        if not isinstance(envelope_id, str):
            return
        if self.lose_acks > 0:  # the socket drops with the ack on it: Slack never sees it
            self.lose_acks -= 1
            self.lost_acks.append(envelope_id)
            ws = self._current_socket()
            if ws is not None:
                self._spawn(ws.close(code=1011, message=b"dropped by the test"))
            self._change()
            return
        self.acks.append(Ack(envelope_id, time.monotonic(), frame.get("payload")))
        self.acked.add(envelope_id)
        envelope = self.envelopes.get(envelope_id)
        if envelope is not None:
            envelope.acked.set()
        self._change()

    def _current_socket(self) -> web.WebSocketResponse | None:
        for ws in reversed(self._sockets):
            if not ws.closed:
                return ws
        return None

    def close_socket(self, code: int = 1000) -> None:
        """Close the current socket from the server side (Slack's routine refresh)."""
        ws = self._current_socket()
        assert ws is not None, "no open socket to close"
        self._spawn(ws.close(code=code, message=b"server closed"))

    def silence(self) -> None:
        """Make the current socket a ghost: it stays open but answers no ping and carries
        no envelope (what is sent to it is lost) — until the client closes it."""
        ws = self._current_socket()
        assert ws is not None, "no open socket to silence"
        self._silent.add(ws)
        self._change()

    @property
    def silent_sockets_open(self) -> int:
        """Silenced sockets the client has not closed."""
        return sum(1 for ws in self._silent if not ws.closed)

    def disconnect(self, reason: str = "refresh_requested") -> None:
        """Send ``{"type": "disconnect", "reason": ...}`` on the current socket."""
        ws = self._current_socket()
        assert ws is not None, "no open socket to send disconnect on"
        frame = {"type": "disconnect", "reason": reason, "debug_info": {"host": "fake"}}
        self._spawn(ws.send_json(frame))

    # ---------------------------------------------------------------- events

    def _next_ts(self) -> str:
        n = next(self._ts)
        return f"{1_700_000_000 + n}.{n:06d}"

    def send_mention(self, user: str, channel: str, text: str, thread_ts: str | None = None) -> str:
        """A user mentions the bot: ``app_mention`` and ``message`` twins. Returns the ts."""
        ts = self._next_ts()
        body = f"<@{self.bot_user_id}> {text}"
        message = self._user_message(user, channel, body, ts, thread_ts)
        self._send_event(dict(message, type="app_mention"), ts)
        self._send_event(dict(message, channel_type="channel"), ts)
        return ts

    def send_message(self, user: str, channel: str, text: str, thread_ts: str | None = None) -> str:
        """A user writes without mentioning the bot (one ``message`` event). Returns the ts."""
        ts = self._next_ts()
        message = self._user_message(user, channel, text, ts, thread_ts)
        self._send_event(dict(message, channel_type="channel"), ts)
        return ts

    def press_button(
        self, user: str, message_ts: str, action_id: str, value: str | None = None, *,
        team_id: str | None = None, app_id: str | None = None,
    ) -> str:
        """A user presses a button of the bot's message ``message_ts``: a ``block_actions``
        payload in an ``interactive`` envelope, as Slack sends it over Socket Mode (unacked,
        it is sent again like an event). ``value`` defaults to the button's own; another
        ``team_id`` / ``app_id`` forges the press. Returns the envelope id."""
        post = next(p for p in self.posts if p.ts == message_ts)
        button = next((element for block in post.blocks or [] if block.get("type") == "actions"
                       for element in block.get("elements", [])
                       if element.get("action_id") == action_id), {})
        team = team_id or self.team_id
        container: dict[str, Any] = {"type": "message", "message_ts": post.ts,
                                     "channel_id": post.channel, "is_ephemeral": False}
        message: dict[str, Any] = {"type": "message", "user": self.bot_user_id,
                                   "bot_id": self.bot_id, "text": post.text, "ts": post.ts,
                                   "blocks": post.blocks or []}
        if post.thread_ts:
            container["thread_ts"] = message["thread_ts"] = post.thread_ts
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": user.lower(), "name": user.lower(),
                     "team_id": team},
            "api_app_id": app_id or APP_ID,
            "token": "verification-token-unused",
            "container": container,
            "trigger_id": f"{next(self._ts)}.{uuid.uuid4().hex[:12]}",
            "team": {"id": team, "domain": "fake"},
            "enterprise": None,
            "is_enterprise_install": False,
            "channel": {"id": post.channel, "name": post.channel.lower()},
            "message": message,
            "state": {"values": {}},
            "response_url": f"http://127.0.0.1:{self._port}/hooks/actions/{uuid.uuid4().hex}",
            "actions": [{
                "action_id": action_id, "block_id": "bothy_question",
                "text": button.get("text", {"type": "plain_text", "text": action_id}),
                "value": value if value is not None else button.get("value", ""),
                "style": button.get("style"), "type": "button",
                "action_ts": f"{time.time():.6f}",
            }],
        }
        envelope = _Envelope(str(uuid.uuid4()), payload, None, kind="interactive")
        self.envelopes[envelope.envelope_id] = envelope
        self._spawn(self._deliver(envelope))
        return envelope.envelope_id

    def replay(self, envelope_id: str) -> None:
        """Send an envelope again, acked or not (a press Slack delivers twice)."""
        envelope = self.envelopes[envelope_id]
        envelope.acked = asyncio.Event()
        self._spawn(self._deliver(envelope))

    def send_event(self, event: dict[str, Any]) -> str:
        """Any other event (e.g. ``reaction_added``). Returns the envelope id."""
        return self._send_event(event, None)

    def _user_message(
        self, user: str, channel: str, text: str, ts: str, thread_ts: str | None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "message",
            "user": user,
            "text": text,
            "ts": ts,
            "channel": channel,
            "event_ts": ts,
            "team": self.team_id,
            "client_msg_id": str(uuid.uuid4()),
        }
        if thread_ts is not None:
            message["thread_ts"] = thread_ts
            message["parent_user_id"] = self.bot_user_id
        self._messages.setdefault(channel, []).append(
            {k: v for k, v in message.items() if k != "event_ts"}
        )
        return message

    def _send_event(self, event: dict[str, Any], ts: str | None) -> str:
        envelope_id = str(uuid.uuid4())
        payload = {
            "token": "verification-token-unused",
            "team_id": self.team_id,
            "api_app_id": APP_ID,
            "event": event,
            "type": "event_callback",
            "event_id": "Ev" + uuid.uuid4().hex[:10].upper(),
            "event_time": int(time.time()),
            "authorizations": [
                {
                    "enterprise_id": None,
                    "team_id": self.team_id,
                    "user_id": self.bot_user_id,
                    "is_bot": True,
                    "is_enterprise_install": False,
                }
            ],
            "is_ext_shared_channel": False,
        }
        envelope = _Envelope(envelope_id, payload, ts)
        self.envelopes[envelope_id] = envelope
        self._spawn(self._deliver(envelope))
        return envelope_id

    async def _deliver(self, envelope: _Envelope) -> None:
        """Send, then resend un-acked envelopes after ``ack_timeout_s``, as Slack retries."""
        for attempt in range(self.max_retries + 1):
            ws = self._current_socket()
            frame = {
                "envelope_id": envelope.envelope_id,
                "type": envelope.kind,
                "accepts_response_payload": False,
                "retry_attempt": attempt,
                "retry_reason": "timeout" if attempt else "",
                "payload": envelope.payload,
            }
            sent = False
            if ws is not None and ws not in self._silent:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await ws.send_json(frame)
                    sent = True
            self.deliveries.append(Delivery(envelope.envelope_id, attempt, time.monotonic(), sent))
            self._change()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.ack_timeout_s):
                    await envelope.acked.wait()
            if envelope.acked.is_set():
                return

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _arguments(request: web.Request) -> dict[str, Any]:
    args: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        if request.content_type == "application/json":
            body = await request.json()
            if isinstance(body, dict):
                args.update(body)
        else:
            args.update(dict(await request.post()))
    return args


def _blocks(value: Any) -> list[dict[str, Any]] | None:
    """Blocks as a client sends them: a JSON list, or that list as a string (form posts)."""
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, list) else None


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    return header[len("Bearer ") :] if header.startswith("Bearer ") else None


def _failure_response(failure: _Failure) -> web.Response:
    body = failure.body
    if body is None:
        body = json.dumps({"ok": False, "error": failure.error})
    return web.Response(
        status=failure.status,
        text=body,
        content_type=failure.content_type,
        headers=failure.headers,
    )
