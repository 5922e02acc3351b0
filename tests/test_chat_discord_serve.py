"""Chat through the real daemon: the real discord.py against a fake Discord on loopback.

``bothy serve`` cannot be handed an aiohttp connector across a process boundary, so these tests
run the real :class:`~bothy.daemon.Daemon` in the test's own event loop, with the config loaded
as the CLI loads it. Only the Discord adapter's connector differs from production: it resolves
Discord's hosts to the fake and trusts a throwaway CA (chat-testing.md option B). Everything
else — the inbox, the dispatcher, the real codex worker against the scripted model, the audit —
is what `bothy serve` runs.

A mention becomes a run whose conversation is a thread started from it: seen (a reaction),
answered in the thread, asked questions there, and answered by allowed accounts only — also
across a gateway drop and RESUME.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bothy.config import load_config
from bothy.daemon import Daemon
from bothy.engine.procgroup import end_orphan_group, live_members
from bothy.home import BothyHome
from tests.fakes.codex import PROVIDER_ENV
from tests.fakes.discord import (
    ALERT_CHANNEL_ID,
    ALICE_ID,
    BOB_ID,
    BOT_TOKEN,
    CHANNEL_ID,
    Certificates,
    FakeDiscord,
)
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import DEADLINE_S, audit_records, recorded_groups, until
from tests.fakes.site import Site
from tests.test_serve import free_port

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

OPERATOR = ALICE_ID
STRANGER = BOB_ID
SEEN = "\N{EYES}"


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `bothy serve` reads from its environment: the bot token and the model's key."""
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


def _site(root: Path, server: ModelServer, **discord_cfg: object) -> Site:
    chat = {"discord": {"allowed_users": [OPERATOR], "alert_channel": ALERT_CHANNEL_ID,
                        **discord_cfg}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": 20}})


@dataclass
class Serving:
    """One real daemon serving ``site`` in this loop."""

    site: Site
    daemon: Daemon
    task: asyncio.Task[int]

    async def stop(self) -> int:
        """What SIGTERM does, then the exit code ``serve`` returns."""
        self.daemon.stop()
        async with asyncio.timeout(DEADLINE_S):
            return await self.task


@contextlib.asynccontextmanager
async def serving(site: Site, discord: FakeDiscord) -> AsyncIterator[Serving]:
    """Start the daemon on ``site`` and wait for ``serve ready``; on the way out stop it if
    the test did not, and end every worker group the site recorded, whatever happened."""
    cfg = load_config(site.home / "config.json")
    daemon = Daemon(BothyHome(site.home), cfg, adapter_options={"discord": {
        "connector": discord.connector, "guild_ready_s": 0.1, "ready_timeout_s": 10.0,
    }})
    before = len(_records(site, "serve", "ready"))
    task = asyncio.create_task(daemon.serve(), name="bothy serve (in process)")
    try:
        await until(lambda: len(_records(site, "serve", "ready")) > before or task.done(),
                    "`serve ready` in the audit")
        if task.done():
            raise AssertionError(f"serve ended before it was ready: {task.result()!r}")
        yield Serving(site, daemon, task)
    finally:
        if not task.done():
            daemon.stop()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DEADLINE_S):
                    await asyncio.wait({task})
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for record in await asyncio.to_thread(recorded_groups, site.home):
            await end_orphan_group(record, grace_s=1.0, kill_wait_s=5.0)


def _records(site: Site, kind: str, event: str) -> list[object]:
    return list(audit_records(site, lambda r: (r.kind, r.event) == (kind, event)))


def _posts_in(discord: FakeDiscord, thread: str) -> list[str]:
    return [post.content for post in discord.posts_in(thread)]


async def _until(discord: FakeDiscord, predicate: Callable[[], object], what: str) -> None:
    await discord.wait_for(predicate, what, timeout_s=DEADLINE_S)


async def _stopped_cleanly(serving: Serving) -> None:
    """``stop()`` ends serve with 0 and ``serve stopped ok``; no worker group is left."""
    assert await serving.stop() == 0
    records = audit_records(serving.site, lambda r: r.kind == "serve")
    assert (records[-1].event, records[-1].outcome) == ("stopped", "ok")
    for group in await asyncio.to_thread(recorded_groups, serving.site.home):
        assert await asyncio.to_thread(live_members, group.pgid) == [], group


async def test_a_mention_is_seen_and_answered_in_a_thread_started_from_it(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """The bot reacts, starts a thread from the mention, runs, and answers in the thread."""
    server.script(text("Nothing changed in /srv/work this week."))
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        mention = await discord.send_mention(OPERATOR, CHANNEL_ID, "what changed this week?")
        await _until(discord, lambda: _posts_in(discord, mention), "an answer in the thread")
        await _stopped_cleanly(daemon)
    assert [(r.channel_id, r.message_id, r.emoji) for r in discord.reactions] == [
        (CHANNEL_ID, mention, SEEN)]
    assert [(t.channel_id, t.thread_id, t.name) for t in discord.threads] == [
        (CHANNEL_ID, mention, "what changed this week?")]
    assert _posts_in(discord, mention) == ["Nothing changed in /srv/work this week."]
    assert _posts_in(discord, CHANNEL_ID) == []  # nothing in the channel itself
    finished = audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))
    assert [(r.outcome, r.subject) for r in finished] == [("ok", f"discord:{mention}")]
    assert len(server.requests) == 1


async def test_a_refused_reaction_costs_neither_the_thread_nor_the_answer(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """Discord refusing the "seen" reaction (403) is audited; the run still answers in its
    thread."""
    server.script(text("Still answered."))
    discord.fail_next("add_reaction", 403)
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        mention = await discord.send_mention(OPERATOR, CHANNEL_ID, "are you there?")
        await _until(discord, lambda: _posts_in(discord, mention), "an answer in the thread")
        await _stopped_cleanly(daemon)
    assert discord.reactions == []
    assert _posts_in(discord, mention) == ["Still answered."]
    failed = audit_records(site, lambda r: (r.kind, r.event) == ("chat", "react-failed"))
    assert len(failed) == 1 and "403" in str(failed[0].details["reason"])


async def test_a_mention_that_cannot_be_recorded_is_audited_lost_and_alerted(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """Discord will not resend a mention the inbox could not take: `chat lost` is audited and
    an alert in the alert channel says whose message to ask for again; nothing runs."""
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        inbox = BothyHome(site.home).inbox_dir
        shutil.rmtree(inbox, ignore_errors=True)
        inbox.write_text("not a directory")  # the inbox refuses every wake from now on
        mention = await discord.send_mention(OPERATOR, CHANNEL_ID, "are you there?")
        await _until(discord, lambda: _posts_in(discord, ALERT_CHANNEL_ID), "an alert")
        await until(lambda: _records(site, "alert", "sent"), "`alert sent` in the audit")
        await _stopped_cleanly(daemon)
    [lost] = audit_records(site, lambda r: (r.kind, r.event) == ("chat", "lost"))
    assert (lost.outcome, lost.subject) == ("failed", f"discord:{mention}")
    assert lost.details["message"] == mention and "InboxError" in str(lost.details["reason"])
    [alert] = _posts_in(discord, ALERT_CHANNEL_ID)
    assert f"a message from discord:{OPERATOR} was lost before it was recorded" in alert
    assert _records(site, "wake", "received") == [] and server.requests == []


async def test_a_stranger_is_refused_politely_and_nothing_runs(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A mention from an account not on the allowlist starts no run and gets a polite no."""
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        mention = await discord.send_mention(STRANGER, CHANNEL_ID, "delete everything")
        await _until(discord, lambda: discord.posts, "a refusal")
        await _stopped_cleanly(daemon)
    [refusal] = discord.posts
    assert "only take requests" in refusal.content
    assert refusal.channel_id == mention  # in a thread started from the mention
    assert [(t.channel_id, t.thread_id) for t in discord.threads] == [(CHANNEL_ID, mention)]
    refused = audit_records(site, lambda r: (r.kind, r.event) == ("chat", "refused"))
    assert [r.details["user"] for r in refused] == [f"discord:{STRANGER}"]
    assert _records(site, "run", "started") == []
    assert server.requests == []


async def test_an_approval_is_asked_in_the_thread_and_only_an_allowed_reply_counts(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A confirm tool asks in the thread; a stranger's yes is ignored, the operator's counts."""
    server.script(
        tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
        text("Added it."),
    )
    site = _site(tmp_path, server, profile="chat")
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a disk checklist item")
        await _until(discord, lambda: any(p.startswith("? May I use bothy_checklist")
                                          for p in _posts_in(discord, thread)),
                     "the question in the thread")
        await discord.send_message(STRANGER, thread, "yes")
        await until(lambda: bool(_records(site, "answer", "ignored")), "the stranger ignored")
        assert (site.home / "checklist.md").exists() is False  # still waiting
        await discord.send_message(OPERATOR, thread, "yes")
        await _until(discord, lambda: "Added it." in _posts_in(discord, thread),
                     "the answer after approval")
        await _stopped_cleanly(daemon)
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"
    ignored = audit_records(site, lambda r: (r.kind, r.event) == ("answer", "ignored"))
    assert [r.details["user"] for r in ignored] == [f"discord:{STRANGER}"]
    allowed = audit_records(site, lambda r: (r.kind, r.event) == ("tool", "allowed"))
    assert [r.details["approved_by"] for r in allowed] == [f"discord:{OPERATOR}"]


async def test_a_long_answer_is_split_within_discords_limit_in_order(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A 12,000-character answer arrives whole, in messages of at most 2,000, in order."""
    answer = " ".join(f"word{n:04d}" for n in range(1400))[:12_000]
    assert len(answer) == 12_000
    server.script(text(answer))
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "write a lot")
        await _until(discord, lambda: " ".join(_posts_in(discord, thread)).endswith(
            answer[-20:]), "the whole answer in the thread")
        await _stopped_cleanly(daemon)
    pieces = _posts_in(discord, thread)
    assert len(pieces) >= 6 and all(len(piece) <= 2000 for piece in pieces)
    assert " ".join(pieces).split() == answer.split()


async def test_an_answer_after_a_gateway_drop_and_resume_still_reaches_the_run(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """The gateway closes with 4000 while a question is held; discord.py RESUMEs the session
    and the operator's answer, sent after it, still approves the held call."""
    server.script(
        tool_call("bothy_checklist", {"action": "add", "item": "Rotate the logs."}),
        text("Added it."),
    )
    site = _site(tmp_path, server, profile="chat")
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "add a log checklist item")
        await _until(discord, lambda: any(p.startswith("? May I use bothy_checklist")
                                          for p in _posts_in(discord, thread)),
                     "the question in the thread")
        first = discord.open_connections[0]
        await discord.close_gateway(4000, "Unknown error")
        resumed = await discord.wait_ready(2)
        assert (resumed.resumed, resumed.session_id) == (True, first.session_id)
        await discord.send_message(OPERATOR, thread, "yes")
        await _until(discord, lambda: "Added it." in _posts_in(discord, thread),
                     "the answer after the resume")
        await _stopped_cleanly(daemon)
    assert [c.identify is not None for c in discord.connections] == [True, False]  # no re-IDENTIFY
    assert (site.home / "checklist.md").read_text() == "- Rotate the logs.\n"
    received = audit_records(site, lambda r: (r.kind, r.event) == ("answer", "received"))
    assert [(r.details["by"], r.details["answer"]) for r in received] == [
        (f"discord:{OPERATOR}", "yes")]


async def test_a_reply_in_the_thread_continues_the_conversation_even_after_a_restart(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A reply in the thread (no mention) resumes the same Codex conversation, also with a new
    daemon that IDENTIFYs afresh and knows the thread only from Discord."""
    server.script(text("The disk is at 71%."), text("It was 64% last week."),
                  text("Mostly logs."))
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        thread = await discord.send_mention(OPERATOR, CHANNEL_ID, "how full is the disk?")
        await _until(discord, lambda: "The disk is at 71%." in _posts_in(discord, thread),
                     "the first answer")
        await discord.send_message(OPERATOR, thread, "and last week?")
        await _until(discord, lambda: "It was 64% last week." in _posts_in(discord, thread),
                     "the second answer")
        await _stopped_cleanly(daemon)
    async with serving(site, discord) as daemon:  # a new daemon: the conversation goes on
        await discord.send_message(OPERATOR, thread, "what is filling it?")
        await _until(discord, lambda: "Mostly logs." in _posts_in(discord, thread),
                     "the answer after the restart")
        await _stopped_cleanly(daemon)
    assert [c.identify is not None for c in discord.connections] == [True, True]
    assert len(discord.threads) == 1  # one conversation, one thread
    history = str(server.requests[2]["input"])  # Codex resends the whole conversation
    for said in ("how full is the disk?", "The disk is at 71%.", "and last week?",
                 "It was 64% last week.", "what is filling it?"):
        assert said in history
    assert not audit_records(site, lambda r: (r.kind, r.event) == ("thread", "resume-failed"))


async def test_a_mention_answered_no_reply_leaves_no_empty_thread(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A mention whose run answers NO_REPLY is seen (the reaction) but starts no thread and
    posts nothing: the thread is opened only when there is something to say in it."""
    server.script(text("NO_REPLY"))
    site = _site(tmp_path, server)
    async with serving(site, discord) as daemon:
        mention = await discord.send_mention(OPERATOR, CHANNEL_ID, "anything to do?")
        await until(lambda: bool(_records(site, "run", "finished")), "the run finished")
        await _stopped_cleanly(daemon)
    assert [(r.message_id, r.emoji) for r in discord.reactions] == [(mention, SEEN)]
    assert discord.threads == []
    assert _posts_in(discord, mention) == [] and _posts_in(discord, CHANNEL_ID) == []


async def test_a_heartbeat_finding_is_posted_to_its_discord_channel(
    tmp_path: Path, server: ModelServer, discord: FakeDiscord
) -> None:
    """A heartbeat with `--report-to discord:<channel>`: its finding is posted in that channel
    (not a thread), naming the site, the schedule, the outcome and the run, pinging nobody."""
    import sqlite3
    from datetime import UTC, datetime, timedelta

    from bothy.clock import to_us

    server.script(text("The nightly backup did not run: @everyone check it."))
    site = _site(tmp_path, server)
    added = await site.bothy("schedule", "add", "hb", "--cron", "0 3 * * *", "--heartbeat",
                             "--report-to", f"discord:{CHANNEL_ID}")
    assert added.code == 0, added.stderr
    slot = datetime.now(UTC) - timedelta(minutes=30)  # fired once as serve starts (missed)
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    with db:
        db.execute("UPDATE schedules SET cron = ?, created_us = ?",
                   (f"{slot.minute} * * * *", to_us(datetime.now(UTC) - timedelta(hours=2))))
    db.close()
    async with serving(site, discord) as daemon:
        await _until(discord, lambda: discord.posts_in(CHANNEL_ID), "the finding in #general")
        await _stopped_cleanly(daemon)
    [finished] = audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))
    [post] = discord.posts_in(CHANNEL_ID)
    assert post.content.startswith(f"test-site · schedule:hb · completed · {finished.run_id}\n")
    assert "The nightly backup did not run" in post.content
    assert post.allowed_mentions is not None and post.allowed_mentions.get("parse") == []
    assert discord.threads == []
    [sent] = audit_records(site, lambda r: (r.kind, r.event) == ("report", "sent"))
    assert sent.details["route"] == f"discord:{CHANNEL_ID}"
