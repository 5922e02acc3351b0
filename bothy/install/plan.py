"""A plan: what `bothy install` looked at, and every file and command it would touch.

The plan is computed once, before anything changes, from read-only checks; ``--dry-run``
prints it and ``--serve`` prints the same lines while carrying each step out, so what the
operator reads is what is done. A step already in place is left out (the plan says
``unchanged``), which makes a second run change nothing. Problems found while planning stop
the whole plan before its first step.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bothy.install.target import Account


@dataclass(frozen=True)
class WriteFile:
    """Write ``content`` to ``path`` with ``mode``, owned by ``owner`` (None: root/self)."""

    path: Path
    content: bytes
    mode: int
    owner: Account | None
    shown: str | None = None  # what the plan shows instead of the content (secrets)


@dataclass(frozen=True)
class MakeDir:
    path: Path
    mode: int
    owner: Account | None


@dataclass(frozen=True)
class RemoveFile:
    path: Path


@dataclass(frozen=True)
class Outcome:
    """What a command did."""

    code: int
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        return (self.stderr.strip() or self.stdout.strip()).replace("\n", " / ")


@dataclass(frozen=True)
class Run:
    """Run ``argv`` (no TTY, bounded). ``explain`` turns a failure into the operator's
    sentence; ``retry`` says whether a failure is worth another try (bounded); ``confirm``
    checks afterwards that the command did what it should, returning a problem or None."""

    argv: tuple[str, ...]
    timeout_s: float = 60.0
    explain: Callable[[Outcome], str] | None = None
    retry: Callable[[Outcome], bool] | None = None
    confirm: Callable[[], str | None] | None = None
    env: tuple[tuple[str, str], ...] = ()


Step = WriteFile | MakeDir | RemoveFile | Run
_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)


@dataclass
class Plan:
    """What one `bothy install` invocation would do."""

    title: str
    checks: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def write(self, step: WriteFile) -> None:
        """Add ``step`` unless the file is already exactly so."""
        if _file_in_place(step):
            self.unchanged.append(f"unchanged: {step.path}")
        else:
            self.steps.append(step)

    def make_dir(self, step: MakeDir) -> None:
        if step.path.is_dir():
            self.unchanged.append(f"unchanged: {step.path}/")
        else:
            self.steps.append(step)


def header_lines(plan: Plan) -> list[str]:
    """The lines printed before any step: the title, the checks, what is already in place."""
    return [plan.title, *plan.checks, *plan.unchanged]


def step_lines(step: Step) -> list[str]:
    """How the plan shows one step: every file with its content and mode, every command."""
    if isinstance(step, WriteFile):
        owner = step.owner.name if step.owner else "root"
        shown = step.shown if step.shown is not None else step.content.decode()
        body = [f"  | {line}" for line in shown.splitlines()]
        return [f"write {step.path} (mode {step.mode:04o}, owner {owner})", *body]
    if isinstance(step, MakeDir):
        owner = step.owner.name if step.owner else "root"
        return [f"mkdir {step.path} (mode {step.mode:04o}, owner {owner})"]
    if isinstance(step, RemoveFile):
        return [f"remove {step.path}"]
    prefix = "".join(f"{name}={shlex.quote(value)} " for name, value in step.env)
    return [f"run: {prefix}{shlex.join(step.argv)}"]


def plan_lines(plan: Plan) -> list[str]:
    lines = header_lines(plan)
    for step in plan.steps:
        lines += step_lines(step)
    return lines + [f"note: {note}" for note in plan.notes]


def carry_out(plan: Plan, out: Callable[[str], None]) -> str | None:
    """Do every step in order, printing each before it is done. Return the first failure."""
    for line in header_lines(plan):
        out(line)
    for step in plan.steps:
        for line in step_lines(step):
            out(line)
        problem = _do(step)
        if problem:
            return problem
    for note in plan.notes:
        out(f"note: {note}")
    return None


def _do(step: Step) -> str | None:
    try:
        if isinstance(step, WriteFile):
            _write(step)
        elif isinstance(step, MakeDir):
            _make_dirs(step.path, step.mode, step.owner)
        elif isinstance(step, RemoveFile):
            with contextlib.suppress(FileNotFoundError):
                step.path.unlink()
        else:
            return _run_step(step)
    except OSError as exc:
        return f"cannot change {exc.filename or '?'}: {exc.strerror or exc}"
    return None


def _run_step(step: Run) -> str | None:
    delays = iter(_RETRY_DELAYS_S)
    while True:
        outcome = run_command(step.argv, timeout_s=step.timeout_s, env=dict(step.env))
        if outcome.code == 0:
            return step.confirm() if step.confirm else None
        delay = next(delays, None) if step.retry and step.retry(outcome) else None
        if delay is None:
            if step.explain:
                return step.explain(outcome)
            return f"`{shlex.join(step.argv)}` failed (exit {outcome.code}): {outcome.text}"
        print(f"retry: `{shlex.join(step.argv)}` failed (exit {outcome.code}: {outcome.text});"
              f" trying again in {delay:g} s", flush=True)
        time.sleep(delay)


def run_command(
    argv: tuple[str, ...] | list[str], *, timeout_s: float = 30.0, env: dict[str, str] | None = None
) -> Outcome:
    """Run an outside command with no TTY and a bound; a missing one exits 127."""
    try:
        done = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout_s, env={**os.environ, **(env or {})}, check=False,
        )
    except FileNotFoundError:
        return Outcome(127, "", f"{argv[0]}: command not found")
    except PermissionError as exc:
        return Outcome(126, "", f"{argv[0]}: {exc.strerror}")
    except subprocess.TimeoutExpired:
        return Outcome(124, "", f"{argv[0]} did not finish within {timeout_s:g} s")
    return Outcome(done.returncode, done.stdout, done.stderr)


def _file_in_place(step: WriteFile) -> bool:
    try:
        info = step.path.stat()
        content = step.path.read_bytes()
    except OSError:
        return False
    owner_ok = step.owner is None or info.st_uid == step.owner.uid
    return content == step.content and (info.st_mode & 0o7777) == step.mode and owner_ok


def _write(step: WriteFile) -> None:
    """Write beside the target, set mode and owner, fsync, rename: the file appears at its
    name already with its owner and mode (so nothing under BOTHY_HOME is ever root's)."""
    _make_dirs(step.path.parent, 0o755 if step.owner is None else 0o700, step.owner)
    partial = step.path.with_name(f".{step.path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            if step.owner is not None and os.geteuid() == 0:
                os.fchown(fd, step.owner.uid, step.owner.gid)
            os.fchmod(fd, step.mode)
            view = memoryview(step.content)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, step.path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _make_dirs(path: Path, mode: int, owner: Account | None) -> None:
    """Create ``path`` and missing parents; those created are given to ``owner``."""
    missing = [path, *path.parents]
    for directory in reversed([d for d in missing if not d.exists()]):
        directory.mkdir(mode=mode)
        if owner is not None and os.geteuid() == 0:
            os.chown(directory, owner.uid, owner.gid)

