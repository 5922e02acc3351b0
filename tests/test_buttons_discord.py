"""Approval buttons on Discord: the real daemon with the real discord.py against a fake Discord
on loopback (message components, ``INTERACTION_CREATE``, interaction responses, message
edits), the real codex against the scripted model.

Like ``tests/test_chat_discord_serve.py``, the daemon runs in the test's own loop (its
Discord adapter is handed the fake's connector), which lets these tests look at every
interaction callback and edit; ``tests/test_buttons_discord_subprocess.py`` proves a press
through a real `bothy serve` subprocess.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.codex import PROVIDER_ENV
from tests.fakes.discord import (
    ALICE_ID,
    BOB_ID,
    BOT_TOKEN,
    CHANNEL_ID,
    Certificates,
    FakeDiscord,
    Post,
)
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import DEADLINE_S, audit_records, until
from tests.fakes.site import Site
from tests.test_chat_discord_serve import serving
from tests.test_serve import free_port

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

OPERATOR = ALICE_ID
STRANGER = BOB_ID
WHEN = r"[0-9]{2}:[0-9]{2}:[0-9]{2} UTC"
DEFERRED_UPDATE, CHANNEL_MESSAGE, EPHEMERAL = 6, 4, 64


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the daemon reads from its environment: the bot token and the model's key."""
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


def _site(root: Path, server: ModelServer, *, hold_s: int = 30) -> Site:
    chat = {"discord": {"allowed_users": [OPERATOR], "profile": "chat"}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": hold_s}})


def _script_checklist(server: ModelServer, after: str) -> None:
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                  text(after))


def _question_post(discord: FakeDiscord, thread: str) -> Post | None:
    return next((p for p in discord.posts_in(thread) if p.components), None)


async def _question(discord: FakeDiscord, thread: str) -> Post:
    await discord.wait_for(lambda: _question_post(discord, thread), "the question with buttons",
                           timeout_s=DEADLINE_S)
    post = _question_post(discord, thread)
    assert post is not None
    return post


def _labels(message: dict[str, Any]) -> list[str]:
    return [button["label"] for row in message["components"] for button in row["components"]]


def _events(site: Site, kind: str, event: str) -> list[Any]:
    return audit_records(site, lambda r: (r.kind, r.event) == (kind, event))


async def test_an_allowed_press_reaches_the_model_and_the_message_says_who_and_when(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A stranger's press is answered ephemerally and changes nothing; the operator's is
    recorded, answered with a deferred update, reaches the tool, and the message is edited to
    say who approved it and when, without buttons."""
    _script_checklist(server, "Added it.")
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        question = await _question(discord, thread)
        assert _labels(discord.message(question.message_id)) == ["Approve", "Decline"]
        assert question.content.startswith("? May I use bothy_checklist")

        stranger = await discord.press_button(STRANGER, question.message_id)
        await discord.wait_for(lambda: discord.callbacks_of(stranger), "the stranger answered")
        press = await discord.press_button(OPERATOR, question.message_id)
        await discord.wait_for(lambda: "Added it." in [p.content for p in discord.posts_in(
            thread)], "the answer after approval", timeout_s=DEADLINE_S)
        await discord.wait_for(lambda: discord.edits, "the question edited")
        assert await daemon.stop() == 0

    [told] = discord.callbacks_of(stranger)
    assert (told.type, told.status) == (CHANNEL_MESSAGE, 200)
    assert told.data is not None and told.data["flags"] & EPHEMERAL
    assert "Only the people this site's operator listed" in told.data["content"]
    assert [(c.type, c.status) for c in discord.callbacks_of(press)] == [(DEFERRED_UPDATE, 200)]
    assert [r.details["user"] for r in _events(site, "button", "refused")] == [
        f"discord:{STRANGER}"]
    received = _events(site, "answer", "received")
    assert [(r.details["via"], r.details["by"]) for r in received] == [
        ("button", f"discord:{OPERATOR}")]
    assert _events(site, "tool", "allowed")[0].details["approved_by"] == f"discord:{OPERATOR}"
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"
    edited = discord.message(question.message_id)
    assert re.search(rf"\nApproved by <@{OPERATOR}> at {WHEN}\.$", edited["content"])
    assert edited["components"] == []


async def test_a_replayed_press_counts_once(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """The same INTERACTION_CREATE dispatched twice (a replay after a RESUME): the question is
    answered once, the replay is audited and its second answer refused by Discord."""
    _script_checklist(server, "Added it.")
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        question = await _question(discord, thread)
        press = await discord.press_button(OPERATOR, question.message_id)
        await discord.wait_for(lambda: discord.callbacks_of(press), "the press answered")
        await discord.replay_interaction(press)
        await until(lambda: bool(_events(site, "button", "repeated")), "the replay audited")
        await discord.wait_for(lambda: "Added it." in [p.content for p in discord.posts_in(
            thread)], "the answer after approval", timeout_s=DEADLINE_S)
        assert await daemon.stop() == 0

    assert [c.status for c in discord.callbacks_of(press)] == [200, 400]  # 40060
    assert len(_events(site, "answer", "received")) == 1
    assert len(_events(site, "tool", "allowed")) == 1
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"


async def test_forged_presses_are_ignored_and_an_expired_question_says_so(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """Presses from another guild or application get no answer and change nothing, audited;
    a button of another question is answered politely; at the deadline the message is edited
    to say the question expired, without buttons."""
    _script_checklist(server, "I could not add it.")
    site = _site(tmp_path, server, hold_s=3)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        question = await _question(discord, thread)
        forged = [
            await discord.press_button(OPERATOR, question.message_id,
                                       guild_id="1200000000000000999"),
            await discord.press_button(OPERATOR, question.message_id,
                                       application_id="1287654321098765999"),
        ]
        foreign = await discord.press_button(
            OPERATOR, question.message_id,
            custom_id="bothy_question:approve|99999:run_20260101T000000Z_00000000")
        await discord.wait_for(lambda: discord.callbacks_of(foreign), "the foreign press")
        await until(lambda: len(_events(site, "button", "forged")) == 2, "the forgeries")
        await discord.wait_for(lambda: discord.edits, "the question edited",
                               timeout_s=DEADLINE_S)
        await discord.wait_for(lambda: "I could not add it." in [
            p.content for p in discord.posts_in(thread)], "the run's answer",
            timeout_s=DEADLINE_S)
        assert await daemon.stop() == 0

    assert [discord.callbacks_of(i) for i in forged] == [[], []]
    reasons = " ".join(r.details["reason"] for r in _events(site, "button", "forged"))
    assert "guild 1200000000000000999" in reasons and "application 1287654321098765999" in reasons
    [polite] = discord.callbacks_of(foreign)
    assert polite.data is not None and "no longer exists" in polite.data["content"]
    assert _events(site, "answer", "received") == []
    edited = discord.message(question.message_id)
    assert re.search(rf"\nExpired at {WHEN}: nobody answered in time", edited["content"])
    assert edited["components"] == []
    assert not (site.home / "checklist.md").exists()


async def test_a_plain_deny_in_the_thread_declines_beside_the_buttons(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """Replies keep working beside the buttons: the word ``deny`` (no leading ``/``) declines,
    and the button message is edited to say who declined and when."""
    _script_checklist(server, "Left it alone.")
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        question = await _question(discord, thread)
        await discord.send_message(OPERATOR, thread, "deny")
        await discord.wait_for(lambda: "Left it alone." in [p.content for p in discord.posts_in(
            thread)], "the answer after the refusal", timeout_s=DEADLINE_S)
        assert await daemon.stop() == 0

    [refused] = _events(site, "tool", "refused")
    assert refused.details["code"] == "declined_by_person"
    edited = discord.message(question.message_id)
    assert re.search(rf"\nDeclined by <@{OPERATOR}> at {WHEN}\.$", edited["content"])
    assert edited["components"] == []
    assert discord.callbacks == []
    assert not (site.home / "checklist.md").exists()
