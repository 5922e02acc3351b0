"""An aged site (issue 18): at start `bothy serve` reads only a recent stretch of its register
for what ran and what was ignored, so its start and its memory do not grow with the years
the register holds; yet what recovery must decide is still found, however long ago its
delivery arrived.

The aged records are written before serve starts by the real register writer and the real
inbox on a clock set back :data:`AGO` (nothing runs serve on another clock); then the real
`bothy serve` starts on them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bothy.engine.audit import AuditLog
from bothy.engine.auditindex import wake_id_for
from bothy.engine.run import new_run_id
from bothy.engine.state import StateDB
from bothy.home import BothyHome
from bothy.wakes.delivery import Delivery, delivery_details
from bothy.wakes.inbox import Duplicate, Inbox
from tests.fakes import github
from tests.fakes.model_server import ModelServer
from tests.fakes.shell import Shell, until
from tests.test_serve import SECRET, records, serve_site, start_serve

AGO = timedelta(days=40)  # far past `wakes.keep_deliveries_days` (7) and its day of slack


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model_server:
        yield model_server


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", SECRET)


def _delivery(key: str, number: int, received_at: datetime) -> Delivery:
    return Delivery(route="github", key=key, event="pull_request", action="opened",
                    headers={"x-github-event": "pull_request"},
                    body=json.dumps(github.pull_request_opened(number)).encode(),
                    received_at=received_at)


@pytest.mark.codex
async def test_a_payload_from_long_ago_left_without_its_row_is_known_to_have_run(
    server: ModelServer, tmp_path: Path
) -> None:
    """A delivery that arrived and ran 40 days ago, whose row a state database restored from
    an older copy lacks: serve's start reads the register back to that delivery's arrival,
    finds its run, and closes it (`wake reinserted`, `closed: … ran it already`); it does
    not run again. (Read from the last week alone, the register would say nothing of it.)"""
    site = serve_site(tmp_path, server)
    home = BothyHome(site.home)
    home.ensure()
    then = datetime.now(UTC) - AGO
    old = _delivery("old-guid:hook", 7, then)
    async with StateDB.open(home.db_path) as db:
        inbox = Inbox(home.inbox_dir, db, clock=lambda: then, audit=AuditLog(home.audit_path))
        await inbox.accept(old)
        await db.execute("DELETE FROM wakes")  # the copy restored was made before it arrived
    register = AuditLog(home.audit_path, clock=lambda: then)
    run_id = new_run_id(lambda: then)
    wake = {"wake_id": wake_id_for(run_id)}
    await register.record("wake", "received", "ok", subject="pr:7",
                          details={**wake, "source": "webhook", **delivery_details(old)})
    await register.record("run", "admitted", "ok", subject="pr:7", run_id=run_id, details=wake)
    await register.record("run", "started", "ok", subject="pr:7", run_id=run_id, details=wake)

    async with Shell(site) as shell:
        serving = await start_serve(shell)
        ready = records(site, "serve", "ready")[-1]
        assert await serving.stop() == 0

    [reinserted] = records(site, "wake", "reinserted")
    assert reinserted.details["delivery"] == "old-guid:hook"
    assert reinserted.details["then"] == f"closed: the register shows {run_id} ran it already"
    assert (ready.details["wakes_reinserted"], ready.details["wakes_already_run"]) == (0, 1)
    assert [r.run_id for r in records(site, "run", "started")] == [run_id]
    assert server.requests == []


@pytest.mark.codex
async def test_a_redelivery_left_without_a_row_is_known_to_have_run_long_ago(
    server: ModelServer, tmp_path: Path
) -> None:
    """A delivery ran 12 days ago; GitHub's "Redeliver" sent it again 9 days ago: a duplicate,
    answered and not queued, whose payload line (the last of its segment) got no row. The
    first start's prune forgets the first delivery's row and segment (older than the week
    kept); at the next start the line has no row, and its own arrival is inside the recent
    stretch while the run's records are not: they are looked for further back, and the line
    is closed as already run, not run again."""
    site = serve_site(tmp_path, server)
    home = BothyHome(site.home)
    home.ensure()
    now = datetime.now(UTC)
    first, again = now - timedelta(days=12), now - timedelta(days=9)
    clock = [first]
    register = AuditLog(home.audit_path, clock=lambda: clock[0])
    run_id = new_run_id(lambda: first)
    wake = {"wake_id": wake_id_for(run_id)}
    async with StateDB.open(home.db_path) as db:
        inbox = Inbox(home.inbox_dir, db, clock=lambda: clock[0], audit=register)
        accepted = await inbox.accept(_delivery("guid-9:hook", 9, first))
        assert await inbox.claim(accepted.wake_id, run_id)
        await register.record("wake", "received", "ok", subject="pr:9", details={
            **wake, "source": "webhook", **delivery_details(_delivery("guid-9:hook", 9, first))})
        await register.record("run", "admitted", "ok", subject="pr:9", run_id=run_id,
                              details=wake)
        await register.record("run", "started", "ok", subject="pr:9", run_id=run_id)
        await inbox.finish(accepted.wake_id, "done", run_id=run_id, note="completed")
        clock[0] = again
        assert isinstance(await inbox.accept(_delivery("guid-9:hook", 9, again)), Duplicate)

    async with Shell(site) as shell:
        serving = await start_serve(shell)  # its start-up prune forgets the first delivery
        await until(lambda: records(site, "wake", "pruned"), "the start-up prune")
        assert await serving.stop() == 0
        serving = await start_serve(shell)
        ready = records(site, "serve", "ready")[-1]
        assert await serving.stop() == 0

    [reinserted] = records(site, "wake", "reinserted")
    assert reinserted.details["then"] == f"closed: the register shows {run_id} ran it already"
    assert ready.details["wakes_already_run"] == 1
    assert [r.run_id for r in records(site, "run", "started")] == [run_id]
    assert server.requests == []
