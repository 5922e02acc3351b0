"""One post, one Web API call: how a command with no gateway connection speaks (issue 11).

``bothy run``, ``bothy schedule run``, ``bothy audit repair`` — every command but ``bothy
serve`` — has no Socket Mode or gateway connection, yet its alerts must reach the alert
channel. :class:`OneShotPoster` posts with the bot token over HTTPS, bounded by
``chat.alert_timeout_s`` in all (retries included):

- Slack: ``chat.postMessage`` with slack_sdk's ``AsyncWebClient`` (base URL ``chat.slack.
  api_url``, as the adapter's), retrying a 429 after its ``Retry-After`` and a 500/503 or a
  dropped connection with backoff, twice at most (contracts.md §2.3);
- Discord: REST ``POST /channels/{id}/messages`` (base URL ``chat.discord.api_url``), with
  ``allowed_mentions`` none and an enforced ``nonce`` (a retry after a lost response returns
  the message already made, contracts.md §3.4), retrying a 429 after its ``retry_after`` and a
  5xx with backoff, three attempts at most.

The text goes through ``chat/formatting.py`` like every adapter post. An alert about a chat
thread links to it: a Slack permalink (``chat.getPermalink``), a Discord jump URL
(``https://discord.com/channels/{guild}/{thread}``); a link that cannot be had is left out,
never a reason not to alert.

Tokens come from the environment, else from the config's ``secrets_file`` — the 0600
``NAME=value`` file a service unit loads (``bothy/install/envfile.py``). A file that group or
others may read is refused; a token found nowhere is an error naming the variable. Every
failure is a :class:`~bothy.errors.ChatError` (or a :class:`~bothy.errors.ConfigError` for the
file) whose message says what was attempted and why: the caller audits it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import ssl
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from bothy.chat.formatting import DISCORD_NO_PINGS, discord_pieces, slack_pieces
from bothy.config import ChatConfig
from bothy.engine.alerts import Alert, AlertThread
from bothy.errors import ChatAuthError, ChatError, ChatUnavailable, ConfigError
from bothy.install.envfile import parse_env_text

__all__ = ["OneShotPoster", "Tokens"]

_SLACK_API_URL = "https://slack.com/api/"
_DISCORD_API_URL = "https://discord.com/api/v10"
_DISCORD_JUMP = "https://discord.com/channels"
_USER_AGENT = "DiscordBot (https://github.com/bothy, 1)"  # the form Discord requires
_RETRIES = 2  # after the first attempt
_BACKOFF_S = 0.5
_NONCE_HEX_BYTES = 12  # 24 characters; Discord accepts at most 25


class Tokens:
    """Chat tokens: the environment first, else the 0600 ``secrets_file``."""

    def __init__(self, secrets_file: Path | None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        self._file = secrets_file
        self._environ = os.environ if environ is None else environ

    def get(self, name: str, key: str) -> str:
        """The value of ``name`` (named by config ``key``); raise ChatAuthError naming the
        variable when it is nowhere, ConfigError for a secrets file others may read."""
        value = self._environ.get(name, "").strip()
        if value:
            return value
        if self._file is None:
            raise ChatAuthError(f"{name} ({key}) is not set in the environment, and no"
                                " secrets_file is configured", platform="-")
        value = self._read_file().get(name, "").strip()
        if not value:
            raise ChatAuthError(f"{name} ({key}) is not set in the environment nor in"
                                f" secrets_file {self._file}", platform="-")
        return value

    def _read_file(self) -> dict[str, str]:
        path = self._file
        assert path is not None
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(f"secrets_file {path} cannot be read: {exc}", path=path,
                              key="secrets_file") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"Refusing to read secrets_file {path}: group or others may read it (mode"
                f" {stat.S_IMODE(mode):04o}); make it private with chmod 600", path=path,
                key="secrets_file")
        try:
            return parse_env_text(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"secrets_file {path} cannot be read: {exc}", path=path,
                              key="secrets_file") from exc


class OneShotPoster:
    """Posts to a chat channel with one Web API call (and bounded retries), no gateway."""

    def __init__(self, cfg: ChatConfig, tokens: Tokens, *,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._cfg = cfg
        self._tokens = tokens
        self._ssl = ssl_context
        self._timeout_s = cfg.alert_timeout_s

    @property
    def alert_route(self) -> str | None:
        """The alert channel alerts go to (``slack:C…`` first, else ``discord:…``), if any."""
        if self._cfg.slack is not None and self._cfg.slack.alert_channel:
            return f"slack:{self._cfg.slack.alert_channel}"
        if self._cfg.discord is not None and self._cfg.discord.alert_channel:
            return f"discord:{self._cfg.discord.alert_channel}"
        return None

    async def post_alert(self, alert: Alert) -> str:
        """Post ``alert`` in the alert channel, linked to its thread; return where it went.
        (An :data:`~bothy.engine.alerts.AlertSink`.)"""
        route = self.alert_route
        if route is None:
            raise ChatError("no chat alert channel is configured", platform="-")
        platform, _, channel = route.partition(":")
        try:
            async with asyncio.timeout(self._timeout_s):
                link = await self._link(alert.thread)
                await self._post(platform, channel, alert.text(link), None)
        except TimeoutError:
            raise _timed_out(f"post an alert to {route}", self._timeout_s, platform) from None
        return route

    async def post(self, platform: str, channel: str, text: str, *,
                   thread: str | None = None) -> list[str]:
        """Post ``text`` (Markdown) in ``channel`` (in ``thread`` when given: Slack's thread
        ts; a Discord thread is a channel of its own, so give it as ``channel``), within
        ``chat.alert_timeout_s``; returns the ids of the messages made."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._post(platform, channel, text, thread)
        except TimeoutError:
            raise _timed_out(f"post in {platform}:{channel}", self._timeout_s,
                             platform) from None

    async def _post(self, platform: str, channel: str, text: str,
                    thread: str | None) -> list[str]:
        if platform == "slack":
            return await self._slack_post(channel, text, thread)
        if platform == "discord":
            return await self._discord_post(channel, text)
        raise ChatError(f"Cannot post to {platform}:{channel}: not a chat platform",
                        platform=platform)

    # ---------------------------------------------------------------- Slack

    def _slack(self) -> Any:
        from slack_sdk.http_retry.builtin_async_handlers import (
            AsyncConnectionErrorRetryHandler,
            AsyncRateLimitErrorRetryHandler,
            AsyncServerErrorRetryHandler,
        )
        from slack_sdk.web.async_client import AsyncWebClient

        slack = self._cfg.slack
        if slack is None:
            raise ChatError("Slack is not configured (chat.slack)", platform="slack")
        token = self._tokens.get(slack.bot_token_env, "chat.slack.bot_token_env")
        return AsyncWebClient(
            token=token, base_url=slack.api_url or _SLACK_API_URL, timeout=int(self._timeout_s),
            ssl=self._ssl,
            retry_handlers=[AsyncConnectionErrorRetryHandler(max_retry_count=_RETRIES),
                            AsyncRateLimitErrorRetryHandler(max_retry_count=_RETRIES),
                            AsyncServerErrorRetryHandler(max_retry_count=_RETRIES)])

    async def _slack_post(self, channel: str, text: str, thread: str | None) -> list[str]:
        client = self._slack()
        posted: list[str] = []
        for piece in slack_pieces(text):
            response = await _slack_call(
                f"post in Slack {channel}",
                client.chat_postMessage(channel=channel, text=piece, thread_ts=thread))
            posted.append(str(response.get("ts")))
        return posted

    async def _slack_permalink(self, thread: AlertThread) -> str | None:
        response = await _slack_call(
            f"link to Slack thread {thread.thread}",
            self._slack().chat_getPermalink(channel=thread.channel, message_ts=thread.thread))
        link = response.get("permalink")
        return link if isinstance(link, str) and link.startswith("https://") else None

    # ---------------------------------------------------------------- Discord

    def _discord(self) -> tuple[str, dict[str, str]]:
        discord = self._cfg.discord
        if discord is None:
            raise ChatError("Discord is not configured (chat.discord)", platform="discord")
        token = self._tokens.get(discord.token_env, "chat.discord.token_env")
        base = (discord.api_url or _DISCORD_API_URL).rstrip("/")
        return base, {"Authorization": f"Bot {token}", "User-Agent": _USER_AGENT}

    async def _discord_post(self, channel: str, text: str) -> list[str]:
        base, headers = self._discord()
        posted: list[str] = []
        async with self._session(headers) as session:
            for piece in discord_pieces(text):
                body = {"content": piece, "allowed_mentions": DISCORD_NO_PINGS,
                        "nonce": secrets.token_hex(_NONCE_HEX_BYTES), "enforce_nonce": True}
                message = await _discord_call(
                    session, "POST", f"{base}/channels/{channel}/messages", body,
                    f"post in Discord channel {channel}")
                posted.append(str(message.get("id")))
        return posted

    async def _discord_jump_url(self, thread: AlertThread) -> str | None:
        """The thread's jump URL; for a mention whose thread was never started, the
        message's (``…/{guild}/{channel}/{message}``)."""
        base, headers = self._discord()
        async with self._session(headers) as session:
            for target, tail in ((thread.thread, thread.thread),
                                 (thread.channel, f"{thread.channel}/{thread.thread}")):
                try:
                    channel = await _discord_call(session, "GET", f"{base}/channels/{target}",
                                                  None, f"link to Discord channel {target}")
                except ChatError:
                    continue  # a mention's id is not a channel until its thread is started
                if channel.get("guild_id"):
                    return f"{_DISCORD_JUMP}/{channel['guild_id']}/{tail}"
        return None

    def _session(self, headers: dict[str, str]) -> aiohttp.ClientSession:
        # The default context honours SSL_CERT_FILE (how a test trusts its throwaway CA).
        connector = aiohttp.TCPConnector(ssl=self._ssl or ssl.create_default_context())
        return aiohttp.ClientSession(connector=connector, headers=headers)

    # ---------------------------------------------------------------- links

    async def _link(self, thread: AlertThread | None) -> str | None:
        """The thread's link, or None when there is no thread or it cannot be had."""
        if thread is None:
            return None
        try:
            if thread.platform == "slack" and self._cfg.slack is not None:
                return await self._slack_permalink(thread)
            if thread.platform == "discord" and self._cfg.discord is not None:
                return await self._discord_jump_url(thread)
        except (ChatError, ConfigError):
            return None  # the alert itself still goes out (or says why it cannot)
        return None


def _timed_out(attempted: str, timeout_s: float, platform: str) -> ChatUnavailable:
    return ChatUnavailable(f"Cannot {attempted}: no answer within {timeout_s:g} s"
                           " (chat.alert_timeout_s)", platform=platform)


async def _slack_call(attempted: str, call: Any) -> Any:
    """Await one slack_sdk call; every failure becomes a ChatError naming ``attempted``."""
    from slack_sdk.errors import SlackApiError

    try:
        response = await call
    except SlackApiError as exc:
        data = getattr(exc.response, "data", None)
        error = data.get("error") if isinstance(data, dict) else None
        status = getattr(exc.response, "status_code", None)
        said = f"Slack answered {error or 'an error'} (HTTP {status})"
        if error in ("invalid_auth", "not_authed", "token_revoked", "account_inactive"):
            raise ChatAuthError(f"Cannot {attempted}: {said}", platform="slack") from None
        raise ChatUnavailable(f"Cannot {attempted}: {said}", platform="slack") from None
    except (aiohttp.ClientError, OSError) as exc:  # TimeoutError is an OSError
        raise ChatUnavailable(f"Cannot {attempted}: Slack is unreachable"
                              f" ({type(exc).__name__}: {exc})", platform="slack") from None
    data = getattr(response, "data", None)
    return data if isinstance(data, dict) else {}


async def _discord_call(session: aiohttp.ClientSession, method: str, url: str,
                        body: dict[str, Any] | None, attempted: str) -> dict[str, Any]:
    """One REST call, retried after a 429 (its ``retry_after``) or a 5xx (backoff), bounded
    by the caller's timeout and :data:`_RETRIES`; a ChatError names what failed."""
    said = ""
    for attempt in range(_RETRIES + 1):
        try:
            async with session.request(method, url, json=body) as response:
                data = await _json(response)
                status = response.status
                if status < 300:
                    return data
                said = f"Discord answered HTTP {status}: {data.get('message') or ''}".rstrip(": ")
                if status == 401:
                    raise ChatAuthError(f"Cannot {attempted}: {said}", platform="discord")
                if status != 429 and status < 500:
                    raise ChatError(f"Cannot {attempted}: {said}", platform="discord")
                wait_s = _retry_after_s(response, data) if status == 429 else \
                    _BACKOFF_S * 2 ** attempt
        except (aiohttp.ClientError, OSError) as exc:  # TimeoutError is an OSError
            said = f"Discord is unreachable ({type(exc).__name__}: {exc})"
            wait_s = _BACKOFF_S * 2 ** attempt
        if attempt < _RETRIES:
            await asyncio.sleep(wait_s)
    raise ChatUnavailable(f"Cannot {attempted}: {said} (after {_RETRIES + 1} attempts)",
                          platform="discord")


async def _json(response: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = await response.json(content_type=None)
    except (ValueError, aiohttp.ContentTypeError):
        return {}
    return data if isinstance(data, dict) else {}


def _retry_after_s(response: aiohttp.ClientResponse, data: dict[str, Any]) -> float:
    raw = data.get("retry_after", response.headers.get("Retry-After", "1"))
    try:
        return max(0.0, float(raw))
    except (TypeError, ValueError):
        return 1.0
