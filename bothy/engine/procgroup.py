"""Process groups, proven alive or gone (rules 2 and 5 of SPEC §11).

A worker is a process group: :meth:`ProcessGroup.spawn` starts it in a new session
(``setsid()``, so ``pgid == pid``), and :meth:`ProcessGroup.stop` ends *the whole group*:
SIGTERM to the group, a bounded wait, SIGKILL, a second bounded wait, and a
:class:`StopReport` that says how it ended — including the near-impossible case where members
survived SIGKILL, which is reported, never hidden.

"Gone" is proven by enumerating the group's live members (:func:`live_members`), never by
``killpg(pgid, 0)``: that call succeeds while any member exists, *zombies included*, and on a
host whose PID 1 does not reap orphans (this container's does not) a zombie can linger forever
(contracts.md §9).

A :class:`GroupRecord` (pgid, leader pid, leader start time) is what Bothy persists so that a
later Bothy can end a group a dead predecessor left behind (:func:`end_orphan_group`) without
ever signalling a recycled pid. The kernel facts this rests on:

* a pid number is not reused while any process still uses it as a pid, a process group id or
  a session id — so while members of group N live, no new process can be given pid N;
* a process is identified by (pid, start time): a recycled pid has a later start time.

Hence: if pid N exists with a start time other than the recorded one, the group we recorded is
gone (its pgid was freed before that pid was handed out), and nothing is signalled. One
residual case cannot be told apart from the record alone, and is accepted as vanishingly
unlikely: our group ended completely, pid N was recycled, the new process made itself a
session leader, forked and exited — its children then look like our leaderless group.

Start times are ``/proc/<pid>/stat`` field 22 (clock ticks since boot) on Linux and
``ps -o lstart=`` on macOS. A Linux start time is relative to the boot: a record written
before a reboot should be discarded by its owner (pair it with the boot id) rather than
compared — after a reboot no process of the old group can exist anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from bothy.errors import ProcessGroupError

__all__ = [
    "Ending",
    "GroupRecord",
    "GroupState",
    "OrphanOutcome",
    "OrphanVerdict",
    "ProcessGroup",
    "StopReport",
    "end_orphan_group",
    "live_members",
    "process_start_time",
]

_IS_DARWIN = sys.platform == "darwin"
_DEAD_STATES = frozenset({"Z", "X", "x"})  # zombie, dead (``x`` on old Linux kernels)
_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.1
_DEFAULT_LIMIT_BYTES = 2**16  # asyncio's own default for StreamReader lines

Redirect = int | IO[Any] | None
"""What ``stdin``/``stdout``/``stderr`` accept: ``asyncio.subprocess.PIPE``, ``DEVNULL``, a file."""


# --- Reading the process table ------------------------------------------------------------


@dataclass(frozen=True)
class _Proc:
    """One row of the process table, as far as Bothy cares."""

    pid: int
    pgid: int
    state: str
    start: str | None  # None when the scan that produced the row does not read start times

    @property
    def is_live(self) -> bool:
        return self.state not in _DEAD_STATES


def _parse_linux_stat(pid: int, raw: bytes) -> _Proc | None:
    # comm (field 2) may hold spaces and parentheses: split after the LAST ')' (proc(5)).
    fields = raw.rpartition(b")")[2].split()
    # fields[0] is field 3 (state), fields[2] field 5 (pgrp), fields[19] field 22 (starttime).
    if len(fields) < 20 or not fields[2].isdigit() or not fields[19].isdigit():
        return None
    return _Proc(pid, int(fields[2]), fields[0].decode("ascii", "replace"), fields[19].decode())


def _read_linux(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        # Gone (or mid-exit), or hidden from us by hidepid — then we could not signal it either.
        return None
    return _parse_linux_stat(pid, raw)


def _scan_linux() -> list[_Proc]:
    try:
        entries = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError as exc:
        raise ProcessGroupError(f"Cannot enumerate processes: /proc is unreadable ({exc})") from exc
    # Processes vanish between the listing and the read: _read_linux says None, we skip them.
    return [proc for name in entries if (proc := _read_linux(int(name))) is not None]


def _ps(*args: str) -> list[list[str]]:
    # LC_ALL=C: ``lstart`` is printed in the C locale, so a stored value compares equal later.
    result = subprocess.run(
        ["ps", *args],
        capture_output=True,
        text=True,
        check=False,
        env={"LC_ALL": "C", "PATH": "/bin:/usr/bin"},
    )
    # ps exits 1 when ``-p PID`` matches nothing: that is "gone", not an error.
    return [line.split() for line in result.stdout.splitlines() if line.strip()]


def _read_darwin(pid: int) -> _Proc | None:
    for row in _ps("-o", "pid=,pgid=,stat=,lstart=", "-p", str(pid)):
        if len(row) >= 4 and row[0] == str(pid):
            return _Proc(pid, int(row[1]), row[2][:1], " ".join(row[3:]))
    return None


def _scan_darwin() -> list[_Proc]:
    return [
        _Proc(int(row[0]), int(row[1]), row[2][:1], None)
        for row in _ps("-A", "-o", "pid=,pgid=,stat=")
        if len(row) >= 3
    ]


def _read_proc(pid: int) -> _Proc | None:
    return _read_darwin(pid) if _IS_DARWIN else _read_linux(pid)


def _scan() -> list[_Proc]:
    return _scan_darwin() if _IS_DARWIN else _scan_linux()


def process_start_time(pid: int) -> str | None:
    """When ``pid`` started, as an opaque string that differs for a recycled pid; None if gone.

    Linux: field 22 of ``/proc/<pid>/stat`` (clock ticks since boot, decimal). macOS:
    ``ps -o lstart=`` in the C locale. A zombie still has its start time. This reads one file
    (Linux) or runs ``ps`` (macOS): call it from a thread when latency matters.
    """
    proc = _read_proc(pid)
    return None if proc is None else proc.start


def live_members(pgid: int) -> list[int]:
    """The pids in process group ``pgid`` that are alive — zombies and dead tasks excluded.

    Linux scans ``/proc/*/stat`` (processes that vanish mid-scan are skipped); macOS runs
    ``ps -A``. Sorted ascending. Blocking (about 6 µs per process on Linux): coroutines call
    it through ``asyncio.to_thread``.
    """
    return sorted(proc.pid for proc in _scan() if proc.pgid == pgid and proc.is_live)


# --- What is persisted, and what is reported ----------------------------------------------


@dataclass(frozen=True)
class GroupRecord:
    """The identity of a process group, persisted so that a recycled pid is never signalled.

    ``leader_start`` is :func:`process_start_time` of the leader. If the leader exited before it
    could be read (it lived less than a millisecond), Bothy's own start time is recorded
    instead: a lower bound, so a live pid with the recorded number reads as recycled (the safe
    direction) and members' start times still compare correctly.
    """

    pgid: int
    leader_pid: int
    leader_start: str

    def __post_init__(self) -> None:
        # pgid 0 means "my own group" to killpg, and 1 is init's: never let either be recorded.
        if self.pgid <= 1 or self.leader_pid <= 1:
            raise ProcessGroupError(
                f"Refusing a group record with pgid {self.pgid} and leader pid"
                f" {self.leader_pid}: both must be greater than 1"
            )

    def to_dict(self) -> dict[str, int | str]:
        """A JSON-ready mapping; :meth:`from_dict` reads it back."""
        return {"pgid": self.pgid, "leader_pid": self.leader_pid, "leader_start": self.leader_start}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> GroupRecord:
        """Read a record written by :meth:`to_dict`; a malformed one raises ProcessGroupError."""
        pgid, leader_pid, leader_start = (
            data.get("pgid"),
            data.get("leader_pid"),
            data.get("leader_start"),
        )
        if (
            type(pgid) is not int
            or type(leader_pid) is not int
            or not isinstance(leader_start, str)
            or not leader_start
        ):
            raise ProcessGroupError(f"Cannot read a group record from {dict(data)!r}")
        return cls(pgid, leader_pid, leader_start)

    def describe(self) -> str:
        """``pgid 4242 (leader 4242 started 123456)``, for logs and audit lines."""
        return f"pgid {self.pgid} (leader {self.leader_pid} started {self.leader_start})"


class Ending(StrEnum):
    """How a stop ended."""

    ALREADY_GONE = "already_gone"  # no live member was found: nothing was signalled
    TERMINATED = "terminated"  # every member was gone within the grace after SIGTERM
    KILLED = "killed"  # SIGKILL was needed, and worked
    SURVIVED = "survived"  # members were still alive after SIGKILL and the bounded wait


@dataclass(frozen=True)
class StopReport:
    """What :meth:`ProcessGroup.stop` did. ``returncode`` is the leader's (None if unreaped)."""

    ending: Ending
    survivors: tuple[int, ...]
    returncode: int | None
    elapsed_s: float

    def describe(self) -> str:
        """One line for logs and audit records."""
        text = f"{self.ending.value} in {self.elapsed_s:.2f}s, leader exit {self.returncode}"
        return text + (f", survivors {list(self.survivors)}" if self.survivors else "")


class OrphanVerdict(StrEnum):
    """What :func:`end_orphan_group` found and did."""

    GONE = "gone"  # no live member: nothing signalled
    RECYCLED = "recycled"  # the pid/pgid now belongs to another process: nothing signalled
    ENDED = "ended"  # live members were signalled and are gone
    SURVIVED = "survived"  # members outlived SIGKILL and the bounded wait


@dataclass(frozen=True)
class OrphanOutcome:
    """The result of :func:`end_orphan_group`: the verdict, who was signalled, who survived."""

    verdict: OrphanVerdict
    record: GroupRecord
    pids: tuple[int, ...] = ()  # the live members found and signalled
    survivors: tuple[int, ...] = ()
    killed: bool = False  # SIGKILL was sent (SIGTERM was not enough)

    def describe(self) -> str:
        """One line for logs and audit records: ``ended by SIGKILL: pgid 42 (…), pids [42, 43]``."""
        how = {
            OrphanVerdict.GONE: "already gone",
            OrphanVerdict.RECYCLED: "pid recycled, nothing signalled",
            OrphanVerdict.ENDED: "ended by SIGKILL" if self.killed else "ended by SIGTERM",
            OrphanVerdict.SURVIVED: "SURVIVED SIGKILL",
        }[self.verdict]
        text = f"{how}: {self.record.describe()}"
        if self.pids:
            text += f", pids {list(self.pids)}"
        return text + (f", survivors {list(self.survivors)}" if self.survivors else "")


# --- Ending a group: the shared core --------------------------------------------------------


@dataclass(frozen=True)
class _Census:
    """The live members of a recorded group, or proof that its pgid belongs to someone else."""

    members: tuple[int, ...]
    recycled: bool = False

    @property
    def gone(self) -> bool:
        return self.recycled or not self.members


def _started_before(proc: _Proc, leader_start: str) -> bool:
    """True if ``proc`` provably started before the leader (Linux ticks; unknown is False)."""
    if proc.start is None or not proc.start.isdigit() or not leader_start.isdigit():
        return False
    return int(proc.start) < int(leader_start)


def _census(record: GroupRecord) -> _Census:
    """Blocking: one read of the leader and one scan of the process table."""
    leader = _read_proc(record.leader_pid)
    if leader is not None and leader.start != record.leader_start:
        # pid N was handed out again, so group N had emptied first: nothing of ours is left.
        return _Census((), recycled=True)
    members = [proc for proc in _scan() if proc.pgid == record.pgid and proc.is_live]
    if any(_started_before(proc, record.leader_start) for proc in members):
        # A member older than the leader cannot be ours (extra safety; Linux only).
        return _Census((), recycled=True)
    return _Census(tuple(sorted(proc.pid for proc in members)))


async def _take_census(record: GroupRecord) -> _Census:
    # A scan costs ~6 µs per process: sub-millisecond here, but tens of milliseconds on a host
    # with thousands of processes, so it runs off the event loop.
    return await asyncio.to_thread(_census, record)


async def _wait_until_gone(record: GroupRecord, within_s: float) -> _Census:
    """Poll the census at a growing interval until the group is gone or ``within_s`` elapses."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    interval_s = _POLL_FIRST_S
    while True:
        census = await _take_census(record)
        remaining_s = deadline - loop.time()
        if census.gone or remaining_s <= 0:
            return census
        await asyncio.sleep(min(interval_s, remaining_s))
        interval_s = min(interval_s * 2, _POLL_MAX_S)


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the group; False if no member (not even a zombie) exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        raise ProcessGroupError(
            f"Cannot send {sig.name} to process group {pgid}: permission denied"
        ) from exc
    return True


async def _end_group(
    record: GroupRecord, *, grace_s: float, kill_wait_s: float
) -> tuple[Ending, tuple[int, ...]]:
    """TERM, bounded wait, KILL, bounded wait. The caller has just seen live members."""
    if not _signal_group(record.pgid, signal.SIGTERM):
        return Ending.ALREADY_GONE, ()
    if (await _wait_until_gone(record, grace_s)).gone:
        return Ending.TERMINATED, ()
    if not _signal_group(record.pgid, signal.SIGKILL):
        return Ending.TERMINATED, ()
    census = await _wait_until_gone(record, kill_wait_s)
    if census.gone:
        return Ending.KILLED, ()
    return Ending.SURVIVED, census.members


async def _start_time_now(pid: int) -> str | None:
    # Linux: one small /proc read, read at once — a thread hop would widen the window in which
    # a short-lived leader is reaped before its start time is seen. macOS runs ps: off the loop.
    if _IS_DARWIN:
        return await asyncio.to_thread(process_start_time, pid)
    return process_start_time(pid)


def _refuse_own_group(record: GroupRecord) -> None:
    if record.pgid == os.getpgrp():
        raise ProcessGroupError(
            f"Refusing to end process group {record.pgid}: it is Bothy's own group"
        )


# --- A group we started ---------------------------------------------------------------------


class GroupState(StrEnum):
    """A :class:`ProcessGroup`'s lifecycle, as Bothy drives it.

    There is no STARTING: the object exists only once the group is started and recorded.
    RUNNING means "not yet proven stopped" — the leader may have exited on its own.
    """

    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"


class ProcessGroup:
    """A child process in its own session and process group, and everything it forks.

    Create with :meth:`spawn`; end with :meth:`stop`, which is safe to call concurrently or
    repeatedly (every caller gets the one report).
    """

    def __init__(self, *, process: asyncio.subprocess.Process, record: GroupRecord) -> None:
        self.process = process
        self.record = record
        self._state = GroupState.RUNNING
        self._report: StopReport | None = None
        self._stopping: asyncio.Event | None = None

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        stdin: Redirect = asyncio.subprocess.PIPE,
        stdout: Redirect = asyncio.subprocess.PIPE,
        stderr: Redirect = asyncio.subprocess.PIPE,
        limit: int = _DEFAULT_LIMIT_BYTES,
    ) -> ProcessGroup:
        """Start ``argv`` as the leader of a new session and process group.

        ``env`` is the child's whole environment (not merged with ours); ``limit`` is the
        longest line, in bytes, that the stdout/stderr readers accept. An executable or a
        ``cwd`` that cannot be used raises :class:`ProcessGroupError` whose ``__cause__`` is the
        ``OSError`` (``FileNotFoundError`` for a missing executable).
        """
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                env=dict(env),
                cwd=cwd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                limit=limit,
                start_new_session=True,
            )
        except OSError as exc:
            raise ProcessGroupError(
                f"Cannot start process group for {list(argv)!r} in {cwd}: {exc.strerror or exc}"
            ) from exc
        # setsid() made the child the leader of a new group: pgid == pid (contracts.md §9).
        # The child watcher may already have reaped a child that exited at once; see GroupRecord.
        start = await _start_time_now(process.pid) or await _start_time_now(os.getpid())
        if start is None:  # pragma: no cover - our own process is always readable
            raise ProcessGroupError("Cannot read Bothy's own start time")
        return cls(process=process, record=GroupRecord(process.pid, process.pid, start))

    @property
    def state(self) -> GroupState:
        """Where this group is in its lifecycle."""
        return self._state

    @property
    def pgid(self) -> int:
        """The process group id (the leader's pid)."""
        return self.record.pgid

    def is_alive(self) -> bool:
        """True if any member of the group is alive (zombies are not).

        One ``/proc`` read while the leader lives; a full scan once it has exited (see
        :func:`live_members` for the cost).
        """
        leader = _read_proc(self.record.leader_pid)
        if leader is not None and leader.start == self.record.leader_start and leader.is_live:
            return True
        return not _census(self.record).gone

    async def stop(self, *, grace_s: float = 5.0, kill_wait_s: float = 5.0) -> StopReport:
        """SIGTERM the group, wait up to ``grace_s``, SIGKILL, wait up to ``kill_wait_s``.

        Then the leader is reaped and the report says how it ended. A concurrent call waits for
        the running stop and returns its report; a later call returns it at once. If the caller
        is cancelled mid-stop, the group is sent SIGKILL (when it is provably still ours) and
        the state returns to RUNNING, so a later ``stop()`` finishes the job.
        """
        while self._stopping is not None:
            await self._stopping.wait()
        if self._report is not None:
            return self._report
        stopping = self._stopping = asyncio.Event()
        self._state = GroupState.STOPPING
        try:
            self._report = await self._stop(grace_s=grace_s, kill_wait_s=kill_wait_s)
            self._state = GroupState.EXITED
            return self._report
        except BaseException:
            self._state = GroupState.RUNNING
            if self.process.returncode is None:
                # An unreaped leader holds pid N, so group N is still ours: KILL without waiting.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.record.pgid, signal.SIGKILL)
            raise
        finally:
            self._stopping = None
            stopping.set()

    async def _stop(self, *, grace_s: float, kill_wait_s: float) -> StopReport:
        loop = asyncio.get_running_loop()
        started = loop.time()
        survivors: tuple[int, ...] = ()
        if (await _take_census(self.record)).gone:
            ending = Ending.ALREADY_GONE
        else:
            ending, survivors = await _end_group(
                self.record, grace_s=grace_s, kill_wait_s=kill_wait_s
            )
        returncode = None
        if self.record.leader_pid not in survivors:
            returncode = await self._reap_leader(within_s=kill_wait_s)
        return StopReport(ending, survivors, returncode, loop.time() - started)

    async def _reap_leader(self, *, within_s: float) -> int | None:
        # The child watcher reaps the leader and sets ``returncode``; we wait for that, not for
        # ``process.wait()``, which (Python 3.11) also waits for stdout/stderr to close — and a
        # process that left the group with setsid() can hold them open for ever.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        interval_s = _POLL_FIRST_S
        while self.process.returncode is None and loop.time() < deadline:
            await asyncio.sleep(min(interval_s, max(deadline - loop.time(), 0)))
            interval_s = min(interval_s * 2, _POLL_MAX_S)
        return self.process.returncode

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.record.describe()} {self._state.value}>"


# --- A group a previous Bothy left behind ---------------------------------------------------


async def end_orphan_group(
    record: GroupRecord, *, grace_s: float = 5.0, kill_wait_s: float = 5.0
) -> OrphanOutcome:
    """End a group recorded by a Bothy that is gone — we are not its parent and cannot reap it.

    * leader pid alive (or a zombie) with another start time → ``RECYCLED``, nothing signalled;
    * no live member → ``GONE``, nothing signalled;
    * otherwise (the leader is ours, or it is gone and live members remain in its pgid, all
      started no earlier than it on Linux) → TERM, bounded wait, KILL → ``ENDED`` or
      ``SURVIVED``.

    Bothy's own process group is refused with :class:`ProcessGroupError`.
    """
    _refuse_own_group(record)
    census = await _take_census(record)
    if census.recycled:
        return OrphanOutcome(OrphanVerdict.RECYCLED, record)
    if not census.members:
        return OrphanOutcome(OrphanVerdict.GONE, record)
    ending, survivors = await _end_group(record, grace_s=grace_s, kill_wait_s=kill_wait_s)
    if ending is Ending.ALREADY_GONE:
        return OrphanOutcome(OrphanVerdict.GONE, record)
    verdict = OrphanVerdict.SURVIVED if ending is Ending.SURVIVED else OrphanVerdict.ENDED
    killed = ending in (Ending.KILLED, Ending.SURVIVED)
    return OrphanOutcome(verdict, record, census.members, survivors, killed)
