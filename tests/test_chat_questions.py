"""Held questions in a chat thread, through a real `bothy serve` with the real slack-bolt
against a fake Slack and the real codex (issue 11): a question that expires is said in its
thread, and a reply after that is told which question it was too late for; Codex's
request_user_input is shown with its options numbered and answered by number.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.model_server import ModelServer, stall, text, tool_call
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import PERMALINK_BASE, FakeSlack, slack_environment
from tests.test_serve import free_port, start_serve

pytestmark = [pytest.mark.codex, pytest.mark.timeout(90)]

OPERATOR = "UOPERATOR"
CHANNEL = "CWORK"


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens for `bothy serve`; no proxy may hijack loopback (chat-testing.md, pitfall 1)."""
    slack_environment(monkeypatch)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


def _site(root: Path, server: ModelServer, slack: FakeSlack, *, hold_s: int,
          **profile: Any) -> Site:
    chat = {"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR], "profile": "chat"}}
    return Site(root, server.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                wakes={"shutdown_grace_s": 1.0},
                profiles={"chat": {"tools": ["bothy_checklist"],
                                   "approvals": {"bothy_checklist": "confirm"},
                                   "question_hold_seconds": hold_s, **profile}})


def _posts_in(slack: FakeSlack, thread: str) -> list[str]:
    return [post.text for post in slack.posts if post.thread_ts == thread]


async def test_an_expired_question_is_said_in_its_thread_and_a_late_reply_is_told_which(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Nobody answers within the hold: a new message in the thread says so with the real
    figure; the run goes on; a reply after that is told the question it came too late for."""
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                  stall("Carrying on without it"))
    site = _site(tmp_path, server, slack, hold_s=2)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
        await until(lambda: len(_posts_in(slack, ts)) >= 2, "the expiry in the thread")
        question, expiry = _posts_in(slack, ts)
        assert question.startswith("? May I use bothy_checklist")
        assert expiry == "No answer within 2 s — declined; the run goes on."
        await server.wait_for_requests(2)  # the run went on: the model was asked again

        slack.send_message(OPERATOR, CHANNEL, "yes", thread_ts=ts)
        await until(lambda: len(_posts_in(slack, ts)) >= 3, "the note on the late reply")
        late = audit_records(site, lambda r: (r.kind, r.event) == ("answer", "late"))
        assert await serving.stop() == 0
    (asked,) = [r.details["question"] for r in audit_records(
        site, lambda r: (r.kind, r.event) == ("run", "question"))]
    assert asked.startswith("May I use bothy_checklist")
    assert _posts_in(slack, ts)[2] == (
        f"The question “{' '.join(asked.split())}” had no answer within 2 s and was declined;"
        " the run went on without it. Your reply was recorded as late.")
    assert [(r.details["answer"], r.details["question"]) for r in late] == [("yes", asked)]
    timed_out = audit_records(site, lambda r: (r.kind, r.event) == ("question", "timed_out"))
    assert len(timed_out) == 1
    assert not (site.home / "checklist.md").exists()


DOOR = {"id": "colour", "header": "Colour", "question": "Which colour should the bothy door be?",
        "isOther": True, "isSecret": False,
        "options": [{"label": "Green (Recommended)", "description": "traditional"},
                    {"label": "Red", "description": "seen from the glen"}]}


def _outputs(server: ModelServer) -> list[str]:
    """The tool outputs Codex sent the model in its last request."""
    return [str(item["output"]) for item in server.requests[-1]["input"]
            if item.get("type") == "function_call_output"]


async def test_request_user_input_shows_numbered_options_and_takes_a_number(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Codex's request_user_input is posted with its options numbered and a hint that fits;
    the operator's "2" reaches Codex as the second option's label."""
    server.script(tool_call("request_user_input", {"questions": [DOOR]}),
                  text("Painting it red."))
    site = _site(tmp_path, server, slack, hold_s=30)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "paint the door")
        await until(lambda: bool(_posts_in(slack, ts)), "the question in the thread")
        slack.send_message(OPERATOR, CHANNEL, "2", thread_ts=ts)
        await until(lambda: "Painting it red." in _posts_in(slack, ts), "the answer")
        assert await serving.stop() == 0
    assert _posts_in(slack, ts) == [
        "? Which colour should the bothy door be?\n"
        "1. Green (Recommended) — traditional\n"
        "2. Red — seen from the glen\n"
        "Answer with a number (1–2), an option's name, or your own words. Reply in this thread.",
        "Painting it red."]
    assert any('"answers":["Red"]' in output.replace(" ", "") for output in _outputs(server)), \
        _outputs(server)
    (answered,) = audit_records(site, lambda r: (r.kind, r.event) == ("question", "answered"))
    assert (answered.details["kind"], answered.details["answer"]) == ("input", "2")


async def test_an_alert_a_chat_run_raises_links_to_its_thread(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A chat run's tool that needs a person nobody set up alerts the alert channel, naming
    the site, the wake (the thread's lane) and the run, with the thread's permalink."""
    server.script(tool_call("bothy_checklist", {"action": "read"}), text("Could not."))
    site = _site(tmp_path, server, slack, hold_s=30, ask=["bothy_checklist"], approvals={})
    site.config["chat"]["slack"]["alert_channel"] = "CALERTS"
    site.write_config(site.config)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ts = slack.send_mention(OPERATOR, CHANNEL, "read the checklist")
        await until(lambda: "Could not." in _posts_in(slack, ts), "the answer")
        await until(lambda: any(p.channel == "CALERTS" for p in slack.posts), "the alert")
        assert await serving.stop() == 0
    (finished,) = audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished"))
    (alert,) = [p.text for p in slack.posts if p.channel == "CALERTS"]
    assert alert == (
        "! *WARNING* `test-site` — bothy_checklist: 'bothy_checklist' is in ask but has no"
        " approvals rule: refused, alert raised\n"
        f"wake `slack:{ts}` · run `{finished.run_id}` ·"
        f" <{PERMALINK_BASE}/archives/{CHANNEL}/p{ts.replace('.', '')}|the thread>")
