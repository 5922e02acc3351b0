"""What the model's shell commands see that Bothy never handed them: variables exported by the
worker account's shell startup files.

Codex runs the model's commands in the account's shell, and that shell reads its startup files
for them. Codex's shell snapshot (on by default in 0.171.0) starts a login shell once and
re-exports what it found before every command; without the snapshot, commands run in a login
shell; and bash reads ``~/.bashrc`` in a shell that is neither when its standard input is a
socket and no ``SHLVL`` is set, as codex starts it. So a variable exported there reaches the
model whatever ``shell_environment_policy`` excludes: that policy filters the environment
codex hands the shell, not what the shell's own files export next (measured on the pinned
codex: tests/test_run_cli.py). An operator who keeps a token in ``~/.profile`` hands it to the
model.

:func:`exported_by_startup_files` starts the shell codex would choose (:func:`worker_shell`)
the two ways codex does, with the environment codex would give it, and names the variables
they export that Bothy keeps from the model. Names only: no value is ever read or said.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bothy.engine.launch import Launch, shell_excluded

__all__ = ["StartupExports", "exported_by_startup_files", "worker_shell"]

_CODEX_SHELLS = ("bash", "zsh", "sh")  # an account's shell codex runs commands in as it is
_MARK = b"bothy-names:"
# The names of the environment the shell ends up with, NUL-separated after the mark (whatever
# a startup file prints before it is passed over); values are never written.
_NAMES = ("import os, sys; sys.stdout.buffer.write(b'bothy-names:'"
          " + b'\\0'.join(os.fsencode(name) for name in os.environ))")


@dataclass(frozen=True)
class StartupExports:
    """What the startup files of ``shell`` export that the model's shell must not see."""

    shell: str
    names: tuple[str, ...]  # sorted


def worker_shell(env: dict[str, str]) -> str:
    """The shell codex runs the model's commands in (as observed on codex 0.171.0, which
    ignores ``SHELL``): the account's own when it is bash, zsh or sh, else the first of bash
    and zsh on the worker's ``PATH``, else ``/bin/sh``."""
    with contextlib.suppress(KeyError):  # an account the system has no entry for
        own = pwd.getpwuid(os.getuid()).pw_shell
        if own and Path(own).name in _CODEX_SHELLS and os.access(own, os.X_OK):
            return own
    for name in ("bash", "zsh"):
        if found := shutil.which(name, path=env.get("PATH", os.defpath)):
            return found
    return "/bin/sh"


async def exported_by_startup_files(
    launch: Launch, excludes: Sequence[str], *, cwd: Path, timeout_s: float = 10.0,
) -> StartupExports:
    """Start the worker's shell as codex does, as a login shell (its snapshot, or a login
    command) and as a plain one reading a socket without ``SHLVL`` (a command), in ``cwd``
    with the worker's environment less what ``excludes`` keeps from the model (what codex
    hands it), and name every variable they end up with that ``excludes`` covers: none of
    those was handed to them, so their startup files exported it.

    Raises TimeoutError when a start takes longer than ``timeout_s``, and OSError when the
    shell cannot be started or does not run the command it was given. Each start is a
    process group of its own, killed whole once it is over (whatever a startup file left
    running), on a timeout or on a cancellation."""
    shell = worker_shell(launch.env)
    handed = {name: value for name, value in launch.env.items()
              if not shell_excluded(name, excludes) and name != "SHLVL"}
    # -I: whatever PYTHONPATH or PYTHONHOME a startup file sets, the names are printed.
    command = f"exec {shlex.quote(sys.executable)} -I -c {shlex.quote(_NAMES)}"
    found: set[str] = set()
    for flag, on_a_socket in (("-lc", False), ("-c", True)):
        out, code = await _run([shell, flag, command], env=handed, cwd=cwd,
                               on_a_socket=on_a_socket, timeout_s=timeout_s)
        _, mark, names = out.rpartition(_MARK)
        if not mark:  # (what it said on stderr is not repeated: it may hold a value)
            raise OSError(f"{shell} {flag} did not run the command it was given (exit {code});"
                          f" run `{shell} {flag} true` as the worker's account to see why")
        found.update(name for name in os.fsdecode(names).split("\0")
                     if name and shell_excluded(name, excludes))
    return StartupExports(shell, tuple(sorted(found)))


async def _run(argv: list[str], *, env: dict[str, str], cwd: Path, on_a_socket: bool,
               timeout_s: float) -> tuple[bytes, int]:
    """Run ``argv`` in a process group of its own, its input a socket or nothing, its output
    in a file (a child a startup file leaves behind holds no pipe open); wait ``timeout_s`` at
    most for it, then kill the group whole. Its output, and its exit code."""
    given, kept = socket.socketpair() if on_a_socket else (None, None)
    with await asyncio.to_thread(tempfile.TemporaryFile) as out:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=cwd,
                stdin=given.fileno() if given is not None else asyncio.subprocess.DEVNULL,
                stdout=out, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
            try:
                async with asyncio.timeout(timeout_s):
                    code = await process.wait()
            finally:  # over, timed out or cancelled: nothing of it may stay
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await asyncio.shield(process.wait())  # reaped (killed, it ends at once)
        finally:
            for end in (given, kept):
                if end is not None:
                    end.close()
        return await asyncio.to_thread(_written, out), code


def _written(out: IO[bytes]) -> bytes:
    out.seek(0)
    return out.read()
