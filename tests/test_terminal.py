"""A foreground run on a terminal shows its progress live; elsewhere, plain lines."""

from __future__ import annotations

import asyncio
import os
import pty
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fakes.model_server import ModelServer, text
from tests.fakes.site import Site

pytestmark = pytest.mark.codex


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as running:
        yield running


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side of the terminal closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def test_a_run_on_a_terminal_streams_text_and_a_live_status_line(
    tmp_path: Path, server: ModelServer
) -> None:
    """On a TTY: the agent's text streams and a status line is redrawn in place."""
    server.script(text("All quiet on site.", chunks=4))
    site = Site(tmp_path, server.base_url)
    primary, secondary = pty.openpty()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bothy", "run", "how is the site?", "--subject", "tty",
        env=site.env(), stdin=secondary, stdout=secondary, stderr=secondary,
    )
    os.close(secondary)
    async with asyncio.timeout(60):
        screen = (await asyncio.to_thread(_read_all, primary)).decode(errors="replace")
        code = await process.wait()
    os.close(primary)
    assert code == 0, screen
    assert "\r\x1b[K[" in screen  # the status line, redrawn in place
    assert "tokens" in screen and "usd" in screen
    assert "All quiet on site." in screen
    assert "completed run_" in screen


async def test_a_run_into_a_pipe_prints_plain_lines(tmp_path: Path, server: ModelServer) -> None:
    """Into a pipe or a log: one plain line per step, no escape codes."""
    server.script(text("All quiet."))
    site = Site(tmp_path, server.base_url)
    done = await site.bothy("run", "how is the site?", "--subject", "pipe")
    assert done.code == 0
    assert "\x1b" not in done.stderr
    assert [line.split()[1] for line in done.stderr.splitlines()] == [
        "admitted", "started", "usage"]
