"""Discord through a real `bothy serve` subprocess: the real discord.py, at its real host
names, against a fake Discord on loopback.

The daemon runs in a network namespace of its own (``tests/fakes/netns.py``, the
``discord_network`` fixture) where ``discord.com`` and ``gateway.discord.gg`` lead to the
fake over TLS, trusted through ``SSL_CERT_FILE``: nothing in Bothy or discord.py is pointed
anywhere. Skipped, with the reason, where namespaces cannot be made (not root).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.discord import ALERT_CHANNEL_ID, ALICE_ID, CHANNEL_ID
from tests.fakes.model_server import ModelServer, text
from tests.fakes.netns import DiscordNetwork
from tests.fakes.shell import Shell, audit_records
from tests.fakes.site import Site
from tests.test_serve import free_port, start_serve

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

OPERATOR = ALICE_ID
SEEN = "\N{EYES}"


async def discord_site(root: Path, server: ModelServer, network: DiscordNetwork) -> Site:
    """A site whose `bothy` commands run in the namespace, Discord configured, the model
    server reachable."""
    chat = {"discord": {"allowed_users": [OPERATOR], "alert_channel": ALERT_CHANNEL_ID}}
    site = Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat)
    return await network.attach(site, ports=[server.port])


async def test_a_mention_is_answered_in_its_thread_by_a_serve_subprocess(
    tmp_path: Path, server: ModelServer, discord_network: DiscordNetwork
) -> None:
    """`bothy serve` as an operator starts it logs in to "discord.com", sees a mention,
    reacts, opens a thread from it and posts the model's answer there."""
    fake = discord_network.fake
    server.script(text("Nothing changed in /srv/work this week."))
    site = await discord_site(tmp_path, server, discord_network)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        status = await shell.bothy("status")
        assert "chat connections: discord connected" in status.stdout
        mention = await fake.send_mention(OPERATOR, CHANNEL_ID, "what changed this week?")
        await fake.wait_for(lambda: fake.posts_in(mention), "an answer in the thread",
                            timeout_s=30.0)
        assert await serving.stop() == 0
        stderr = serving.command.stderr.text()
    assert [post.content for post in fake.posts_in(mention)] == [
        "Nothing changed in /srv/work this week."]
    assert [(t.channel_id, t.thread_id) for t in fake.threads] == [(CHANNEL_ID, mention)]
    assert [(r.message_id, r.emoji) for r in fake.reactions] == [(mention, SEEN)]
    first = fake.connections[0]
    assert (first.host, first.query.get("v")) == ("gateway.discord.gg", "10")
    assert {request.host for request in fake.requests} == {"discord.com"}
    finished = audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))
    assert [(r.outcome, r.subject) for r in finished] == [("ok", f"discord:{mention}")]
    assert "Traceback" not in stderr


async def test_a_dropped_gateway_is_resumed_by_a_serve_subprocess(
    tmp_path: Path, server: ModelServer, discord_network: DiscordNetwork
) -> None:
    """A gateway connection the fake drops without a close frame is resumed (the same
    session, no new IDENTIFY), and a mention sent while it was down is still answered."""
    fake = discord_network.fake
    server.script(text("Still here."))
    site = await discord_site(tmp_path, server, discord_network)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        session = fake.session_id
        await fake.abort_gateway()
        mention = await fake.send_mention(OPERATOR, CHANNEL_ID, "are you there?")
        await fake.wait_for(lambda: fake.posts_in(mention), "an answer after the drop",
                            timeout_s=30.0)
        assert await serving.stop() == 0
    assert [post.content for post in fake.posts_in(mention)] == ["Still here."]
    resumed = [c for c in fake.connections if c.resumed]
    assert resumed and resumed[0].session_id == session
    assert mention in resumed[0].replayed_ids
    assert sum(c.identify is not None for c in fake.connections) == 1
