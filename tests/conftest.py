"""Shared test setup: nothing leaves loopback, and what Bothy says to codex is checked.

Every test marked ``codex`` (it drives the real pinned binary) records the JSON-RPC traffic
of every Bothy process it starts (``RECORD_CODEX_RPC``, inherited by subprocesses) and, after
the test, each frame is validated against the JSON Schema that binary generates: a frame that
breaks it fails the test, naming the method and the field. A test marked ``fake_app_server``
(a fake that breaks the protocol on purpose stands in for codex) is not checked.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.rpc import RECORD_ENV
from tests.codex_schema import CodexSchema, generate_schema
from tests.fakes.codex import REPO_ROOT, codex_binary
from tests.fakes.model_server import ModelServer

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _is_loopback_or_local(address: Any) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if not _is_loopback_or_local(address):
        raise ConnectionRefusedError(f"test guard: refusing {address!r} (not loopback)")
    _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if not _is_loopback_or_local(address):
        raise ConnectionRefusedError(f"test guard: refusing {address!r} (not loopback)")
    return _real_connect_ex(self, address)


@pytest.fixture(autouse=True, scope="session")
def _loopback_only() -> Any:
    """Any connection to a non-loopback address fails loudly for the whole session."""
    socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]
    yield
    socket.socket.connect = _real_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _real_connect_ex  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def codex_schema() -> CodexSchema:
    """The pinned binary's experimental JSON Schema, generated once per binary and cached."""
    binary = codex_binary()
    version = json.loads((REPO_ROOT / "package.json").read_text())["dependencies"]
    stat = binary.stat()
    key = f"{version['@openai/codex']}-{stat.st_size}-{stat.st_mtime_ns}"
    cache = Path(tempfile.gettempdir()) / "bothy-codex-schema" / key
    if not (cache / "ServerNotification.json").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".building-"))
        generate_schema(binary, building / "schema", building / "codex-home")
        with contextlib.suppress(OSError):  # a parallel session won the rename: use its copy
            (building / "schema").rename(cache)
        shutil.rmtree(building, ignore_errors=True)
    return CodexSchema(cache)


@pytest.fixture(autouse=True)
def _codex_traffic_matches_schema(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test that drives the real codex fails if any frame breaks codex's own schema."""
    marked = request.node.get_closest_marker
    if marked("codex") is None or marked("fake_app_server") is not None:
        yield
        return
    schema: CodexSchema = request.getfixturevalue("codex_schema")
    record = tmp_path_factory.mktemp("rpc") / "traffic.jsonl"
    before = os.environ.get(RECORD_ENV)
    os.environ[RECORD_ENV] = str(record)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RECORD_ENV, None)
        else:
            os.environ[RECORD_ENV] = before
    if record.exists():
        problems = schema.traffic_problems(record)
        if problems:
            pytest.fail("traffic breaks codex's schema:\n  " + "\n  ".join(problems[:20]),
                        pytrace=False)


@pytest.fixture(scope="session")
def discord_certificates(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A throwaway CA and a certificate for Discord's hosts, made once per session."""
    from tests.fakes.discord import Certificates

    return Certificates.create(Path(tmp_path_factory.mktemp("discord-tls")))


@pytest.fixture
async def discord_network(tmp_path_factory: pytest.TempPathFactory,
                          discord_certificates: Any) -> Any:
    """A fake Discord that `bothy` subprocesses reach at discord.com & co, from a network
    namespace (tests/fakes/netns.py); skipped, with the reason, where there can be none.
    ``await discord_network.attach(site, ports=[server.port])`` runs the site's commands there."""
    from tests.fakes.netns import NamespaceUnavailable, open_discord_network

    opened = open_discord_network(tmp_path_factory.mktemp("netns"), discord_certificates)
    try:
        network = await opened.__aenter__()
    except NamespaceUnavailable as exc:
        pytest.skip(f"no network namespace for a Discord serve subprocess: {exc}")
    try:
        yield network
    finally:
        await opened.__aexit__(None, None, None)


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    """The scripted model server (a test scripts its answers with ``server.script``)."""
    async with ModelServer() as running:
        yield running

