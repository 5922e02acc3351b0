"""Proofs of profiles end to end: the real CLI, the real codex, a scripted model, a real MCP server.

Each test writes a profile into a throwaway site's config, scripts what "the model" calls,
runs ``bothy run ... --profile NAME`` as an operator would, and asserts what the operator and
the model see: the printed line and exit code, the audit register, the checklist, the fake
MCP server's outbox, and the ``function_call_output`` items codex sent back to the model
(the tool's result, or Bothy's refusal). MCP servers are ``tests/fakes/mcp_server.py`` over
stdio, in the mode under test; after a run, every process group recorded for it is proven
empty by enumerating its live members.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from bothy.engine.audit import AuditRecord
from bothy.engine.procgroup import live_members
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import Shell, audit_records
from tests.fakes.site import Completed, Site

MCP_SERVER = Path(__file__).parent / "fakes" / "mcp_server.py"
RUN_LINE = re.compile(
    r"^(?P<outcome>\S+) (?P<run_id>run_\S+) (?P<usd>\d+\.\d{4}) usd ?(?P<rest>.*)$"
)
BY_SHELL = f"{os.environ.get('USER', 'operator')}@shell"
AUDIT_CHAIN_ITEM = "Verify the audit chain is intact, with no missing or invalid links."

pytestmark = pytest.mark.codex


# --- fixtures and helpers -------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.fixture
def make_site(tmp_path: Path, server: ModelServer) -> Callable[..., Site]:
    """A site whose config holds ``profiles``."""

    def make(**profiles: dict[str, Any]) -> Site:
        return Site(tmp_path, server.base_url, profiles=profiles)

    return make


def fake_mcp(mode: str = "normal", **settings: Any) -> dict[str, Any]:
    """An ``mcp_servers`` entry starting the fake MCP server in ``mode``."""
    return {"command": sys.executable, "args": [str(MCP_SERVER), mode],
            "env": ["FAKE_MCP_OUTBOX"], **settings}


def run_line(done: Completed) -> re.Match[str]:
    """The one line ``bothy run`` prints on stdout, parsed."""
    lines = done.stdout.splitlines()
    assert len(lines) == 1, f"expected one line on stdout, got {done.stdout!r} ({done.stderr})"
    match = RUN_LINE.match(lines[0])
    assert match, f"not a run line: {lines[0]!r}"
    return match


def completed(done: Completed, answer: str) -> str:
    """The run id of a run that completed with ``answer`` and exited 0."""
    assert done.code == 0, (done.stdout, done.stderr)
    match = run_line(done)
    assert (match["outcome"], match["rest"]) == ("completed", answer), done.stdout
    return match["run_id"]


def told(server: ModelServer) -> list[str]:
    """What the model was told of each of its tool calls, in order (the last request's input)."""
    outputs = [item["output"] for item in server.requests[-1]["input"]
               if item.get("type") == "function_call_output"]
    return [out if isinstance(out, str) else json.dumps(out) for out in outputs]


def offered(server: ModelServer) -> set[str]:
    """The names of the tools codex offered the model in its first request."""
    return {tool["name"] for tool in server.requests[0]["tools"] if "name" in tool}


def records(site: Site, run_id: str, kind: str, event: str | None = None) -> list[AuditRecord]:
    return audit_records(site, lambda r: r.run_id == run_id and r.kind == kind
                         and (event is None or r.event == event))


def tool_verdicts(site: Site, run_id: str) -> list[tuple[str, str, str | None]]:
    """(tool, event, refusal code) of each of the run's tool decisions, in order."""
    return [(str(r.details["tool"]), r.event, r.details.get("code"))
            for r in records(site, run_id, "tool")]


def recorded_groups(site: Site, run_id: str) -> dict[str, int]:
    """Role → pgid of every process group recorded for the run: its worker, its MCP servers."""
    db = sqlite3.connect(f"file:{site.home / 'state' / 'bothy.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT role, pgid FROM groups WHERE run_id = ?", (run_id,)).fetchall()
        rows += db.execute("SELECT 'worker', pgid FROM runs WHERE run_id = ? AND pgid IS NOT NULL",
                           (run_id,)).fetchall()
    finally:
        db.close()
    return {str(role): int(pgid) for role, pgid in rows}


def assert_no_live_process(site: Site, run_id: str, roles: set[str]) -> None:
    """The run recorded its worker's group and one for each of ``roles``; none has a live member."""
    groups = recorded_groups(site, run_id)
    assert set(groups) == {"worker", *roles}, groups
    alive = {role: live_members(pgid) for role, pgid in groups.items()}
    assert all(not pids for pids in alive.values()), f"still alive after the run: {alive}"


def checklist_file(site: Site) -> Path:
    return site.home / "checklist.md"


# --- the user story -------------------------------------------------------------------


async def test_a_selfcare_run_reads_the_checklist_and_adds_to_it(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """The issue's story: a run reads the checklist and adds an item; `bothy checklist` shows it."""
    site = make_site(selfcare={"tools": ["bothy_checklist"]})
    checklist_file(site).write_text("- Disk on / should stay under 85%.\n")
    server.script(
        tool_call("bothy_checklist", {"action": "read"}),
        tool_call("bothy_checklist", {"action": "add", "item": AUDIT_CHAIN_ITEM}),
        text("Added an item about the audit chain."),
    )

    done = await site.bothy("run", "read the checklist, add an item about the audit chain",
                            "--profile", "selfcare")
    shown = await site.bothy("checklist")

    run_id = completed(done, "Added an item about the audit chain.")
    assert told(server) == ["- Disk on / should stay under 85%.", f"added: {AUDIT_CHAIN_ITEM}"]
    assert (shown.code, shown.stdout) == (
        0, f"- Disk on / should stay under 85%.\n- {AUDIT_CHAIN_ITEM}\n"
    )
    assert tool_verdicts(site, run_id) == [
        ("bothy_checklist", "allowed", None), ("bothy_checklist", "allowed", None)
    ]


async def test_an_empty_checklist_says_so(make_site: Callable[..., Site]) -> None:
    """`bothy checklist` on a site with no checklist says it is empty."""
    site = make_site()

    shown = await site.bothy("checklist")

    assert (shown.code, shown.stdout) == (0, "(the checklist is empty)\n")


# --- what is not granted --------------------------------------------------------------


async def test_a_run_without_a_profile_is_offered_none_of_bothys_tools(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """Without --profile the model is offered no Bothy tool, and calling one changes nothing."""
    site = make_site(selfcare={"tools": ["bothy_checklist"]})
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("done"))

    done = await site.bothy("run", "add x to the checklist")

    completed(done, "done")
    assert "bothy_checklist" not in offered(server)
    assert told(server) == ["unsupported call: bothy_checklist"]
    assert not checklist_file(site).exists()


async def test_a_name_that_mimics_a_granted_tool_is_refused(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """`bothy_checklist_admin` is not `bothy_checklist`: never offered, refused, nothing written."""
    site = make_site(selfcare={"tools": ["bothy_checklist"]})
    server.script(
        tool_call("bothy_checklist_admin", {"action": "add", "item": "x"}),
        text("done"),
    )

    done = await site.bothy("run", "add x", "--profile", "selfcare")

    run_id = completed(done, "done")
    assert "bothy_checklist" in offered(server)
    assert "bothy_checklist_admin" not in offered(server)
    assert told(server) == ["unsupported call: bothy_checklist_admin"]
    assert tool_verdicts(site, run_id) == []  # codex refused it; nothing reached the tool
    assert not checklist_file(site).exists()


async def test_a_sibling_of_a_granted_mcp_tool_is_refused(
    make_site: Callable[..., Site], server: ModelServer, tmp_path: Path
) -> None:
    """With only fake.search granted, fake__send_message is never offered and sends nothing."""
    outbox = tmp_path / "outbox.jsonl"
    site = make_site(mail={"tools": ["fake.search"], "mcp_servers": {"fake": fake_mcp()}})
    server.script(
        tool_call("fake__send_message", {"to": "ada@example.test", "body": "hi"}),
        tool_call("fake.send_message", {"to": "ada@example.test", "body": "hi"}),
        text("done"),
    )

    done = await site.bothy("run", "send a message", "--profile", "mail",
                            FAKE_MCP_OUTBOX=str(outbox))

    run_id = completed(done, "done")
    assert {"fake__search"} <= offered(server)
    assert not {"fake__send_message", "fake__environment", "fake__fail"} & offered(server)
    assert told(server) == ["unsupported call: fake__send_message",
                            "unsupported call: fake.send_message"]
    assert tool_verdicts(site, run_id) == []
    assert not outbox.exists()
    assert_no_live_process(site, run_id, {"mcp:fake"})


async def test_a_command_outside_the_sandbox_is_refused_when_shell_is_not_granted(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """Codex's request to run a command unsandboxed is refused as not granted, and audited."""
    site = make_site(selfcare={"tools": ["bothy_checklist"]})
    server.script(
        tool_call("exec_command", {"cmd": "touch escalated.txt",
                                   "sandbox_permissions": "require_escalated",
                                   "justification": "needs to write"}),
        text("done"),
    )

    done = await site.bothy("run", "make a file", "--profile", "selfcare")

    run_id = completed(done, "done")
    [refused] = records(site, run_id, "tool", "refused")
    assert (refused.details["tool"], refused.details["code"]) == ("shell", "not_granted")
    assert refused.details["reason"] == "'shell' is not granted to profile 'selfcare'"
    assert not (site.workspace / "escalated.txt").exists()
    # An approval answer carries no reason: codex tells the model its own words.
    [output] = told(server)
    assert "rejected by user" in output, output


# --- the rules ------------------------------------------------------------------------


async def test_deny_refuses_and_tells_the_model(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """A denied tool is refused, audited as denied, and the model is told not to retry."""
    site = make_site(selfcare={"tools": ["bothy_checklist"],
                               "approvals": {"bothy_checklist": "deny"}})
    server.script(tool_call("bothy_checklist", {"action": "read"}), text("done"))

    done = await site.bothy("run", "read the checklist", "--profile", "selfcare")

    run_id = completed(done, "done")
    assert told(server) == ["The tool 'bothy_checklist' is denied. Do not retry it."]
    assert tool_verdicts(site, run_id) == [("bothy_checklist", "refused", "denied")]


async def test_guide_refuses_and_its_reason_reaches_the_model(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """A guided tool is refused, and the model reads the guide's reason in the tool's output."""
    reason = "Put the item in your final answer; the operator adds items by hand."
    site = make_site(selfcare={"tools": ["bothy_checklist"],
                               "approvals": {"bothy_checklist": {"guide": reason}}})
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("done"))

    done = await site.bothy("run", "add x", "--profile", "selfcare")

    run_id = completed(done, "done")
    assert told(server) == [f"The tool 'bothy_checklist' was refused: {reason}"]
    assert tool_verdicts(site, run_id) == [("bothy_checklist", "refused", "guided")]
    assert not checklist_file(site).exists()


def confirming(**extra: Any) -> dict[str, Any]:
    return {"tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "confirm"}, **extra}


async def hold_and_answer(site: Site, answer: str) -> tuple[str, Completed, Completed]:
    """Start a run that will ask, answer it from another shell once it asks; both results."""
    async with Shell(site) as shell:
        run = await shell.start("run", "add the audit chain item", "--profile", "selfcare")
        run_id = await run.admitted()
        assert run_id is not None
        await run.line(rf"^bothy: question: May I use bothy_checklist\? .*bothy answer {run_id}")
        answered = await shell.bothy("answer", run_id, answer)
        return run_id, answered, await run.finish()


async def test_confirm_approved_from_another_shell_carries_the_call_out(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """A held question answered `yes` by `bothy answer` lets the call through, naming who."""
    site = make_site(selfcare=confirming(unless_approved_within=600))
    add_item = {"action": "add", "item": AUDIT_CHAIN_ITEM}
    server.script(tool_call("bothy_checklist", add_item), text("added"))

    run_id, answered, done = await hold_and_answer(site, "yes")

    question = f"May I use bothy_checklist? {add_item!r}"
    assert (answered.code, answered.stdout) == (0, f"answered {run_id}: {question}\n")
    assert completed(done, "added") == run_id
    assert told(server) == [f"added: {AUDIT_CHAIN_ITEM}"]
    assert checklist_file(site).read_text() == f"- {AUDIT_CHAIN_ITEM}\n"
    [asked] = records(site, run_id, "run", "question")
    [reply] = records(site, run_id, "question", "answered")
    [allowed] = records(site, run_id, "tool", "allowed")
    assert (asked.outcome, asked.details["question"]) == ("pending", question)
    assert (reply.details["by"], reply.details["answer"]) == (BY_SHELL, "yes")
    assert allowed.details["approved_by"] == BY_SHELL
    assert [r.details["by"] for r in records(site, run_id, "answer", "received")] == [BY_SHELL]


async def test_confirm_passes_on_a_fresh_approval_without_asking(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """Within unless_approved_within of a person's yes, the next run's call passes unasked."""
    site = make_site(selfcare=confirming(unless_approved_within=600))
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "first"}), text("one"))
    await hold_and_answer(site, "yes")
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "second"}), text("two"))

    done = await site.bothy("run", "add the second item", "--profile", "selfcare")

    run_id = completed(done, "two")
    assert records(site, run_id, "question") == records(site, run_id, "run", "question") == []
    [allowed] = records(site, run_id, "tool", "allowed")
    assert allowed.details["approved_by"] == BY_SHELL
    assert re.fullmatch(rf"approved by {re.escape(BY_SHELL)} \d+ s ago", allowed.details["why"])
    assert checklist_file(site).read_text() == "- first\n- second\n"


async def test_confirm_declined_from_another_shell_is_a_persons_no(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """`bothy answer RUN no` refuses the call as declined by that person; nothing is written."""
    site = make_site(selfcare=confirming(unless_approved_within=600))
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("ok"))

    run_id, answered, done = await hold_and_answer(site, "no")

    assert answered.code == 0
    assert completed(done, "ok") == run_id
    assert told(server) == ["A person declined the use of 'bothy_checklist'. Do not retry it."]
    [refused] = records(site, run_id, "tool", "refused")
    assert refused.details["code"] == "declined_by_person"
    assert refused.details["reason"] == f"{BY_SHELL} answered 'no'"
    assert not checklist_file(site).exists()


async def test_confirm_unanswered_times_out_and_a_later_answer_is_late(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """No answer within the hold: refused as timed out (not a no); a yes afterwards is late."""
    site = make_site(selfcare=confirming(question_hold_seconds=1, unless_approved_within=600))
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("ok"))

    done = await site.bothy("run", "add x", "--profile", "selfcare")
    run_id = completed(done, "ok")
    late = await site.bothy("answer", run_id, "yes")

    assert "bothy: question: May I use bothy_checklist?" in done.stderr
    assert told(server) == ["Nobody approved 'bothy_checklist' in time. Continue without it."]
    [refused] = records(site, run_id, "tool", "refused")
    assert refused.details["code"] == "timed_out"
    [timed_out] = records(site, run_id, "question", "timed_out")
    assert timed_out.outcome == "failed"
    assert records(site, run_id, "question", "answered") == []
    assert (late.code, late.stdout) == (
        1, f"{run_id} has no pending question: the run had moved on (recorded as late)\n"
    )
    [recorded] = records(site, run_id, "answer", "late")
    assert recorded.details["answer"] == "yes"
    # The late yes approves nothing: the next call still has to ask.
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "y"}), text("ok"))
    again = await site.bothy("run", "add y", "--profile", "selfcare")
    assert records(site, completed(again, "ok"), "run", "question")
    assert not checklist_file(site).exists()


async def test_a_stop_while_a_question_is_held_is_recorded_as_stopped_not_as_a_no(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """SIGINT during a hold ends the question as stopped, refuses the call, cancels the run."""
    site = make_site(selfcare=confirming())
    server.script(tool_call("bothy_checklist", {"action": "add", "item": "x"}), text("ok"))

    async with Shell(site) as shell:
        run = await shell.start("run", "add x", "--profile", "selfcare")
        run_id = await run.admitted()
        assert run_id is not None
        await run.line(r"^bothy: question: May I use bothy_checklist\?")
        run.signal(signal.SIGINT)
        done = await run.finish()

    assert done.code == 5, (done.stdout, done.stderr)
    assert done.stdout.startswith(f"cancelled {run_id} ")
    [stopped] = records(site, run_id, "question", "stopped")
    assert (stopped.outcome, stopped.details["reason"]) == ("failed", "bothy is stopping")
    assert records(site, run_id, "question", "answered") == []
    assert tool_verdicts(site, run_id) == [("bothy_checklist", "refused", "stopped")]
    assert not checklist_file(site).exists()
    assert_no_live_process(site, run_id, set())


async def test_ask_without_a_rule_is_refused_and_audited_as_an_undelivered_alert(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """A tool in ask with no rule is refused, and an alert with nowhere to go is recorded."""
    site = make_site(selfcare={"tools": ["bothy_checklist"], "ask": ["bothy_checklist"]})
    server.script(tool_call("bothy_checklist", {"action": "read"}), text("done"))

    done = await site.bothy("run", "read the checklist", "--profile", "selfcare")

    run_id = completed(done, "done")
    assert told(server) == ["The tool 'bothy_checklist' needs a person and none is set up to"
                            " answer it. Do not retry."]
    assert tool_verdicts(site, run_id) == [("bothy_checklist", "refused", "ask_without_rule")]
    [alert] = records(site, run_id, "alert")
    assert (alert.event, alert.outcome) == ("undelivered", "failed")
    assert (alert.details["about"], alert.details["route"]) == ("bothy_checklist",
                                                                "none configured")


# --- malformed calls ------------------------------------------------------------------


async def test_malformed_tool_arguments_are_an_error_for_the_model(
    make_site: Callable[..., Site], server: ModelServer, tmp_path: Path
) -> None:
    """Bad arguments to Bothy's and MCP tools come back as errors; the run goes on and completes."""
    site = make_site(selfcare={"tools": ["bothy_checklist", "fake.search"],
                               "mcp_servers": {"fake": fake_mcp()}})
    server.script(
        tool_call("bothy_checklist", {"action": 5}),
        tool_call("bothy_checklist", "[1, 2]"),
        tool_call("bothy_checklist", "{not json"),
        tool_call("bothy_checklist", {"action": "add"}),
        tool_call("fake__search", '["invoices"]'),
        tool_call("fake__search", {"q": "invoices"}),
        text("done despite all that"),
    )

    done = await site.bothy("run", "misbehave", "--profile", "selfcare",
                            FAKE_MCP_OUTBOX=str(tmp_path / "outbox.jsonl"))

    run_id = completed(done, "done despite all that")
    said = told(server)
    assert said[:2] == ["unknown action 5: use read, add or remove",
                        "arguments must be an object with an 'action'"]
    assert said[2].startswith("failed to parse function arguments")
    assert said[3] == "action add needs a non-empty 'item' string"
    assert said[4] == "arguments for 'fake.search' must be a JSON object"
    assert said[5].startswith("MCP tool 'fake.search' reported an error:"), said[5]
    assert "query" in said[5]
    assert not checklist_file(site).exists()
    assert_no_live_process(site, run_id, {"mcp:fake"})


# --- MCP servers through the real codex -----------------------------------------------


async def test_mcp_tools_are_offered_called_and_audited(
    make_site: Callable[..., Site], server: ModelServer, tmp_path: Path
) -> None:
    """fake__search's text reaches the model; fake__send_message (proceed) really sends."""
    outbox = tmp_path / "outbox.jsonl"
    site = make_site(mail={"tools": ["fake.search", "fake.send_message"],
                           "approvals": {"fake.send_message": "proceed"},
                           "mcp_servers": {"fake": fake_mcp()}})
    server.script(
        tool_call("fake__search", {"query": "invoices"}),
        tool_call("fake__send_message", {"to": "ada@example.test", "body": "found 3"}),
        text("sent"),
    )

    done = await site.bothy("run", "find invoices and tell Ada", "--profile", "mail",
                            FAKE_MCP_OUTBOX=str(outbox))

    run_id = completed(done, "sent")
    assert {"fake__search", "fake__send_message"} <= offered(server)
    assert told(server) == [
        "\n".join(f"{n}. message about 'invoices' from sender{n}@example.test" for n in (1, 2, 3)),
        "sent to ada@example.test",
    ]
    assert [json.loads(line) for line in outbox.read_text().splitlines()] == [
        {"to": "ada@example.test", "body": "found 3"}
    ]
    allowed = records(site, run_id, "tool", "allowed")
    assert [(r.details["tool"], r.details["why"]) for r in allowed] == [
        ("fake.search", "granted"), ("fake.send_message", "rule: proceed")
    ]
    assert records(site, run_id, "mcp") == []
    assert_no_live_process(site, run_id, {"mcp:fake"})


async def test_an_mcp_server_that_hangs_on_start_is_audited_and_the_run_goes_on(
    make_site: Callable[..., Site], server: ModelServer, tmp_path: Path
) -> None:
    """A server that never answers initialize: audited, its tool errors, the run goes on."""
    site = make_site(mail={"tools": ["bothy_checklist", "fake.search"],
                           "mcp_servers": {"fake": fake_mcp("hang", start_timeout_s=1)}})
    server.script(
        tool_call("fake__search", {"query": "invoices"}),
        tool_call("bothy_checklist", {"action": "read"}),
        text("carried on"),
    )

    done = await site.bothy("run", "search", "--profile", "mail",
                            FAKE_MCP_OUTBOX=str(tmp_path / "outbox.jsonl"))

    run_id = completed(done, "carried on")
    [failed] = records(site, run_id, "mcp", "failed")
    assert failed.outcome == "failed"
    assert failed.details == {"server": "fake",
                              "problem": "MCP server 'fake' did not answer 'initialize' within 1 s"}
    assert told(server) == ["unsupported call: fake__search", "(the checklist is empty)"]
    # The hanging server left a child in its group: the whole group is gone.
    assert_no_live_process(site, run_id, {"mcp:fake"})


async def test_an_mcp_server_that_crashes_mid_call_is_a_tool_error_and_leaves_nothing_behind(
    make_site: Callable[..., Site], server: ModelServer, tmp_path: Path
) -> None:
    """A server dying mid-call: the model reads why, later calls fail fast, the run completes."""
    outbox = tmp_path / "outbox.jsonl"
    site = make_site(mail={"tools": ["fake.search", "fake.send_message"],
                           "mcp_servers": {"fake": fake_mcp("crash")}})
    server.script(
        tool_call("fake__send_message", {"to": "ada@example.test", "body": "hi"}),
        tool_call("fake__search", {"query": "invoices"}),
        text("carried on"),
    )

    done = await site.bothy("run", "send", "--profile", "mail", FAKE_MCP_OUTBOX=str(outbox))

    run_id = completed(done, "carried on")
    unavailable = "is unavailable: server 'fake' stopped unexpectedly (exit code 3)"
    assert told(server) == [f"MCP tool 'fake.send_message' {unavailable}.",
                            f"MCP tool 'fake.search' {unavailable}."]
    assert not outbox.exists()
    [lost] = records(site, run_id, "mcp", "failed")
    assert lost.details == {"server": "fake",
                            "problem": "MCP server 'fake' stopped unexpectedly (exit code 3)"}
    assert_no_live_process(site, run_id, {"mcp:fake"})


async def test_an_mcp_server_that_writes_garbage_is_a_tool_error_and_the_run_goes_on(
    make_site: Callable[..., Site], server: ModelServer, tmp_path: Path
) -> None:
    """A server writing a non-JSON-RPC line is lost: the model reads why, the run completes."""
    site = make_site(mail={"tools": ["fake.search", "bothy_checklist"],
                           "mcp_servers": {"fake": fake_mcp("garbage")}})
    server.script(
        tool_call("fake__search", {"query": "invoices"}),
        tool_call("bothy_checklist", {"action": "add", "item": "look at the fake server"}),
        text("carried on"),
    )

    done = await site.bothy("run", "search", "--profile", "mail",
                            FAKE_MCP_OUTBOX=str(tmp_path / "outbox.jsonl"))

    run_id = completed(done, "carried on")
    said = told(server)
    assert said == ["MCP tool 'fake.search' is unavailable: server 'fake' wrote a line that is"
                    " not JSON-RPC: 'this is not json-rpc'.",
                    "added: look at the fake server"]
    [lost] = records(site, run_id, "mcp", "failed")
    assert "wrote a line that is not JSON-RPC" in lost.details["problem"]
    assert_no_live_process(site, run_id, {"mcp:fake"})


# --- bothy answer ---------------------------------------------------------------------


async def test_an_answer_to_a_run_that_asked_nothing_is_late(
    make_site: Callable[..., Site], server: ModelServer
) -> None:
    """`bothy answer` to a finished run with nothing pending exits 1 and is recorded as late."""
    site = make_site()
    server.script(text("hello"))
    run_id = completed(await site.bothy("run", "say hello"), "hello")

    late = await site.bothy("answer", run_id, "yes")

    assert (late.code, late.stdout) == (
        1, f"{run_id} has no pending question: the run had moved on (recorded as late)\n"
    )
    [recorded] = records(site, run_id, "answer", "late")
    assert (recorded.details["by"], recorded.details["answer"]) == (BY_SHELL, "yes")


async def test_an_answer_to_an_unknown_run_is_a_usage_error(
    make_site: Callable[..., Site],
) -> None:
    """`bothy answer run_nope yes` exits 64 and says there is no such run."""
    site = make_site()

    done = await site.bothy("answer", "run_nope", "yes")

    assert done.code == 64
    assert "no run 'run_nope' in this site's state" in done.stderr
    assert done.stdout == ""


# --- bothy profile, and bad profiles --------------------------------------------------


async def test_profile_list_and_show_print_the_resolved_grant(
    make_site: Callable[..., Site],
) -> None:
    """`bothy profile list` has a line per profile; `show` gives each tool's verdict."""
    site = make_site(
        selfcare={"tools": ["bothy_checklist"]},
        mail={
            "sandbox": "workspace-write",
            "tools": ["fake.search", "fake.send_message", "shell", "apply_patch",
                      "bothy_checklist"],
            "approvals": {"fake.send_message": "confirm", "shell": "deny",
                          "apply_patch": {"guide": "Describe the change instead."}},
            "ask": ["bothy_checklist"],
            "unless_approved_within": 900,
            "question_hold_seconds": 60,
            "mcp_servers": {"fake": {"command": "fake-mcp", "args": ["--stdio"],
                                     "env": ["FAKE_TOKEN"]}},
        },
    )

    listed = await site.bothy("profile", "list")
    shown = await site.bothy("profile", "show", "mail")

    assert (listed.code, listed.stdout) == (0, (
        "mail  sandbox workspace-write, 5 tools, 1 MCP servers\n"
        "selfcare  sandbox read-only, 1 tools, 0 MCP servers\n"
    ))
    assert (shown.code, shown.stdout) == (0, (
        "profile mail\n"
        "  sandbox: workspace-write\n"
        "  tools (everything else is refused):\n"
        "    fake.search: proceed (granted)\n"
        "    fake.send_message: confirm (asks a person, or passes on an approval younger than"
        " 900 s)\n"
        "    shell: deny\n"
        "    apply_patch: guide (refused, the model is told: Describe the change instead.)\n"
        "    bothy_checklist: ask without a rule (refused, and an alert is raised)\n"
        "  mcp server fake: fake-mcp --stdio (environment passed: FAKE_TOKEN)\n"
        "  questions held up to 60 s (foreground runs and chat threads; others never wait)\n"
        "  untrusted runs (webhooks, polls): write-capable tools withheld\n"
    ))


@pytest.mark.parametrize(
    "args",
    [("run", "hello", "--profile", "nope"), ("profile", "show", "nope")],
)
async def test_an_unknown_profile_is_a_usage_error_naming_the_configured_ones(
    make_site: Callable[..., Site], server: ModelServer, args: tuple[str, ...]
) -> None:
    """Naming a profile that is not configured exits 64 and lists the profiles there are."""
    site = make_site(selfcare={"tools": ["bothy_checklist"]}, mail={})

    done = await site.bothy(*args)

    assert done.code == 64
    assert "'nope'" in done.stderr and "(mail, selfcare)" in done.stderr
    assert done.stdout == ""
    assert server.requests == []


@pytest.mark.parametrize(
    ("profile", "key", "problem"),
    [
        ({"tools": ["shel"]}, "profiles.p",
         "tools: unknown tool 'shel' (built-in tools: apply_patch, bothy_checklist, bothy_note,"
         " shell;"
         " MCP tools are server.tool)"),
        ({"tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "maybe"}},
         "profiles.p.approvals.bothy_checklist",
         'expected "proceed", "deny", "confirm" or {"guide": "<reason for the model>"}'),
        ({"tools": ["bothy_checklist"], "approvals": {"shell": "proceed"}}, "profiles.p",
         "'shell' has a rule but is not granted: add it to tools, or remove the rule"),
        ({"tools": ["gmail.search"]}, "profiles.p",
         "tools: tool 'gmail.search' names MCP server 'gmail', which this profile does not"
         " define"),
    ],
    ids=["unknown-tool", "unknown-verdict", "rule-for-ungranted-tool", "undefined-mcp-server"],
)
async def test_a_bad_profile_is_a_config_error_naming_the_key(
    make_site: Callable[..., Site], server: ModelServer, profile: dict[str, Any], key: str,
    problem: str
) -> None:
    """A profile naming an unknown tool or verdict, or a rule it does not grant, exits 78."""
    site = make_site(p=profile)

    for args in (("profile", "list"), ("run", "hello", "--profile", "p")):
        done = await site.bothy(*args)

        assert done.code == 78, (args, done.stderr)
        assert f"  {key}: " in done.stderr and problem in done.stderr, done.stderr
        assert done.stdout == ""
    assert server.requests == []

