"""Limits the oto-runner lessons ask for (SPEC §4): long texts cut with a marker, a turn cap.

Every test runs the real ``bothy run`` against the pinned codex and the scripted model, and
asserts what the operator sees (the printed line, the exit code, the register) and what the
model was told.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.engine.rpc import RECORD_ENV
from bothy.engine.supervisor import FINAL_TEXT_MAX_CHARS
from bothy.engine.toolbox import TOOL_RESULT_MAX_CHARS
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import audit_records
from tests.fakes.site import Site

MCP_SERVER = Path(__file__).parent / "fakes" / "mcp_server.py"

pytestmark = pytest.mark.codex


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


def _final_text(site: Site, run_id: str) -> str:
    db = sqlite3.connect(f"file:{site.home / 'state' / 'bothy.sqlite3'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT final_text FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    finally:
        db.close()
    return str(row[0])


async def test_a_final_text_above_the_cap_is_cut_with_a_marker(
    server: ModelServer, tmp_path: Path
) -> None:
    """An answer 5,000 characters over the cap is kept and shown cut, saying how much was cut."""
    answer = "".join(f"{n:09d}\n" for n in range((FINAL_TEXT_MAX_CHARS + 5_000) // 10))
    server.script(text(answer, chunks=8))
    site = Site(tmp_path, server.base_url)

    done = await site.bothy("run", "say a lot", "--subject", "long")

    assert done.code == 0, done.stderr
    outcome, run_id, _cost, _usd, shown = done.stdout.split(" ", 4)
    kept = answer[:FINAL_TEXT_MAX_CHARS] + "\n[truncated by bothy: 5000 more characters]"
    assert (outcome, shown) == ("completed", kept + "\n")
    assert _final_text(site, run_id) == kept


# --- the turn cap ----------------------------------------------------------------------


def _told(server: ModelServer) -> list[str]:
    """What codex told the model of its tool calls (the last request's input)."""
    return [str(item["output"]) for item in server.requests[-1]["input"]
            if item.get("type") == "function_call_output"]


def _run_events(site: Site, run_id: str) -> list[tuple[str, str, str, str | None]]:
    return [(r.kind, r.event, r.outcome, r.details.get("code"))
            for r in audit_records(site, lambda r: r.run_id == run_id and r.kind in
                                   ("tool", "run"))]


async def test_a_dynamic_tool_call_past_the_cap_is_declined_and_ends_the_run(
    server: ModelServer, tmp_path: Path
) -> None:
    """limits.max_turns 1: the second bothy_checklist call is declined; turn_limit, exit 4."""
    server.script(tool_call("bothy_checklist", {"action": "read"}),
                  tool_call("bothy_checklist", {"action": "add", "item": "one too many"}),
                  text("never reached"))
    site = Site(tmp_path, server.base_url, limits={"max_turns": 1},
                profiles={"care": {"tools": ["bothy_checklist"]}})

    done = await site.bothy("run", "tend", "--subject", "cap", "--profile", "care")

    assert done.code == 4, done.stderr
    outcome, run_id, _cost, _usd, reason = done.stdout.split(" ", 4)
    assert (outcome, reason) == ("turn_limit", "tool call 2 (dynamicToolCall) declined: the run"
                                 " may make 1 (limits.max_turns)\n")
    assert _run_events(site, run_id) == [
        ("run", "admitted", "ok", None), ("run", "started", "ok", None),
        ("tool", "allowed", "ok", None), ("tool", "refused", "refused", "turn_limit"),
        ("run", "finished", "turn_limit", None)]


@pytest.mark.parametrize(("second", "how"), [
    ({"cmd": "echo two"}, "interrupted"),
    ({"cmd": "echo two", "sandbox_permissions": "require_escalated",
      "justification": "needs the network"}, "declined"),
])
async def test_a_command_past_the_cap_is_interrupted_or_its_approval_declined(
    server: ModelServer, tmp_path: Path, second: dict[str, str], how: str
) -> None:
    """A sandboxed command past the cap runs inside Codex: the turn is interrupted. One asking
    to leave the sandbox asks Bothy: its approval is declined. Either way, turn_limit."""
    server.script(tool_call("exec_command", {"cmd": "echo one"}),
                  tool_call("exec_command", second), text("never reached"))
    site = Site(tmp_path, server.base_url, limits={"max_turns": 1})

    done = await site.bothy("run", "work", "--subject", "cap")

    assert done.code == 4, done.stderr
    outcome, run_id, _cost, _usd, reason = done.stdout.split(" ", 4)
    assert (outcome, reason) == ("turn_limit", f"tool call 2 (commandExecution) {how}: the run"
                                 " may make 1 (limits.max_turns)\n")
    events = _run_events(site, run_id)
    refused = [event for event in events if event[0] == "tool" and event[1] != "ran"]
    assert refused == ([("tool", "refused", "refused", "turn_limit")] if how == "declined"
                       else [])
    assert ("tool", "ran", "ok", None) in events  # the first command, which Codex ran itself
    assert _run_events(site, run_id)[-1] == ("run", "finished", "turn_limit", None)


# --- tool results ----------------------------------------------------------------------


def _answers_sent(method: str) -> list[str]:
    """The text of each answer Bothy sent codex to a ``method`` request, from the recording
    the test harness keeps of every frame (``RECORD_CODEX_RPC``)."""
    frames = [json.loads(line) for line in
              Path(os.environ[RECORD_ENV]).read_text().splitlines()]
    return [frame["message"]["result"]["contentItems"][0]["text"] for frame in frames
            if frame["method"] == method and frame["direction"] == "sent"]


async def test_a_tool_result_above_the_cap_is_cut_with_a_marker(
    server: ModelServer, tmp_path: Path
) -> None:
    """An MCP result 50,000 characters over the cap is passed to Codex cut, with a marker
    saying how much; Codex's own cut (head and tail, for the model) keeps the marker in view."""
    chars = TOOL_RESULT_MAX_CHARS + 50_000
    server.script(tool_call("fake__dump", {"chars": chars}), text("read it"))
    site = Site(tmp_path, server.base_url, profiles={"reader": {
        "tools": ["fake.dump"],
        "mcp_servers": {"fake": {"command": sys.executable, "args": [str(MCP_SERVER)]}}}})

    done = await site.bothy("run", "read", "--subject", "big", "--profile", "reader")

    assert done.code == 0, done.stderr
    marker = "\n[truncated by bothy: 50000 more characters]"
    full = ("0123456789" * (chars // 10 + 1))[:chars]
    (answered,) = _answers_sent("item/tool/call")
    assert answered == full[:TOOL_RESULT_MAX_CHARS] + marker
    (told,) = _told(server)
    assert told.endswith(marker)
