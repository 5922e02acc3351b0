"""A foreground run on a terminal shows its progress live; elsewhere, plain lines."""

from __future__ import annotations

import asyncio
import os
import pty
import sys
from pathlib import Path

import pytest

from tests.fakes.model_server import ModelServer, text
from tests.fakes.site import Site

pytestmark = pytest.mark.codex


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


async def _on_a_terminal(site: Site, *args: str) -> tuple[int, str]:
    """Run ``bothy ARGS`` with a pseudo-terminal as stdin, stdout and stderr; its exit code and
    everything the terminal showed."""
    primary, secondary = pty.openpty()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bothy", *args,
        env=site.env(), stdin=secondary, stdout=secondary, stderr=secondary,
    )
    os.close(secondary)
    async with asyncio.timeout(60):
        screen = (await asyncio.to_thread(_read_all, primary)).decode(errors="replace")
        code = await process.wait()
    os.close(primary)
    return code, screen


async def test_a_no_reply_streamed_in_pieces_never_shows_on_a_terminal(
    tmp_path: Path, server: ModelServer
) -> None:
    """NO_REPLY streamed in three deltas is held while it could still be NO_REPLY, then never
    shown: not even its first piece reaches the terminal."""
    server.script(text("NO_REPLY", chunks=3))
    site = Site(tmp_path, server.base_url)
    code, screen = await _on_a_terminal(site, "run", "anything new?", "--subject", "tty")
    assert code == 0, screen
    assert "completed run_" in screen
    assert "NO_" not in screen, screen


async def test_text_that_only_begins_like_no_reply_is_shown_whole(
    tmp_path: Path, server: ModelServer
) -> None:
    """A message that starts "NO" but is not NO_REPLY is held only until it cannot be, then
    shown whole."""
    server.script(text("NOTE: the backup ran late.", chunks=5))
    site = Site(tmp_path, server.base_url)
    code, screen = await _on_a_terminal(site, "run", "anything new?", "--subject", "tty")
    assert code == 0, screen
    assert "NOTE: the backup ran late." in screen


async def test_schedule_run_of_a_heartbeat_answering_no_reply_shows_none_on_a_terminal(
    tmp_path: Path, server: ModelServer
) -> None:
    """`bothy schedule run` of a heartbeat, on a terminal: the run line, and no NO_REPLY."""
    server.script(text("NO_REPLY", chunks=2))
    site = Site(tmp_path, server.base_url)
    added = await site.bothy("schedule", "add", "hb", "--cron", "0 3 * * *", "--heartbeat")
    assert added.code == 0, added.stderr
    code, screen = await _on_a_terminal(site, "schedule", "run", "hb")
    assert code == 0, screen
    assert "completed run_" in screen
    assert "NO_" not in screen, screen
