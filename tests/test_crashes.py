"""What Bothy does when something dies or lies: its own process, the worker, the protocol, the
register (SPEC §3–§4, rules 1, 2 and 5).

Real SIGKILLs against the real ``bothy`` CLI and the pinned codex binary. Where the fault is a
peer that misbehaves in a way the real binary cannot be made to (a bad frame, a worker that
ignores the end of its input), ``tests/fakes/broken_app_server.py`` stands in for it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from bothy.clock import utc_now
from bothy.config import load_config
from bothy.engine.procgroup import live_members
from bothy.home import BothyHome
from bothy.runtime import Runtime
from tests.fakes.broken_app_server import LEADER_EXIT_CODE, TRUNCATED_FRAME, UNKNOWN_ID
from tests.fakes.model_server import ModelServer, stall, text
from tests.fakes.shell import DEADLINE_S, Shell, audit_records, started_group, until
from tests.fakes.site import Site

BROKEN_APP_SERVER = Path(__file__).resolve().parent / "fakes" / "broken_app_server.py"
REPLY_COST = "0.0152"  # the fake model's default usage at the fake price
NO_HANG_S = 15.0  # well under the wall clock (60 s) and codex's stream idle timeout (60 s)


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


async def _mid_turn(server: ModelServer) -> None:
    """Wait until the model has started its stalled answer: the turn is under way."""
    async with asyncio.timeout(DEADLINE_S):
        await server.stalled.wait()


def _broken_site(root: Path, mode: str, log: Path) -> Site:
    """A site whose worker is the fault-injecting app-server in ``mode``."""
    command = [sys.executable, str(BROKEN_APP_SERVER), mode, "--log", str(log)]
    return Site(root, "http://127.0.0.1:9/v1", codex={"command": command})


def _milestones(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _child_of(log: Path) -> int:
    return next(int(m.split()[1]) for m in _milestones(log) if m.startswith("child "))


async def _reserved_micros(site: Site, *, after: timedelta) -> int:
    """Today's reserved total as the budget gate sees it, ``after`` from now."""
    home = BothyHome(site.home)
    cfg = load_config(home.config_path)
    moment = utc_now() + after
    async with Runtime.open(home, cfg, clock=lambda: moment) as rt:
        return (await rt.supervisor().budget.today()).reserved_micros


async def _assert_held_until_expiry(site: Site, shell: Shell, run_id: str) -> None:
    """The crashed run's reservation shows in `bothy status` and lapses after the expiry."""
    status = await shell.bothy("status")
    assert f"held by a crashed run: {run_id} 0.5000 usd until " in status.stdout
    assert ", 0.5000 usd reserved," in status.stdout
    expiry_s = load_config(site.home / "config.json").budget.reservation_expiry_s
    assert await _reserved_micros(site, after=timedelta(0)) == 500_000
    assert await _reserved_micros(site, after=timedelta(seconds=expiry_s + 1)) == 0


# --- the bothy process dies -------------------------------------------------------------------


@pytest.mark.codex
async def test_sigkilled_bothy_run_is_recovered_by_the_next_bothy_run(
    server: ModelServer, tmp_path: Path
) -> None:
    """SIGKILL of `bothy run` mid-turn: the next `bothy run` audits the run as recovered, its
    worker group ends, and its reservation is held until it expires."""
    server.script(stall(), text("after the crash"))
    site = Site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        crashed = await shell.start("run", "long job", "--subject", "demo")
        crashed_id = await crashed.admitted()
        assert crashed_id is not None
        await _mid_turn(server)
        group = started_group(site, crashed_id)
        assert group.leader_pid in live_members(group.pgid)

        crashed.signal(signal.SIGKILL)
        assert (await crashed.finish()).code == -signal.SIGKILL
        # Codex exits when its stdin ends, so this group may be gone by itself already; the
        # group that outlives its bothy is the next test's.

        after = await shell.bothy("run", "next job", "--subject", "other")
        assert after.code == 0 and after.stdout.endswith(f"{REPLY_COST} usd after the crash\n")
        assert live_members(group.pgid) == []
        lines = site.audit_lines()
        recovered = [i for i, line in enumerate(lines)
                     if line.endswith(f" run recovered failed demo {crashed_id}")]
        next_run = next(i for i, line in enumerate(lines) if " wake received ok other " in line)
        assert len(recovered) == 1 and recovered[0] < next_run
        [record] = audit_records(site, lambda r: r.event == "recovered")
        assert record.details["reservation"] == "held until it expires"
        await _assert_held_until_expiry(site, shell, crashed_id)


@pytest.mark.codex
@pytest.mark.fake_app_server
async def test_worker_that_outlives_its_bothy_is_ended_by_doctor(tmp_path: Path) -> None:
    """A worker group that outlives its SIGKILLed `bothy run` is ended and audited by `doctor`."""
    log = tmp_path / "worker.log"
    site = _broken_site(tmp_path, "hang", log)
    async with Shell(site) as shell:
        crashed = await shell.start("run", "long job", "--subject", "demo")
        crashed_id = await crashed.admitted()
        assert crashed_id is not None
        await until(lambda: "turn started" in _milestones(log), "the worker never got a turn")
        group = started_group(site, crashed_id)

        crashed.signal(signal.SIGKILL)
        assert (await crashed.finish()).code == -signal.SIGKILL
        await until(lambda: "stdin closed" in _milestones(log), "the worker never saw EOF")
        assert live_members(group.pgid) == sorted([group.leader_pid, _child_of(log)])

        doctor = await shell.bothy("doctor")
        assert ("[ok ] no orphaned workers: 1 process group(s) left by a previous instance"
                f" ({crashed_id}): ended and audited\n") in doctor.stdout
        assert live_members(group.pgid) == []
        [line] = [line for line in site.audit_lines() if " recovered " in line]
        assert line.endswith(f" run recovered failed demo {crashed_id}")
        [record] = audit_records(site, lambda r: r.event == "recovered")
        assert str(record.details["group"]).startswith(f"ended by SIGTERM: pgid {group.pgid} ")
        await _assert_held_until_expiry(site, shell, crashed_id)


def _rewrite_starts_in_the_old_format(site: Site) -> list[str]:
    """What a Bothy from before psutil stored: each start as bare ticks since boot (no boot)."""
    with sqlite3.connect(BothyHome(site.home).db_path) as db:
        for table, column in (("runs", "owner_start"), ("runs", "leader_start"),
                              ("groups", "leader_start")):
            db.execute(f"UPDATE {table} SET {column} = substr({column}, 1,"
                       f" instr({column}, '@') - 1) WHERE instr({column}, '@') > 0")
        rows = db.execute("SELECT owner_start, leader_start FROM runs").fetchall()
    return [value for row in rows for value in row if value is not None]


@pytest.mark.codex
@pytest.mark.fake_app_server
async def test_an_orphan_whose_row_is_in_the_old_format_is_ended_after_the_upgrade(
    tmp_path: Path,
) -> None:
    """A run row written before psutil (starts as ticks since boot alone) is still understood:
    the next Bothy ends the group its SIGKILLed owner left, and audits it."""
    log = tmp_path / "worker.log"
    site = _broken_site(tmp_path, "hang", log)
    async with Shell(site) as shell:
        crashed = await shell.start("run", "long job", "--subject", "demo")
        crashed_id = await crashed.admitted()
        assert crashed_id is not None
        await until(lambda: "turn started" in _milestones(log), "the worker never got a turn")
        group = started_group(site, crashed_id)
        crashed.signal(signal.SIGKILL)
        assert (await crashed.finish()).code == -signal.SIGKILL
        await until(lambda: "stdin closed" in _milestones(log), "the worker never saw EOF")
        old_format = _rewrite_starts_in_the_old_format(site)
        assert old_format and all(value.isdigit() for value in old_format)
        assert group.leader_pid in live_members(group.pgid)

        doctor = await shell.bothy("doctor")
        assert ("[ok ] no orphaned workers: 1 process group(s) left by a previous instance"
                f" ({crashed_id}): ended and audited\n") in doctor.stdout
        assert live_members(group.pgid) == []
        [record] = audit_records(site, lambda r: r.event == "recovered")
        assert record.run_id == crashed_id
        assert str(record.details["group"]).startswith(f"ended by SIGTERM: pgid {group.pgid} ")


# --- the worker dies or breaks the protocol ----------------------------------------------------


@pytest.mark.codex
async def test_app_server_killed_mid_turn_fails_the_run_at_once(
    server: ModelServer, tmp_path: Path
) -> None:
    """SIGKILL of the codex app-server mid-turn ends the run `failed`, naming the app-server."""
    server.script(stall())
    site = Site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        run = await shell.start("run", "long job", "--subject", "demo")
        run_id = await run.admitted()
        assert run_id is not None
        await _mid_turn(server)
        group = started_group(site, run_id)

        os.kill(group.leader_pid, signal.SIGKILL)
        done = await run.finish(timeout_s=NO_HANG_S)
        assert done.code == 1
        assert done.stdout.startswith(f"failed {run_id} 0.0000 usd the app-server died mid-turn: ")
        assert done.stdout.rstrip("\n").isprintable(), "codex's colour codes reached the operator"
        assert live_members(group.pgid) == []
    events = [f"{r.kind} {r.event} {r.outcome}" for r in audit_records(site)]
    assert events[-3:] == ["worker stopped ok", "budget settled ok", "run finished failed"]


@pytest.mark.codex
@pytest.mark.fake_app_server
async def test_app_server_exiting_while_a_child_holds_its_output_fails_the_run(
    tmp_path: Path,
) -> None:
    """The app-server's death mid-turn is noticed even when a child keeps its stdout open."""
    log = tmp_path / "worker.log"
    site = _broken_site(tmp_path, "exit-leaving-child", log)
    async with Shell(site) as shell:
        run = await shell.start("run", "any job", "--subject", "demo")
        run_id = await run.admitted()
        assert run_id is not None
        done = await run.finish(timeout_s=NO_HANG_S)
        assert (done.code, done.stdout) == (1, (
            f"failed {run_id} 0.0000 usd the app-server died mid-turn: the app-server exited"
            f" with code {LEADER_EXIT_CODE}; exit code {LEADER_EXIT_CODE}\n"))
        group = started_group(site, run_id)
        assert live_members(group.pgid) == []


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("not-json", "the app-server sent a frame that is not JSON: 'this is not json at all"),
        ("truncated", f"the app-server's output ended mid-frame ({len(TRUNCATED_FRAME)} bytes"
                      " without a newline)"),
        ("unknown-id", f"a response to a request we never sent (id {UNKNOWN_ID})"),
    ],
)
@pytest.mark.codex
@pytest.mark.fake_app_server
async def test_broken_frame_mid_turn_fails_the_run_and_reaps_the_group(
    tmp_path: Path, mode: str, problem: str
) -> None:
    """A frame that is not JSON-RPC fails the run, naming the problem; no hang, no leftovers."""
    log = tmp_path / "worker.log"
    site = _broken_site(tmp_path, mode, log)
    async with Shell(site) as shell:
        run = await shell.start("run", "any job", "--subject", "demo")
        run_id = await run.admitted()
        assert run_id is not None
        done = await run.finish(timeout_s=NO_HANG_S)
        assert done.code == 1
        assert done.stdout.startswith(
            f"failed {run_id} 0.0000 usd the app-server broke the protocol mid-turn: {problem}")
        group = started_group(site, run_id)
        assert live_members(group.pgid) == []
        assert "turn started" in _milestones(log)
    [stopped] = audit_records(site, lambda r: r.event == "stopped")
    assert stopped.outcome == "ok"
    [finished] = audit_records(site, lambda r: r.event == "finished")
    assert (finished.outcome, finished.details["reason"]) == ("failed", done.stdout.split(
        " usd ", 1)[1].rstrip("\n"))


# --- the register is tampered with -----------------------------------------------------------


def _edit(lines: list[bytes]) -> tuple[list[bytes], str]:
    forged = lines[1].replace(b'"reserved_usd":"0.500000"', b'"reserved_usd":"0.000000"')
    assert forged != lines[1]
    return [lines[0], forged, *lines[2:]], "record 0002 was altered"


def _delete(lines: list[bytes]) -> tuple[list[bytes], str]:
    return [*lines[:2], *lines[3:]], "record 0003 is missing: 0002 is followed by 0004"


def _swap(lines: list[bytes]) -> tuple[list[bytes], str]:
    return ([*lines[:3], lines[4], lines[3], *lines[5:]],
            "record 0005 is out of order at line 4: 0004 belongs there and appears later,"
            " at line 5")


def _truncate(lines: list[bytes]) -> tuple[list[bytes], str]:
    last = len(lines)
    return ([*lines[:-1], lines[-1][: len(lines[-1]) // 2]],
            f"line {last} is truncated: record {last:04d} was cut off mid-write")


def _tamper(site: Site, how: str) -> str:
    lines = site.audit_path.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 6, lines
    changed, problem = {"edit": _edit, "delete": _delete, "swap": _swap,
                        "truncate": _truncate}[how](lines)
    site.audit_path.write_bytes(b"".join(changed))
    return problem


@pytest.mark.codex
@pytest.mark.parametrize("how", ["edit", "delete", "swap", "truncate"])
async def test_tampered_register_fails_audit_verify_and_doctor(
    server: ModelServer, tmp_path: Path, how: str
) -> None:
    """An edited, deleted, swapped or truncated audit record fails `audit verify` and `doctor`,
    naming the record."""
    server.script(text("BOTHY"))
    site = Site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        assert (await shell.bothy("run", "Reply with exactly: BOTHY")).code == 0
        assert (await shell.bothy("audit", "verify")).code == 0
        problem = _tamper(site, how)

        verify = await shell.bothy("audit", "verify")
        assert verify.code == 1
        assert verify.stdout.startswith(f"audit chain broken: {problem}")
        doctor = await shell.bothy("doctor")
        assert doctor.code == 1
        assert f"[fail] audit chain intact: broken: {problem}" in doctor.stdout
        assert doctor.stdout.rstrip().endswith(" 1 failed")
