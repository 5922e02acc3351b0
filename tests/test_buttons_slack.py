"""Approval buttons on Slack through a real `bothy serve`: the real slack-bolt over Socket Mode
against a fake Slack on loopback, the real codex against the scripted model.

A `confirm` question is posted with Approve / Decline; a press from an allowed account is
recorded before it is acknowledged and reaches the held question once, also when the ack is
lost and Slack sends the press again; everybody else's press is told or ignored, and audited;
the message is replaced by who decided and when, or that the question expired or was stopped.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, Post, slack_environment
from tests.test_serve import free_port, start_serve

pytestmark = [pytest.mark.codex, pytest.mark.timeout(120)]

OPERATOR = "UOPERATOR"
STRANGER = "USTRANGER"
CHANNEL = "CWORK"
APPROVE = "bothy_question:approve"
DECLINE = "bothy_question:decline"
WHEN = r"[0-9]{2}:[0-9]{2}:[0-9]{2} UTC"


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens for `bothy serve`; no proxy may hijack loopback (chat-testing.md, pitfall 1)."""
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=1.0) as fake:
        yield fake


def _site(root: Path, server: ModelServer, slack: FakeSlack, *, hold_s: int = 30) -> Site:
    chat = {"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR],
                      "profile": "chat"}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": hold_s}})


def _script_checklist(server: ModelServer, after: str) -> None:
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                  text(after))


async def _question(site: Site, slack: FakeSlack, thread: str) -> Post:
    """The question's post in ``thread``, once it is there with its buttons."""
    await until(lambda: _question_post(slack, thread) is not None, "the question with buttons")
    post = _question_post(slack, thread)
    assert post is not None
    return post


def _question_post(slack: FakeSlack, thread: str) -> Post | None:
    return next((p for p in slack.posts if p.thread_ts == thread and p.blocks
                 and any(b["type"] == "actions" for b in p.blocks)), None)


def _buttons_of(post: Post) -> list[str]:
    return [e["action_id"] for b in post.blocks or [] if b["type"] == "actions"
            for e in b["elements"]]


def _texts(slack: FakeSlack, thread: str) -> list[str]:
    return [post.text for post in slack.posts if post.thread_ts == thread]


def _events(site: Site, kind: str, event: str) -> list[Any]:
    return audit_records(site, lambda r: (r.kind, r.event) == (kind, event))


async def test_an_allowed_press_reaches_the_model_and_the_message_says_who_and_when(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A stranger's press is told privately and changes nothing; the operator's approves, the
    tool runs, and the question is replaced by who approved it and when, without buttons."""
    _script_checklist(server, "Added it.")
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        question = await _question(site, slack, ts)
        assert _buttons_of(question) == [APPROVE, DECLINE]
        assert question.text.startswith("? May I use bothy_checklist")

        stranger = slack.press_button(STRANGER, question.ts, APPROVE)
        await slack.wait_for_ack(stranger)
        await until(lambda: bool(slack.ephemerals), "the stranger told privately")
        assert _buttons_of(question) == [APPROVE, DECLINE]  # still waiting

        press = slack.press_button(OPERATOR, question.ts, APPROVE)
        await slack.wait_for_ack(press)
        await until(lambda: "Added it." in _texts(slack, ts), "the answer after approval")
        assert await serving.stop() == 0

    assert [(e.user, e.thread_ts) for e in slack.ephemerals] == [(STRANGER, ts)]
    assert "Only the people this site's operator listed" in slack.ephemerals[0].text
    refused = _events(site, "button", "refused")
    assert [r.details["user"] for r in refused] == [f"slack:{STRANGER}"]
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"
    allowed = _events(site, "tool", "allowed")
    assert allowed[0].details["approved_by"] == f"slack:{OPERATOR}"
    received = _events(site, "answer", "received")
    assert [(r.details["via"], r.details["answer"]) for r in received] == [("button", "approve")]
    # The message now says who decided and when, and has no buttons left.
    assert re.search(rf"\nApproved by <@{OPERATOR}> at {WHEN}\.$", question.text), question.text
    assert _buttons_of(question) == []
    assert [u["ts"] for u in slack.updates] == [question.ts]


async def test_a_press_whose_ack_was_lost_and_a_replayed_press_count_once(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """The socket drops as the press's ack arrives: Slack sends the press again on the next
    socket, and once more later; the question is answered once, the repeats are audited."""
    _script_checklist(server, "Added it.")
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        question = await _question(site, slack, ts)
        connections = slack.connections
        slack.lose_acks = 1
        press = slack.press_button(OPERATOR, question.ts, APPROVE)
        await until(lambda: press in slack.lost_acks, "the first ack lost with its socket")
        await slack.wait_for_connections(connections + 1)
        await slack.wait_for_ack(press)  # the retry, on the new socket
        slack.replay(press)
        await slack.wait_for_ack(press)
        await until(lambda: len(_events(site, "button", "repeated")) >= 2, "two repeats")
        await until(lambda: "Added it." in _texts(slack, ts), "the answer after approval")
        assert await serving.stop() == 0

    retried = [d.attempt for d in slack.deliveries if d.envelope_id == press and d.sent]
    assert retried[:2] == [0, 1]
    assert len(_events(site, "answer", "received")) == 1
    assert len(_events(site, "question", "answered")) == 1
    assert len(_events(site, "tool", "allowed")) == 1
    assert (site.home / "checklist.md").read_text() == "- Watch the disk.\n"
    assert slack.ephemerals == []  # a repeat tells nobody anything
    assert re.search(rf"Approved by <@{OPERATOR}> at {WHEN}", question.text)


async def test_an_expired_question_says_so_and_a_late_press_changes_nothing(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Nobody presses: at the deadline the buttons are replaced by "Expired at …"; a press
    after that is told the question no longer waits, and audited."""
    _script_checklist(server, "I could not add it.")
    site = _site(tmp_path, server, slack, hold_s=2)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        question = await _question(site, slack, ts)
        value = _value_of(question)  # what the person's stale client still shows
        await until(lambda: "Expired at" in question.text, "the question marked expired")
        late = slack.press_button(OPERATOR, question.ts, APPROVE, value=value)
        await slack.wait_for_ack(late)
        await until(lambda: bool(slack.ephemerals), "the late presser told")
        await until(lambda: "I could not add it." in _texts(slack, ts), "the run's answer")
        assert await serving.stop() == 0

    assert re.search(rf"\nExpired at {WHEN}: nobody answered in time", question.text)
    assert _buttons_of(question) == []
    assert "no longer waits" in slack.ephemerals[0].text
    stale = _events(site, "button", "stale")
    assert [r.details["reason"] for r in stale] == ["the question is timed_out"]
    assert _events(site, "answer", "received") == []
    assert not (site.home / "checklist.md").exists()


async def test_forged_stale_and_foreign_presses_change_nothing_and_a_reply_still_answers(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Presses naming another workspace or app are ignored; a button of a question that does
    not exist or of another run is answered politely; all are audited; the question still
    waits, and the plain word ``approve`` in the thread answers it."""
    _script_checklist(server, "Added it.")
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        question = await _question(site, slack, ts)
        value = _value_of(question)
        question_id, run_id = value.split(":", 1)
        presses = [
            slack.press_button(OPERATOR, question.ts, APPROVE, team_id="TOTHER01"),
            slack.press_button(OPERATOR, question.ts, APPROVE, app_id="AOTHER01"),
            slack.press_button(OPERATOR, question.ts, APPROVE, value=f"99999:{run_id}"),
            slack.press_button(OPERATOR, question.ts, APPROVE,
                               value=f"{question_id}:run_20260101T000000Z_00000000"),
            slack.press_button(OPERATOR, question.ts, APPROVE, value="not ours"),
        ]
        for press in presses:
            await slack.wait_for_ack(press)
        await until(lambda: len(slack.ephemerals) == 3, "the three polite answers")
        assert _buttons_of(question) == [APPROVE, DECLINE]  # nothing changed
        slack.send_message(OPERATOR, CHANNEL, "approve", thread_ts=ts)
        await until(lambda: "Added it." in _texts(slack, ts), "the answer after the reply")
        assert await serving.stop() == 0

    forged = " ".join(r.details["reason"] for r in _events(site, "button", "forged"))
    assert len(_events(site, "button", "forged")) == 2
    assert "workspace 'TOTHER01'" in forged and "app 'AOTHER01'" in forged
    stale = sorted(r.details["reason"] for r in _events(site, "button", "stale"))
    assert stale == ["no such question", "not a Bothy question button",
                     "the question belongs to another run"]
    told = " ".join(e.text for e in slack.ephemerals)
    assert "no longer exists" in told and "another run" in told and "not one of" in told
    received = _events(site, "answer", "received")
    assert [(r.details.get("via"), r.details["answer"]) for r in received] == [(None, "approve")]
    assert re.search(rf"Approved by <@{OPERATOR}> at {WHEN}", question.text)


async def test_a_press_while_the_run_is_stopped_declines_the_question_as_a_stop_does(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """`bothy cancel` while a question waits: a press then approves nothing, the presser is
    told the run is being stopped, and the message says the question was declined."""
    _script_checklist(server, "Stopped.")
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        question = await _question(site, slack, ts)
        value = _value_of(question)  # the button the person sees, until the update lands
        cancelled = await shell.bothy("cancel", value.split(":", 1)[1])
        assert cancelled.code == 0, cancelled.stderr
        press = slack.press_button(OPERATOR, question.ts, APPROVE, value=value)
        await slack.wait_for_ack(press)
        await until(lambda: bool(slack.ephemerals), "the presser told")
        await until(lambda: "the run was stopped" in question.text, "the message updated")
        await until(lambda: bool(_events(site, "run", "finished")), "the run's end")
        assert await serving.stop() == 0

    assert "The run was stopped" in slack.ephemerals[0].text
    assert re.search(r"\nDeclined: the run was stopped", question.text)
    assert _events(site, "answer", "received") == []
    assert len(_events(site, "button", "stopped")) == 1
    assert [r.details["code"] for r in _events(site, "tool", "refused")] == ["stopped"]
    assert not (site.home / "checklist.md").exists()


def _value_of(post: Post) -> str:
    return next(e["value"] for b in post.blocks or [] if b["type"] == "actions"
                for e in b["elements"])



async def test_a_stopped_serve_declines_the_question_and_a_message_left_behind_is_replaced(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """`bothy serve` stops while a question waits: at the end of its grace the question is
    declined as on any stop, and the message is to say so — here Slack refuses that update
    (`button update-failed`), so the buttons stay. After a restart a press on them is told the
    run was stopped, changes nothing, and the message is replaced then."""
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                  text("Stopped."))
    site = _site(tmp_path, server, slack)
    site.config["wakes"] = {"shutdown_grace_s": 1.0}
    site.write_config(site.config)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        question = await _question(site, slack, ts)
        value = _value_of(question)
        slack.fail_method("chat.update", error="internal_error")
        assert await serving.stop() == 0
        assert _buttons_of(question) == [APPROVE, DECLINE]  # the update was refused

        restarted = await start_serve(shell)
        press = slack.press_button(OPERATOR, question.ts, APPROVE, value=value)
        await slack.wait_for_ack(press)
        await until(lambda: bool(slack.ephemerals), "the presser told")
        await until(lambda: _buttons_of(question) == [], "the message replaced")
        assert await restarted.stop() == 0

    failed = _events(site, "button", "update-failed")
    assert len(failed) == 1 and "internal_error" in failed[0].details["reason"]
    assert "The run was stopped" in slack.ephemerals[0].text
    assert len(_events(site, "button", "stopped")) == 1
    assert re.search(r"\nDeclined: the run was stopped", question.text)
    assert [r.details["reason"] for r in _events(site, "question", "stopped")] == [
        "bothy is stopping"]
    assert _events(site, "answer", "received") == []
    assert not (site.home / "checklist.md").exists()
