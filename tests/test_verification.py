"""A job checks its own work: verified on a later attempt, or unverified and raised."""

from __future__ import annotations

from pathlib import Path

import pytest

from bothy.config import load_config
from bothy.engine.audit import AuditLog
from bothy.engine.run import RunRequest, RunResult
from bothy.engine.verification import Verification
from bothy.home import BothyHome
from bothy.runtime import Runtime
from tests.fakes.codex import PROVIDER_ENV
from tests.fakes.model_server import ModelServer, text
from tests.fakes.site import Site

pytestmark = pytest.mark.codex


@pytest.fixture
def site(tmp_path: Path, server: ModelServer, monkeypatch: pytest.MonkeyPatch) -> Site:
    for name, value in PROVIDER_ENV.items():
        monkeypatch.setenv(name, value)
    return Site(tmp_path, server.base_url)


async def _run(site: Site, verify: Verification) -> RunResult:
    home = BothyHome(site.home)
    cfg = load_config(home.config_path)
    async with Runtime.open(home, cfg) as rt:
        request = RunRequest(prompt="Write DONE when finished", subject="job", source="test",
                             max_usd_micros=500_000, wall_clock_s=60, verify=verify)
        return await rt.supervisor().execute(request)


def _events(site: Site, run_id: str) -> list[tuple[str, str, str]]:
    log = AuditLog(site.audit_path)
    return [(r.kind, r.event, r.outcome) for r in log.records(run_id=run_id)]


async def test_a_run_verified_on_its_second_attempt(site: Site, server: ModelServer) -> None:
    """A failed check starts a new turn told what failed; the second answer verifies."""
    server.script(text("not yet"), text("DONE"))
    result = await _run(site, Verification(regex=r"^DONE$"))
    assert result.outcome == "verified"
    assert result.final_text == "DONE"
    told = str(server.requests[1]["input"])
    assert "Verification of your work failed (attempt 1 of 5)" in told
    assert "does not match /^DONE$/" in told
    events = _events(site, result.run_id)
    assert ("run", "verification-failed", "failed") in events
    assert ("run", "verified", "ok") in events
    assert ("run", "finished", "verified") in events


async def test_a_run_still_failing_after_five_attempts_is_unverified_and_raised(
    site: Site, server: ModelServer
) -> None:
    """Five failed checks end the run `unverified`, with an alert record."""
    server.script(*[text("never") for _ in range(5)])
    result = await _run(site, Verification(regex="DONE"))
    assert result.outcome == "unverified"
    assert result.reason is not None and "after 5 attempts" in result.reason
    assert len(server.requests) == 5
    events = _events(site, result.run_id)
    assert events.count(("run", "verification-failed", "failed")) == 5
    assert ("alert", "undelivered", "failed") in events
    assert ("run", "finished", "unverified") in events


async def test_a_verification_command_runs_in_the_workspace(
    site: Site, server: ModelServer
) -> None:
    """An argv check runs in the workspace; its failure output reaches the model."""
    server.script(text("done"), text("done again"))
    (site.workspace / "flag").write_text("")
    check = Verification(argv=["sh", "-c", "test -f flag && test -f second || "
                                           "{ echo 'second is missing'; exit 3; }"],
                         max_attempts=2)
    result = await _run(site, check)
    assert result.outcome == "unverified"
    told = str(server.requests[1]["input"])
    assert "exited with code 3" in told and "second is missing" in told

    server.script(text("done"))
    (site.workspace / "second").write_text("")
    assert (await _run(site, check)).outcome == "verified"
