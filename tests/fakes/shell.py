"""An operator's shell on a test site: ``bothy`` commands started, watched and cleaned up.

``Shell.start`` runs the real CLI as a subprocess (through :meth:`Site.start`) and reads its
stdout and stderr as they come, so a test can wait for a line (``bothy: waiting: ...``)
while the command still runs, signal it, and collect what it printed when it ends::

    async with Shell(site) as shell:
        first = await shell.start("run", "hello", "--subject", "pr:42")
        run_id = await first.admitted()
        done = await first.finish()

Leaving the ``async with`` SIGKILLs every command still running and ends every worker group
the site's state database recorded (through Bothy's own :func:`end_orphan_group`, which never
signals a recycled pid) — whatever the test's fate.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bothy.engine.audit import AuditLog, AuditRecord
from bothy.engine.procgroup import GroupRecord, end_orphan_group
from bothy.engine.run import wake_id_for
from tests.fakes.site import Completed, Site

DEADLINE_S = 30.0
"""How long any one wait may take before the test fails (a 2-core machine, other suites)."""

_ADMITTED = re.compile(r"^bothy: admitted (run_\S+)$")


class _Lines:
    """The lines of one output stream, as they arrive."""

    def __init__(self, name: str, reader: asyncio.StreamReader) -> None:
        self.name = name
        self.lines: list[str] = []
        self.ended = False
        self._changed = asyncio.Condition()
        self.task = asyncio.create_task(self._pump(reader))

    async def _pump(self, reader: asyncio.StreamReader) -> None:
        while raw := await reader.readline():
            async with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._changed.notify_all()
        async with self._changed:
            self.ended = True
            self._changed.notify_all()

    def _search(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        return next((m for line in self.lines if (m := pattern.search(line))), None)

    async def first(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str] | None:
        """The first line matching ``pattern``; None if the stream ended without one."""
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(
                    lambda: self._search(pattern) is not None or self.ended
                )
        except TimeoutError:
            raise AssertionError(
                f"no {self.name} line matching {pattern.pattern!r} within {timeout_s:g} s;"
                f" so far: {self.lines!r}"
            ) from None
        return self._search(pattern)

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)


class Command:
    """One running ``bothy`` command."""

    def __init__(self, args: tuple[str, ...], process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None and process.stderr is not None
        self.args = args
        self.process = process
        self.stdout = _Lines("stdout", process.stdout)
        self.stderr = _Lines("stderr", process.stderr)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    async def line(
        self, pattern: str, *, stream: str = "stderr", timeout_s: float = DEADLINE_S
    ) -> re.Match[str]:
        """Wait for a line matching the regex ``pattern``; fail if the command ends first."""
        lines = self.stderr if stream == "stderr" else self.stdout
        found = await lines.first(re.compile(pattern), timeout_s)
        if found is None:
            raise AssertionError(
                f"`bothy {' '.join(self.args)}` ended without a {stream} line matching"
                f" {pattern!r}; stdout {self.stdout.lines!r}, stderr {self.stderr.lines!r}"
            )
        return found

    async def admitted(self, *, timeout_s: float = DEADLINE_S) -> str | None:
        """The run id once ``bothy run`` says it was admitted; None if it ended unadmitted."""
        found = await self.stderr.first(_ADMITTED, timeout_s)
        return found.group(1) if found else None

    def signal(self, signum: signal.Signals) -> None:
        if self.running:
            self.process.send_signal(signum)

    async def finish(self, *, timeout_s: float = DEADLINE_S) -> Completed:
        """Wait for the command to exit and return what it printed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.process.wait()
                await asyncio.gather(self.stdout.task, self.stderr.task)
        except TimeoutError:
            raise AssertionError(
                f"`bothy {' '.join(self.args)}` still running after {timeout_s:g} s;"
                f" stdout {self.stdout.lines!r}, stderr {self.stderr.lines!r}"
            ) from None
        assert self.process.returncode is not None
        return Completed(self.process.returncode, self.stdout.text(), self.stderr.text())

    async def kill(self) -> None:
        """SIGKILL the command (not its workers: they live in their own groups) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DEADLINE_S):
                await self.process.wait()
        for lines in (self.stdout, self.stderr):
            lines.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lines.task


class Shell:
    """Starts ``bothy`` commands on ``site``; ends all of them, and their workers, on exit."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self._commands: list[Command] = []

    async def start(self, *args: str, **extra_env: str) -> Command:
        command = Command(args, await self.site.start(*args, **extra_env))
        self._commands.append(command)
        return command

    async def bothy(self, *args: str, timeout_s: float = DEADLINE_S) -> Completed:
        """Run ``bothy ARGS`` to completion."""
        return await (await self.start(*args)).finish(timeout_s=timeout_s)

    async def close(self) -> None:
        for command in self._commands:
            await command.kill()
        for record in await asyncio.to_thread(recorded_groups, self.site.home):
            await end_orphan_group(record, grace_s=1.0, kill_wait_s=5.0)

    async def __aenter__(self) -> Shell:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def recorded_groups(home: Path) -> list[GroupRecord]:
    """Every worker group the site's state database knows of, spares too (blocking)."""
    path = home / "state" / "bothy.sqlite3"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        # A command killed while it made the database may leave it without tables yet.
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'runs'").fetchone():
            return []
        rows = db.execute(
            "SELECT pgid, leader_pid, leader_start FROM runs WHERE pgid IS NOT NULL"
        ).fetchall()
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'spares'").fetchone():
            rows += db.execute("SELECT pgid, leader_pid, leader_start FROM spares").fetchall()
    finally:
        db.close()
    return [GroupRecord(pgid, leader, start) for pgid, leader, start in rows]


def state_rows(site: Site, query: str) -> list[tuple[Any, ...]]:
    """The rows ``query`` reads from the site's state database (read-only; blocking)."""
    db = sqlite3.connect(f"file:{site.home / 'state' / 'bothy.sqlite3'}?mode=ro", uri=True)
    try:
        return db.execute(query).fetchall()
    finally:
        db.close()


def audit_records(
    site: Site, where: Callable[[AuditRecord], bool] | None = None
) -> list[AuditRecord]:
    """The site's audit records, in order (optionally only those ``where`` accepts)."""
    records = AuditLog(site.audit_path).records()
    return [record for record in records if where is None or where(record)]


def of_run(run_id: str) -> Callable[[AuditRecord], bool]:
    """Whether a record is the run's, or that of the wake that asked for it (a wake has no run
    yet: its details carry the wake id the run's records name), as `bothy audit --run` picks."""
    wake_id = wake_id_for(run_id)
    return lambda r: r.run_id == run_id or (
        r.run_id is None and r.kind == "wake" and r.details.get("wake_id") == wake_id)


def runs_of_wakes(site: Site) -> dict[str, str]:
    """Wake id → the run it asked for, from the run records that name the wake."""
    return {str(r.details["wake_id"]): str(r.run_id) for r in audit_records(site)
            if r.kind == "run" and r.run_id is not None and "wake_id" in r.details}


def started_group(site: Site, run_id: str) -> GroupRecord:
    """The worker group of ``run_id``, as its ``run started`` audit record names it."""
    started = audit_records(
        site, lambda r: r.run_id == run_id and (r.kind, r.event) == ("run", "started")
    )
    assert len(started) == 1, f"{run_id} has {len(started)} 'run started' records"
    return GroupRecord.from_dict(started[0].details)


async def until(condition: Callable[[], bool], what: str, *, timeout_s: float = DEADLINE_S) -> None:
    """Wait for ``condition`` (re-checked every 50 ms) or fail saying ``what`` never happened."""
    try:
        async with asyncio.timeout(timeout_s):
            # The condition is another process's state (a file, /proc): there is no event to
            # await, only a poll.
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_s:g} s") from None
