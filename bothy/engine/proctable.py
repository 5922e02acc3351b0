"""The process table, read through psutil: who is alive, in which group, and since when.

psutil reads ``/proc`` on Linux and ``sysctl`` on macOS (and is tested on both upstream), so
Bothy keeps no parser of its own. This module answers three questions and nothing else:

* :func:`read_row` — one process: its group, whether it is alive (a zombie is not), its start;
* :func:`group_rows` — every process whose process group is ``pgid``, zombies included;
* :func:`same_process` — is ``pid`` still the process a record names (not a recycled pid)?

A process is identified by (pid, start). A start is stored as text (:class:`ProcessStart`):
``"<ticks>@<boot>"`` — clock ticks (``SC_CLK_TCK``) from boot to the process's start, and the
boot's own time in whole seconds since the epoch (psutil's ``boot_time``). Ticks since boot
never move when the wall clock is stepped, so they are what is compared; the boot says which
boot the ticks count from. Rows written before psutil hold ticks alone (``"123456"``, field 22
of ``/proc/<pid>/stat``): they are still understood, as ticks of the current boot.

A record is judged to come from an *earlier boot* when the process it names started, by the
record's own figures, before the current boot did (beyond a second or two of rounding): no
process of that boot can exist any more, so the pid is someone else's. A wall clock stepped
forward, between the record and the check, by more than the recorded process's age at the
time, would make a record of this boot look older than the boot: that errs towards "not the
same process" (nothing is signalled).
"""

from __future__ import annotations

import os

import psutil

__all__ = [
    "ProcessRow",
    "ProcessStart",
    "boot_time_s",
    "group_rows",
    "matches",
    "read_row",
    "same_process",
]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_DEAD = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
# /proc/stat's btime is whole seconds and two readings may round apart: one second, and one
# more for psutil's float arithmetic, before a record is called older than this boot.
_BOOT_SLACK_S = 2


class _Value:
    """A small immutable value, compared by its fields in ``_FIELDS``' order. (Not a
    dataclass: ``bothy status`` reads the process table when a daemon is published, and
    ``dataclasses``, with the ``inspect`` it imports, was a fifth of that status's start;
    issue 18.)"""

    __slots__ = ()
    _FIELDS: tuple[str, ...] = ()

    def _set(self, **values: object) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot set {name!r}")

    def _fields(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, _Value):
            return NotImplemented
        return other._fields() == self._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"{type(self).__name__}({shown})"


class ProcessStart(_Value):
    """When a process started: clock ticks since boot, and that boot (None in an old record)."""

    __slots__ = ("boot_s", "ticks")
    _FIELDS = ("ticks", "boot_s")
    ticks: int
    boot_s: int | None

    def __init__(self, ticks: int, boot_s: int | None) -> None:
        self._set(ticks=ticks, boot_s=boot_s)

    def encode(self) -> str:
        """The stored form: ``"<ticks>@<boot>"``, or bare ``"<ticks>"`` for an old record."""
        return str(self.ticks) if self.boot_s is None else f"{self.ticks}@{self.boot_s}"

    @classmethod
    def parse(cls, text: str) -> ProcessStart | None:
        """Read a stored start; None if it is neither form (then it matches no process)."""
        ticks, at, boot = text.partition("@")
        if not ticks.isdigit() or (at and not boot.isdigit()):
            return None
        return cls(int(ticks), int(boot) if at else None)

    def before_boot(self, boot_s: int) -> bool:
        """True if this start, by its own boot's clock, is earlier than the boot ``boot_s``."""
        if self.boot_s is None:
            return False  # an old record: which boot it counts from was never written down
        return self.boot_s + self.ticks / _TICKS_PER_S + _BOOT_SLACK_S < boot_s


class ProcessRow(_Value):
    """One row of the process table, as far as Bothy cares."""

    __slots__ = ("is_live", "pgid", "pid", "start")
    _FIELDS = ("pid", "pgid", "is_live", "start")
    pid: int
    pgid: int
    is_live: bool  # False for a zombie or a dead task
    start: ProcessStart | None  # None if the table would not say (it was exiting)

    def __init__(self, pid: int, pgid: int, is_live: bool, start: ProcessStart | None) -> None:
        self._set(pid=pid, pgid=pgid, is_live=is_live, start=start)


def boot_time_s() -> int:
    """When this machine booted, in whole seconds since the epoch (psutil's ``boot_time``)."""
    return round(psutil.boot_time())


def read_row(pid: int, *, boot_s: int | None = None) -> ProcessRow | None:
    """The row of ``pid``, or None if there is no such process (or it is hidden from us).

    ``boot_s`` saves a read of the boot time when the caller has one. Blocking but short:
    one ``/proc/<pid>/stat`` read on Linux, one ``sysctl`` on macOS.
    """
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            status = process.status()
            created_s = _created_s(process)
        pgid = os.getpgid(pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
        # Gone (or mid-exit), or hidden from us by hidepid — then we could not signal it either.
        # (psutil.ZombieProcess is a NoSuchProcess: only raised where a zombie shows nothing.)
        return None
    boot = boot_time_s() if boot_s is None else boot_s
    start = None if created_s is None else ProcessStart(_ticks_since(created_s, boot), boot)
    return ProcessRow(pid, pgid, status not in _DEAD, start)


def group_rows(pgid: int) -> list[ProcessRow]:
    """Every process in process group ``pgid``, zombies included, sorted by pid.

    Blocking: one ``getpgid`` per process on the machine, then a row for each member.
    Processes that vanish mid-scan are skipped. Coroutines call it through a thread.
    """
    boot = boot_time_s()
    rows = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        row = read_row(pid, boot_s=boot)
        if row is not None and row.pgid == pgid:
            rows.append(row)
    return sorted(rows, key=lambda row: row.pid)


def same_process(pid: int, recorded: str) -> bool:
    """True if ``pid`` is still the process whose start was recorded as ``recorded``.

    A zombie still counts (it keeps its start until reaped); a recycled pid, a record from an
    earlier boot, or a start that cannot be read back does not.
    """
    row = read_row(pid)
    return row is not None and matches(row.start, recorded)


def matches(start: ProcessStart | None, recorded: str) -> bool:
    """True if a process that started at ``start`` is the one recorded as ``recorded``."""
    wanted = ProcessStart.parse(recorded)
    if start is None or wanted is None or start.boot_s is None:
        return False
    return wanted.ticks == start.ticks and not wanted.before_boot(start.boot_s)


def _created_s(process: psutil.Process) -> float | None:
    try:
        return process.create_time()
    except psutil.ZombieProcess:
        return None  # a zombie whose start the table no longer shows (macOS)


def _ticks_since(created_s: float, boot_s: int) -> int:
    # On Linux psutil's create_time is starttime_ticks / SC_CLK_TCK + btime: subtracting the
    # same btime gives the kernel's own tick count back exactly (a double holds it to ~1e-7 s).
    return round((created_s - boot_s) * _TICKS_PER_S)
