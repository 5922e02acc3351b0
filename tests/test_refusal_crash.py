"""A wake refused at a gate, and a SIGKILL of a real ``bothy serve`` between the register's
commit of that refusal and the wake row's change: the restart does what the register says.

The refusal's one commit holds `wake received`, `run refused` and `wake deferred` (or `wake
abandoned`); the row is queued again (or closed) only after it is durable. The test holds that
commit's fsync (tests/fakes/slowdisk: a disk slow to make the wake's record durable), sees the
row still ``running`` with the register already holding the records, kills serve there, and
restarts it: a deferred wake is tried again when its record said, not at once and not recorded
deferred twice; an abandoned one stays abandoned and its alert is raised, once.

The real daemon as a subprocess, real signed HTTP, the real codex against the scripted model
(for the run that spends the day's budget).
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
from pathlib import Path

import pytest

from bothy.engine.audit import AuditRecord
from tests.fakes import github
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import DEADLINE_S, Shell, audit_records, until
from tests.fakes.site import Site
from tests.test_serve import SECRET, queued, records, serve_site, start_serve, until_count

pytestmark = pytest.mark.codex

SLOW_DISK = Path(__file__).parent / "fakes" / "slowdisk"
RETRY_FIRST_S = 4.0  # long beside a restart: a wake run at once is seen early


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's secret is in the environment `bothy serve` starts with."""
    monkeypatch.setenv("GH_SECRET", SECRET)


def _site(root: Path, server: ModelServer, *, max_attempts: int, held: str) -> Site:
    """A site whose day's budget is spent by one run, with `wake <held>` slow to be durable."""
    site = serve_site(root, server, budget={"per_run_usd": "0.50", "per_day_usd": "0.50"},
                      wakes={"max_attempts": max_attempts, "retry_first_s": RETRY_FIRST_S})
    site.extra_env.update({"PYTHONPATH": str(SLOW_DISK),
                           "FAKE_SLOW_FSYNC_MARK": f'"kind":"wake","event":"{held}"',
                           "FAKE_SLOW_FSYNC_WHILE": str(root / "hold")})
    return site


def _wakes(site: Site) -> list[tuple[str, str | None, int]]:
    """Each wake's status, run id and attempts, read as an operator's sqlite3 would."""
    with contextlib.closing(sqlite3.connect(site.home / "state" / "bothy.sqlite3",
                                            timeout=DEADLINE_S)) as db:
        return list(db.execute("SELECT status, run_id, attempts FROM wakes ORDER BY id"))


def _webhook_lines(site: Site) -> list[str]:
    return [" ".join(line.split()[2:5]) for line in site.audit_lines()
            if " pr:42 " in line or " github " in line]


def _ready(site: Site) -> list[AuditRecord]:
    return audit_records(site, lambda r: (r.kind, r.event) == ("serve", "ready"))


async def _refused_then_killed(site: Site, shell: Shell, held: str) -> str:
    """Spend the day, deliver a pull request, and SIGKILL serve while its refusal's commit is
    written but not yet durable (so the wake's row was not yet told); the refused run's id."""
    spent = await shell.bothy("run", "spend", "--max-usd", "0.05")
    assert spent.code == 0, spent
    serving = await start_serve(shell)
    hold = site.root / "hold"
    hold.touch()  # from here on, the wake's `wake <held>` is slow to become durable
    await queued(serving, github.pull_request_opened(42))
    await until((site.root / "hold.holding").exists, f"`wake {held}`'s fsync held")
    serving.command.signal(signal.SIGKILL)
    await serving.command.finish(timeout_s=DEADLINE_S)
    hold.unlink()
    [refused] = records(site, "run", "refused")
    assert len(records(site, "wake", held)) == 1  # written: only its fsync was held
    assert _wakes(site) == [("running", refused.run_id, 0)]  # the window
    return str(refused.run_id)


async def test_a_wake_deferred_before_a_sigkill_is_tried_again_when_its_record_said(
    tmp_path: Path, server: ModelServer
) -> None:
    """Killed once the refusal's commit holds `wake deferred` but before the row is queued
    again: the restart does not run it at once, nor record it deferred again; it is tried
    `retry_in_s` after its record, refused again, and abandoned out loud."""
    site = _site(tmp_path, server, max_attempts=2, held="deferred")
    server.script(text("Spent the day's money."))
    async with Shell(site) as shell:
        await _refused_then_killed(site, shell, "deferred")
        restarted = await start_serve(shell)
        await until_count(site, "alert", "undelivered", "failed", 1)
        assert await restarted.stop() == 0

    assert _webhook_lines(site) == [
        "wake received ok", "run refused refused", "wake deferred pending",
        "wake received ok", "run refused refused", "wake abandoned failed",
        "alert undelivered failed",
    ]
    [deferred] = records(site, "wake", "deferred")
    retried = records(site, "wake", "received")[-1]
    assert (deferred.details["retry_in_s"], retried.details["attempt"]) == (RETRY_FIRST_S, 2)
    assert (retried.ts - deferred.ts).total_seconds() >= RETRY_FIRST_S
    assert _ready(site)[-1].details["wakes_requeued"] == 0
    assert len(server.requests) == 1  # only the run that spent the money reached the model
    assert _wakes(site)[0][0] == "abandoned"


async def test_a_wake_abandoned_before_a_sigkill_stays_abandoned_and_is_alerted_once(
    tmp_path: Path, server: ModelServer
) -> None:
    """Killed once the refusal's commit holds `wake abandoned` (its last attempt) but before
    the row is closed: the restart closes it abandoned and raises the alert, once; it is
    never run past `wakes.max_attempts`."""
    site = _site(tmp_path, server, max_attempts=1, held="abandoned")
    server.script(text("Spent the day's money."))
    async with Shell(site) as shell:
        run_id = await _refused_then_killed(site, shell, "abandoned")
        restarted = await start_serve(shell)
        await until_count(site, "alert", "undelivered", "failed", 1)
        assert await restarted.stop() == 0

    assert _webhook_lines(site) == [
        "wake received ok", "run refused refused", "wake abandoned failed",
        "alert undelivered failed",
    ]
    [abandoned] = records(site, "wake", "abandoned")
    assert abandoned.details["reason"].startswith("abandoned after 1 attempts: ")
    assert _wakes(site) == [("abandoned", run_id, 0)]
    assert _ready(site)[-1].details["wakes_requeued"] == 0
    assert len(server.requests) == 1
