"""`bothy trace RUN` on the stories an operator asks about (issue 14): a question held and
answered in Slack with a late reply after it, a reply continuing the kept Codex thread, a
question that timed out, one a stop ended, one a run could not wait for, and a job checking
its own work — each in the tree, with the tokens each turn used.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.audit import AuditLog
from bothy.engine.auditindex import wake_id_for
from tests.fakes.model_server import ModelServer, Usage, text, tool_call
from tests.fakes.otlp import problems
from tests.fakes.shell import Shell, audit_records, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_serve import free_port, start_serve

OPERATOR = "UOPERATOR"
CHANNEL = "CWORK"
DURATION = r"(\d+ ms|\d+\.\d s)"
CONFIRMS = {"tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "confirm"}}


def _finished(site: Site) -> list[str]:
    return [str(r.run_id) for r in audit_records(site, lambda r: (r.kind, r.event)
                                                 == ("run", "finished"))]


def _has(site: Site, kind: str, event: str) -> bool:
    return bool(audit_records(site, lambda r: (r.kind, r.event) == (kind, event)))


async def _tree(site: Site, run_id: str) -> list[str]:
    shown = await site.bothy("trace", run_id)
    assert shown.code == 0, shown.stderr
    return shown.stdout.splitlines()


async def _spans(site: Site, run_id: str) -> list[dict[str, Any]]:
    shown = await site.bothy("trace", run_id, "--json")
    assert shown.code == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert problems(document) == []
    return [span for rs in document["resourceSpans"] for ss in rs["scopeSpans"]
            for span in ss["spans"]]


def _attr(span: dict[str, Any], key: str) -> Any:
    [value] = [a["value"] for a in span["attributes"] if a["key"] == key]
    return next(iter(value.values()))


def _line(lines: list[str], pattern: str) -> str:
    found = [line for line in lines if re.search(pattern, line)]
    assert len(found) == 1, (pattern, lines)
    return found[0]


@pytest.mark.codex
async def test_a_question_answered_in_slack_a_late_reply_and_a_continued_thread_are_traced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a real `bothy serve` with the real slack-bolt: the question held in the thread
    and the operator's answer, the second reply that came while the run was still working (a
    late answer), each with who wrote it; the next reply is a run of its own on the same Codex
    thread, whose turn counts only its own tokens."""
    slack_environment(monkeypatch)
    release = asyncio.Event()
    async with ModelServer() as server, FakeSlack(ack_timeout_s=5.0) as slack:
        server.script(tool_call("bothy_checklist", {"action": "add", "item": "Watch the disk."}),
                      text("Added it.", after=release),
                      text("The backups ran.", usage=Usage(input_tokens=300, output_tokens=5)))
        site = Site(tmp_path, server.base_url, listen={"tailnet_port": free_port()},
                    chat={"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR],
                                    "profile": "chat"}},
                    profiles={"chat": {**CONFIRMS, "question_hold_seconds": 20}})
        async with Shell(site) as shell:
            serving = await start_serve(shell)
            ts = slack.send_mention(OPERATOR, CHANNEL, "add a checklist item about the disk")
            await until(lambda: _has(site, "run", "question"), "the question held")
            slack.send_message(OPERATOR, CHANNEL, "yes", thread_ts=ts)
            await until(lambda: _has(site, "question", "answered"), "the question answered")
            slack.send_message(OPERATOR, CHANNEL, "yes, and hurry", thread_ts=ts)
            await until(lambda: _has(site, "answer", "late"), "the late reply recorded")
            release.set()
            await until(lambda: len(_finished(site)) == 1, "the run finished")
            slack.send_message(OPERATOR, CHANNEL, "and the backups?", thread_ts=ts)
            await until(lambda: len(_finished(site)) == 2, "the continued run finished")
            assert await serving.stop() == 0

    first, second = _finished(site)
    lines = await _tree(site, first)
    assert re.fullmatch(rf"run {first} ok {DURATION}  completed cost 0\.\d+ usd,"
                        r" 240 in, 16 out tokens", lines[0])
    assert lines[1] == "├─ wake chat ok 0 ms  " + f"{wake_id_for(first)} from chat"
    _line(lines, rf"^│     ├─ question approval bothy_checklist ok {DURATION}  .*bothy_checklist"
                 rf".* → answered by slack:{OPERATOR}$")
    _line(lines, rf"^│     └─ tool bothy_checklist allowed ok 0 ms  approved by slack:{OPERATOR}")
    _line(lines, rf"^├─ late answer ok 0 ms  from slack:{OPERATOR}: the run had moved on$")
    spans = await _spans(site, first)
    [question] = [s for s in spans if s["name"].startswith("question")]
    assert _attr(question, "bothy.answer.by") == f"slack:{OPERATOR}"
    assert _attr(question, "bothy.answer.received_by") == f"slack:{OPERATOR}"
    [late] = [s for s in spans if s["name"] == "late answer"]
    assert _attr(late, "bothy.late") is True
    assert "parentSpanId" in late and late["parentSpanId"] == next(
        s["spanId"] for s in spans if "parentSpanId" not in s)
    assert "yes, and hurry" not in json.dumps(spans)  # what people wrote is not in any span

    [turn] = [s for s in await _spans(site, second) if s["name"] == "turn 1"]
    [first_turn] = [s for s in spans if s["name"] == "turn 1"]
    assert _attr(turn, "gen_ai.conversation.id") == _attr(first_turn, "gen_ai.conversation.id")
    assert (_attr(turn, "gen_ai.usage.input_tokens"),
            _attr(turn, "gen_ai.usage.output_tokens")) == ("300", "5")


@pytest.mark.codex
async def test_a_question_that_timed_out_or_was_stopped_is_traced_as_such(
    tmp_path: Path,
) -> None:
    """A hold that ran out is a failed question span ending `timed_out`, never an answer; a
    SIGTERM during a hold ends the question `stopped` and the run `cancelled` (ERROR)."""
    async with ModelServer() as server:
        site = Site(tmp_path, server.base_url, profiles={
            "brief": {**CONFIRMS, "question_hold_seconds": 1},
            "patient": {**CONFIRMS, "question_hold_seconds": 60}})
        server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}),
                      text("went on without it"),
                      tool_call("bothy_checklist", {"action": "add", "item": "y"}))
        async with Shell(site) as shell:
            brief = await shell.bothy("run", "add x", "--profile", "brief", "--subject", "ops")
            assert brief.code == 0, brief.stderr
            patient = await shell.start("run", "add y", "--profile", "patient", "--subject", "ops")
            stopped_id = await patient.admitted()
            await patient.line(r"^bothy: question: ")
            patient.signal(signal.SIGTERM)
            assert (await patient.finish()).code == 5

    timed_out_id = next(run for run in _finished(site) if run != stopped_id)
    lines = await _tree(site, timed_out_id)
    _line(lines, rf"question approval bothy_checklist failed {DURATION}  .* → timed_out$")
    _line(lines, r"tool bothy_checklist refused refused 0 ms")
    [question] = [s for s in await _spans(site, timed_out_id) if s["name"].startswith("question")]
    assert question["status"]["code"] == 2
    assert _attr(question, "bothy.question.end") == "timed_out"
    assert "bothy.answer.by" not in {a["key"] for a in question["attributes"]}

    lines = await _tree(site, str(stopped_id))
    assert re.match(rf"run {stopped_id} cancelled {DURATION}  cancelled cost ", lines[0])
    _line(lines, rf"question approval bothy_checklist failed {DURATION}  .* → stopped$")
    spans = await _spans(site, str(stopped_id))
    [root] = [s for s in spans if "parentSpanId" not in s]
    assert root["status"]["code"] == 2 and "cancelled" in root["status"]["message"]


@pytest.mark.codex
async def test_a_job_checking_its_own_work_shows_each_attempt_and_each_turns_tokens(
    tmp_path: Path,
) -> None:
    """`bothy schedule run` of a job with `--verify-regex`: the failed check and the passing
    one are spans of the turns they judged, and each turn carries its own tokens."""
    async with ModelServer() as server:
        site = Site(tmp_path, server.base_url)
        server.script(text("not yet", usage=Usage(input_tokens=100, output_tokens=3)),
                      text("DONE", usage=Usage(input_tokens=250, output_tokens=1)))
        async with Shell(site) as shell:
            added = await shell.bothy("schedule", "add", "nightly", "--cron", "0 3 * * *",
                                      "--prompt", "Write DONE when finished",
                                      "--verify-regex", "^DONE$")
            assert added.code == 0, added.stderr
            done = await shell.bothy("schedule", "run", "nightly")
            assert done.code == 0, (done.stdout, done.stderr)

    [run_id] = _finished(site)
    lines = await _tree(site, run_id)
    assert re.fullmatch(rf"run {run_id} verified {DURATION}  verified cost 0\.\d+ usd,"
                        r" 350 in, 4 out tokens", lines[0])
    turn_1 = _line(lines, r"turn 1 ok ")
    assert turn_1.endswith("model fake-model, 100 in, 3 out tokens")
    _line(lines, r"^│  │  └─ verification verification-failed failed 0 ms  .*does not match")
    assert _line(lines, r"turn 2 ok ").endswith("model fake-model, 250 in, 1 out tokens")
    _line(lines, r"^│     └─ verification verified ok 0 ms")
    spans = await _spans(site, run_id)
    [failed] = [s for s in spans if s["name"] == "verification verification-failed"]
    assert (failed["status"]["code"], _attr(failed, "bothy.verification.attempt")) == (2, "1")


async def test_a_question_a_run_could_not_wait_for_is_traced_as_declined(tmp_path: Path) -> None:
    """A run that cannot hold (an untrusted wake) declines a question at once: the tree shows
    the question `declined`, refused, with no answer (the records as the toolbox writes them)."""
    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    run_id = "run_20261201T100000Z_0badcafe"
    log = AuditLog(site.audit_path)
    log.append("run", "admitted", "ok", subject="pr:42", run_id=run_id,
               details={"wake_id": wake_id_for(run_id), "reserved_usd": "0.500000"})
    log.append("turn", "started", "ok", subject="pr:42", run_id=run_id,
               details={"model": "fake-model", "turn_id": "t1", "thread_id": "th1"})
    log.append("question", "declined", "refused", subject="pr:42", run_id=run_id,
               details={"kind": "input", "question": "Which colour?",
                        "reason": "this run cannot wait for a person"})
    log.append("run", "finished", "ok", subject="pr:42", run_id=run_id,
               details={"outcome": "completed", "cost_usd": "0.010000"})
    lines = await _tree(site, run_id)
    _line(lines, r"^   └─ question refused 0 ms   → declined$")
    [question] = [s for s in await _spans(site, run_id) if s["name"] == "question"]
    assert question["status"]["code"] == 2
    assert _attr(question, "bothy.question.end") == "declined"
