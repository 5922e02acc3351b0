"""A run meeting a spare app-server that is still starting (issue 18): in process, with the
real pinned codex behind a start the test holds until it says go, so that the run is surely
waiting when the next step comes.

What is checked is what an operator sees: whether a run got the spare or started cold and
why (`Spare.take`'s answer, `run started`), the spare's own records, and process groups
proven empty by psutil.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bothy.config import load_config
from bothy.engine.procgroup import live_members
from bothy.engine.run import Outcome, RunRequest
from bothy.engine.spare import Cold, Spare
from bothy.engine.supervisor import STOPPED_BEFORE_START, Supervisor
from bothy.engine.worker import Worker
from bothy.home import BothyHome
from bothy.runtime import Runtime
from tests.fakes.codex import PROVIDER_ENV, codex_binary
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import audit_records, state_rows, until
from tests.fakes.site import Site

pytestmark = pytest.mark.codex

# The spare's first start waits (up to 30 s) for the go file, then is codex, or exits 3 if
# the file says "fail" (a codex that cannot start); every later start is codex at once (the
# flag file is gone).
_FIRST_START_WAITS = ('[ -e "$FLAG" ] && rm -f "$FLAG" && i=0 && while [ ! -e "$GO" ]'
                      ' && [ $i -lt 3000 ]; do sleep 0.01; i=$((i + 1)); done;'
                      ' [ "$(cat "$GO")" = fail ] && exit 3; exec "$0" "$@"')


@dataclass
class _Held:
    """A site whose spare is spawned and held in its start until ``go`` exists."""

    site: Site
    supervisor: Supervisor
    spare: Spare
    go: Path
    pgid: int


@pytest.fixture(autouse=True)
def _provider(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PROVIDER_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
async def held(tmp_path: Path, server: ModelServer) -> AsyncIterator[_Held]:
    flag, go = tmp_path / "first-start-waits", tmp_path / "go"
    flag.touch()
    site = Site(tmp_path, server.base_url, codex={"command": [
        "/bin/sh", "-c", _FIRST_START_WAITS.replace("$FLAG", str(flag)).replace("$GO", str(go)),
        str(codex_binary()), "app-server"]})
    home = BothyHome(site.home)
    async with Runtime.open(home, load_config(home.config_path)) as rt:
        supervisor = rt.supervisor()
        spare = supervisor.keep_spare()
        spare.start()
        await until(lambda: not flag.exists() and len(_spare_rows(site)) == 1,
                    "the spare spawned, its start held")
        [pgid] = _spare_rows(site)
        try:
            yield _Held(site, supervisor, spare, go, pgid)
        finally:
            go.touch()
            await spare.close()


def _spare_rows(site: Site) -> list[int]:
    return [row[0] for row in state_rows(site, "SELECT pgid FROM spares ORDER BY pgid")]


async def _taking(held: _Held) -> asyncio.Task[Worker | Cold]:
    """A take of the held spare, returned once it waits: ``take`` runs without a pause from
    its call to its wait on the spare's start, so once the task's first step has set
    ``called``, the take waits."""
    called = asyncio.Event()

    async def take() -> Worker | Cold:
        called.set()
        return await held.spare.take(held.spare.launch, held.spare.cwd)

    task = asyncio.ensure_future(take())
    await called.wait()
    assert not task.done(), task
    return task


async def test_two_runs_waiting_on_a_starting_spare_get_it_once(held: _Held) -> None:
    """Two takes wait on the same starting spare: once it is up, one gets it, the other
    starts cold saying another run took it."""
    first, second = await _taking(held), await _taking(held)
    held.go.touch()
    outcomes = [await first, await second]

    workers = [o for o in outcomes if isinstance(o, Worker)]
    colds = [o for o in outcomes if isinstance(o, Cold)]
    assert len(workers) == 1, outcomes
    assert colds == [Cold("another run took the spare it waited for")]
    assert workers[0].is_alive()
    await workers[0].stop(grace_s=2.0)
    assert live_members(held.pgid) == []


async def test_a_run_whose_spare_fails_to_start_while_it_waits_starts_cold_saying_so(
    held: _Held
) -> None:
    """The spare a run waits on cannot start (codex exits): the run starts cold at once,
    saying so, and the failed spare is recorded and its group empty."""
    taking = await _taking(held)
    held.go.write_text("fail")

    assert await asyncio.wait_for(taking, 10) == Cold("the spare it waited for could not start")
    [ended] = audit_records(held.site, lambda r: (r.kind, r.event) == ("spare", "ended"))
    assert (ended.outcome, ended.details["pgid"]) == ("failed", held.pgid)
    assert str(ended.details["why"]).startswith("it could not start")
    assert live_members(held.pgid) == []


async def test_a_stop_ends_the_wait_and_the_starting_spare(held: _Held) -> None:
    """A stop while a run waits on a starting spare: the take ends at once saying bothy is
    stopping, and the spare's start is ended where it is (recorded, its group empty)."""
    taking = await _taking(held)
    await held.spare.close()

    assert await asyncio.wait_for(taking, 10) == Cold("bothy is stopping")
    [ended] = audit_records(held.site, lambda r: (r.kind, r.event) == ("spare", "ended"))
    assert (ended.details["pgid"], ended.details["why"]) == (held.pgid,
                                                            "bothy stopped while it started")
    assert live_members(held.pgid) == []


async def test_a_run_cancelled_while_it_waits_leaves_the_spare_for_the_next(
    held: _Held
) -> None:
    """A run cancelled while it waits does not take the spare's start down with it: the spare
    comes up, and the next run gets it."""
    taking = await _taking(held)
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    held.go.touch()
    await until(lambda: len(audit_records(held.site, lambda r: (r.kind, r.event)
                                          == ("spare", "started"))) == 1, "the spare up")

    taken = await held.spare.take(held.spare.launch, held.spare.cwd)
    assert isinstance(taken, Worker)
    assert taken.record.pgid == held.pgid
    await taken.stop(grace_s=2.0)


async def test_a_run_waiting_on_the_spare_when_the_stop_comes_starts_no_worker(
    held: _Held, server: ModelServer
) -> None:
    """A run admitted while the spare starts, then the stop (serve's order: no new workers,
    then the spare closed): the run withdraws with no worker of its own, as one waiting for
    a slot would, and the model is never asked."""
    server.script(text("never asked"))
    admitted = asyncio.Event()
    run = asyncio.ensure_future(held.supervisor.execute(
        RunRequest(prompt="Say hi", subject="lane", source="test", max_usd_micros=500_000,
                   wall_clock_s=60), admitted=admitted))
    await asyncio.wait_for(admitted.wait(), 10)
    # From its slot to its wait on the spare the run does no I/O: once the claim's row is
    # seen here, the run has gone on to the spare.
    await until(lambda: _running(held.site), "the run holding its slot")
    held.supervisor.close_to_new_workers()
    await held.spare.close()
    result = await asyncio.wait_for(run, 20)

    assert (result.outcome, result.reason) == (Outcome.CANCELLED, STOPPED_BEFORE_START)
    assert audit_records(held.site, lambda r: r.run_id == result.run_id
                         and (r.kind, r.event) == ("run", "started")) == []
    assert server.requests == []
    assert live_members(held.pgid) == []


def _running(site: Site) -> bool:
    return state_rows(site, "SELECT count(*) FROM runs WHERE status = 'running'") == [(1,)]
