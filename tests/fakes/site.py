"""A throwaway Bothy site for tests: a ``$BOTHY_HOME`` whose codex talks to the fake model.

The real ``bothy`` CLI runs as a subprocess (``python -m bothy``) against it, exactly as an
operator would run it, with the pinned codex binary and the scripted model server.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.codex import PROVIDER_ENV, codex_binary, provider_config

FAKE_PRICE = {
    "input_per_mtok": "100.00",
    "cached_input_per_mtok": "10.00",
    "output_per_mtok": "400.00",
}


@dataclass(frozen=True)
class Completed:
    """What a finished ``bothy`` command showed."""

    code: int
    stdout: str
    stderr: str


class Site:
    """A BOTHY_HOME under ``root`` wired to a model server at ``base_url``."""

    def __init__(self, root: Path, base_url: str, **overrides: Any) -> None:
        self.root = root
        self.home = root / "home"
        self.workspace = root / "workspace"
        self.codex_home = root / "codex-home"
        for directory in (self.home, self.workspace, self.codex_home):
            directory.mkdir(parents=True, exist_ok=True)
        # What runs every `bothy` command (tests/fakes/netns.py sets both to run them in a
        # network namespace): a prefix to the argv, and variables added to the environment.
        self.launch_prefix: list[str] = []
        self.extra_env: dict[str, str] = {}
        self.config = self.base_config(base_url)
        _deep_update(self.config, overrides)
        self.write_config(self.config)

    def base_config(self, base_url: str) -> dict[str, Any]:
        return {
            "site": "test-site",
            "workspace": str(self.workspace),
            "pool": {"max_workers": 2},
            "budget": {
                "mode": "api",
                "per_run_usd": "0.50",
                "per_day_usd": "25.00",
                "prices": {"fake-model": dict(FAKE_PRICE)},
            },
            "codex": {
                "command": [str(codex_binary()), "app-server"],
                "home": str(self.codex_home),
                "config": provider_config(base_url),
                "env": sorted(PROVIDER_ENV),
            },
            "limits": {"wall_clock_s": 60, "stop_grace_s": 2.0},
        }

    def write_config(self, config: dict[str, Any] | str) -> None:
        text = config if isinstance(config, str) else json.dumps(config, indent=2)
        (self.home / "config.json").write_text(text)

    @property
    def audit_path(self) -> Path:
        return self.home / "state" / "audit.jsonl"

    def env(self, **extra: str) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("BOTHY_")}
        env.update(PROVIDER_ENV)
        env["BOTHY_HOME"] = str(self.home)
        env.update(self.extra_env)
        env.update(extra)
        return env

    async def start(self, *args: str, **extra_env: str) -> asyncio.subprocess.Process:
        """Start ``bothy ARGS`` and return the process (for tests that signal it)."""
        return await asyncio.create_subprocess_exec(
            *self.launch_prefix, sys.executable, "-m", "bothy", *args,
            env=self.env(**extra_env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def bothy(self, *args: str, timeout_s: float = 60.0, **extra_env: str) -> Completed:
        """Run ``bothy ARGS`` to completion."""
        process = await self.start(*args, **extra_env)
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await process.communicate()
        assert process.returncode is not None
        return Completed(process.returncode, stdout.decode(), stderr.decode())

    def audit_lines(self) -> list[str]:
        """The human audit lines, via the file (not the CLI), for assertions."""
        from bothy.engine.audit import AuditLog

        return [record.human_line() for record in AuditLog(self.audit_path).records()]


def _deep_update(target: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def without_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy variable may send loopback traffic elsewhere (chat-testing.md, pitfall 1)."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)


def operator_home(path: Path, files: dict[str, str]) -> Path:
    """A home directory holding the shell startup files ``files`` (name -> text), as the
    account a site's worker runs under may have them; pass it to a command as ``HOME``."""
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path
