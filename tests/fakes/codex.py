"""Where the pinned Codex binary lives, and the config that points it at the fake model.

``codex_binary()`` finds the native binary that ``make install`` (``npm ci``) put under the
repo's ``node_modules`` — the native one, not the ``node_modules/.bin/codex`` Node shim, so
the process we spawn is Codex itself and owns its process group.

``provider_config()`` is the configuration the app-server protocol was observed with (the
``config.toml`` of those notes) as a nested dict; ``config_overrides()`` turns it into
``-c dotted.key=<TOML value>`` flags for ``codex app-server``, so no ``config.toml`` is needed.
This is the test side's copy; Bothy's engine keeps its own.
"""

from __future__ import annotations

import math
import platform
import re
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

PROVIDER_ENV: dict[str, str] = {"FAKE_OPENAI_API_KEY": "bothy-test"}

# (sys.platform, machine) -> (npm package suffix, Rust target triple); mirrors the npm shim
# node_modules/@openai/codex/bin/codex.js.
_TARGETS: dict[tuple[str, str], tuple[str, str]] = {
    ("linux", "x86_64"): ("linux-x64", "x86_64-unknown-linux-musl"),
    ("linux", "amd64"): ("linux-x64", "x86_64-unknown-linux-musl"),
    ("linux", "aarch64"): ("linux-arm64", "aarch64-unknown-linux-musl"),
    ("linux", "arm64"): ("linux-arm64", "aarch64-unknown-linux-musl"),
    ("darwin", "x86_64"): ("darwin-x64", "x86_64-apple-darwin"),
    ("darwin", "arm64"): ("darwin-arm64", "aarch64-apple-darwin"),
}

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def codex_binary() -> Path:
    """The pinned native ``codex`` binary; ``RuntimeError`` if it is not installed."""
    machine = platform.machine().lower()
    target = _TARGETS.get((sys.platform, machine))
    if target is None:
        raise RuntimeError(
            f"no pinned codex binary for platform {sys.platform}/{machine}; "
            "supported: linux and macOS on x64 or arm64"
        )
    package, triple = target
    path = (
        REPO_ROOT / "node_modules" / "@openai" / f"codex-{package}"
        / "vendor" / triple / "bin" / "codex"
    )
    if not path.is_file():
        raise RuntimeError(f"codex binary not found at {path}: run `make install`")
    return path


def provider_config(base_url: str, *, model: str = "fake-model") -> dict[str, Any]:
    """Codex config that sends every model call to ``base_url`` and nothing anywhere else."""
    return {
        "model": model,
        "model_provider": "fake",
        # "untrusted" is rejected in config by codex 0.171.0; thread/start may still ask for it.
        "approval_policy": "on-request",
        "sandbox_mode": "read-only",
        "check_for_update_on_startup": False,
        "model_reasoning_effort": "low",
        "model_providers": {
            "fake": {
                "name": "fake",
                "base_url": base_url,
                "env_key": "FAKE_OPENAI_API_KEY",
                "wire_api": "responses",
                "request_max_retries": 0,
                "stream_max_retries": 0,
                "stream_idle_timeout_ms": 60000,
                "supports_websockets": False,
            }
        },
        "features": {
            "plugins": False,  # otherwise Codex resolves github.com at start-up
            "unbounded_connection_retries": False,  # otherwise a dead provider is retried forever
            "default_mode_request_user_input": True,
        },
        "analytics": {"enabled": False},
        "feedback": {"enabled": False},
        "history": {"persistence": "none"},
    }


def config_overrides(config: dict[str, Any]) -> list[str]:
    """Flatten ``config`` into ``["-c", "a.b=<TOML value>", ...]`` for ``codex app-server``."""
    flags: list[str] = []
    for dotted, value in _flatten(config, ()):
        flags += ["-c", f"{dotted}={_toml_value(value)}"]
    return flags


def _flatten(table: dict[str, Any], prefix: tuple[str, ...]) -> list[tuple[str, Any]]:
    pairs: list[tuple[str, Any]] = []
    for key, value in table.items():
        # Codex splits the override key on "." and takes no quoted segments.
        if not _BARE_KEY.match(key):
            raise ValueError(f"config key {key!r} is not a bare TOML key")
        path = (*prefix, key)
        if isinstance(value, dict):
            pairs += _flatten(value, path)
        else:
            pairs.append((".".join(path), value))
    return pairs


def _toml_value(value: Any) -> str:
    # bool before int: bool is a subclass of int.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        if any(isinstance(item, dict | list | tuple) for item in value):
            raise ValueError(f"only lists of scalars are supported, not {value!r}")
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise ValueError(f"no TOML form for {type(value).__name__} value {value!r}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def _toml_string(value: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped."""
    out = []
    for char in value:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
