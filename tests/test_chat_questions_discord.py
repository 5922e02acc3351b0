"""Speaking up on Discord through the real daemon in process (issue 11), as
tests/test_chat_discord_serve.py runs it: the real discord.py against the fake Discord, the
real codex. A held question that expires is said in its thread and a late reply is told which
question it missed; an alert about a lost message links to it (a jump URL).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.home import BothyHome
from tests.fakes.codex import PROVIDER_ENV
from tests.fakes.discord import (
    ALERT_CHANNEL_ID,
    ALICE_ID,
    BOT_TOKEN,
    CHANNEL_ID,
    GUILD_ID,
    Certificates,
    FakeDiscord,
)
from tests.fakes.model_server import ModelServer, stall, tool_call
from tests.fakes.shell import DEADLINE_S, audit_records, until
from tests.fakes.site import Site
from tests.test_chat_discord_serve import serving
from tests.test_serve import free_port

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

OPERATOR = ALICE_ID


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("BOTHY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DISCORD_BOT_TOKEN", BOT_TOKEN)
    for name, value in PROVIDER_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates.create(Path(tmp_path_factory.mktemp("discord-tls")))


@pytest.fixture
async def discord(certificates: Certificates) -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(certificates) as fake:
        yield fake


def _site(root: Path, server: ModelServer, *, hold_s: int = 20) -> Site:
    chat = {"discord": {"allowed_users": [OPERATOR], "alert_channel": ALERT_CHANNEL_ID,
                        "profile": "chat"}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                wakes={"shutdown_grace_s": 1.0},
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": hold_s}})


def _posts_in(discord: FakeDiscord, channel: str) -> list[str]:
    return [post.content for post in discord.posts_in(channel)]


async def test_an_expired_question_is_said_in_its_discord_thread_and_a_late_reply_told(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """Nobody answers within the hold: a new message in the thread says so; the run goes on;
    a reply after that is told the question it came too late for. No post pings anyone."""
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                  stall("Carrying on without it"))
    site = _site(tmp_path, server, hold_s=2)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        await discord.wait_for(lambda: len(_posts_in(discord, thread)) >= 2, "the expiry",
                               timeout_s=DEADLINE_S)
        question, expiry = _posts_in(discord, thread)
        assert question.startswith("? May I use bothy_checklist")
        # An approval carries buttons; a reply in words works beside them (issue 12).
        assert question.endswith(
            "\nPress Approve or Decline, or answer yes or no in this thread.")
        assert expiry == "No answer within 2 s — declined; the run goes on."
        await server.wait_for_requests(2)
        await discord.send_message(OPERATOR, thread, "yes")
        await discord.wait_for(lambda: len(_posts_in(discord, thread)) >= 3, "the late note",
                               timeout_s=DEADLINE_S)
        await until(lambda: audit_records(site, lambda r: (r.kind, r.event) == ("answer", "late")),
                    "`answer late` in the audit")
        daemon.daemon.stop()
    late = _posts_in(discord, thread)[2]
    assert late.startswith("The question “May I use bothy_checklist")
    assert late.endswith("” had no answer within 2 s and was declined; the run went on without"
                         " it. Your reply was recorded as late.")
    assert all(post.allowed_mentions == {"parse": []} for post in discord.posts)


async def test_a_serve_alert_about_a_lost_message_links_to_it(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """The alert `bothy serve` raises for a mention it could not record carries the message's
    jump URL (no thread was started from it), beside the site and the wake."""
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        inbox = BothyHome(site.home).inbox_dir
        shutil.rmtree(inbox, ignore_errors=True)
        inbox.write_text("not a directory")  # the inbox refuses every wake from now on
        mention = await discord.send_mention(OPERATOR, CHANNEL_ID, "are you there?")
        await discord.wait_for(lambda: _posts_in(discord, ALERT_CHANNEL_ID), "the alert",
                               timeout_s=DEADLINE_S)
        daemon.daemon.stop()
    [alert] = _posts_in(discord, ALERT_CHANNEL_ID)
    assert alert.startswith("! **WARNING** `test-site` — chat message discord:")
    assert alert.endswith(f"\nwake `discord:{mention}` · [the thread](https://discord.com/"
                          f"channels/{GUILD_ID}/{CHANNEL_ID}/{mention})")
