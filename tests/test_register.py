"""The register's lines in the product page's forms, from a real run and a real webhook wake.

The page (fig. 1)::

    0416 2026-09-24T10:14:02.118734+00:00 wake received ok pr:42 -
    0417 2026-09-24T10:14:02.391650+00:00 run admitted ok pr:42 run_20260924T101402Z_8d41e7b2
    0418 2026-09-24T10:14:03.027114+00:00 run started ok pr:42 run_20260924T101402Z_8d41e7b2
    0419 2026-09-24T10:15:07.302114+00:00 run question pending pr:42 run_20260924T101402Z_8d41e7b2
    0420 2026-09-24T10:15:41.772301+00:00 run finished ok pr:42 run_20260924T101402Z_8d41e7b2
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.fakes import github
from tests.fakes.model_server import ModelServer, text, tool_call
from tests.fakes.shell import Shell
from tests.fakes.site import Site
from tests.test_serve import SECRET, queued, serve_site, start_serve, until_count

pytestmark = pytest.mark.codex

LINE = re.compile(
    r"^(?P<seq>\d{4,}) (?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00)"
    r" (?P<form>\S+ \S+ \S+ \S+) (?P<run>-|run_\d{8}T\d{6}Z_[0-9a-f]{8})$"
)
SEED_FORMS = ["wake received ok pr:42", "run admitted ok pr:42", "run started ok pr:42",
              "run question pending pr:42", "run finished ok pr:42"]


def seed_lines(listing: str) -> list[tuple[str, str]]:
    """(form, run) of each line in the page's forms, in order; every line must parse."""
    found = []
    for line in listing.splitlines():
        match = LINE.match(line)
        assert match, f"not a register line: {line!r}"
        if match["form"] in SEED_FORMS:
            found.append((match["form"], match["run"]))
    return found


async def test_a_run_leaves_the_pages_lines(tmp_path: Path) -> None:
    """`bothy run` in lane pr:42 that asks a question: the page's five lines, in order, the
    wake with no run yet; `audit --run` finds the wake through the id its run names."""
    async with ModelServer() as server:
        site = Site(tmp_path, server.base_url, profiles={"reviewer": {
            "tools": ["bothy_checklist"], "approvals": {"bothy_checklist": "confirm"}}})
        server.script(tool_call("bothy_checklist", {"action": "list"}), text("Reviewed."))
        async with Shell(site) as shell:
            run = await shell.start("run", "Review pull request 42", "--subject", "pr:42",
                                    "--profile", "reviewer")
            run_id = await run.admitted()
            await run.line(r"^bothy: question: May I use bothy_checklist\?")
            assert (await shell.bothy("answer", str(run_id), "yes")).code == 0
            assert (await run.finish()).code == 0
            listing = await shell.bothy("audit")
            of_run = await shell.bothy("audit", "--run", str(run_id))
            as_json = await shell.bothy("audit", "--run", str(run_id), "--json")

    assert seed_lines(listing.stdout) == [
        ("wake received ok pr:42", "-"), ("run admitted ok pr:42", run_id),
        ("run started ok pr:42", run_id), ("run question pending pr:42", run_id),
        ("run finished ok pr:42", run_id)]
    assert of_run.stdout.splitlines()[0].endswith(" wake received ok pr:42 -")
    assert of_run.stdout.splitlines()[-1].endswith(f" run finished ok pr:42 {run_id}")
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    wake, admitted, finished = records[0], records[1], records[-1]
    assert (wake["kind"], wake["run_id"]) == ("wake", None)
    assert wake["details"]["wake_id"] == admitted["details"]["wake_id"]
    assert wake["details"]["wake_id"].startswith("wake_")
    assert finished["details"]["outcome"] == "completed"


async def test_a_webhook_wake_leaves_the_pages_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed delivery for PR 42 through `bothy serve`: the wake with no run, then its run
    admitted, started and finished ok, in the page's forms."""
    monkeypatch.setenv("GH_SECRET", SECRET)
    async with ModelServer() as server:
        site = serve_site(tmp_path, server)
        server.script(text("Looks fine."))
        async with Shell(site) as shell:
            serving = await start_serve(shell)
            await queued(serving, github.pull_request_opened(42))
            [finished] = await until_count(site, "run", "finished", "ok", 1)
            assert await serving.stop() == 0
            listing = await shell.bothy("audit")

    run_id = finished.run_id
    assert seed_lines(listing.stdout) == [
        ("wake received ok pr:42", "-"), ("run admitted ok pr:42", run_id),
        ("run started ok pr:42", run_id), ("run finished ok pr:42", run_id)]
