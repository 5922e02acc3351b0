"""How text becomes a chat post: in the platform's own form, and harmless (issue 11).

Every post an adapter makes (and every one-shot Web API post) goes through here, once, just
before it leaves. The text may have come from a run that read untrusted input (a webhook
payload, a feed, a web page), so it must not be able to ping anyone:

- **Slack** (mrkdwn): ``&``, ``<`` and ``>`` are escaped as ``&amp;``, ``&lt;``, ``&gt;``,
  which is all Slack asks — "you shouldn't HTML-escape the entire message, just those three
  characters" (https://docs.slack.dev/messaging/formatting-message-text#escaping). Every
  control sequence that pings — ``<!channel>``, ``<!here>``, ``<!everyone>``, ``<@U…>``,
  ``<#C…>``, ``<!subteam^…>`` — starts with ``<``, so none survives: it shows as the text it
  was. Bare ``@here`` is not a mention over the Web API (``chat.postMessage`` does not parse
  names unless asked with ``link_names``), so it is left as written.
  The Markdown Bothy and Codex write is converted to mrkdwn: ``**bold**`` → ``*bold*``,
  ``*italic*`` → ``_italic_`` (``_italic_`` is the same in both; ``__x__`` is left alone, as
  it is more often a Python name than emphasis), ``~~struck~~`` → ``~struck~``, a ``# heading``
  → a bold line, ``[text](https://…)`` → ``<https://…|text>``; code spans and fenced blocks
  are kept as they are (only escaped), since Slack shows them the same way.
- **Discord** (Markdown, as Bothy writes it): every post is sent with
  ``allowed_mentions: {"parse": []}`` (:data:`DISCORD_NO_PINGS`; discord.py's
  ``AllowedMentions.none()``), so no ``<@…>``, ``<@&…>``, ``@everyone`` or ``@here`` notifies
  anybody; and ``@everyone``/``@here`` in the text are also broken with a zero-width space,
  so they do not even look like a ping, nor become one if the text is ever re-posted.

Both split a long text within the platform's limit (:func:`slack_pieces`,
:func:`discord_pieces`), formatting first so the limit holds for what is sent.
"""

from __future__ import annotations

import re
from typing import Final

from bothy.chat.base import DISCORD_MAX_CHARS, SLACK_MAX_CHARS, split_text

__all__ = [
    "DISCORD_NO_PINGS",
    "discord_markdown",
    "discord_pieces",
    "slack_mrkdwn",
    "slack_pieces",
]

DISCORD_NO_PINGS: Final[dict[str, list[str]]] = {"parse": []}
"""The ``allowed_mentions`` of every Discord post: nobody is notified (Discord's API,
"Allowed Mentions Object": an empty ``parse`` and no ``users``/``roles`` lists)."""

_ZWSP = "\u200b"
# Code is kept as written: a fenced block (``` … ```, to the end if unclosed) or a span.
_CODE = re.compile(r"```.*?(?:```|\Z)|`[^`\n]+`", re.DOTALL)
_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^\s()<>|]+)\)")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_ITALIC_STAR = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_MASS_PING = re.compile(r"@(everyone|here)\b", re.IGNORECASE)
# Markers for bold while the single-star italics are converted (never in chat text).
_BOLD_ON, _BOLD_OFF = "\x02", "\x03"
_ENTITY_TAIL = re.compile(r"&[a-z]{0,3}$")


def slack_mrkdwn(text: str) -> str:
    """``text`` (Markdown) as Slack mrkdwn that pings nobody."""
    out: list[str] = []
    last = 0
    for code in _CODE.finditer(text):
        out.append(_slack_prose(text[last:code.start()]))
        out.append(_slack_escape(code.group(0)))
        last = code.end()
    out.append(_slack_prose(text[last:]))
    return "".join(out)


def discord_markdown(text: str) -> str:
    """``text`` as Discord Markdown, ``@everyone``/``@here`` broken so they read as text.

    Discord renders the Markdown Bothy writes; the post itself must still carry
    :data:`DISCORD_NO_PINGS`, which is what guarantees that nobody is notified."""
    return _MASS_PING.sub(lambda m: f"@{_ZWSP}{m.group(1)}", text)


def slack_pieces(text: str) -> list[str]:
    """``text`` as Slack mrkdwn, in pieces within Slack's limit (never cutting an entity)."""
    # An entity moved whole into the next piece may lengthen it by up to 4 characters.
    pieces = split_text(slack_mrkdwn(text), SLACK_MAX_CHARS - 4)
    return _mend_entities(pieces)


def discord_pieces(text: str) -> list[str]:
    """``text`` as Discord Markdown, in pieces within Discord's 2,000 characters."""
    return split_text(discord_markdown(text), DISCORD_MAX_CHARS)


def _slack_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _slack_prose(text: str) -> str:
    """Prose (no code in it): escaped, then Markdown's emphasis, headings and links."""
    text = _slack_escape(text)
    text = _HEADING.sub(lambda m: _BOLD_ON + _unbold(m.group(1)) + _BOLD_OFF, text)
    text = _BOLD.sub(lambda m: _BOLD_ON + m.group(1) + _BOLD_OFF, text)
    text = _ITALIC_STAR.sub(r"_\1_", text)
    text = _STRIKE.sub(r"~\1~", text)
    # Last: the link's own < > must not be escaped. Its text and URL already are.
    text = _LINK.sub(lambda m: f"<{m.group(2)}|{m.group(1)}>", text)
    return text.replace(_BOLD_ON, "*").replace(_BOLD_OFF, "*")


def _unbold(text: str) -> str:
    return text.replace("**", "")


def _mend_entities(pieces: list[str]) -> list[str]:
    """Move an entity cut by a hard split (``&am`` | ``p;``) whole into the next piece."""
    mended: list[str] = []
    carry = ""
    for index, piece in enumerate(pieces):
        piece = carry + piece
        tail = _ENTITY_TAIL.search(piece)
        carry = tail.group(0) if tail is not None and index < len(pieces) - 1 else ""
        mended.append(piece[: len(piece) - len(carry)])
    return [piece for piece in mended if piece]
