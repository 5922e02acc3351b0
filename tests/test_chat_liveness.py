"""A chat connection that looks alive but hears nothing is noticed (issue 11).

Through a real `bothy serve` subprocess: the real slack-bolt against the fake Slack, and the
real discord.py against the fake Discord in a network namespace (``discord_network``). The
fakes can make a socket a ghost — open, answering no ping, carrying no event — and count the
sockets open at once. `bothy status` and `doctor` show each connection's last event and last
ping; a connection silent past ``silent_after_s`` is reconnected (`chat silent`, `chat
reconnected`), never with the old socket still open beside the new one; a reconnect that
fails is audited (`chat reconnect-failed`) and alerted, and tried again.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.discord import ALERT_CHANNEL_ID, ALICE_ID, CHANNEL_ID
from tests.fakes.model_server import ModelServer, text
from tests.fakes.netns import DiscordNetwork
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_serve import free_port, start_serve

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

OPERATOR = "UOPERATOR"
CHANNEL = "CWORK"
ALERTS = "CALERTS"
SILENT_AFTER_S = 3.0  # well above a ping round trip on a loaded 2-core machine


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens for `bothy serve`; no proxy may hijack loopback (chat-testing.md, pitfall 1)."""
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=1.0, max_retries=20) as fake:
        yield fake


def slack_site(root: Path, server: ModelServer, slack: FakeSlack) -> Site:
    chat = {"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR],
                      "alert_channel": ALERTS, "silent_after_s": SILENT_AFTER_S}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat)


async def discord_site(
    root: Path, server: ModelServer, network: DiscordNetwork, *, silent_after_s: float
) -> Site:
    chat = {"discord": {"allowed_users": [ALICE_ID], "alert_channel": ALERT_CHANNEL_ID,
                        "silent_after_s": silent_after_s}}
    return await network.attach(
        Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat),
        ports=[server.port])


def records(site: Site, kind: str, event: str) -> list[Any]:
    return audit_records(site, lambda r: (r.kind, r.event) == (kind, event))


async def status_json(shell: Shell) -> dict[str, Any]:
    done = await shell.bothy("status", "--json")
    assert done.code == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


async def until_status(
    shell: Shell, accept: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """`bothy status --json`, again until ``accept`` holds (each run takes a few tenths of a
    second: the attempts bound the wait)."""
    for _ in range(60):
        report = await status_json(shell)
        if accept(report):
            return report
    raise AssertionError(f"{what}: not shown; last {report!r}")


async def test_status_and_doctor_show_each_connections_last_event_and_last_ping(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """While `bothy serve` runs, status (and --json) and doctor say when the Slack
    connection last heard an event and last had a ping answered."""
    site = slack_site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: slack.pongs >= 2, "pings answered by the fake")
        slack.send_event({"type": "reaction_added", "user": OPERATOR, "reaction": "eyes"})
        report = await until_status(
            shell, lambda r: r["chat_connections"].get("slack", {}).get("last_event_s_ago")
            is not None and r["chat_connections"]["slack"].get("last_ping_s_ago") is not None,
            "a last event and a last ping in `bothy status --json`")
        connection = report["chat_connections"]["slack"]
        status = await shell.bothy("status")
        doctor = await shell.bothy("doctor")
        assert await serving.stop() == 0
    assert connection["state"] == "connected"
    assert connection["last_event_s_ago"] is not None and connection["last_event_s_ago"] <= 5
    assert connection["last_ping_s_ago"] <= 5
    assert connection["silent_after_s"] == SILENT_AFTER_S
    assert "chat connections: slack connected" in status.stdout
    assert re.search(r"^  slack: last event \d+ s ago, last ping \d+ s ago, connected \d+ s ago$",
                     status.stdout, re.M), status.stdout
    assert re.search(r"^\[ok \] chat connections: slack: last event \d+ s ago, last ping \d+ s",
                     doctor.stdout, re.M), doctor.stdout
    assert records(site, "chat", "silent") == []


async def test_a_silent_socket_is_reconnected_and_never_left_open_beside_the_new_one(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A socket that stays open but answers nothing is audited silent and replaced: the
    ghost closed before the new one opened; a mention Slack sent into the ghost is answered
    after, from its retry, once."""
    server.script(text("Back."))
    site = slack_site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        slack.silence()
        ts = slack.send_mention(OPERATOR, CHANNEL, "are you there?")
        await until(lambda: any(p.thread_ts == ts for p in slack.posts), "the answer")
        reconnected = records(site, "chat", "reconnected")
        report = await status_json(shell)
        assert await serving.stop() == 0
    silent = records(site, "chat", "silent")
    assert len(silent) == 1 and silent[0].outcome == "failed"
    assert silent[0].details["platform"] == "slack"
    assert silent[0].details["silent_s"] >= SILENT_AFTER_S  # (recorded to 0.1 s)
    assert [r.outcome for r in reconnected] == ["ok"]
    assert slack.connections == 2
    assert slack.peak_open_sockets == 1  # the ghost was closed before the new one opened
    assert slack.silent_sockets_open == 0
    assert [p.text for p in slack.posts if p.thread_ts == ts] == ["Back."]
    assert len(server.requests) == 1
    assert report["chat_connections"]["slack"]["reconnects"] == 1


async def test_a_reconnect_that_fails_is_audited_alerted_and_tried_again(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A silent socket that cannot be replaced (Slack refuses the websocket) is audited
    `chat reconnect-failed`, alerted in the alert channel through the Web API, shown as
    unreachable, and reconnected once Slack takes sockets again."""
    site = slack_site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        slack.refuse_sockets = True
        slack.silence()
        await until(lambda: bool(records(site, "chat", "reconnect-failed")),
                    "`chat reconnect-failed` in the register")
        await until(lambda: any(p.channel == ALERTS for p in slack.posts), "the alert")
        down = await shell.bothy("status")
        doctor = await shell.bothy("doctor")
        slack.refuse_sockets = False
        await until(lambda: bool(records(site, "chat", "reconnected")), "`chat reconnected`")
        assert await serving.stop() == 0
    failed = records(site, "chat", "reconnect-failed")[0]
    assert failed.details["platform"] == "slack" and failed.details["attempt"] == 1
    alert = next(p.text for p in slack.posts if p.channel == ALERTS)
    assert "chat:slack" in alert and "could not be reconnected" in alert, alert
    assert records(site, "alert", "sent")
    assert "chat connections: slack unreachable" in down.stdout, down.stdout
    assert re.search(r"^\[warn\] chat connections: slack: last event .*; silent \d+ s .*;"
                     r" (unreachable|reconnecting), last failure: Cannot open the Slack socket",
                     doctor.stdout, re.M), doctor.stdout
    assert slack.peak_open_sockets == 1
    assert slack.silent_sockets_open == 0


async def test_a_restart_leaves_no_old_socket_open_beside_the_new_one(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Stopping `bothy serve` (SIGTERM) closes its socket; after a SIGKILL the system does;
    either way the next daemon's socket is the only one open."""
    site = slack_site(tmp_path, server, slack)
    async with Shell(site) as shell:
        first = await start_serve(shell)
        assert await first.stop() == 0
        assert slack.open_sockets == 0
        second = await start_serve(shell)
        await second.command.kill()
        await slack.wait_for(lambda: slack.open_sockets == 0)
        third = await start_serve(shell)
        assert slack.open_sockets == 1
        assert await third.stop() == 0
    assert slack.connections == 3
    assert slack.peak_open_sockets == 1


async def test_a_silent_discord_gateway_is_resumed_and_what_it_missed_is_answered(
    tmp_path: Path, server: ModelServer, discord_network: DiscordNetwork
) -> None:
    """A gateway socket that stays open but acknowledges no heartbeat is closed by Bothy and
    the session RESUMEd on a new one: the mention sent meanwhile is replayed and answered;
    never two sockets open at once."""
    fake = discord_network.fake
    server.script(text("Back on Discord."))
    site = await discord_site(tmp_path, server, discord_network, silent_after_s=SILENT_AFTER_S)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        session = fake.session_id
        fake.silence()
        mention = await fake.send_mention(ALICE_ID, CHANNEL_ID, "still there?")
        await fake.wait_for(lambda: fake.posts_in(mention), "the answer", timeout_s=30.0)
        report = await status_json(shell)
        assert await serving.stop() == 0
    assert [p.content for p in fake.posts_in(mention)] == ["Back on Discord."]
    silent = records(site, "chat", "silent")
    assert [(r.details["platform"], r.outcome) for r in silent] == [("discord", "failed")]
    assert [r.outcome for r in records(site, "chat", "reconnected")] == ["ok"]
    resumed = [c for c in fake.connections if c.resumed]
    assert len(resumed) == 1 and resumed[0].session_id == session
    assert mention in resumed[0].replayed_ids
    assert fake.peak_open_connections == 1
    discord = report["chat_connections"]["discord"]
    assert discord["state"] == "connected" and discord["reconnects"] == 1
    assert discord["last_ping_s_ago"] is not None


async def test_a_discord_gateway_whose_resume_never_comes_back_gets_a_new_session(
    tmp_path: Path, server: ModelServer, discord_network: DiscordNetwork
) -> None:
    """A silent gateway whose RESUME gets no answer is given up for a new client and a new
    session (IDENTIFY); the bot answers mentions again."""
    fake = discord_network.fake
    server.script(text("New session."))
    site = await discord_site(tmp_path, server, discord_network, silent_after_s=4.0)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        first = fake.session_id
        fake.hold_resumes()
        fake.silence()
        await until(lambda: bool(records(site, "chat", "reconnected")), "`chat reconnected`")
        fake.release_resumes()
        mention = await fake.send_mention(ALICE_ID, CHANNEL_ID, "hello again")
        await fake.wait_for(lambda: fake.posts_in(mention), "the answer", timeout_s=30.0)
        assert await serving.stop() == 0
    assert fake.session_id != first
    assert sum(c.identify is not None for c in fake.connections) == 2
    assert [p.content for p in fake.posts_in(mention)] == ["New session."]
    assert records(site, "chat", "reconnect-failed") == []


async def test_a_discord_reconnect_that_fails_is_audited_and_alerted_then_tried_again(
    tmp_path: Path, server: ModelServer, discord_network: DiscordNetwork
) -> None:
    """A silent gateway that cannot be replaced (Discord refuses the upgrade) is audited
    `chat reconnect-failed` and alerted — in Discord's alert channel all the same, by the
    one-shot REST call the daemon falls back to — and once the gateway is back the next
    attempt reconnects."""
    fake = discord_network.fake
    site = await discord_site(tmp_path, server, discord_network, silent_after_s=4.0)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        fake.gateway_available = False
        fake.silence()
        await until(lambda: bool(records(site, "chat", "reconnect-failed")),
                    "`chat reconnect-failed` in the register")
        fake.gateway_available = True
        await until(lambda: bool(records(site, "chat", "reconnected")), "`chat reconnected`")
        assert await serving.stop() == 0
    failed = records(site, "chat", "reconnect-failed")[0]
    assert failed.details["platform"] == "discord", failed.details
    alerts = [r for r in audit_records(site) if r.kind == "alert"]
    assert [(r.event, r.subject) for r in alerts[:1]] == [("sent", "chat:discord")], alerts
    posted = [p.content for p in fake.posts_in(ALERT_CHANNEL_ID)]
    assert posted and "could not be reconnected" in posted[0], posted
    assert fake.peak_open_connections == 1
