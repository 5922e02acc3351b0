"""What unattended runs find reaches a channel (SPEC §5, §6; issue 11): a real `bothy serve`
subprocess, the real slack-bolt against the fake Slack, the real codex against the scripted
model.

A heartbeat's finding is posted to the channel its schedule names, and ``NO_REPLY`` posts
nothing anywhere; a webhook run's question is posted there at once, and a reply to it is late;
a run that fails raises an alert; a post Slack refuses is retried, then audited undelivered
with the run unaffected; a heartbeat's preflight keeps a quiet site from waking the model.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bothy.clock import to_us
from tests.fakes import github
from tests.fakes.model_server import ModelServer, stall, text, tool_call
from tests.fakes.shell import Shell, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, Post, slack_environment
from tests.test_serve import SECRET, free_port, queued, records, start_serve

pytestmark = pytest.mark.codex

OPERATOR = "UOPERATOR"
OPS = "C0OPS"
ALERTS = "CALERTS"
SITE = "test-site"


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens and the route's secret for `bothy serve`; no proxy may hijack loopback."""
    slack_environment(monkeypatch)
    monkeypatch.setenv("GH_SECRET", SECRET)


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


def _site(root: Path, server: ModelServer, slack: FakeSlack, *, job: dict[str, Any] | None = None,
          **overrides: Any) -> Site:
    """A site on the fake Slack (alerts in CALERTS), one worker, and a GitHub route whose job
    reviews opened pull requests in lane pr:N."""
    route = {"path": "/hooks/github", "secret_env": ["GH_SECRET"],
             "jobs": [{"event": "pull_request", "actions": ["opened"],
                       "prompt": "Review #{pull_request.number}.",
                       "subject": "pr:{pull_request.number}", **(job or {})}]}
    return Site(root, server.base_url, pool={"max_workers": 1},
                listen={"tailnet_port": free_port()}, wakes={"shutdown_grace_s": 5.0},
                webhooks={"github": route},
                chat={"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR],
                                "alert_channel": ALERTS}}, **overrides)


def _posts_in(slack: FakeSlack, channel: str) -> list[Post]:
    return [post for post in slack.posts if post.channel == channel]


def _missed_fire(site: Site, name: str) -> None:
    """Make schedule ``name`` two hours old with a slot half an hour ago, so that `bothy serve`
    fires it once as it starts (the missed-fire rule) and no timer fires while the test runs."""
    slot = datetime.now(UTC) - timedelta(minutes=30)
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    try:
        with db:
            db.execute("UPDATE schedules SET cron = ?, created_us = ? WHERE name = ?",
                       (f"{slot.minute} * * * *", to_us(datetime.now(UTC) - timedelta(hours=2)),
                        name))
    finally:
        db.close()


def _set_preflight_seen(site: Site, name: str, output: bytes) -> None:
    """As if the last fire's preflight had printed ``output``."""
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    try:
        with db:
            db.execute("UPDATE schedules SET preflight_sha256 = ? WHERE name = ?",
                       (hashlib.sha256(output).hexdigest(), name))
    finally:
        db.close()


async def _schedule(site: Site, name: str, *flags: str) -> None:
    added = await site.bothy("schedule", "add", name, "--cron", "0 3 * * *", *flags)
    assert added.code == 0, added.stderr
    _missed_fire(site, name)


def _prompts(request: dict[str, Any]) -> list[str]:
    return [part.get("text", "") for item in request["input"] if item.get("role") == "user"
            for part in item.get("content", []) if isinstance(part, dict)]


# --- findings ---------------------------------------------------------------------------------


async def test_a_heartbeat_finding_is_posted_to_its_channel_and_no_reply_posts_nothing(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Two heartbeats fire: the one that finds something is posted to its report_to channel
    naming the site, the schedule, the outcome and the run; the NO_REPLY one posts nothing,
    not even to the alert channel."""
    server.script(text("Disk /srv is 97% full: 2 GB left."), text("NO_REPLY"))
    site = _site(tmp_path, server, slack)
    await _schedule(site, "a-disk", "--heartbeat", "--report-to", f"slack:{OPS}")
    await _schedule(site, "b-quiet", "--heartbeat")  # would report to the alert channel
    listed = (await site.bothy("schedule", "list")).stdout.splitlines()
    assert listed[0].startswith("a-disk") and listed[0].endswith(f"reports to slack:{OPS}")
    assert "reports to" not in listed[1]
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: len(records(site, "run", "finished")) == 2, "both heartbeats run")
        await until(lambda: bool(records(site, "report", "sent")), "the finding posted")
        assert await serving.stop() == 0
    finished = {r.subject: r.run_id for r in records(site, "run", "finished", "ok")}
    assert set(finished) == {"schedule:a-disk", "schedule:b-quiet"}
    [post] = slack.posts  # the NO_REPLY heartbeat posted nothing, anywhere
    assert (post.channel, post.thread_ts) == (OPS, None)
    assert post.text == (f"{SITE} · schedule:a-disk · completed · {finished['schedule:a-disk']}"
                         "\nDisk /srv is 97% full: 2 GB left.")
    [sent] = records(site, "report", "sent", "ok")
    assert (sent.subject, sent.run_id, sent.details["route"], sent.details["message"]) == (
        "schedule:a-disk", finished["schedule:a-disk"], f"slack:{OPS}", post.ts)
    assert "NO_REPLY" not in " ".join(p.text for p in slack.posts)


async def test_a_webhook_finding_without_report_to_goes_to_the_alert_channel(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A webhook job naming no channel reports to the alert channel, with its lane pr:42."""
    server.script(text("PR 42 drops the retry limit: worth a second look."))
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        await until(lambda: bool(records(site, "report", "sent")), "the finding posted")
        assert await serving.stop() == 0
    [finished] = records(site, "run", "finished", "ok")
    [post] = _posts_in(slack, ALERTS)
    assert post.text == (f"{SITE} · pr:42 · completed · {finished.run_id}\n"
                         "PR 42 drops the retry limit: worth a second look.")


async def test_a_webhook_runs_question_is_shown_in_its_channel_and_a_reply_there_is_late(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A webhook run's request_user_input is posted to its channel at once, saying the run goes
    on without an answer; the turn is told no answer is coming; a reply in the question's
    thread is recorded late and acknowledged, and resumes nothing."""
    question = {"id": "merge", "header": "Merge", "question": "May I merge #42 now?",
                "options": [{"label": "Yes", "description": "merge it"},
                            {"label": "No", "description": "leave it open"}]}
    server.script(tool_call("request_user_input", {"questions": [question]}),
                  text("Reviewed #42; left it open."))
    site = _site(tmp_path, server, slack, job={"report_to": f"slack:{OPS}"})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        await until(lambda: len(_posts_in(slack, OPS)) == 2, "the question and the finding")
        [asked, found] = _posts_in(slack, OPS)
        slack.send_message(OPERATOR, OPS, "yes, merge it", thread_ts=asked.ts)
        await until(lambda: any(p.thread_ts == asked.ts for p in slack.posts),
                    "the late reply acknowledged in its thread")
        assert await serving.stop() == 0
    [finished] = records(site, "run", "finished", "ok")
    run_id = str(finished.run_id)
    assert asked.text.startswith("? May I merge #42 now?\n1. Yes — merge it\n"
                                 "2. No — leave it open\n")
    assert asked.text.endswith(f"{SITE} · pr:42 · asking · {run_id}\n"
                               "This run cannot wait for an answer: it goes on without one.")
    assert found.text.endswith("Reviewed #42; left it open.")
    [late] = records(site, "answer", "late")
    assert (late.run_id, late.details["by"], late.details["answer"]) == (
        run_id, f"slack:{OPERATOR}", "yes, merge it")
    [note] = [p for p in slack.posts if p.thread_ts == asked.ts]
    assert "recorded as late" in note.text and "Mention me" in note.text
    outputs = [str(item["output"]) for item in server.requests[-1]["input"]
               if item.get("type") == "function_call_output"]
    assert any("No answer is coming" in out for out in outputs)
    assert len(server.requests) == 2  # the reply started no run


async def test_a_schedules_approval_it_cannot_wait_for_is_posted_and_refused(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A scheduled run's `confirm` tool needs a person, and a schedule cannot wait: the question
    is posted to its channel at once, the tool is refused (`no_hold`), the run goes on."""
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "Rotate the logs."}),
                  text("Could not add it without an approval."))
    site = _site(tmp_path, server, slack, profiles={"ops": {
        "tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "confirm"}}})
    await _schedule(site, "tidy", "--prompt", "Add a checklist item about the logs.",
                    "--profile", "ops", "--report-to", f"slack:{OPS}")
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: len(_posts_in(slack, OPS)) == 2, "the question and the finding")
        assert await serving.stop() == 0
    [finished] = records(site, "run", "finished", "ok")
    [asked, found] = _posts_in(slack, OPS)
    assert asked.text.startswith("? May I use bothy_checklist?")
    assert "This run cannot wait for an answer: it goes on without one." in asked.text
    [refused] = records(site, "tool", "refused")
    assert (refused.run_id, refused.details["code"]) == (finished.run_id, "no_hold")
    assert found.text.endswith("Could not add it without an approval.")
    assert not (site.home / "checklist.md").exists()


async def test_a_failing_unattended_run_raises_an_alert(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A webhook run stopped at its token limit alerts the alert channel naming the site, the
    lane, the run and the outcome; its report_to channel is told too."""
    server.script(text("A long review that goes on and on."))
    site = _site(tmp_path, server, slack, job={"report_to": f"slack:{OPS}"},
                 limits={"max_tokens": 1})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        await until(lambda: bool(records(site, "alert", "sent")), "the alert")
        await until(lambda: bool(records(site, "report", "sent")), "the report")
        assert await serving.stop() == 0
    [finished] = records(site, "run", "finished")
    assert finished.outcome == "token_limit"
    [alert] = _posts_in(slack, ALERTS)
    assert alert.text.startswith(f"! *WARNING* `{SITE}` — unattended run: ended token_limit:")
    assert alert.text.endswith(f"wake `pr:42` · run `{finished.run_id}`")
    [report] = _posts_in(slack, OPS)
    assert report.text.startswith(f"{SITE} · pr:42 · token_limit · {finished.run_id}\n")


async def test_a_run_a_sigkill_cut_short_is_alerted_when_serve_starts_again(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """`bothy serve` SIGKILLed while a webhook run works: the next serve closes the wake (never
    run twice) and alerts that the run was cut short."""
    server.script(stall())
    site = _site(tmp_path, server, slack)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        await until(lambda: bool(records(site, "run", "started")), "the run with the model")
        await serving.command.kill()
        restarted = await start_serve(shell)
        await until(lambda: bool(records(site, "alert", "sent")), "the alert")
        assert await restarted.stop() == 0
    [started] = records(site, "run", "started")
    [alert] = _posts_in(slack, ALERTS)
    assert alert.text.startswith(f"! *WARNING* `{SITE}` — unattended run: bothy stopped while"
                                 " it worked; it was not run again")
    assert alert.text.endswith(f"wake `pr:42` · run `{started.run_id}`")


async def test_a_report_slack_keeps_refusing_is_retried_then_undelivered_the_run_unaffected(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """chat.postMessage answering 500 every time: the report is tried three times, audited
    `report undelivered` with the reason, the alert about it `alert undelivered`; the run
    finished ok and its wake is done."""
    server.script(text("Found a stale lock file."))
    site = _site(tmp_path, server, slack, job={"report_to": f"slack:{OPS}"})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        slack.fail_method("chat.postMessage", status=500, count=None)
        await queued(serving, github.pull_request_opened(42))
        await until(lambda: bool(records(site, "alert", "undelivered")), "the alert undelivered")
        assert await serving.stop() == 0
    [finished] = records(site, "run", "finished", "ok")
    [undelivered] = records(site, "report", "undelivered", "failed")
    assert (undelivered.run_id, undelivered.details["route"]) == (finished.run_id, f"slack:{OPS}")
    assert "(after 3 tries)" in str(undelivered.details["reason"])
    assert len([c for c in slack.calls_to("chat.postMessage")
                if c.args.get("channel") == OPS]) == 3
    [alert] = records(site, "alert", "undelivered", "failed")
    assert alert.run_id == finished.run_id
    assert f"could not be posted: {undelivered.details['reason']}" in str(alert.details["reason"])
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    try:
        assert db.execute("SELECT status FROM wakes").fetchall() == [("done",)]
    finally:
        db.close()


async def test_a_channel_the_bot_cannot_post_in_is_not_retried_and_alerts_the_alert_channel(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """Slack refusing the report for good (channel_not_found): one try, `report undelivered`
    naming Slack's answer, and an alert in the alert channel saying the finding was lost."""
    server.script(text("The certificate expires in 3 days."))
    site = _site(tmp_path, server, slack, job={"report_to": f"slack:{OPS}"})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        slack.fail_method("chat.postMessage", error="channel_not_found", count=1)
        await queued(serving, github.pull_request_opened(42))
        await until(lambda: bool(records(site, "alert", "sent")), "the alert")
        assert await serving.stop() == 0
    [undelivered] = records(site, "report", "undelivered", "failed")
    assert "channel_not_found" in str(undelivered.details["reason"])
    assert "tries" not in str(undelivered.details["reason"])  # refused for good: not retried
    assert [c.args.get("channel") for c in slack.calls_to("chat.postMessage")] == [OPS, ALERTS]
    [alert] = _posts_in(slack, ALERTS)
    assert "the run's answer could not be posted" in alert.text
    assert "channel_not_found" in alert.text


# --- the preflight ------------------------------------------------------------------------------


async def test_a_quiet_preflight_wakes_no_model_and_reserves_nothing(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A preflight exiting 0 with the last fire's output: `heartbeat quiet`, no run, no
    reservation, nothing posted, the model never asked."""
    site = _site(tmp_path, server, slack)
    await _schedule(site, "hb", "--heartbeat", "--preflight-cmd", "printf 'all good'")
    [listed] = (await site.bothy("schedule", "list")).stdout.splitlines()
    assert listed.endswith("preflight printf 'all good'")
    _set_preflight_seen(site, "hb", b"all good")
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: bool(records(site, "heartbeat", "quiet")), "a quiet fire")
        assert await serving.stop() == 0
    [quiet] = records(site, "heartbeat", "quiet", "ok")
    assert (quiet.subject, quiet.details["preflight"], quiet.details["exit_code"]) == (
        "schedule:hb", "printf all good", 0)
    assert quiet.details["why"] == "exited 0 with the output of the last fire"
    assert records(site, "run", "admitted") == [] and records(site, "wake", "ignored") == []
    assert server.requests == [] and slack.posts == []
    db = sqlite3.connect(site.home / "state" / "bothy.sqlite3")
    try:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)
        assert db.execute("SELECT status, note FROM wakes").fetchall() == [
            ("done", "preflight `printf all good` exited 0 with the output of the last fire")]
    finally:
        db.close()


@pytest.mark.parametrize(("command", "seen_before", "why"), [
    ("sh -c 'echo disk at 97%; exit 1'", b"disk at 97%\n", "exited with code 1"),
    ("printf 'disk at 97%%'", b"disk at 80%", "its output changed since the last fire"),
    ("/nonexistent/check-disk", b"", "could not start"),
])
async def test_a_preflight_that_fails_or_changes_or_cannot_start_wakes_the_model(
    tmp_path: Path, server: ModelServer, slack: FakeSlack, command: str, seen_before: bytes,
    why: str,
) -> None:
    """Exit non-zero (even with the same output), a changed output, or a command that cannot
    start: `heartbeat woken`, and the model is told what the preflight saw."""
    server.script(text("NO_REPLY"))
    site = _site(tmp_path, server, slack)
    await _schedule(site, "hb", "--heartbeat", "--preflight-cmd", command)
    _set_preflight_seen(site, "hb", seen_before)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: bool(records(site, "run", "finished")), "the heartbeat's run")
        assert await serving.stop() == 0
    [woken] = records(site, "heartbeat", "woken", "ok")
    assert str(woken.details["why"]).startswith(why)
    [prompt] = [p for p in _prompts(server.requests[0]) if "Scheduled heartbeat" in p]
    assert f"The preflight check `{' '.join(woken.details['preflight'].split())}` {why}" in prompt
    assert prompt.endswith("If nothing needs attention, reply exactly NO_REPLY.")
    if seen_before:
        assert "disk at 97%" in prompt
    assert slack.posts == []  # NO_REPLY


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("job", "pollers", "key", "message"), [
    ({"report_to": "discord:123456789012345678"}, {}, "webhooks.github.jobs.0.report_to",
     "names discord, but chat.discord is not configured"),
    ({"report_to": "slack:#ops"}, {}, "webhooks.github.jobs.0.report_to",
     "'#ops' is not a Slack channel id such as C0OPS"),
    ({}, {"feed": {"url": "http://127.0.0.1:9/feed", "job": {"prompt": "Look.",
                                                            "report_to": "teams:ops"}}},
     "pollers.feed.job.report_to", "is not a report target"),
])
async def test_a_report_to_that_cannot_receive_reports_stops_serve_with_exit_78(
    tmp_path: Path, server: ModelServer, slack: FakeSlack, job: dict[str, Any],
    pollers: dict[str, Any], key: str, message: str,
) -> None:
    """A report_to naming an unconfigured platform or a malformed channel: exit 78 naming the
    key, before anything starts."""
    site = _site(tmp_path, server, slack, job=job, pollers=pollers)
    done = await site.bothy("serve")
    assert done.code == 78, done
    assert key in done.stderr and message in done.stderr, done.stderr
    assert slack.calls == []


async def test_doctor_warns_of_a_schedule_reporting_to_a_platform_no_longer_configured(
    tmp_path: Path, server: ModelServer, slack: FakeSlack
) -> None:
    """A schedule added with --report-to slack:C0OPS, then Slack taken out of the config:
    `bothy doctor` warns that its findings reach nobody; with Slack back, it names the channel."""
    site = _site(tmp_path, server, slack)
    await _schedule(site, "hb", "--heartbeat", "--report-to", f"slack:{OPS}")
    healthy = await site.bothy("doctor")
    [line] = [ln for ln in healthy.stdout.splitlines() if "report channels" in ln]
    assert line.startswith("[ok") and f"slack:{OPS}" in line, line
    site.write_config({k: v for k, v in site.config.items() if k != "chat"})
    broken = await site.bothy("doctor")
    [line] = [ln for ln in broken.stdout.splitlines() if "report channels" in ln]
    assert line.startswith("[warn]"), line
    assert (f"schedule hb: 'slack:{OPS}' names slack, but chat.slack is not configured — its"
            " findings reach nobody") in line
