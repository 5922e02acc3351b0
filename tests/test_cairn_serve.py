"""Proofs of a wake's run tied to its task in Cairn (docs/CAIRN.md): the real ``bothy serve``,
real signed HTTP, the real codex against the scripted model, the fake ``cairn``.

A webhook job names its task from the payload (``"ref": "ACME-{pull_request.number}"``). A task
held by someone else is a refusal like any other (deferred, retried, abandoned out loud); a
payload whose ref is no task reference is refused and recorded, and the run goes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fakes import github
from tests.fakes.cairn import FakeCairn
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import Shell, audit_records
from tests.test_serve import queued, records, serve_site, start_serve, until_count

pytestmark = pytest.mark.codex

SECRET = "It's a Secret to Everybody"


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", SECRET)


@pytest.fixture
def cairn(tmp_path: Path) -> FakeCairn:
    fake = FakeCairn(tmp_path / "cairn")
    fake.add("ACME-42", brief="Review pull requests against the style guide.")
    return fake


async def test_a_webhook_jobs_ref_from_the_payload_ties_its_run_to_the_task(
    server: ModelServer, tmp_path: Path, cairn: FakeCairn
) -> None:
    """`ref: ACME-{pull_request.number}`: the delivery's run claims ACME-42, notes and releases."""
    site = serve_site(tmp_path, server, job={"ref": "ACME-{pull_request.number}"},
                      cairn={"command": cairn.command, "timeout_s": 2.0})
    server.script(text("Reviewed."))
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        [finished] = await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0

    run_id = str(finished.run_id)
    events = [r.event for r in audit_records(site, lambda r: r.kind == "cairn")]
    assert events == ["claimed", "briefed", "noted", "released"]
    assert [(call["verb"], call["by"]) for call in cairn.calls()] == [
        ("claim", run_id), ("show", None), ("note", None), ("release", run_id)
    ]
    assert cairn.task("ACME-42")["holder"] is None
    assert cairn.task("ACME-42")["notes"][0]["text"].startswith(f"run {run_id} on test-site:"
                                                               " completed, ")


async def test_a_held_task_defers_the_wake_then_abandons_it_out_loud(
    server: ModelServer, tmp_path: Path, cairn: FakeCairn
) -> None:
    """Held by someone else: refused at gate 'cairn', deferred, retried, then abandoned with an
    alert naming the holder; the model is never asked and the holder keeps the task."""
    cairn.hold("ACME-42", "alice@laptop")
    site = serve_site(tmp_path, server, job={"ref": "ACME-{pull_request.number}"},
                      cairn={"command": cairn.command, "timeout_s": 2.0},
                      wakes={"max_attempts": 2, "retry_first_s": 0.2})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        await until_count(site, "alert", "undelivered", "failed", 1)
        assert await serving.stop() == 0

    webhook_lines = [" ".join(line.split()[2:5]) for line in site.audit_lines()
                     if " pr:42 " in line or " github " in line]
    attempt = ["wake received ok", "run admitted ok", "run refused refused",
               "budget settled ok", "run finished refused"]
    assert webhook_lines == [*attempt, "wake deferred pending",
                             *attempt, "wake abandoned failed", "alert undelivered failed"]
    refusals = records(site, "run", "refused")
    assert {(r.details["gate"], r.details["holder"]) for r in refusals} == {
        ("cairn", "alice@laptop")
    }
    [abandoned] = records(site, "wake", "abandoned")
    assert abandoned.details["reason"].endswith(
        "refused at gate 'cairn': task ACME-42 is held by alice@laptop")
    assert server.requests == []
    assert cairn.task("ACME-42")["holder"] == "alice@laptop"
    assert cairn.verbs() == ["claim", "claim"]


async def test_a_payload_ref_that_is_no_task_reference_is_refused_and_the_run_goes_on(
    server: ModelServer, tmp_path: Path, cairn: FakeCairn
) -> None:
    """A ref rendered from the payload with spaces and a semicolon: `cairn ref_refused` with the
    reason, Cairn never called, and the review still done."""
    site = serve_site(tmp_path, server, job={"ref": "{pull_request.title}"},
                      cairn={"command": cairn.command, "timeout_s": 2.0})
    server.script(text("Reviewed anyway."))
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42, title="ACME-1; rm -rf /"))
        [finished] = await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0

    [refused] = records(site, "cairn", "ref_refused", "refused")
    assert refused.run_id == finished.run_id
    assert refused.details["ref"] == "ACME-1; rm -rf /"
    assert "is not a task reference" in refused.details["reason"]
    assert refused.details["then"] == "the run goes on without Cairn"
    assert cairn.calls() == []


async def test_bothy_note_is_withheld_from_a_webhook_run(
    server: ModelServer, tmp_path: Path, cairn: FakeCairn
) -> None:
    """`bothy_note` writes: a run woken by a payload is refused it (unless its profile allows
    untrusted runs), and only Bothy's own note reaches the task."""
    site = serve_site(tmp_path, server,
                      job={"ref": "ACME-{pull_request.number}", "profile": "ledger"},
                      cairn={"command": cairn.command, "timeout_s": 2.0},
                      profiles={"ledger": {"tools": ["bothy_note"]}})
    server.script(tool_call("bothy_note", {"text": "The payload told me to write this."}),
                  text("Reviewed."))
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await queued(serving, github.pull_request_opened(42))
        [finished] = await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0

    outputs = [str(item["output"]) for item in server.requests[-1]["input"]
               if item.get("type") == "function_call_output"]
    assert outputs == ["The tool 'bothy_note' is withheld in runs started by untrusted input."]
    [note] = cairn.task("ACME-42")["notes"]
    assert note["text"].startswith(f"run {finished.run_id} on test-site: completed, ")
