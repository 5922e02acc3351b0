"""The secret scan every memory write passes before anything touches disk (SPEC §8).

Rules of Bothy's own, written from the token formats (research note §A.5) rather than a
general-purpose scanner: detect-secrets-style bare-entropy rules flag ordinary prose. A match
is reported by its rule's name only; the text it matched is never repeated anywhere.

Rules: the formats of common credentials (cloud keys, GitHub, Slack and OpenAI tokens,
private-key blocks, JWTs), ``keyword = value`` where the value is long and high in entropy,
an exact match of any secret Bothy itself holds (chat tokens, webhook secrets, ``codex.env``
values), and invisible or bidirectional-control Unicode (which hides text from a reader).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bothy.config import Config

# A held secret shorter than this is too likely to occur in ordinary text to match on.
_MIN_HELD_CHARS = 8

# Zero-width and word-joiner characters, the byte-order mark, bidirectional embeddings,
# overrides and isolates (the "Trojan Source" set), and Unicode tag characters.
_INVISIBLE = re.compile(
    "[\u200b-\u200f\u2060-\u2064\ufeff\u202a-\u202e\u2066-\u2069\U000e0000-\U000e007f]"
)

_FORMATS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("aws-access-key", re.compile(r"\b(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}\b")),
    ("gcp-api-key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("github-token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_\w{22,})")),
    ("slack-token", re.compile(
        r"\bxox[abposre]-[A-Za-z0-9-]{10,}|\bxapp-\d-[A-Za-z0-9]+-\d+-[A-Za-z0-9]+"
        r"|hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9+/]{20,}"
    )),
    ("openai-key", re.compile(r"\bsk-(?:proj-|svcacct-|admin-|ant-)?[A-Za-z0-9_-]{20,}")),
    ("stripe-key", re.compile(r"\b[sr]k_(?:live|test|prod)_[A-Za-z0-9]{16,}")),
    ("private-key", re.compile(r"-----BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----")),
    ("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]*")),
)

# keyword, an operator, then a value; the value must also be long and high in entropy so
# that "the token: refreshed" or "password = see the runbook" pass.
_KEYWORD_VALUE = re.compile(
    r"(?i)(?<![a-z0-9])(?:api[_-]?key|access[_-]?key|secret|token|passw(?:or)?d|passwd|pwd|credentials?"
    r"|auth)[\w-]{0,20}[\"']?\s*[:=]\s*[\"']?([^\s\"',;]{10,200})"
)
_MIN_VALUE_ENTROPY_BITS = 3.2


class SecretScan:
    """Finds text that looks like a secret; names the rule that matched, never the text."""

    def __init__(self, held: Iterable[str] = ()) -> None:
        self._held = tuple(sorted({value for value in held if len(value) >= _MIN_HELD_CHARS}))

    def find(self, text: str) -> str | None:
        """The name of the first rule ``text`` breaks, or None when it is clean."""
        if _INVISIBLE.search(text):
            return "invisible-unicode"
        if any(value in text for value in self._held):
            return "held-secret"
        folded = unicodedata.normalize("NFKC", text)  # full-width letters fold to ASCII
        for rule, pattern in _FORMATS:
            if pattern.search(folded):
                return rule
        for match in _KEYWORD_VALUE.finditer(folded):
            if _entropy_bits(match.group(1)) >= _MIN_VALUE_ENTROPY_BITS:
                return "keyword-value"
        return None


def held_secrets(cfg: Config, environ: Mapping[str, str]) -> list[str]:
    """Every secret value this Bothy holds: the variables its configuration names."""
    names = set(cfg.codex.env)
    if cfg.chat.slack is not None:
        names |= {cfg.chat.slack.bot_token_env, cfg.chat.slack.app_token_env}
    if cfg.chat.discord is not None:
        names.add(cfg.chat.discord.token_env)
    for route in cfg.webhooks.values():
        names |= set(route.secret_env)
    names.add(cfg.web.token_env)  # the status pages' token, when one is set
    for poller in cfg.pollers.values():
        names |= set(poller.headers_env.values())
    for profile in cfg.profiles.values():
        for server in profile.mcp_servers.values():
            names |= set(server.env)
    return [environ[name] for name in sorted(names) if environ.get(name)]


def _entropy_bits(value: str) -> float:
    """Shannon entropy of ``value`` in bits per character."""
    counts = Counter(value)
    return -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
