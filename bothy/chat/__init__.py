"""Chat: an adapter per platform (the protocol in ``base.py``), what a message means
(``router.py``), a conversation and its runs (``conversation.py``), and how text becomes a
post on each platform, harmless (``formatting.py``).

The names in ``__all__`` are its surface: what the other packages use, importable from the
package itself (``from bothy.chat import X``), each loaded on first use (:mod:`bothy.surface`).
"""

from __future__ import annotations

from typing import Any

from bothy.surface import surface_attribute

_SURFACE = {
    "ChatAdapter": "bothy.chat.base",
    "ChatMessage": "bothy.chat.base",
    "OnLost": "bothy.chat.base",
    "OnMessage": "bothy.chat.base",
    "Conversations": "bothy.chat.conversation",
    "SOURCE": "bothy.chat.conversation",
    "DiscordAdapter": "bothy.chat.discord",
    "ConnectionView": "bothy.chat.liveness",
    "Heard": "bothy.chat.liveness",
    "Liveness": "bothy.chat.liveness",
    "Watched": "bothy.chat.liveness",
    "DISCORD_NO_PINGS": "bothy.chat.formatting",
    "OneShotPoster": "bothy.chat.oneshot",
    "Tokens": "bothy.chat.oneshot",
    "discord_markdown": "bothy.chat.formatting",
    "slack_mrkdwn": "bothy.chat.formatting",
    "ChatRouter": "bothy.chat.router",
    "SlackAdapter": "bothy.chat.slack",
}
__all__ = [
    "DISCORD_NO_PINGS",
    "SOURCE",
    "ChatAdapter",
    "ChatMessage",
    "ChatRouter",
    "ConnectionView",
    "Conversations",
    "DiscordAdapter",
    "Heard",
    "Liveness",
    "OnLost",
    "OnMessage",
    "OneShotPoster",
    "SlackAdapter",
    "Tokens",
    "Watched",
    "discord_markdown",
    "slack_mrkdwn",
]


def __getattr__(name: str) -> Any:
    """Load a name of the surface from its module on first use (PEP 562)."""
    return surface_attribute(__name__, _SURFACE, name)

