"""The ``bothy`` command: parse (``bothy.commandline``), dispatch to ``bothy.commands``, map
errors to exit codes.

The only module that exits; it calls ``asyncio.run`` once per command. Exit codes are
:class:`bothy.exitcodes.ExitCode`. Nothing heavy is imported here: ``bothy status`` runs
without argparse, an event loop, the engine or pydantic models whenever it can, so it starts
fast.
"""

from __future__ import annotations

import gc
import os
import sys

from bothy.errors import (
    AuditIntegrityError,
    BothyError,
    ChatAuthError,
    ChatUnavailable,
    CodexNotFoundError,
    ConfigError,
    StateCorruptError,
    TemporaryFailure,
    UsageError,
)
from bothy.exitcodes import ExitCode
from bothy.pydanticplugins import look_for_plugins_only_when_on

# ``typing`` costs a cold ``bothy status`` several milliseconds and is only needed by mypy
# here (every annotation is a string); mypy reads any ``if TYPE_CHECKING:`` as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Coroutine, Sequence
    from typing import Any


def _config_exit(command: str, message: str) -> int:
    """78 (do not restart me) — except `serve` under launchd, which cannot filter exit codes
    and would relaunch a 78 every 10 s forever (docs/RUNBOOK.md): there the error is written
    to ``$BOTHY_HOME/state/config-error.txt`` and the exit is 0, so launchd leaves it down."""
    import os

    if command != "serve" or os.environ.get("BOTHY_SERVICE_MANAGER") != "launchd":
        return ExitCode.CONFIG
    from bothy.home import BothyHome

    state = BothyHome.from_env().state_dir
    from bothy.atomicfile import write_atomically

    try:
        write_atomically(state / "config-error.txt", (message + "\n").encode())
    except OSError as exc:
        print(f"bothy: could not record the configuration error: {exc}", file=sys.stderr)
    print("bothy: not restarting under launchd; fix the configuration, then"
          " `launchctl kickstart` the job", file=sys.stderr)
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    # pydantic looks for plugins among every installed distribution's entry points when it
    # builds the config's first model (a scan on every start of every command); Bothy uses
    # none. An operator who wants one sets the variable (pydantic's docs: "Plugins").
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    # ...and pydantic's loader of them, which imports importlib.metadata to scan for them
    # even when they are off, is not imported unless they are on (bothy/pydanticplugins.py).
    look_for_plugins_only_when_on()
    try:
        code = _main(argv)
        if sys.stdout is not None:  # None when started with standard output closed (>&-)
            sys.stdout.flush()  # here, so a closed pipe is met inside the try
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """The reader of our output went away (``bothy audit | head``): not an error of ours.

    stdout is pointed at /dev/null so that the interpreter's last flush does not meet the
    closed pipe again (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
    """
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return ExitCode.OK


def _main(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words in (["status"], ["status", "--json"]):
        # What a monitoring script runs every minute, so its two exact forms are read without
        # argparse, whose import and parsers are a third of status's own start (issue 18). Any
        # other line (an abbreviation, --help, a typo) goes through the grammar, which knows
        # these two as well and parses them to the same.
        return _answered("status", lambda: _status(as_json=len(words) == 2))
    from bothy.commandline import parse_command_line

    args = parse_command_line(argv)
    return _answered(args.command, lambda: _dispatch(args))


def _answered(command: str, work: Callable[[], int]) -> int:
    """``work``'s exit code, or the one its error means, said on standard error."""
    try:
        return work()
    except StateCorruptError as exc:
        print(f"bothy: {exc}", file=sys.stderr)
        return ExitCode.STATE
    except ConfigError as exc:
        print(f"bothy: configuration error: {exc}", file=sys.stderr)
        return _config_exit(command, str(exc))
    except CodexNotFoundError as exc:  # as much "do not restart me" as a bad config file
        print(f"bothy: {exc}", file=sys.stderr)
        return _config_exit(command, str(exc))
    except UsageError as exc:
        print(f"bothy: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except ChatAuthError as exc:
        print(f"bothy: configuration error: {exc}", file=sys.stderr)
        return _config_exit(command, str(exc))
    except (TemporaryFailure, ChatUnavailable) as exc:
        print(f"bothy: temporary failure: {exc}", file=sys.stderr)
        return ExitCode.TEMPFAIL
    except AuditIntegrityError as exc:
        print(f"bothy: {exc}", file=sys.stderr)
        # A broken register is not mended by restarting: serve says so as a config error does.
        return _config_exit(command, str(exc)) if command == "serve" \
            else ExitCode.FAILED
    except BothyError as exc:
        print(f"bothy: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    except KeyboardInterrupt:
        return ExitCode.CANCELLED


def _status(as_json: bool) -> int:
    """Synchronous on purpose: no event loop, no engine, pydantic only if the config changed.

    A read that exits once it has printed, so the garbage collector is off throughout and
    what it made is frozen before the exit: the interpreter's last collection would walk
    every object it holds only to free memory the exit frees anyway (a tenth of a cold
    status's instructions, more than its own imports; issue 18).
    """
    gc.disable()
    try:
        import json

        from bothy.home import BothyHome
        from bothy.status import collect_status, render_status, status_view

        home = BothyHome.from_env()
        report = collect_status(home, status_view(home))
        print(json.dumps(report, indent=2) if as_json else render_status(report))
        gc.freeze()
    finally:
        gc.enable()  # a caller in the same process (a test, a tool) gets its collector back
    return ExitCode.OK


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "status":
        return _status(args.json)
    if args.command in ("install", "funnel"):  # no event loop: they only run commands
        from bothy.commands.install import cmd_funnel, cmd_install

        return cmd_install(args) if args.command == "install" else cmd_funnel(args)
    from bothy import commands

    if args.command == "trace" or (args.command == "audit" and args.action is None):
        # Reads of the register, with no event loop: a run's records come through the index.
        return int(commands.cmd_trace(args) if args.command == "trace"
                   else commands.read_audit(args))
    return _run_async(args)


# The commands that run under an event loop, and the name of each one's coroutine function.
_ASYNC_COMMANDS = {
    "run": "cmd_run",
    "cancel": "cmd_cancel",
    "audit": "cmd_audit",
    "doctor": "cmd_doctor",
    "answer": "cmd_answer",
    "checklist": "cmd_checklist",
    "profile": "cmd_profile",
    "serve": "cmd_daemon",
    "schedule": "cmd_schedule",
    "sop": "cmd_sop",
    "memory": "cmd_memory",
}


def _run_async(args: argparse.Namespace) -> int:
    """Run the command's coroutine, the one ``asyncio.run`` of this process.

    The garbage collector is paused while the command starts: the imports and the config's
    validation make what lives on and next to no garbage, yet the collector would walk it
    some eighty times over (~20 ms of CPU of `bothy run` here, issue 18). It is turned back
    on, with what start-up made frozen, the first time the command waits on anything, by
    when its start is over. (`bothy serve` pauses it on its own until it is ready:
    commands/operate.py, daemon.py.)
    """
    paused = args.command != "serve"
    if paused:
        gc.disable()
    try:
        import asyncio

        from bothy import commands

        work = getattr(commands, _ASYNC_COMMANDS[args.command])(args)
        try:
            return int(asyncio.run(_collecting_once_started(work) if paused else work))
        except asyncio.CancelledError:
            print("bothy: stopped by a second signal before the run could settle",
                  file=sys.stderr)
            return ExitCode.CANCELLED
    finally:
        if paused:
            gc.enable()


async def _collecting_once_started(work: Coroutine[Any, Any, Any]) -> Any:
    import asyncio  # (loaded already: this runs under asyncio.run)

    # A callback runs when the loop next has control: when ``work`` first waits.
    asyncio.get_running_loop().call_soon(_collect_from_now)
    return await work


def _collect_from_now() -> None:
    """Collect again, leaving out what start-up made (frozen: it lives as long as the command
    does), or the first collection would walk all of it at once. The price: the little
    garbage start-up left in cycles (about a thousand objects, under a megabyte, measured for
    `bothy run`) is kept too; collecting it first would cost what the pause saved."""
    gc.freeze()
    gc.enable()
