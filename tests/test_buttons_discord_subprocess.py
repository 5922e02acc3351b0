"""Approval buttons on Discord through a real `bothy serve` subprocess: the real discord.py at
its real host names, in a network namespace whose Discord is the fake (``discord_network``,
``tests/fakes/netns.py``); the real codex against the scripted model. Skipped, with the
reason, where namespaces cannot be made (not root).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.discord import ALICE_ID, BOB_ID, CHANNEL_ID, FakeDiscord, Post
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.netns import DiscordNetwork
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.test_serve import free_port, start_serve

pytestmark = [pytest.mark.codex, pytest.mark.timeout(120)]

OPERATOR = ALICE_ID
STRANGER = BOB_ID
WHEN = r"[0-9]{2}:[0-9]{2}:[0-9]{2} UTC"
WAIT_S = 30.0


async def _site(root: Path, server: ModelServer, network: DiscordNetwork) -> Site:
    chat = {"discord": {"allowed_users": [OPERATOR], "profile": "chat"}}
    site = Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": 30}})
    return await network.attach(site, ports=[server.port])


def _question_post(fake: FakeDiscord, thread: str) -> Post | None:
    return next((p for p in fake.posts_in(thread) if p.components), None)


def _events(site: Site, kind: str, event: str) -> list[Any]:
    return audit_records(site, lambda r: (r.kind, r.event) == (kind, event))


async def test_a_press_made_while_the_gateway_was_down_approves_once(
    tmp_path: Path, server: ModelServer, discord_network: DiscordNetwork
) -> None:
    """A stranger's press is answered ephemerally; the operator presses while the gateway is
    down: discord.py RESUMEs, the press is replayed to it and approves the tool; the same
    interaction replayed again changes nothing; the message says who approved it and when."""
    fake = discord_network.fake
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                  text("Added it."))
    site = await _site(tmp_path, server, discord_network)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        thread = await fake.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        await fake.wait_for(lambda: _question_post(fake, thread), "the question with buttons",
                            timeout_s=WAIT_S)
        question = _question_post(fake, thread)
        assert question is not None
        stranger = await fake.press_button(STRANGER, question.message_id)
        await fake.wait_for(lambda: fake.callbacks_of(stranger), "the stranger answered",
                            timeout_s=WAIT_S)

        await fake.abort_gateway()
        press = await fake.press_button(OPERATOR, question.message_id)  # kept for the RESUME
        await fake.wait_for(lambda: fake.callbacks_of(press), "the press answered",
                            timeout_s=WAIT_S)
        await fake.replay_interaction(press)
        await until(lambda: bool(_events(site, "button", "repeated")), "the replay audited")
        await fake.wait_for(lambda: "Added it." in [p.content for p in fake.posts_in(thread)],
                            "the answer after approval", timeout_s=WAIT_S)
        await fake.wait_for(lambda: fake.edits, "the question edited", timeout_s=WAIT_S)
        assert await serving.stop() == 0
        stderr = serving.command.stderr.text()

    resumed = [c for c in fake.connections if c.resumed]
    assert resumed and resumed[0].replayed  # the press reached discord.py by the RESUME
    [told] = fake.callbacks_of(stranger)
    assert told.data is not None and told.data["flags"] & 64
    assert [c.status for c in fake.callbacks_of(press)] == [200, 400]  # the replay: 40060
    assert len(_events(site, "answer", "received")) == 1
    assert _events(site, "tool", "allowed")[0].details["approved_by"] == f"discord:{OPERATOR}"
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"
    edited = fake.message(question.message_id)
    assert re.search(rf"\nApproved by <@{OPERATOR}> at {WHEN}\.$", edited["content"])
    assert edited["components"] == []
    assert "Traceback" not in stderr
