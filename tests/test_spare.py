"""The spare app-server of a real ``bothy serve`` (issue 18): started ahead, handed to one run,
replaced, never shared, never handed over dead or stale, ended at stop, and ended by the next
start after a SIGKILL.

The real daemon as a subprocess, the real pinned codex against the scripted model, real
signed deliveries and a real Slack mention; what is checked is what an operator sees: the
register (`spare started`, `run started` naming the group it got, `spare ended`, `spare
recovered`), the state database's `spares` rows, and process groups proven empty by psutil.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bothy.engine.audit import AuditRecord
from bothy.engine.procgroup import live_members
from bothy.engine.spare import STARTING_WAIT_S
from tests.fakes import github
from tests.fakes.codex import codex_binary
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import Shell, audit_records, started_group, state_rows, until
from tests.fakes.site import Site
from tests.fakes.slack import FakeSlack, slack_environment
from tests.test_serve import Serving, free_port, queued, serve_site, start_serve, until_count

pytestmark = pytest.mark.codex

# A worker command that leaves a member behind in its group when codex itself exits (as codex
# does on the end of its input, once its bothy is gone): only ending the group ends it.
_WITH_A_CHILD = 'sleep 600 </dev/null >/dev/null 2>&1 & exec "$0" "$@"'


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", "It's a Secret to Everybody")


def _spare_records(site: Site, event: str) -> list[AuditRecord]:
    return audit_records(site, lambda r: (r.kind, r.event) == ("spare", event))


async def _spares_started(site: Site, count: int) -> list[AuditRecord]:
    await until(lambda: len(_spare_records(site, "started")) >= count,
                f"{count} `spare started` record(s)")
    return _spare_records(site, "started")


def _spare_rows(site: Site) -> list[int]:
    """The pgids the state database holds as spares no run has taken."""
    return [row[0] for row in state_rows(site, "SELECT pgid FROM spares ORDER BY pgid")]


def _started(site: Site, finished: AuditRecord) -> AuditRecord:
    [started] = audit_records(site, lambda r: r.run_id == finished.run_id
                              and (r.kind, r.event) == ("run", "started"))
    return started


def _opened(number: int) -> dict[str, Any]:
    return github.pull_request_opened(number)


async def _run_one(serving: Serving, site: Site, number: int) -> AuditRecord:
    """Deliver one pull request and wait for its run to finish ok; its `run started`."""
    before = len(audit_records(site, lambda r: (r.kind, r.event) == ("run", "finished")))
    await queued(serving, _opened(number))
    finished = await until_count(site, "run", "finished", "ok", before + 1)
    return _started(site, finished[-1])


def _site_whose_codex_carries_a_child(root: Path, server: ModelServer) -> Site:
    return serve_site(root, server, codex={
        "command": ["/bin/sh", "-c", _WITH_A_CHILD, str(codex_binary()), "app-server"]})


async def _serve_with_a_spare_waiting(shell: Shell) -> tuple[Serving, AuditRecord, int]:
    """`bothy serve` started, once its spare is: the serve, the spare's record, its pgid."""
    serving = await start_serve(shell)
    [spare] = await _spares_started(shell.site, 1)
    return serving, spare, int(spare.details["pgid"])  # type: ignore[call-overload]


async def test_each_run_takes_its_own_spare_and_the_stop_ends_the_last(
    server: ModelServer, tmp_path: Path
) -> None:
    """Two runs back to back: each runs on the spare that was ready (its `run started` names the
    spare's group), a new spare follows each hand-off, no group serves two runs, the taken
    spare's row is gone, and the stop ends the spare left waiting (psutil: nothing alive)."""
    server.script(text("First."), text("Second."))
    site = serve_site(tmp_path, server)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [first_spare] = await _spares_started(site, 1)
        first = await _run_one(serving, site, 1)
        second_spare = (await _spares_started(site, 2))[1]
        second = await _run_one(serving, site, 2)
        third_spare = (await _spares_started(site, 3))[2]
        await until(lambda: _spare_rows(site) == [third_spare.details["pgid"]],
                    "only the waiting spare recorded")
        assert await serving.stop() == 0

    assert (first.details["spare"], first.details["pgid"]) == ("taken",
                                                              first_spare.details["pgid"])
    assert first.details["leader_start"] == first_spare.details["leader_start"]
    assert (second.details["spare"], second.details["pgid"]) == ("taken",
                                                                second_spare.details["pgid"])
    pgids = [spare.details["pgid"] for spare in (first_spare, second_spare, third_spare)]
    assert len(set(pgids)) == 3
    [ended] = _spare_records(site, "ended")
    assert (ended.outcome, ended.details["pgid"], ended.details["why"]) == (
        "ok", third_spare.details["pgid"], "bothy is stopping")
    assert site.audit_lines()[-1].endswith(" serve stopped ok - -")
    assert _spare_rows(site) == []
    assert all(live_members(pgid) == [] for pgid in pgids)  # type: ignore[arg-type]


async def test_runs_at_once_never_share_an_app_server(
    server: ModelServer, tmp_path: Path
) -> None:
    """Three deliveries at once in three lanes (two slots): every run has a group of its own,
    whether it took a spare or started cold, and each spare taken served one run."""
    server.script(text("A."), text("B."), text("C."))
    site = serve_site(tmp_path, server)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await _spares_started(site, 1)
        for number in (11, 12, 13):
            await queued(serving, _opened(number))
        finished = await until_count(site, "run", "finished", "ok", 3)
        assert await serving.stop() == 0

    started = [_started(site, run) for run in finished]
    pgids = [run.details["pgid"] for run in started]
    assert len(set(pgids)) == 3
    spares = {spare.details["pgid"] for spare in _spare_records(site, "started")}
    taken = [run.details["pgid"] for run in started if run.details["spare"] == "taken"]
    assert taken and set(taken) <= spares
    assert all(live_members(int(pgid)) == [] for pgid in pgids)  # type: ignore[call-overload]


async def test_sigkill_of_serve_leaves_no_spare_once_the_next_start_recovers(
    server: ModelServer, tmp_path: Path
) -> None:
    """SIGKILL of `bothy serve` with a spare waiting: its group outlives serve (a member that
    does not read codex's input), the next `bothy serve` ends it and records `spare recovered`,
    and psutil finds nothing left in the group."""
    site = _site_whose_codex_carries_a_child(tmp_path, server)
    async with Shell(site) as shell:
        serving, _, pgid = await _serve_with_a_spare_waiting(shell)
        assert len(live_members(pgid)) == 2  # codex and the child it carries
        serving.command.signal(signal.SIGKILL)
        await serving.command.finish()
        assert live_members(pgid) != []  # left behind: only recovery ends it
        again = await start_serve(shell)
        [recovered] = _spare_records(site, "recovered")
        assert live_members(pgid) == []
        assert recovered.details["pgid"] == pgid
        assert "ended by SIG" in str(recovered.details["group"])
        assert (await _spares_started(site, 2))[1].details["pgid"] != pgid
        assert await again.stop() == 0
    assert _spare_rows(site) == []


async def test_status_shows_the_spare_and_doctor_ends_it_after_a_sigkill_of_serve(
    server: ModelServer, tmp_path: Path
) -> None:
    """`bothy status` shows the waiting spare; after serve was SIGKILLed, it says the spare's
    serve is gone, and `bothy doctor`'s orphan check ends the spare's group and counts it on
    its line, as it does a run's."""
    site = _site_whose_codex_carries_a_child(tmp_path, server)
    async with Shell(site) as shell:
        serving, spare, pgid = await _serve_with_a_spare_waiting(shell)
        waiting = await shell.bothy("status")
        serving.command.signal(signal.SIGKILL)
        await serving.command.finish()
        left = await shell.bothy("status", "--json")
        doctor = await shell.bothy("doctor")
    shown = f"  spare app-server: pid {spare.details['leader_pid']} (group {pgid}), started "
    [line] = [line for line in waiting.stdout.splitlines() if line.startswith(shown)]
    assert "gone" not in line, waiting.stdout
    [entry] = json.loads(left.stdout)["spares"]
    assert (entry["pgid"], entry["owner_alive"]) == (pgid, False)
    assert (f"[ok ] no orphaned workers: 1 process group(s) left by a previous instance"
            f" (spare app-server pgid {pgid}): ended and audited") in doctor.stdout, doctor.stdout
    assert live_members(pgid) == []
    assert [r.details["pgid"] for r in _spare_records(site, "recovered")] == [pgid]
    assert _spare_rows(site) == []


async def test_doctor_on_a_broken_register_keeps_the_spare_for_after_the_repair(
    server: ModelServer, tmp_path: Path
) -> None:
    """SIGKILL of serve with a spare waiting, then the register's last record cut: doctor's
    orphan line says it cannot sweep (what it ends must be recorded) and forgets nothing;
    after `bothy audit repair`, doctor ends the spare and it is recorded once."""
    site = _site_whose_codex_carries_a_child(tmp_path, server)
    async with Shell(site) as shell:
        serving, _, pgid = await _serve_with_a_spare_waiting(shell)
        serving.command.signal(signal.SIGKILL)
        await serving.command.finish()
        kept = site.audit_path.read_bytes().splitlines(keepends=True)
        site.audit_path.write_bytes(b"".join(kept[:-1]))
        refused = await shell.bothy("doctor")
        assert _spare_rows(site) == [pgid]
        assert (await shell.bothy("audit", "repair")).code == 0
        swept = await shell.bothy("doctor")
    assert ("[fail] no orphaned workers: not swept: what it ends must be recorded, and the"
            " register is broken") in refused.stdout, refused.stdout
    assert "AuditIntegrityError" not in refused.stdout
    assert f"(spare app-server pgid {pgid}): ended and audited" in swept.stdout, swept.stdout
    assert [r.details["pgid"] for r in _spare_records(site, "recovered")] == [pgid]
    assert live_members(pgid) == []
    assert _spare_rows(site) == []


async def test_a_profile_with_its_own_codex_config_starts_cold_and_the_spare_waits(
    server: ModelServer, tmp_path: Path
) -> None:
    """A job whose profile sets `codex_config` runs on an app-server of its own started with
    that config (the model is asked with its reasoning effort); the spare is left waiting, and
    the next plain run takes it."""
    server.script(text("Thought hard."), text("Plain."))
    site = serve_site(tmp_path, server, profiles={
        "careful": {"codex_config": {"model_reasoning_effort": "high"}}})
    site.config["webhooks"]["github"]["jobs"] = [
        {"event": "pull_request", "actions": ["opened"], "prompt": "Review #{number}",
         "subject": "pr:{number}", "profile": "careful"},
        {"event": "pull_request", "actions": ["closed"], "prompt": "Note #{number}",
         "subject": "pr:{number}"}]
    site.write_config(site.config)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [spare] = await _spares_started(site, 1)
        cold = await _run_one(serving, site, 7)
        await queued(serving, {**_opened(8), "action": "closed"})
        finished = await until_count(site, "run", "finished", "ok", 2)
        warm = _started(site, finished[-1])
        assert await serving.stop() == 0

    assert cold.details["spare"] == "cold"
    assert "codex_config" in str(cold.details["cold"])
    assert cold.details["pgid"] != spare.details["pgid"]
    assert (warm.details["spare"], warm.details["pgid"]) == ("taken", spare.details["pgid"])
    careful, plain = server.requests
    assert careful["reasoning"]["effort"] == "high"
    assert (plain.get("reasoning") or {}).get("effort") != "high"


async def test_a_spare_that_died_while_waiting_is_not_handed_to_a_run(
    server: ModelServer, tmp_path: Path
) -> None:
    """The spare killed while it waits is recorded `spare ended failed`; the next run starts
    cold (not on the dead group) and is answered, and a new spare is started after it."""
    server.script(text("Cold but fine."))
    site = serve_site(tmp_path, server)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [spare] = await _spares_started(site, 1)
        os.kill(int(spare.details["leader_pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        await until(lambda: bool(_spare_records(site, "ended")), "the death recorded")
        run = await _run_one(serving, site, 3)
        [_, after] = await _spares_started(site, 2)
        assert await serving.stop() == 0

    [died, stopped] = _spare_records(site, "ended")
    assert (died.outcome, died.details["pgid"]) == ("failed", spare.details["pgid"])
    assert died.details["why"] == "it died while waiting for a run"
    assert died.details["exit_code"] == -signal.SIGKILL
    assert (run.details["spare"], run.details["cold"]) == ("cold", "no spare was ready")
    assert run.details["pgid"] not in (spare.details["pgid"], after.details["pgid"])
    assert stopped.details["pgid"] == after.details["pgid"]


async def test_a_spare_started_before_codex_home_changed_is_ended_not_used(
    server: ModelServer, tmp_path: Path
) -> None:
    """An `auth.json` written into CODEX_HOME after the spare started (codex reads it as it
    starts): the run starts cold, the stale spare is ended saying why, a new one follows."""
    server.script(text("Fresh."))
    site = serve_site(tmp_path, server)
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [stale] = await _spares_started(site, 1)
        (site.codex_home / "auth.json").write_text(json.dumps({"OPENAI_API_KEY": None}))
        run = await _run_one(serving, site, 5)
        await _spares_started(site, 2)
        assert await serving.stop() == 0

    assert run.details["spare"] == "cold"
    assert run.details["cold"] == "CODEX_HOME's auth.json changed after the spare started"
    ended = _spare_records(site, "ended")
    assert (ended[0].details["pgid"], ended[0].outcome, ended[0].details["why"]) == (
        stale.details["pgid"], "ok", run.details["cold"])
    assert live_members(int(stale.details["pgid"])) == []  # type: ignore[call-overload]


async def test_a_spare_that_cannot_start_is_recorded_and_not_retried_in_a_loop(
    server: ModelServer, tmp_path: Path
) -> None:
    """A worker command that exits at once: the spare's failed start is `spare ended failed`
    saying why, serve stays up, a run still gets its answer (failed, with the reason), and
    spares are tried once at start and once per run after — never in a loop."""
    site = serve_site(tmp_path, server, codex={"command": ["/bin/false"]})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: bool(_spare_records(site, "ended")), "the failed start recorded")
        await queued(serving, _opened(9))
        [run] = await until_count(site, "run", "finished", "failed", 1)
        assert await serving.stop() == 0

    first, *later = _spare_records(site, "ended")
    assert first.outcome == "failed"
    assert str(first.details["why"]).startswith("it could not start")
    assert len(later) <= 1  # the one started when the run ended, if it got that far
    assert _spare_records(site, "started") == []
    assert "app-server" in str(run.details["reason"])
    assert _spare_rows(site) == []


# A worker command whose first start hangs (the flag file is there), as a codex stuck in its
# start would; every later start is codex at once.
_FIRST_START_HANGS = '[ -e "$FLAG" ] && rm -f "$FLAG" && sleep 600; exec "$0" "$@"'


async def test_a_run_waits_on_a_hung_spare_only_until_the_bound_after_its_spawn(
    server: ModelServer, tmp_path: Path
) -> None:
    """The spare's start hangs: a delivery runs on a cold app-server of its own once the spare
    has been starting for STARTING_WAIT_S (`cold` says so), not for as long as codex hangs, and
    SIGTERM ends the hung start, its group empty (psutil) and its row gone."""
    server.script(text("Done."))
    flag = tmp_path / "first-start-hangs"
    flag.touch()
    site = serve_site(tmp_path, server, codex={
        "command": ["/bin/sh", "-c", _FIRST_START_HANGS.replace("$FLAG", str(flag)),
                    str(codex_binary()), "app-server"]})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: not flag.exists() and len(_spare_rows(site)) == 1,
                    "the spare's start under way, and recorded")
        [hung] = _spare_rows(site)
        run = await _run_one(serving, site, 11)
        assert _spare_records(site, "started") == []  # still hanging while the run ran
        assert await serving.stop() == 0

    assert (run.details["spare"], run.details["cold"]) == (
        "cold", f"the spare was still starting {STARTING_WAIT_S:g} s after its spawn")
    assert run.details["pgid"] != hung
    [ended] = _spare_records(site, "ended")
    assert (ended.details["pgid"], ended.details["why"]) == (hung,
                                                            "bothy stopped while it started")
    assert live_members(hung) == []
    assert _spare_rows(site) == []


# A worker command whose first start waits (up to 30 s) for the test to say go, as a codex
# slow to start on a busy machine would; every later start is codex at once.
_FIRST_START_WAITS = ('[ -e "$FLAG" ] && rm -f "$FLAG" && i=0 && while [ ! -e "$GO" ]'
                      ' && [ $i -lt 3000 ]; do sleep 0.01; i=$((i + 1)); done; exec "$0" "$@"')


async def test_a_run_that_comes_while_the_spare_starts_waits_for_it_and_takes_it(
    server: ModelServer, tmp_path: Path
) -> None:
    """A delivery admitted while the spare is still starting (as a mention sent right after
    the last answer meets the next spare) runs on that spare once it is up: `run started`
    names the spare's group, recorded after `spare started`, and no cold app-server is
    spawned for it."""
    server.script(text("Done."))
    flag, go = tmp_path / "first-start-waits", tmp_path / "go"
    flag.touch()
    site = serve_site(tmp_path, server, codex={
        "command": ["/bin/sh", "-c", _FIRST_START_WAITS.replace("$FLAG", str(flag))
                    .replace("$GO", str(go)), str(codex_binary()), "app-server"]})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        await until(lambda: not flag.exists() and len(_spare_rows(site)) == 1,
                    "the spare's start under way, and recorded")
        [starting] = _spare_rows(site)
        await queued(serving, _opened(12))
        await until_count(site, "run", "admitted", "ok", 1)
        assert _spare_records(site, "started") == []  # the run came while it was starting
        go.touch()
        [finished] = await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0

    run = _started(site, finished)
    [spare] = _spare_records(site, "started")[:1]
    assert (run.details["spare"], run.details["pgid"]) == ("taken", starting)
    assert spare.details["pgid"] == starting
    assert spare.seq < run.seq
    assert "cold" not in run.details
    assert live_members(starting) == []


async def test_with_the_spare_off_runs_start_cold_and_nothing_is_started_ahead(
    server: ModelServer, tmp_path: Path
) -> None:
    """`codex.spare: false`: no `spare` record, no row, and a run still answers."""
    server.script(text("Done."))
    site = serve_site(tmp_path, server, codex={"spare": False})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        run = await _run_one(serving, site, 4)
        assert await serving.stop() == 0
    assert "spare" not in run.details
    assert [r for r in audit_records(site) if r.kind == "spare"] == []
    assert _spare_rows(site) == []


async def test_a_spare_that_is_not_true_or_false_is_a_configuration_error(
    server: ModelServer, tmp_path: Path
) -> None:
    """`codex.spare: "yes"`: `bothy serve` exits 78 naming the key, and starts nothing."""
    site = serve_site(tmp_path, server, codex={"spare": "yes"})
    done = await site.bothy("serve")
    assert done.code == 78, done.stderr
    assert "codex.spare" in done.stderr and "Traceback" not in done.stderr


# --- a Slack mention ---------------------------------------------------------------------


@pytest.fixture
async def slack(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeSlack]:
    slack_environment(monkeypatch)
    async with FakeSlack(ack_timeout_s=5.0) as fake:
        yield fake


async def test_a_mention_is_answered_on_the_spare(
    server: ModelServer, slack: FakeSlack, tmp_path: Path
) -> None:
    """A Slack mention's run takes the spare: the group that answered is the spare's, whose
    pid was codex's as it waited (psutil), and the answer is in the thread."""
    server.script(text("On the spare."))
    site = Site(tmp_path, server.base_url, listen={"tailnet_port": free_port()},
                chat={"slack": {"api_url": slack.api_url, "allowed_users": ["UOPERATOR"]}})
    async with Shell(site) as shell:
        serving = await start_serve(shell)
        [spare] = await _spares_started(site, 1)
        waiting = psutil.Process(int(spare.details["leader_pid"]))  # type: ignore[call-overload]
        assert waiting.name() == "codex"
        ts = slack.send_mention("UOPERATOR", "CWORK", "are you warm?")
        await until(lambda: any(p.thread_ts == ts for p in slack.posts), "the answer")
        finished = await until_count(site, "run", "finished", "ok", 1)
        assert await serving.stop() == 0

    group = started_group(site, str(finished[0].run_id))
    assert (group.pgid, group.leader_pid) == (spare.details["pgid"], waiting.pid)
    assert _started(site, finished[0]).details["spare"] == "taken"
    assert [p.text for p in slack.posts if p.thread_ts == ts] == ["On the spare."]
