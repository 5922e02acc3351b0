"""The service's environment file: ``BOTHY_HOME`` and every secret the config names.

One 0600 file under ``BOTHY_HOME``, owned by the service's user, read by systemd
(``EnvironmentFile=``) and, on macOS, by :mod:`bothy.install.envexec` before it execs
``bothy serve`` — so no secret is ever inline in a unit or a plist. The format is the subset
both read the same way: ``NAME=value`` lines and ``#`` comments; a value that is not plain is
written in double quotes with ``\\``, ``"``, ``$`` and `````` ` `````` escaped; a newline is
refused.

A value comes from the file as it stands, else from the installer's environment (so
``sudo --preserve-env=NAME bothy install`` or a first install as the user can fill it);
a secret found nowhere is listed as missing, in the file (as a comment) and in the plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from bothy.config import Config

_PLAIN = re.compile(r"^[A-Za-z0-9_.,:/@%+=~-]*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MISSING_MARK = "# missing: "
_HEADER = (
    "# The environment of `bothy serve`, written by `bothy install`. Keep it 0600.\n"
    "# Add a missing secret as NAME=value (replacing its '# missing:' line), then rerun\n"
    "# `bothy install --serve` (or restart the service).\n"
)


def secret_names(config: Config) -> dict[str, str]:
    """Every environment variable the config names, with the key that names it."""
    names: dict[str, str] = {}
    for name in config.codex.env:
        names.setdefault(name, "codex.env")
    for route, hook in config.webhooks.items():
        for name in hook.secret_env:
            names.setdefault(name, f"webhooks.{route}.secret_env")
    for poller_name, poller in config.pollers.items():
        for name in poller.headers_env.values():
            names.setdefault(name, f"pollers.{poller_name}.headers_env")
    for profile_name, profile in config.profiles.items():
        for server_name, server in profile.mcp_servers.items():
            for name in server.env:
                names.setdefault(name, f"profiles.{profile_name}.mcp_servers.{server_name}.env")
    if config.chat.slack is not None:
        names.setdefault(config.chat.slack.bot_token_env, "chat.slack.bot_token_env")
        names.setdefault(config.chat.slack.app_token_env, "chat.slack.app_token_env")
    if config.chat.discord is not None:
        names.setdefault(config.chat.discord.token_env, "chat.discord.token_env")
    names.pop("BOTHY_HOME", None)
    return names


@dataclass(frozen=True)
class EnvFile:
    """The file to write: its bytes, how the plan shows it, and what is missing."""

    content: bytes
    shown: str
    missing: dict[str, str]  # name -> the config key that needs it
    problems: list[str]


def build_env_file(
    path: Path, bothy_home: Path, needed: dict[str, str], environ: dict[str, str]
) -> EnvFile:
    """The file as it should be, keeping values (and extra names) already in it."""
    kept = read_env_file(path)
    values: dict[str, str | None] = {"BOTHY_HOME": str(bothy_home)}
    for name in sorted(needed):
        values[name] = environ.get(name) or kept.get(name)
    for name in sorted(kept):
        values.setdefault(name, kept[name])
    lines, shown, problems = [_HEADER.rstrip("\n")], [_HEADER.rstrip("\n")], []
    missing = {}
    for name, value in values.items():
        if value is None:
            missing[name] = needed[name]
            lines.append(f"{_MISSING_MARK}{name} (named by {needed[name]})")
            shown.append(f"{name}=<missing>")
        elif "\n" in value or "\r" in value:
            problems.append(f"the value of {name} holds a line break, which an environment"
                            " file cannot carry")
        else:
            lines.append(f"{name}={_quoted(value)}")
            shown.append(f"{name}=<set>")
    return EnvFile(("\n".join(lines) + "\n").encode(), "\n".join(shown) + "\n", missing,
                   problems)


def read_env_file(path: Path) -> dict[str, str]:
    """The ``NAME=value`` pairs of an environment file ({} if there is none)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    return parse_env_text(text)


def parse_env_text(text: str) -> dict[str, str]:
    pairs = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        name = name.strip()
        if _NAME.match(name):
            pairs[name] = _unquoted(value.strip())
    return pairs


def _quoted(value: str) -> str:
    if _PLAIN.match(value):
        return value
    escaped = re.sub(r'([\\"$`])', r"\\\1", value)
    return f'"{escaped}"'


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value
