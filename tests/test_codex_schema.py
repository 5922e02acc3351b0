"""Bothy pinned to Codex's generated schema: the check itself, and every field Bothy reads.

The traffic of every ``codex``-marked test is validated by ``conftest.py``; these tests prove
that check fails on a wrong frame, naming the method and the field, and that each field
listed in ``bothy/engine/contract.py`` exists in the pinned binary's schema.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from bothy.engine.contract import READS
from tests.codex_schema import CodexSchema
from tests.fakes.codex import REPO_ROOT

pytestmark = pytest.mark.codex  # every test here runs or names the pinned codex binary


def _write(path: Path, *records: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _frame(direction: str, kind: str, method: str, message: dict[str, object]) -> dict[str, object]:
    return {"connection": "1.1", "direction": direction, "kind": kind, "method": method,
            "message": message}


def test_a_well_formed_exchange_passes(codex_schema: CodexSchema, tmp_path: Path) -> None:
    """Frames shaped as codex 0.171.0 sends and takes them raise no problem."""
    record = _write(
        tmp_path / "traffic.jsonl",
        _frame("sent", "request", "turn/interrupt",
               {"id": 3, "method": "turn/interrupt", "params": {"threadId": "t", "turnId": "u"}}),
        _frame("sent", "notification", "initialized", {"method": "initialized"}),
        _frame("received", "notification", "item/agentMessage/delta",
               {"method": "item/agentMessage/delta",
                "params": {"threadId": "t", "turnId": "u", "itemId": "i", "delta": "BO"}}),
        _frame("received", "request", "item/fileChange/requestApproval",
               {"id": 0, "method": "item/fileChange/requestApproval",
                "params": {"threadId": "t", "turnId": "u", "itemId": "i", "startedAtMs": 1}}),
        _frame("sent", "response", "item/fileChange/requestApproval",
               {"id": 0, "result": {"decision": "accept"}}),
        _frame("received", "response", "turn/interrupt", {"id": 3, "result": {}}),
    )
    assert codex_schema.traffic_problems(record) == []


def test_a_wrong_frame_fails_naming_method_and_field(
    codex_schema: CodexSchema, tmp_path: Path
) -> None:
    """A deliberately wrong message fails the check, which names its method and field."""
    record = _write(
        tmp_path / "traffic.jsonl",
        _frame("sent", "request", "thread/start",
               {"id": 2, "method": "thread/start",
                "params": {"cwd": "/w", "sandbox": "read-only-please"}}),
        _frame("sent", "response", "item/commandExecution/requestApproval",
               {"id": 0, "result": {"decision": "maybe"}}),
        _frame("received", "notification", "turn/completed",
               {"method": "turn/completed", "params": {"threadId": "t"}}),
        _frame("sent", "request", "thread/begin",
               {"id": 4, "method": "thread/begin", "params": {}}),
    )
    problems = codex_schema.traffic_problems(record)
    assert len(problems) == 4, problems
    assert problems[0].startswith(
        "sent request 'thread/start' (from Bothy): field 'params.sandbox': 'read-only-please'")
    assert problems[1].startswith(
        "sent response 'item/commandExecution/requestApproval' (Bothy's answer): field"
        " 'result.decision': 'maybe'")
    assert problems[2] == ("received notification 'turn/completed' (from Codex): field 'params':"
                           " 'turn' is a required property")
    assert problems[3] == "sent request 'thread/begin': the method is not in codex's schema"


def test_a_renamed_field_bothy_reads_is_caught(codex_schema: CodexSchema) -> None:
    """A field path absent from the schema fails naming the method and the field."""
    assert codex_schema.field_problem("notification", "turn/completed", "turn.status") is None
    assert codex_schema.field_problem("notification", "turn/completed", "turn.state") == (
        "notification 'turn/completed': field 'turn.state' is not in codex's schema"
        " (renamed or dropped?)")
    assert codex_schema.field_problem(
        "notification", "item/completed", "item{type=agentMessage}.body") == (
        "notification 'item/completed': field 'item.body' is not in codex's schema"
        " (renamed or dropped?)")
    assert codex_schema.field_problem(
        "notification", "item/completed", "item{type=agentMesage}.text") == (
        "notification 'item/completed': field 'item' has no variant of type 'agentMesage'"
        " in codex's schema")


@pytest.mark.parametrize(("kind", "method", "path"), [
    (kind, method, path) for (kind, method), paths in READS.items() for path in paths
] + [(kind, method, None) for (kind, method), paths in READS.items() if not paths])
def test_every_field_bothy_reads_is_in_codex_schema(
    codex_schema: CodexSchema, kind: str, method: str, path: str | None
) -> None:
    """Each field Bothy's parsing reads exists, for its method, in the pinned schema."""
    if path is None:
        assert codex_schema.entry(kind, method) is not None, f"{kind} '{method}' not in schema"
        return
    assert codex_schema.field_problem(kind, method, path) is None


def test_every_method_bothy_names_is_listed_in_the_contract(codex_schema: CodexSchema) -> None:
    """Each protocol method named in Bothy's engine has its reads declared in contract.py."""
    methods = {*codex_schema.client_requests, *codex_schema.server_notifications,
               *codex_schema.server_requests}
    declared = {method for _, method in READS}
    # Method names without a slash are too common as words to find in the source this way.
    named = {node.value
             for source in (REPO_ROOT / "bothy" / "engine").glob("*.py")
             for node in ast.walk(ast.parse(source.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and "/" in node.value and node.value in methods}
    assert named - declared == set()
