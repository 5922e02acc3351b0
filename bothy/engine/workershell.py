"""What the model's shell commands see that Bothy never handed them: variables exported by the
worker user's shell startup files.

Codex runs the model's commands in the user's shell, and that shell reads its startup files
for them. Codex's shell snapshot (on by default in 0.171.0) starts a login shell once and
re-exports what it found before every command; without the snapshot, commands run in a login
shell; and bash reads ``~/.bashrc`` even in a shell that is neither, when its standard input
is a socket, as codex's is. So a variable exported there reaches the model whatever
``shell_environment_policy`` excludes: that policy filters the environment codex hands the
shell, not what the shell's own files export next (measured on the pinned codex:
tests/test_run_cli.py). An operator who keeps a token in ``~/.profile`` hands it to the model.

:func:`exported_by_startup_files` starts the worker's shell twice, as a login shell and as an
interactive one (between them, every startup file bash and zsh read), with the environment
codex would give it, and names the variables they export that Bothy keeps from the model.
Names only: no value is ever read or said.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shlex
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.launch import Launch, shell_excluded

__all__ = ["StartupExports", "exported_by_startup_files", "worker_shell"]

# A login shell reads the profile files (.profile, .bash_profile, .zprofile); an interactive
# one the rc files (.bashrc, .zshrc); zsh reads .zshenv in both.
_STARTS = ("-lc", "-ic")
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
    """The shell codex runs the model's commands in: ``SHELL`` as the worker has it, else the
    user's login shell."""
    return env.get("SHELL") or pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"


async def exported_by_startup_files(
    launch: Launch, excludes: Sequence[str], *, cwd: Path, timeout_s: float = 10.0,
) -> StartupExports:
    """Start the worker's shell as a login shell, then as an interactive one, in ``cwd`` with
    the worker's environment less what ``excludes`` keeps from the model (what codex hands
    it), and name every variable they end up with that ``excludes`` covers: none of those
    was handed to them, so their startup files exported it.

    Raises TimeoutError when a start takes longer than ``timeout_s``, and OSError when the
    shell cannot be started or does not run the command it was given. Each start is a
    process group of its own, killed whole on a timeout or a cancellation (a startup file's
    own children too)."""
    shell = worker_shell(launch.env)
    handed = {name: value for name, value in launch.env.items()
              if not shell_excluded(name, excludes)}
    command = f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_NAMES)}"
    found: set[str] = set()
    for start in _STARTS:
        out, err, code = await _run([shell, start, command], env=handed, cwd=cwd,
                                    timeout_s=timeout_s)
        _, mark, names = out.rpartition(_MARK)
        if not mark:
            said = err.decode(errors="replace").strip().splitlines()
            raise OSError(f"{shell} {start} did not run the command it was given (exit"
                          f" {code}{': ' + said[-1][:200] if said else ''})")
        found.update(name for name in os.fsdecode(names).split("\0")
                     if name and shell_excluded(name, excludes))
    return StartupExports(shell, tuple(sorted(found)))


async def _run(argv: list[str], *, env: dict[str, str], cwd: Path,
               timeout_s: float) -> tuple[bytes, bytes, int]:
    """Run ``argv`` in a process group of its own, whole-killed past ``timeout_s``."""
    process = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await process.communicate()
    except BaseException:  # the timeout, or a cancellation: nothing of it may stay
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.shield(process.wait())
        raise
    assert process.returncode is not None
    return out, err, process.returncode
