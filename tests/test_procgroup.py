"""Process groups are ended whole, and their life is proven, not assumed (SPEC §11 rules 2, 5).

Real processes and real signals throughout. Every test is bounded by ``asyncio.timeout``, and
the ``leftovers`` fixture SIGKILLs any group a test started, even when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bothy.engine.procgroup import (
    Ending,
    GroupRecord,
    GroupState,
    OrphanVerdict,
    ProcessGroup,
    end_orphan_group,
    live_members,
    process_start_time,
)
from bothy.engine.proctable import ProcessStart, boot_time_s, same_process
from bothy.errors import ProcessGroupError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="checks results in /proc")

_BOUND_S = 15.0
_REPO = Path(__file__).resolve().parent.parent
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


class _Leftovers:
    """Every group and child process a test started, to be killed whatever the test's fate."""

    def __init__(self) -> None:
        self.pgids: list[int] = []
        self.processes: list[asyncio.subprocess.Process] = []

    def group(self, group: ProcessGroup) -> ProcessGroup:
        self.pgids.append(group.pgid)
        self.processes.append(group.process)
        return group


@pytest.fixture
async def leftovers() -> AsyncIterator[_Leftovers]:
    """SIGKILL every recorded group that still has a live member, then reap our children."""
    started = _Leftovers()
    yield started
    for pgid in started.pgids:
        if live_members(pgid):  # proven ours and alive: the test started it moments ago
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    async with asyncio.timeout(5):
        for process in started.processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await process.wait()


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3… of /proc/<pid>/stat (state, ppid, pgrp, …), or None if the pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return raw.rpartition(")")[2].split()


def _gone_or_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")


async def _spawn(leftovers: _Leftovers, argv: list[str]) -> ProcessGroup:
    group = await ProcessGroup.spawn(
        argv,
        env=dict(os.environ),
        cwd=_REPO,
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return leftovers.group(group)


async def _spawn_ready(leftovers: _Leftovers, script: str) -> ProcessGroup:
    """Spawn ``sh -c script`` and wait for the script to print ``ready``."""
    group = await _spawn(leftovers, ["sh", "-c", script])
    assert await _read_line(group.process) == "ready"
    return group


async def _read_line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    return (await process.stdout.readline()).decode().strip()


def _reap_if_exited(pid: int) -> None:
    """Reap ``pid`` if it is our exited child; never blocks (WNOHANG)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


async def test_stop_ends_every_member_of_the_group(leftovers: _Leftovers) -> None:
    """stop() TERMs the whole group: the shell leader and both background children end."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "sleep 300 & sleep 300 & echo ready; wait")
        members = live_members(group.pgid)
        assert len(members) == 3 and group.pgid in members
        assert group.is_alive()

        report = await group.stop(grace_s=5)

        assert report.ending is Ending.TERMINATED
        assert report.survivors == ()
        assert report.returncode == -signal.SIGTERM
        assert live_members(group.pgid) == []
        assert all(_gone_or_zombie(pid) for pid in members)
        assert not group.is_alive()
        assert group.state is GroupState.EXITED


async def test_a_group_that_ignores_sigterm_is_killed_after_the_grace(
    leftovers: _Leftovers,
) -> None:
    """Members that ignore SIGTERM are SIGKILLed once the grace has elapsed, and it says so."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "trap '' TERM; sleep 300 & echo ready; wait")
        members = live_members(group.pgid)
        assert len(members) == 2

        report = await group.stop(grace_s=0.3, kill_wait_s=5)

        assert report.ending is Ending.KILLED
        assert report.elapsed_s >= 0.3
        assert report.returncode == -signal.SIGKILL
        assert live_members(group.pgid) == []
        assert all(_gone_or_zombie(pid) for pid in members)


_ZOMBIE_MAKER = textwrap.dedent(
    """
    import os, signal
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)  # it has exited; it is not reaped
    print(child, flush=True)
    signal.pause()  # alive until the test's signal ends it
    """
)


async def test_a_zombie_member_is_not_alive_though_killpg_still_finds_it(
    leftovers: _Leftovers,
) -> None:
    """Once the live part is ended a zombie stays in the group: killpg(pgid, 0) succeeds,
    yet live_members() is empty and stop() returns rather than waiting for ever (rule 5)."""
    # While the test runs this process is a subreaper: the zombie is reparented to us when
    # its parent dies, so it lingers whatever PID 1 does; it is reaped in ``finally``.
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    zombie = 0
    try:
        async with asyncio.timeout(_BOUND_S):
            group = await _spawn(leftovers, [sys.executable, "-c", _ZOMBIE_MAKER])
            assert group.process.stdout is not None
            zombie = int(await _read_line(group.process))
            fields = _stat_fields(zombie)
            assert fields is not None and fields[0] == "Z" and int(fields[2]) == group.pgid
            assert live_members(group.pgid) == [group.pgid]

            report = await group.stop(grace_s=5)

            assert report.ending is Ending.TERMINATED
            assert live_members(group.pgid) == []
            os.killpg(group.pgid, 0)  # does not raise: a member (the zombie) still exists
            fields = _stat_fields(zombie)
            assert fields is not None and fields[0] == "Z" and int(fields[2]) == group.pgid
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        if zombie:
            _reap_if_exited(zombie)


_INTERMEDIATE = textwrap.dedent(
    """
    import signal, subprocess, sys
    from bothy.engine.procgroup import process_start_time
    group = subprocess.Popen(
        ["sh", "-c", sys.argv[1]], start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    assert group.stdout.readline().strip() == b"ready"
    start = process_start_time(group.pid)
    if sys.argv[2] == "reap-leader":
        group.wait()
    print(group.pid, start, flush=True)
    signal.pause()  # alive until the test SIGKILLs it
    """
)


async def _orphan_group(
    leftovers: _Leftovers, script: str, *, reap_leader: bool = False
) -> GroupRecord:
    """A group started by another process, which is then SIGKILLed: we are not its parent."""
    intermediate = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _INTERMEDIATE,
        script,
        "reap-leader" if reap_leader else "keep-leader",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        cwd=_REPO,
    )
    leftovers.processes.append(intermediate)
    pgid, start = (await _read_line(intermediate)).split()
    record = GroupRecord(int(pgid), int(pgid), start)
    leftovers.pgids.append(record.pgid)
    intermediate.kill()
    await intermediate.wait()
    return record


async def test_an_orphaned_group_is_ended_though_we_are_not_its_parent(
    leftovers: _Leftovers,
) -> None:
    """end_orphan_group TERMs a group whose parent died, and proves every member gone."""
    async with asyncio.timeout(_BOUND_S):
        record = await _orphan_group(leftovers, "sleep 300 & sleep 300 & echo ready; wait")
        members = live_members(record.pgid)
        assert len(members) == 3
        leader = _stat_fields(record.leader_pid)
        assert leader is not None and int(leader[1]) != os.getpid()  # not our child

        outcome = await end_orphan_group(record, grace_s=5)

        assert outcome.verdict is OrphanVerdict.ENDED
        assert outcome.pids == tuple(members)
        assert not outcome.killed
        assert live_members(record.pgid) == []
        assert outcome.describe().startswith("ended by SIGTERM: pgid")


async def test_members_left_after_the_orphan_leader_was_reaped_are_ended(
    leftovers: _Leftovers,
) -> None:
    """With the leader gone (reaped), live members still in its pgid are found and ended."""
    async with asyncio.timeout(_BOUND_S):
        record = await _orphan_group(
            leftovers, "sleep 300 & sleep 300 & echo ready", reap_leader=True
        )
        assert _stat_fields(record.leader_pid) is None
        members = live_members(record.pgid)
        assert len(members) == 2

        outcome = await end_orphan_group(record, grace_s=5)

        assert outcome.verdict is OrphanVerdict.ENDED
        assert outcome.pids == tuple(members)
        assert live_members(record.pgid) == []


async def test_a_recycled_leader_pid_is_never_signalled(leftovers: _Leftovers) -> None:
    """A live pid whose start time is not the recorded one is left alone and called recycled."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "echo ready; exec sleep 300")
        start = ProcessStart.parse(group.record.leader_start)
        assert start is not None
        later = ProcessStart(start.ticks + 1, start.boot_s).encode()
        stale = GroupRecord(group.pgid, group.pgid, later)

        outcome = await end_orphan_group(stale, grace_s=0.1)

        assert outcome.verdict is OrphanVerdict.RECYCLED
        assert outcome.pids == ()
        assert live_members(group.pgid) == [group.pgid]
        assert group.process.returncode is None
        assert "nothing signalled" in outcome.describe()


async def test_an_orphan_recorded_in_the_old_format_is_ended(leftovers: _Leftovers) -> None:
    """A row written before psutil (ticks since boot alone, /proc field 22) still ends its group."""
    async with asyncio.timeout(_BOUND_S):
        current = await _orphan_group(leftovers, "sleep 300 & echo ready; wait")
        leader = _stat_fields(current.leader_pid)
        assert leader is not None
        old_format = GroupRecord(current.pgid, current.leader_pid, leader[19])
        assert old_format.leader_start.isdigit()
        members = live_members(old_format.pgid)
        assert len(members) == 2

        outcome = await end_orphan_group(old_format, grace_s=5)

        assert outcome.verdict is OrphanVerdict.ENDED
        assert outcome.pids == tuple(members)
        assert live_members(old_format.pgid) == []


async def test_an_old_format_record_of_another_start_is_never_signalled(
    leftovers: _Leftovers,
) -> None:
    """An old-format row whose ticks are not the live leader's is a recycled pid: left alone."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "echo ready; exec sleep 300")
        leader = _stat_fields(group.pgid)
        assert leader is not None
        stale = GroupRecord(group.pgid, group.pgid, str(int(leader[19]) - 1))

        outcome = await end_orphan_group(stale, grace_s=0.1)

        assert outcome.verdict is OrphanVerdict.RECYCLED
        assert live_members(group.pgid) == [group.pgid]


async def test_a_record_from_before_a_reboot_is_never_signalled(leftovers: _Leftovers) -> None:
    """Same pid, same ticks since boot, but an earlier boot: a stranger's group, left alone."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "echo ready; exec sleep 300")
        start = ProcessStart.parse(group.record.leader_start)
        assert start is not None and start.boot_s == boot_time_s()
        a_day_earlier = ProcessStart(start.ticks, start.boot_s - 86_400).encode()
        before_reboot = GroupRecord(group.pgid, group.pgid, a_day_earlier)

        outcome = await end_orphan_group(before_reboot, grace_s=0.1)

        assert outcome.verdict is OrphanVerdict.PREVIOUS_BOOT
        assert outcome.pids == ()
        assert live_members(group.pgid) == [group.pgid]
        assert group.process.returncode is None
        assert outcome.describe().startswith("recorded before a reboot, nothing signalled: pgid")


def test_a_process_is_known_by_its_start_in_either_format_and_this_boot_only() -> None:
    """Our own pid matches its start as recorded now and as recorded before psutil (ticks
    alone); an earlier boot, another tick or an unreadable start does not match."""
    recorded = process_start_time(os.getpid())
    assert recorded is not None
    start = ProcessStart.parse(recorded)
    assert start is not None and start.boot_s is not None
    fields = _stat_fields(os.getpid())
    assert fields is not None and start.ticks == int(fields[19])

    assert same_process(os.getpid(), recorded)
    assert same_process(os.getpid(), fields[19])
    assert not same_process(os.getpid(), ProcessStart(start.ticks, start.boot_s - 3600).encode())
    assert not same_process(os.getpid(), ProcessStart(start.ticks + 1, start.boot_s).encode())
    assert not same_process(os.getpid(), "Tue Dec  1 08:38:56 2026")


async def test_an_orphan_record_with_no_live_member_is_gone(leftovers: _Leftovers) -> None:
    """A record whose group has ended yields GONE and signals nothing."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn(leftovers, ["sh", "-c", "exit 0"])
        await group.process.wait()

        outcome = await end_orphan_group(group.record)

        assert outcome.verdict is OrphanVerdict.GONE
        assert outcome.pids == ()


async def test_stopping_a_group_that_already_exited_signals_nothing(
    leftovers: _Leftovers,
) -> None:
    """A leader that exited on its own leaves nothing to signal; its exit code is reported."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn(leftovers, ["sh", "-c", "exit 3"])
        await group.process.wait()

        report = await group.stop()

        assert report.ending is Ending.ALREADY_GONE
        assert report.returncode == 3
        assert report.describe().startswith("already_gone in ")


async def test_concurrent_and_repeated_stops_share_one_report(leftovers: _Leftovers) -> None:
    """Two concurrent stop() calls and a later one all get the same report."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "echo ready; exec sleep 300")

        first, second = await asyncio.gather(group.stop(), group.stop())
        third = await group.stop()

        assert first is second is third
        assert first.ending is Ending.TERMINATED
        assert group.state is GroupState.EXITED


async def test_a_cancelled_stop_kills_the_group(leftovers: _Leftovers) -> None:
    """A stop() cancelled by its caller's deadline SIGKILLs the group; a later stop() reports."""
    async with asyncio.timeout(_BOUND_S):
        group = await _spawn_ready(leftovers, "trap '' TERM; echo ready; exec sleep 300")

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):  # well inside the 60 s grace TERM cannot end
                await group.stop(grace_s=60)
        assert group.state is GroupState.RUNNING

        report = await group.stop(grace_s=0.5)
        # TERM is ignored, so a leader dead of SIGKILL proves the cancelled stop killed it.
        # (The ending word depends on whether that SIGKILL had landed when this stop looked.)
        assert report.returncode == -signal.SIGKILL
        assert report.ending is not Ending.SURVIVED
        assert live_members(group.pgid) == []


def test_process_start_time_is_kept_by_a_zombie_and_gone_once_reaped() -> None:
    """A zombie still has its start time; a reaped pid has none."""
    child = subprocess.Popen(["true"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert process_start_time(child.pid) is not None
    finally:
        child.wait(timeout=5)
    assert process_start_time(child.pid) is None


async def test_spawning_a_missing_executable_raises_process_group_error() -> None:
    """A missing executable is a ProcessGroupError naming it, caused by FileNotFoundError."""
    async with asyncio.timeout(_BOUND_S):
        with pytest.raises(ProcessGroupError, match="/nonexistent/codex") as caught:
            await ProcessGroup.spawn(["/nonexistent/codex"], env={}, cwd=_REPO)
        assert isinstance(caught.value.__cause__, FileNotFoundError)


def test_a_group_record_round_trips_and_refuses_init_and_our_own_group() -> None:
    """to_dict/from_dict round-trip; pgid 0 (our group, to killpg) or 1 (init) is refused."""
    record = GroupRecord(4242, 4242, "123456")
    assert GroupRecord.from_dict(record.to_dict()) == record
    for pgid in (0, 1, -5):
        with pytest.raises(ProcessGroupError, match="greater than 1"):
            GroupRecord(pgid, 4242, "1")
    with pytest.raises(ProcessGroupError, match="Cannot read a group record"):
        GroupRecord.from_dict({"pgid": "4242", "leader_pid": 4242, "leader_start": "1"})


async def test_end_orphan_group_refuses_bothys_own_group() -> None:
    """Bothy never ends its own process group, whatever a record says."""
    own = os.getpgrp()
    record = GroupRecord(own, own, process_start_time(own) or "1")
    with pytest.raises(ProcessGroupError, match="Bothy's own group"):
        await end_orphan_group(record, grace_s=0.1)
