"""Chat through a real `bothy serve`: the real slack-bolt against a fake Slack on loopback.

A mention becomes a run whose conversation is that thread: seen (a reaction), answered in the
thread, asked questions there, and answered by allowed accounts only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.model_server import ModelServer, stall, text, tool_call
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_serve import free_port, start_serve

pytestmark = pytest.mark.codex

OPERATOR = "UOPERATOR"
STRANGER = "USTRANGER"
CHANNEL = "CWORK"


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens for `bothy serve`; no proxy may hijack loopback (chat-testing.md, pitfall 1)."""
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


def _site(root: Path, server: ModelServer, slack: FakeSlack, **slack_cfg: Any) -> Site:
    chat = {"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR],
                      "alert_channel": "CALERTS", **slack_cfg}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": 20}})


def _posts_in(slack: FakeSlack, thread: str) -> list[str]:
    return [post.text for post in slack.posts if post.thread_ts == thread]


async def test_a_mention_is_seen_and_answered_in_its_thread(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """The bot reacts, runs, and posts the answer in the mention's thread; twins run once."""
    server.script(text("Nothing changed in /srv/work this week."))
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        status = await shell.bothy("status")
        assert "chat connections: slack connected" in status.stdout
        assert "bothy serve: ready (pid" in status.stdout
        ts = slack.send_mention(OPERATOR, CHANNEL, "what changed this week?")
        await until(lambda: bool(_posts_in(slack, ts)), "an answer in the thread")
        assert await serving.stop() == 0
        after = await shell.bothy("status")
        assert "bothy serve: not running" in after.stdout
    assert _posts_in(slack, ts) == ["Nothing changed in /srv/work this week."]
    assert (CHANNEL, ts, "eyes") in slack.reactions
    assert slack.envelopes_acked(ts)
    finished = audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))
    assert [(r.outcome, r.subject) for r in finished] == [("ok", f"slack:{ts}")]
    assert len(server.requests) == 1  # app_mention + message twins and retries: one run


async def test_a_reaction_slack_does_not_answer_does_not_hold_the_answer(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """The "seen" reaction goes beside the run: with reactions.add left unanswered (the
    adapter would wait 30 s for it), the answer is in the thread within a few seconds, and
    the reaction, given up, is audited."""
    server.script(text("Answered while the reaction hangs."))
    slack.hang_method("reactions.add")
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "are you there?")
        await until(lambda: bool(_posts_in(slack, ts)), "an answer in the thread",
                    timeout_s=15.0)
        reacting = [c for c in slack.calls_to("reactions.add") if c.args.get("timestamp") == ts]
        assert await serving.stop() == 0
    assert _posts_in(slack, ts) == ["Answered while the reaction hangs."]
    assert reacting != []  # asked for, unanswered, while the answer went out
    [failed] = audit_records(site, lambda r: (r.kind, r.event) == ("chat", "react-failed"))
    assert "given up" in str(failed.details["reason"])


async def test_a_stranger_is_refused_politely_and_audited(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A mention from an account not on the allowlist starts nothing and gets a polite no."""
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(STRANGER, CHANNEL, "delete everything")
        await until(lambda: bool(_posts_in(slack, ts)), "a refusal in the thread")
        assert await serving.stop() == 0
    assert "only take requests" in _posts_in(slack, ts)[0]
    refused = audit_records(site, lambda r: (r.kind, r.event) == ("chat", "refused"))
    assert refused[0].details["user"] == f"slack:{STRANGER}"
    assert server.requests == []


async def test_an_approval_is_asked_in_the_thread_and_only_an_allowed_reply_counts(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A confirm tool asks in the thread; a stranger's yes is ignored, the operator's counts."""
    server.script(
        tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
        text("Added it."),
    )
    site = _site(tmp_path, server, slack, profile="chat")
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        await until(lambda: any(p.startswith("? May I use bothy_checklist")
                                for p in _posts_in(slack, ts)), "the question in the thread")
        slack.send_message(STRANGER, CHANNEL, "yes", thread_ts=ts)
        await until(lambda: bool(audit_records(
            site, lambda r: (r.kind, r.event) == ("answer", "ignored"))), "the stranger ignored")
        slack.send_message(OPERATOR, CHANNEL, "yes", thread_ts=ts)
        await until(lambda: "Added it." in _posts_in(slack, ts), "the answer after approval")
        assert await serving.stop() == 0
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"
    allowed = audit_records(site, lambda r: (r.kind, r.event) == ("tool", "allowed"))
    assert allowed[0].details["approved_by"] == f"slack:{OPERATOR}"


async def test_a_long_answer_is_split_within_slacks_limit(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A 12,000-character answer arrives whole, in pieces Slack accepts, in order."""
    words = " ".join(f"word{n}" for n in range(2000))
    server.script(text(words))
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "write a lot")
        await until(lambda: " ".join(_posts_in(slack, ts)).endswith("word1999"),
                    "the whole answer in the thread")
        assert await serving.stop() == 0
    pieces = _posts_in(slack, ts)
    assert len(pieces) >= 3 and all(len(piece) <= 4000 for piece in pieces)
    assert " ".join(pieces).split() == words.split()


async def test_an_invalid_slack_token_is_a_configuration_error(
    tmp_path: Path, server: ModelServer, slack: FakeSlack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slack refusing the token stops `bothy serve` with exit 78, naming the problem."""
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-wrong")
    site = _site(tmp_path, server, slack)
    done = await site.bothy("serve", timeout_s=30)
    assert done.code == 78, done.stderr
    assert "configuration error" in done.stderr


async def test_a_reply_continues_the_same_codex_thread_even_after_a_restart(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Replies in the thread resume the same Codex conversation, across a restart of Bothy."""
    server.script(text("The disk is at 71%."), text("It was 64% last week."),
                  text("Mostly logs."))
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "how full is the disk?")
        await until(lambda: "The disk is at 71%." in _posts_in(slack, ts), "the first answer")
        slack.send_message(OPERATOR, CHANNEL, "and last week?", thread_ts=ts)
        await until(lambda: "It was 64% last week." in _posts_in(slack, ts), "the second answer")
        assert await serving.stop() == 0

        serving = await start_serve(shell)  # a new bothy serve: the conversation goes on
        slack.send_message(OPERATOR, CHANNEL, "what is filling it?", thread_ts=ts)
        await until(lambda: "Mostly logs." in _posts_in(slack, ts), "the answer after restart")
        assert await serving.stop() == 0
    # Codex resends the whole history each time: the third request carries the first two turns.
    history = str(server.requests[2]["input"])
    for said in ("how full is the disk?", "The disk is at 71%.", "and last week?",
                 "It was 64% last week.", "what is filling it?"):
        assert said in history
    assert not audit_records(site, lambda r: (r.kind, r.event) == ("thread", "resume-failed"))


async def test_a_restart_after_a_sigkill_tells_the_thread_and_runs_nothing_twice(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """SIGKILL mid-run: the next daemon ends the orphan, tells the thread, and does not rerun."""
    server.script(stall("Looking"))
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "check the backups")
        await until(lambda: bool(audit_records(
            site, lambda r: (r.kind, r.event) == ("turn", "started"))), "the run working")
        await server.wait_for_requests(1)
        await serving.command.kill()
        restarted = await start_serve(shell)
        await until(lambda: any("was restarted" in post for post in _posts_in(slack, ts)),
                    "the thread told of the restart")
        assert await restarted.stop() == 0
    recovered = audit_records(site, lambda r: (r.kind, r.event) == ("run", "recovered"))
    assert [r.details["was"] for r in recovered] == ["running"]
    assert len(audit_records(site, lambda r: (r.kind, r.event) == ("wake", "interrupted"))) == 1
    assert len(server.requests) == 1  # the mention was not run a second time
