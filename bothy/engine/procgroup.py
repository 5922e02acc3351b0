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

The process table itself (rows, start times, the boot a start counts from) is read by
:mod:`bothy.engine.proctable` through psutil. A record written before a reboot is told apart
by its boot and signals nothing (``PREVIOUS_BOOT``): after a reboot no process of the old group
can exist. A record of the older, ticks-only form is still read, as ticks of this boot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from bothy.engine.proctable import (
    ProcessStart,
    boot_time_s,
    group_rows,
    matches,
    read_row,
)
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

_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.1
_DEFAULT_LIMIT_BYTES = 2**16  # asyncio's own default for StreamReader lines

Redirect = int | IO[Any] | None
"""What ``stdin``/``stdout``/``stderr`` accept: ``asyncio.subprocess.PIPE``, ``DEVNULL``, a file."""


# --- Reading the process table (bothy.engine.proctable) -----------------------------------


def process_start_time(pid: int) -> str | None:
    """When ``pid`` started, in the stored form of :class:`ProcessStart`; None if it is gone.

    Differs for a recycled pid and for a process of another boot. A zombie still has its start
    time. One short read of the process table (see :func:`~bothy.engine.proctable.read_row`).
    """
    row = read_row(pid)
    return None if row is None or row.start is None else row.start.encode()


def live_members(pgid: int) -> list[int]:
    """The pids in process group ``pgid`` that are alive — zombies and dead tasks excluded.

    Sorted ascending. Blocking (a ``getpgid`` per process on the machine): coroutines call it
    through ``asyncio.to_thread``.
    """
    return [row.pid for row in group_rows(pgid) if row.is_live]


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
    PREVIOUS_BOOT = "previous_boot"  # recorded before a reboot: nothing of it can be left
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
            OrphanVerdict.PREVIOUS_BOOT: "recorded before a reboot, nothing signalled",
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
    foreign: OrphanVerdict | None = None  # RECYCLED or PREVIOUS_BOOT: nothing there is ours

    @property
    def gone(self) -> bool:
        return self.foreign is not None or not self.members


def _census(record: GroupRecord) -> _Census:
    """Blocking: one read of the leader and one scan of the process table."""
    boot_s = boot_time_s()
    recorded = ProcessStart.parse(record.leader_start)
    if recorded is None:
        # A start we cannot read back (a macOS ``ps`` date of old) identifies nobody.
        return _Census((), foreign=OrphanVerdict.RECYCLED)
    if recorded.before_boot(boot_s):
        # Nothing survives a reboot: whoever holds pid or pgid N now is a stranger.
        return _Census((), foreign=OrphanVerdict.PREVIOUS_BOOT)
    leader = read_row(record.leader_pid, boot_s=boot_s)
    if leader is not None and not matches(leader.start, record.leader_start):
        # pid N was handed out again, so group N had emptied first: nothing of ours is left.
        return _Census((), foreign=OrphanVerdict.RECYCLED)
    members = [row for row in group_rows(record.pgid) if row.is_live]
    if any(row.start is not None and row.start.ticks < recorded.ticks for row in members):
        # A member older than the leader cannot be ours (extra safety).
        return _Census((), foreign=OrphanVerdict.RECYCLED)
    return _Census(tuple(row.pid for row in members))


async def _take_census(record: GroupRecord) -> _Census:
    # A scan costs a getpgid per process: sub-millisecond here, but tens of milliseconds on a
    # host with thousands of processes, so it runs off the event loop.
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
        # Read at once, not from a thread: a hop would widen the window in which a short-lived
        # leader is reaped before its start is seen.
        start = process_start_time(process.pid) or process_start_time(os.getpid())
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

        One read of the leader while it lives; a full scan once it has exited (see
        :func:`live_members` for the cost).
        """
        leader = read_row(self.record.leader_pid)
        if (
            leader is not None
            and leader.is_live
            and matches(leader.start, self.record.leader_start)
        ):
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
    if census.foreign is not None:
        return OrphanOutcome(census.foreign, record)
    if not census.members:
        return OrphanOutcome(OrphanVerdict.GONE, record)
    ending, survivors = await _end_group(record, grace_s=grace_s, kill_wait_s=kill_wait_s)
    if ending is Ending.ALREADY_GONE:
        return OrphanOutcome(OrphanVerdict.GONE, record)
    verdict = OrphanVerdict.SURVIVED if ending is Ending.SURVIVED else OrphanVerdict.ENDED
    killed = ending in (Ending.KILLED, Ending.SURVIVED)
    return OrphanOutcome(verdict, record, census.members, survivors, killed)
