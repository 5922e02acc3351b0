"""Discord on loopback: the REST API and a v10 gateway that the real discord.py talks to.

discord.py has no base-URL option. Rather than patching its class attributes (``Route.BASE``,
``DiscordWebSocket.DEFAULT_GATEWAY``: process-global, chat-testing.md pitfall 8), the bot is
given an aiohttp connector (:meth:`FakeDiscord.connector`) whose resolver sends
``discord.com``, ``gateway.discord.gg`` and the resume host to this server, and whose TLS
context trusts a throwaway CA (:class:`Certificates`, made with the ``openssl`` CLI) that signed
this server's certificate. discord.py then runs exactly as in production: the same URLs, TLS
with verification on, no attribute touched (chat-testing.md option B)::

    certificates = Certificates.create(tmp_dir)          # once per session
    async with FakeDiscord(certificates) as fake:
        client = discord.Client(intents=..., connector=fake.connector())   # inside the loop
        ...
        message_id = await fake.send_mention(ALICE_ID, CHANNEL_ID, "what changed?")
        await fake.wait_for(lambda: fake.posts, "an answer")

What it speaks (shapes from discord-api-docs, contracts.md §3, and what discord.py 2.7 reads):

* REST under ``/api/v10``: ``GET /users/@me`` (401 for a token other than :attr:`token`),
  ``GET /oauth2/applications/@me``, ``GET /gateway``, ``GET /gateway/bot``,
  ``GET /channels/{id}``, ``POST /channels/{id}/messages`` (2,000-character limit, ``nonce`` +
  ``enforce_nonce`` returning the earlier message), ``POST …/messages/{id}/threads`` (the
  thread id is the message id; a second thread for one message is 400 code 160004),
  ``PUT …/reactions/{emoji}/@me`` (a unicode emoji or ``name:id``; a bare name is 400 code
  10014, Unknown Emoji). Bodies are JSON with ``Content-Type: application/json``
  exactly: discord.py parses nothing else (chat-testing.md pitfall 7).
* The gateway at ``/``: HELLO (``heartbeat_interval_ms``), heartbeat ACK, IDENTIFY → READY
  (``resume_gateway_url`` = :data:`RESUME_HOST`, also this server) + GUILD_CREATE; dispatches
  with sequence numbers; RESUME replays every event after the client's ``seq`` then RESUMED;
  op 7 RECONNECT, op 9 INVALID_SESSION; close codes 4004 (authentication failed) and 4014
  (disallowed intent); a client closing with 1000/1001 ends its session, as Discord does.
  ``compress=zlib-stream`` is honoured (one zlib stream per connection, ``Z_SYNC_FLUSH`` after
  each payload, payloads split across two frames to exercise reassembly); any other value gets
  uncompressed text frames (pitfall 9: discord.py asks for zstd when ``zstandard`` is installed).
* Intents: MESSAGE_CREATE only with GUILD_MESSAGES; without MESSAGE_CONTENT a message's
  ``content`` is empty unless it mentions the bot or the bot wrote it.

Not emulated: permissions (all allowed), rate-limit headers and 429s, ETF, sharding, members,
presences, interactions, DMs, archiving, session expiry by time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import ssl
import subprocess
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

JSON = dict[str, Any]

BOT_TOKEN = "MTI4NzY1NDMyMTA5ODc2NTQzMg.GfAkE1.fake-discord-bot-token-for-tests"
REST_HOST = "discord.com"
GATEWAY_HOST = "gateway.discord.gg"
RESUME_HOST = "gateway-us-east1-b.discord.gg"
HOSTS = (REST_HOST, GATEWAY_HOST, RESUME_HOST)

BOT_ID = "1287654321098765432"
APP_ID = BOT_ID  # a bot user's id is its application's id
OWNER_ID = "1100000000000000001"
ALICE_ID = "1100000000000000002"
BOB_ID = "1100000000000000003"
GUILD_ID = "1200000000000000001"
CHANNEL_ID = "1200000000000000002"  # #general
ALERT_CHANNEL_ID = "1200000000000000003"  # #bothy-alerts

# Gateway intents (discord-api-docs, gateway.mdx "List of Intents").
GUILDS = 1 << 0
GUILD_MESSAGES = 1 << 9
MESSAGE_CONTENT = 1 << 15

# JSON error codes (opcodes-and-status-codes.mdx).
UNKNOWN_CHANNEL = 10003
UNKNOWN_MESSAGE = 10008
UNKNOWN_EMOJI = 10014
INVALID_FORM_BODY = 50035
WRONG_CHANNEL_TYPE = 50024
THREAD_ALREADY_CREATED = 160004

_DISCORD_EPOCH_MS = 1420070400000
_TEXT_CHANNEL = 0
_PUBLIC_THREAD = 11
_MAX_CONTENT = 2000
_MAX_NONCE = 25
_ZLIB_SUFFIX = b"\x00\x00\xff\xff"
_SHUTDOWN_GRACE_S = 1.0


def _now() -> str:
    return datetime.now(UTC).isoformat()


# --- TLS: a throwaway CA and one certificate for every Discord host ----------------------


@dataclass(frozen=True)
class Certificates:
    """A CA and a server certificate for :data:`HOSTS`, as PEM files in ``directory``."""

    ca_pem: Path
    cert_pem: Path
    key_pem: Path

    @classmethod
    def create(cls, directory: Path) -> Certificates:
        """Make the CA and the certificate with the openssl CLI (about 50 ms)."""
        ca_key, ca_pem = directory / "ca.key", directory / "ca.pem"
        key, csr = directory / "server.key", directory / "server.csr"
        cert = directory / "server.pem"
        extensions = directory / "server.ext"
        extensions.write_text(
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
            # 127.0.0.1 too: a one-shot REST post is pointed at the fake by its api_url.
            "subjectAltName=" + ",".join(f"DNS:{host}" for host in HOSTS) + ",IP:127.0.0.1\n"
        )
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for argv in (
            ["req", "-x509", *ec, "-days", "2", "-subj", "/CN=Bothy throwaway test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", ca_key, "-out", ca_pem],
            ["req", *ec, "-subj", f"/CN={REST_HOST}", "-keyout", key, "-out", csr],
            ["x509", "-req", "-in", csr, "-CA", ca_pem, "-CAkey", ca_key,
             "-set_serial", str(uuid.uuid4().int >> 64), "-days", "2",
             "-extfile", extensions, "-out", cert],
        ):
            subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
        return cls(ca_pem=ca_pem, cert_pem=cert, key_pem=key)

    def server_context(self) -> ssl.SSLContext:
        """What the fake serves with."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_pem, self.key_pem)
        return context

    def client_context(self) -> ssl.SSLContext:
        """What the bot verifies with: the throwaway CA only, hostname checks on."""
        return ssl.create_default_context(cafile=str(self.ca_pem))


class _FakeDNS(AbstractResolver):
    """Resolves the Discord hosts to the fake's port on 127.0.0.1; nothing else resolves."""

    def __init__(self, port: int) -> None:
        self._port = port

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host not in HOSTS:
            raise OSError(f"fake DNS: {host} is not a Discord host")
        return [ResolveResult(hostname=host, host="127.0.0.1", port=self._port,
                              family=socket.AF_INET, proto=0, flags=socket.AI_NUMERICHOST)]

    async def close(self) -> None:
        return None


# --- what the fake records ------------------------------------------------------------------


@dataclass(frozen=True)
class Post:
    """A message the bot created through REST."""

    channel_id: str
    message_id: str
    content: str
    nonce: str | None
    enforce_nonce: bool
    allowed_mentions: JSON | None = None  # as the request carried it (None: absent)


@dataclass(frozen=True)
class ThreadStart:
    """A thread the bot started from a message (its id is the message's id)."""

    channel_id: str
    thread_id: str
    name: str
    auto_archive_duration: int


@dataclass(frozen=True)
class Reaction:
    """A reaction the bot added."""

    channel_id: str
    message_id: str
    emoji: str


@dataclass(frozen=True)
class Request:
    """One REST request and the status it got."""

    method: str
    path: str
    host: str
    status: int


@dataclass
class Connection:
    """One gateway websocket, as the fake saw it."""

    number: int
    host: str
    query: dict[str, str]
    ops: list[int] = field(default_factory=list)  # the client's opcodes, in order
    identify: JSON | None = None  # the IDENTIFY payload's ``d`` (token removed)
    session_id: str | None = None  # set by IDENTIFY (new session) or RESUME
    resumed: bool = False
    replayed: list[int] = field(default_factory=list)  # sequence numbers replayed on RESUME
    replayed_ids: list[str] = field(default_factory=list)  # ids of the messages among them
    heartbeats: list[int | None] = field(default_factory=list)  # each heartbeat's last seq
    closed: bool = False
    close_code: int | None = None  # the code of whoever closed first
    closed_by_server: bool = False
    silent: bool = False  # silence(): open, but nothing is sent on it (no ACK, no event)


@dataclass
class _Failure:
    route: str
    status: int
    after_commit: bool


@dataclass
class _Session:
    id: str
    intents: int
    seq: int = 0
    log: list[JSON] = field(default_factory=list)
    live: _Live | None = None
    resumable: bool = True


class _Live:
    """The server side of one open gateway socket."""

    def __init__(self, record: Connection, ws: web.WebSocketResponse, request: web.Request) -> None:
        self.record = record
        self.ws = ws
        self.request = request
        self.zlib = zlib.compressobj() if record.query.get("compress") == "zlib-stream" else None
        self._sending = asyncio.Lock()  # frames leave in sequence order; the zlib stream is one

    async def send(self, *payloads: JSON) -> None:
        if self.record.silent:
            return  # a ghost: what the session logged is replayed on a RESUME elsewhere
        async with self._sending:
            for payload in payloads:
                data = json.dumps(payload).encode()
                try:
                    if self.zlib is None:
                        await self.ws.send_str(data.decode())
                        continue
                    compressed = self.zlib.compress(data) + self.zlib.flush(zlib.Z_SYNC_FLUSH)
                    cut = len(compressed) // 2
                    if cut and not compressed[:cut].endswith(_ZLIB_SUFFIX):
                        await self.ws.send_bytes(compressed[:cut])
                        compressed = compressed[cut:]
                    await self.ws.send_bytes(compressed)
                except (ConnectionError, RuntimeError):
                    return  # the socket is going; a RESUME replays what it missed


# --- the fake ---------------------------------------------------------------------------------


class FakeDiscord:
    """Discord's REST API and gateway on 127.0.0.1, over TLS, for one bot.

    Knobs (set any time): :attr:`token` (the token REST and the gateway accept),
    :attr:`allow_message_content` (False: IDENTIFY with MESSAGE_CONTENT is closed with 4014),
    :attr:`refuse_identify` (close 4004 on IDENTIFY although REST accepted the token),
    :attr:`gateway_available` (False: the websocket upgrade gets 503), :attr:`ack_heartbeats`,
    :meth:`fail_next` for one REST failure, and :meth:`silence` for a socket that stays open
    and says nothing (``peak_open_connections``: the most sockets open at once).
    """

    def __init__(
        self,
        certificates: Certificates,
        *,
        token: str = BOT_TOKEN,
        heartbeat_interval_ms: int = 500,
    ) -> None:
        self.token = token
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.allow_message_content = True
        self.refuse_identify = False
        self.gateway_available = True
        self.ack_heartbeats = True
        self.posts: list[Post] = []
        self.threads: list[ThreadStart] = []
        self.reactions: list[Reaction] = []
        self.requests: list[Request] = []
        self.connections: list[Connection] = []
        self.refused_upgrades = 0  # gateway upgrades answered 503 (gateway_available False)
        self._certificates = certificates
        self._failures: list[_Failure] = []
        self._ids = itertools.count()
        self._last_id = 0
        self._channels: dict[str, JSON] = {
            CHANNEL_ID: _text_channel(CHANNEL_ID, "general", 0),
            ALERT_CHANNEL_ID: _text_channel(ALERT_CHANNEL_ID, "bothy-alerts", 1),
        }
        self._thread_members: dict[str, set[str]] = {}
        self._messages: dict[str, JSON] = {}
        self._nonces: dict[str, JSON] = {}
        self._sessions: dict[str, _Session] = {}
        self._session: _Session | None = None  # the newest identified session
        self._lives: set[_Live] = set()
        self._peak_open = 0
        self._change = asyncio.Event()
        self._resumes_open = asyncio.Event()
        self._resumes_open.set()
        self._runner: web.AppRunner | None = None
        self._port = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1 every Discord host resolves to."""
        return self._port

    @property
    def api_url(self) -> str:
        """The REST base URL by address (``chat.discord.api_url``): the certificate names
        127.0.0.1 too, so a client trusting :attr:`Certificates.ca_pem` verifies it."""
        return f"https://127.0.0.1:{self._port}/api/v10"

    def connector(self) -> aiohttp.TCPConnector:
        """An aiohttp connector that reaches this fake for the Discord hosts, verifying TLS
        against the throwaway CA. Call it inside the running loop (discord.py owns it after)."""
        return aiohttp.TCPConnector(resolver=_FakeDNS(self._port),
                                    ssl=self._certificates.client_context(), limit=0)

    async def __aenter__(self) -> FakeDiscord:
        app = web.Application(middlewares=[self._rest_middleware])
        api = "/api/v10"
        app.router.add_get("/", self._gateway, name="gateway")
        app.router.add_get(f"{api}/users/@me", self._me, name="me")
        app.router.add_get(f"{api}/oauth2/applications/@me", self._application,
                           name="application")
        app.router.add_get(f"{api}/gateway", self._gateway_url, name="gateway_url")
        app.router.add_get(f"{api}/gateway/bot", self._gateway_url, name="gateway_bot")
        app.router.add_get(f"{api}/channels/{{channel}}", self._channel, name="channel")
        app.router.add_post(f"{api}/channels/{{channel}}/messages", self._create_message,
                            name="create_message")
        app.router.add_post(f"{api}/channels/{{channel}}/messages/{{message}}/threads",
                            self._create_thread, name="create_thread")
        app.router.add_put(
            f"{api}/channels/{{channel}}/messages/{{message}}/reactions/{{emoji}}/@me",
            self._add_reaction, name="add_reaction")
        runner = web.AppRunner(app, handler_cancellation=True,
                               shutdown_timeout=_SHUTDOWN_GRACE_S, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0,
                           ssl_context=self._certificates.server_context())
        await site.start()
        self._runner = runner
        self._port = runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for live in list(self._lives):
            await self._close(live, 1001, "fake Discord shutting down")
        if self._runner is not None:
            await self._runner.cleanup()

    # ---------------------------------------------------------------- test-facing API

    async def send_mention(self, author_id: str, channel_id: str, text: str) -> str:
        """A user posts ``<@bot> text`` in a channel or thread; returns the message id."""
        return await self._user_message(author_id, channel_id, f"<@{BOT_ID}> {text}",
                                        mentions_bot=True)

    async def send_message(self, author_id: str, channel_id: str, text: str) -> str:
        """A user posts ``text`` (no mention) in a channel or thread; returns the message id."""
        return await self._user_message(author_id, channel_id, text, mentions_bot=False)

    async def close_gateway(self, code: int, reason: str = "") -> None:
        """Close the current gateway socket with ``code`` (4000 resumable, 4004, 4014 …)."""
        await self._close(self._detach(), code, reason)

    async def abort_gateway(self) -> None:
        """Drop the current gateway socket's TCP connection without a close frame."""
        live = self._detach()
        live.record.closed_by_server = True
        transport = live.request.transport
        assert transport is not None, "the gateway socket has no transport"
        transport.abort()

    async def reconnect(self) -> None:
        """Send op 7 RECONNECT: the client should reconnect and RESUME."""
        live = self._detach()
        await live.send({"op": 7, "d": None})

    async def invalidate_session(self, *, resumable: bool) -> None:
        """Send op 9 INVALID_SESSION (``d`` = ``resumable``)."""
        session = self._session
        assert session is not None, "no session to invalidate"
        live = self._detach()
        session.resumable = resumable
        await live.send({"op": 9, "d": resumable})

    async def caught_up(self) -> None:
        """Ask for a heartbeat now (op 1) and wait for one carrying the newest sequence
        number: the client has then read, and dispatched, every event sent before."""
        session = self._session
        assert session is not None and session.live is not None, "no gateway socket is open"
        live, seq = session.live, session.seq
        await live.send({"op": 1, "d": None})
        await self.wait_for(lambda: any(s is not None and s >= seq
                                        for s in live.record.heartbeats),
                            f"a heartbeat acknowledging sequence {seq}")

    def silence(self) -> None:
        """Make the current gateway socket a ghost: it stays open, but no heartbeat is
        acknowledged and no event is sent on it (the session still logs them, so a RESUME
        on another socket replays them) — until the client closes it."""
        session = self._session
        assert session is not None and session.live is not None, "no gateway socket is open"
        session.live.record.silent = True
        self._changed()

    @property
    def peak_open_connections(self) -> int:
        """The most gateway sockets that were open at once."""
        return self._peak_open

    def hold_resumes(self) -> None:
        """Keep RESUMEs waiting (events meanwhile are buffered) until :meth:`release_resumes`."""
        self._resumes_open.clear()

    def release_resumes(self) -> None:
        """Let held and later RESUMEs proceed."""
        self._resumes_open.set()

    def fail_next(self, route: str, status: int = 500, *, after_commit: bool = False) -> None:
        """Answer the next request to ``route`` (``create_message``, ``me``, …) with
        ``status``; with ``after_commit`` the request takes effect first (a lost response)."""
        self._failures.append(_Failure(route, status, after_commit))

    @property
    def session_id(self) -> str | None:
        """The newest identified session, if any."""
        return None if self._session is None else self._session.id

    @property
    def open_connections(self) -> list[Connection]:
        """Gateway sockets open now."""
        return [c for c in self.connections if not c.closed]

    def posts_in(self, channel_id: str) -> list[Post]:
        """What the bot posted in one channel or thread, in order."""
        return [post for post in self.posts if post.channel_id == channel_id]

    async def wait_for(
        self, predicate: Callable[[], object], what: str, *, timeout_s: float = 5.0
    ) -> None:
        """Wait until ``predicate()`` is truthy; re-checked on every change the fake sees."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    changed = self._change
                    if predicate():
                        return
                    await changed.wait()
        except TimeoutError:
            raise AssertionError(f"fake Discord: no {what} within {timeout_s} s") from None

    async def wait_ready(self, count: int = 1) -> Connection:
        """Wait until ``count`` connections have identified or resumed; returns the last."""
        def settled() -> list[Connection]:
            return [c for c in self.connections if c.session_id is not None]
        await self.wait_for(lambda: len(settled()) >= count, f"{count} settled connection(s)")
        return settled()[count - 1]

    async def wait_posts(self, count: int) -> list[Post]:
        """Wait until the bot has posted ``count`` messages; returns them all."""
        await self.wait_for(lambda: len(self.posts) >= count, f"{count} post(s)")
        return list(self.posts)

    # ---------------------------------------------------------------- state helpers

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def _snowflake(self) -> str:
        stamp = int(time.time() * 1000) - _DISCORD_EPOCH_MS
        value = max((stamp << 22) | (next(self._ids) & 0xFFF), self._last_id + 1)
        self._last_id = value
        return str(value)

    def _detach(self) -> _Live:
        session = self._session
        assert session is not None and session.live is not None, "no gateway socket is open"
        live, session.live = session.live, None
        return live

    def _is_thread(self, channel_id: str) -> bool:
        return bool(self._channels[channel_id]["type"] == _PUBLIC_THREAD)

    def _user(self, user_id: str) -> JSON:
        if user_id == BOT_ID:
            return {"id": BOT_ID, "username": "bothy", "discriminator": "0",
                    "global_name": "Bothy", "avatar": None, "bot": True, "flags": 0}
        names = {OWNER_ID: "owner", ALICE_ID: "alice", BOB_ID: "bob"}
        name = names.get(user_id, f"user{user_id[-4:]}")
        return {"id": user_id, "username": name, "discriminator": "0",
                "global_name": name.title(), "avatar": None, "bot": False, "flags": 0}

    def _thread(self, thread_id: str) -> JSON:
        channel = dict(self._channels[thread_id])
        members = self._thread_members[thread_id]
        channel["member_count"] = len(members)
        if BOT_ID in members:
            channel["member"] = {"id": thread_id, "user_id": BOT_ID,
                                 "join_timestamp": channel["thread_metadata"]["create_timestamp"],
                                 "flags": 0}
        return channel

    def _channel_payload(self, channel_id: str) -> JSON:
        return self._thread(channel_id) if self._is_thread(channel_id) else self._channels[
            channel_id]

    def _guild(self) -> JSON:
        now = _now()
        return {
            "id": GUILD_ID, "name": "Acme Ops", "icon": None, "splash": None,
            "owner_id": OWNER_ID, "unavailable": False, "large": False, "member_count": 4,
            "joined_at": now, "afk_timeout": 300, "afk_channel_id": None,
            "verification_level": 0, "default_message_notifications": 0,
            "explicit_content_filter": 0, "mfa_level": 0, "nsfw_level": 0, "premium_tier": 0,
            "preferred_locale": "en-US", "system_channel_id": None, "system_channel_flags": 0,
            "features": [], "emojis": [], "stickers": [], "members": [], "presences": [],
            "voice_states": [], "stage_instances": [], "guild_scheduled_events": [],
            "soundboard_sounds": [],
            "roles": [{"id": GUILD_ID, "name": "@everyone", "permissions": "2248473465835073",
                       "position": 0, "color": 0, "hoist": False, "managed": False,
                       "mentionable": False, "flags": 0, "icon": None, "unicode_emoji": None}],
            "channels": [c for c in self._channels.values() if c["type"] == _TEXT_CHANNEL],
            "threads": [self._thread(c["id"]) for c in self._channels.values()
                        if c["type"] == _PUBLIC_THREAD],
        }

    def _message(self, author_id: str, channel_id: str, content: str, *, mentions_bot: bool,
                 nonce: str | None = None) -> JSON:
        message: JSON = {
            "id": self._snowflake(), "channel_id": channel_id, "guild_id": GUILD_ID,
            "author": self._user(author_id), "content": content, "timestamp": _now(),
            "edited_timestamp": None, "tts": False, "mention_everyone": False,
            "mentions": [self._user(BOT_ID)] if mentions_bot else [], "mention_roles": [],
            "attachments": [], "embeds": [], "components": [], "pinned": False, "type": 0,
            "flags": 0,
        }
        if nonce is not None:
            message["nonce"] = nonce
        self._messages[message["id"]] = message
        return message

    async def _user_message(self, author_id: str, channel_id: str, content: str, *,
                            mentions_bot: bool) -> str:
        assert channel_id in self._channels, f"unknown channel {channel_id}"
        message = self._message(author_id, channel_id, content, mentions_bot=mentions_bot)
        await self._dispatch_message(message)
        return str(message["id"])

    # ---------------------------------------------------------------- dispatching

    async def _emit(self, session: _Session, event: str, data: JSON) -> None:
        session.seq += 1
        frame = {"op": 0, "t": event, "s": session.seq, "d": data}
        session.log.append(frame)
        self._changed()
        if session.live is not None:
            await session.live.send(frame)

    async def _dispatch_message(self, message: JSON) -> None:
        session = self._session
        if session is None or not session.resumable or not session.intents & GUILD_MESSAGES:
            return  # nobody to tell: Discord does not keep events for a dead session
        visible = dict(message)
        sees_content = (session.intents & MESSAGE_CONTENT
                        or message["author"]["id"] == BOT_ID
                        or any(user["id"] == BOT_ID for user in message["mentions"]))
        if not sees_content:
            visible.update(content="", embeds=[], attachments=[], components=[])
        await self._emit(session, "MESSAGE_CREATE", visible)

    # ---------------------------------------------------------------- gateway

    async def _gateway(self, request: web.Request) -> web.StreamResponse:
        if not self.gateway_available:
            self.refused_upgrades += 1
            self._changed()
            return _json({"message": "Service Unavailable", "code": 0}, 503)
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        record = Connection(number=len(self.connections) + 1,
                            host=request.host.split(":")[0], query=dict(request.query))
        live = _Live(record, ws, request)
        self.connections.append(record)
        self._lives.add(live)
        self._peak_open = max(self._peak_open, len(self.open_connections))
        self._changed()
        try:
            await live.send({"op": 10, "d": {"heartbeat_interval": self.heartbeat_interval_ms}})
            async for frame in ws:
                if frame.type is aiohttp.WSMsgType.TEXT:
                    await self._client_frame(live, json.loads(frame.data))
        finally:
            self._lives.discard(live)
            record.closed = True
            if not record.closed_by_server:
                record.close_code = ws.close_code
            session = self._sessions.get(record.session_id or "")
            if session is not None and session.live is live:
                session.live = None
            if (session is not None and not record.closed_by_server
                    and ws.close_code in (1000, 1001)):
                session.resumable = False  # a clean close by the client ends its session
            self._changed()
        return ws

    async def _client_frame(self, live: _Live, frame: JSON) -> None:
        op = frame.get("op")
        live.record.ops.append(op if isinstance(op, int) else -1)
        self._changed()
        data = frame.get("d")
        if op == 1:
            live.record.heartbeats.append(data if isinstance(data, int) else None)
            if self.ack_heartbeats:
                await live.send({"op": 11, "d": None})
        elif op == 2 and isinstance(data, dict):
            await self._identify(live, data)
        elif op == 6 and isinstance(data, dict):
            await self._resume(live, data)

    async def _close(self, live: _Live, code: int, reason: str) -> None:
        live.record.closed_by_server = True
        live.record.close_code = code
        await live.ws.close(code=code, message=reason.encode())

    async def _identify(self, live: _Live, data: JSON) -> None:
        live.record.identify = {k: v for k, v in data.items() if k != "token"}
        if data.get("token") != self.token or self.refuse_identify:
            await self._close(live, 4004, "Authentication failed.")
            return
        intents = int(data.get("intents", 0))
        if intents & MESSAGE_CONTENT and not self.allow_message_content:
            await self._close(live, 4014, "Disallowed intent(s).")
            return
        session = _Session(id=uuid.uuid4().hex, intents=intents, live=live)
        self._sessions[session.id] = session
        self._session = session
        live.record.session_id = session.id
        await self._emit(session, "READY", {
            "v": 10, "user": self._user(BOT_ID), "guilds": [{"id": GUILD_ID, "unavailable": True}],
            "session_id": session.id, "session_type": "normal",
            "resume_gateway_url": f"wss://{RESUME_HOST}", "private_channels": [],
            "application": {"id": APP_ID, "flags": 0},
        })
        if intents & GUILDS:
            await self._emit(session, "GUILD_CREATE", self._guild())

    async def _resume(self, live: _Live, data: JSON) -> None:
        await self._resumes_open.wait()
        if data.get("token") != self.token:
            await self._close(live, 4004, "Authentication failed.")
            return
        session = self._sessions.get(str(data.get("session_id")))
        if session is None or not session.resumable:
            await live.send({"op": 9, "d": False})
            return
        since = data.get("seq") or 0
        missed = [frame for frame in session.log if frame["s"] > since]
        session.live = live
        live.record.session_id = session.id
        live.record.resumed = True
        live.record.replayed = [frame["s"] for frame in missed]
        live.record.replayed_ids = [frame["d"]["id"] for frame in missed
                                    if frame["t"] == "MESSAGE_CREATE"]
        session.seq += 1
        self._changed()
        await live.send(*missed, {"op": 0, "t": "RESUMED", "s": session.seq, "d": {}})

    # ---------------------------------------------------------------- REST

    @web.middleware
    async def _rest_middleware(
        self, request: web.Request,
        handler: Callable[[web.Request], Any],
    ) -> web.StreamResponse:
        route = request.match_info.route.name or ""
        if route == "gateway":
            response: web.StreamResponse = await handler(request)
            return response
        response = await self._rest(request, route, handler)
        self.requests.append(Request(request.method, request.path,
                                     request.host.split(":")[0], response.status))
        self._changed()
        return response

    async def _rest(self, request: web.Request, route: str,
                    handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bot {self.token}":
            return _json({"message": "401: Unauthorized", "code": 0}, 401)
        failure = next((f for f in self._failures if f.route == route), None)
        if failure is not None:
            self._failures.remove(failure)
            if not failure.after_commit:
                return _json({"message": "Internal Server Error", "code": 0}, failure.status)
        response: web.StreamResponse = await handler(request)
        if failure is not None:
            return _json({"message": "Internal Server Error", "code": 0}, failure.status)
        return response

    async def _me(self, request: web.Request) -> web.Response:
        return _json(self._user(BOT_ID))

    async def _application(self, request: web.Request) -> web.Response:
        return _json({
            "id": APP_ID, "name": "Bothy", "description": "", "icon": None,
            "bot_public": False, "bot_require_code_grant": False,
            "owner": self._user(OWNER_ID), "team": None, "summary": "",
            "verify_key": "9d1d3c5c9e0b4f0e8d1b2c3a4f5e6d7c8b9a0f1e2d3c4b5a6978877665544332",
            "flags": 0, "tags": [], "redirect_uris": [], "approximate_guild_count": 1,
            "bot": self._user(BOT_ID),
        })

    async def _gateway_url(self, request: web.Request) -> web.Response:
        return _json({"url": f"wss://{GATEWAY_HOST}", "shards": 1, "session_start_limit": {
            "total": 1000, "remaining": 999, "reset_after": 14_400_000, "max_concurrency": 1}})

    async def _channel(self, request: web.Request) -> web.Response:
        channel_id = request.match_info["channel"]
        if channel_id not in self._channels:
            return _json({"message": "Unknown Channel", "code": UNKNOWN_CHANNEL}, 404)
        return _json(self._channel_payload(channel_id))

    async def _create_message(self, request: web.Request) -> web.Response:
        channel_id = request.match_info["channel"]
        if channel_id not in self._channels:
            return _json({"message": "Unknown Channel", "code": UNKNOWN_CHANNEL}, 404)
        body = await request.json()
        content = str(body.get("content") or "")
        nonce = None if body.get("nonce") is None else str(body["nonce"])
        problem = _form_problem(content, nonce)
        if problem is not None:
            return _json(problem, 400)
        if nonce is not None and body.get("enforce_nonce") and nonce in self._nonces:
            return _json(self._nonces[nonce])  # contracts.md §3.4: the earlier message
        message = self._message(BOT_ID, channel_id, content, mentions_bot=False, nonce=nonce)
        if nonce is not None:
            self._nonces[nonce] = message
        if self._is_thread(channel_id):
            self._thread_members[channel_id].add(BOT_ID)  # posting in a thread joins it
        self.posts.append(Post(channel_id, message["id"], content, nonce,
                               bool(body.get("enforce_nonce")),
                               allowed_mentions=body.get("allowed_mentions")))
        await self._dispatch_message(message)
        return _json(message)

    async def _create_thread(self, request: web.Request) -> web.Response:
        channel_id, message_id = request.match_info["channel"], request.match_info["message"]
        if channel_id not in self._channels:
            return _json({"message": "Unknown Channel", "code": UNKNOWN_CHANNEL}, 404)
        if self._messages.get(message_id, {}).get("channel_id") != channel_id:
            return _json({"message": "Unknown Message", "code": UNKNOWN_MESSAGE}, 404)
        if self._is_thread(channel_id):
            return _json({"message": "Cannot execute action on this channel type",
                          "code": WRONG_CHANNEL_TYPE}, 400)
        if message_id in self._channels:
            return _json({"message": "A thread has already been created for this message",
                          "code": THREAD_ALREADY_CREATED}, 400)
        body = await request.json()
        name = str(body.get("name") or "")
        if not 1 <= len(name) <= 100:
            return _json({"message": "Invalid Form Body", "code": INVALID_FORM_BODY,
                          "errors": {"name": {"_errors": [{"code": "BASE_TYPE_BAD_LENGTH",
                                     "message": "Must be between 1 and 100 in length."}]}}}, 400)
        duration = int(body.get("auto_archive_duration") or 1440)
        now = _now()
        self._channels[message_id] = {
            "id": message_id, "guild_id": GUILD_ID, "parent_id": channel_id,
            "owner_id": BOT_ID, "type": _PUBLIC_THREAD, "name": name, "last_message_id": None,
            "message_count": 0, "total_message_sent": 0, "rate_limit_per_user": 0, "flags": 0,
            "thread_metadata": {"archived": False, "auto_archive_duration": duration,
                                "archive_timestamp": now, "locked": False,
                                "create_timestamp": now},
        }
        self._thread_members[message_id] = {BOT_ID}
        self.threads.append(ThreadStart(channel_id, message_id, name, duration))
        thread = self._thread(message_id)
        session = self._session
        if session is not None and session.resumable and session.intents & GUILDS:
            await self._emit(session, "THREAD_CREATE", {**thread, "newly_created": True})
        return _json(thread, 201)

    async def _add_reaction(self, request: web.Request) -> web.Response:
        channel_id, message_id = request.match_info["channel"], request.match_info["message"]
        if channel_id not in self._channels:
            return _json({"message": "Unknown Channel", "code": UNKNOWN_CHANNEL}, 404)
        if message_id not in self._messages:
            return _json({"message": "Unknown Message", "code": UNKNOWN_MESSAGE}, 404)
        emoji = request.match_info["emoji"]
        if emoji.isascii() and not re.fullmatch(r"\w+:[0-9]+", emoji):
            # Discord takes a unicode emoji or a custom one as name:id; a bare name such as
            # Slack's "eyes" is not an emoji to it.
            return _json({"message": "Unknown Emoji", "code": UNKNOWN_EMOJI}, 400)
        self.reactions.append(Reaction(channel_id, message_id, emoji))
        return web.Response(status=204)


def _text_channel(channel_id: str, name: str, position: int) -> JSON:
    return {"id": channel_id, "guild_id": GUILD_ID, "type": _TEXT_CHANNEL, "name": name,
            "position": position, "parent_id": None, "topic": None, "nsfw": False,
            "rate_limit_per_user": 0, "last_message_id": None, "permission_overwrites": [],
            "default_auto_archive_duration": 1440}


def _form_problem(content: str, nonce: str | None) -> JSON | None:
    errors: JSON = {}
    if not content:
        return {"message": "Cannot send an empty message", "code": 50006}
    if len(content) > _MAX_CONTENT:
        errors["content"] = {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH",
                                          "message": "Must be 2000 or fewer in length."}]}
    if nonce is not None and len(nonce) > _MAX_NONCE:
        errors["nonce"] = {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH",
                                        "message": "Must be 25 or fewer in length."}]}
    if errors:
        return {"message": "Invalid Form Body", "code": INVALID_FORM_BODY, "errors": errors}
    return None


def _json(data: JSON, status: int = 200) -> web.Response:
    # Exactly "application/json": web.json_response's "; charset=utf-8" makes discord.py
    # treat the body as text (chat-testing.md pitfall 7).
    return web.Response(status=status, body=json.dumps(data).encode(),
                        headers={"Content-Type": "application/json"})
