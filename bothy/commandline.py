"""The ``bothy`` command line's grammar: every command, its arguments and their help.

Only the command the line names has its parser built (argparse looks up translations for
every parser it makes); a line that names none (``--help``, a typo) gets all of them. A bad
line exits 64, with the usage of the command it named.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from bothy import __version__
from bothy.exitcodes import ExitCode

TYPE_CHECKING = False  # (typing is for mypy only: see bothy/cli.py)
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["parse_command_line"]


def parse_command_line(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command ``argv`` (default: this process's arguments) names, parsed; a bad line is
    answered with its usage and exit 64 (``SystemExit``)."""
    return _parser(argv).parse_args(argv)


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter, given the terminal's width itself: argparse makes one for
    every argument added, and left to find the width it imports shutil (with zlib, bz2 and
    lzma), milliseconds of every cold start."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None, **later: Any) -> None:  # (later Pythons add some)
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width, **later)


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it: ``$COLUMNS``, else the
    terminal on standard output, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    stdout = sys.__stdout__
    if columns <= 0 and stdout is not None:
        try:
            columns = os.get_terminal_size(stdout.fileno()).columns
        except (AttributeError, ValueError, OSError):  # not a terminal, or no descriptor
            columns = 0
    return columns if columns > 0 else 80


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage; Bothy's contract says 64 (EX_USAGE)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"bothy: error: {message}", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE)


class _Subparser(_Parser):
    """A subcommand refuses what it does not know itself, so its own usage is shown
    (argparse would hand the leftovers up and print the top-level usage)."""

    def parse_known_args(  # type: ignore[override]  # (typeshed's overloads; same behaviour)
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


class _Unbuilt:
    """Stands in for a subcommand's parser that this command line does not name: whatever is
    asked of it (add_argument, add_subparsers, ...) is nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self


class _Wanted:
    """The subcommands, of which only the one the command line names is built: building all
    of them is most of a `bothy status` (argparse looks up translations for every parser)."""

    def __init__(self, commands: Any, wanted: str | None) -> None:
        self._commands = commands
        self._wanted = wanted
        self.found = wanted is None

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if self._wanted is None or name == self._wanted:
            self.found = True
            return self._commands.add_parser(name, **kwargs)
        return _Unbuilt()


def _parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. When the first word of ``argv`` is a command, only that
    command's parser is built; anything else (``--help``, a typo) gets all of them."""
    words = list(sys.argv[1:] if argv is None else argv)
    first = words[0] if words and not words[0].startswith("-") else None
    parser, found = _build_parser(first)
    return parser if found else _build_parser(None)[0]


def _build_parser(wanted: str | None) -> tuple[argparse.ArgumentParser, bool]:
    parser = _Parser(
        prog="bothy", description="A supervised Codex harness for unattended machines."
    )
    parser.add_argument("--version", action="version", version=f"bothy {__version__}")
    commands = _Wanted(
        parser.add_subparsers(dest="command", required=True, parser_class=_Subparser), wanted)
    # (each command's behaviour lives in bothy.commands; status in bothy.status)

    run = commands.add_parser("run", help="run one prompt through a supervised codex worker")
    run.add_argument("prompt", help="the prompt; '-' reads it from standard input")
    run.add_argument(
        "--subject", default="cli", help="the lane (runs in one lane go one at a time)"
    )
    run.add_argument("--max-usd", help="reserve this much instead of budget.per_run_usd")
    run.add_argument("--max-tokens", type=int, help="stop the run past this many tokens")
    run.add_argument("--wall-clock", type=int, help="stop the run after this many seconds")
    run.add_argument("--profile", help="grant the tools of this profile (see bothy profile list)")
    run.add_argument("--ref", help="tie the run to this task in Cairn, e.g. ACME-12")

    answer = commands.add_parser("answer", help="answer a run's pending question")
    answer.add_argument("run_id")
    answer.add_argument("text", help="yes or no for an approval, free text for a question")

    checklist = commands.add_parser("checklist", help="print the standing checklist")
    checklist.add_argument("--json", action="store_true")
    commands.add_parser("serve", help="run the daemon: webhook listeners and the dispatcher")

    profile = commands.add_parser("profile", help="what the configured profiles grant")
    profile_actions = profile.add_subparsers(dest="action", required=True, parser_class=_Subparser)
    profile_actions.add_parser("list", help="one line per profile").add_argument(
        "--json", action="store_true")
    show = profile_actions.add_parser("show", help="the resolved grant of one profile")
    show.add_argument("name")
    show.add_argument("--json", action="store_true")

    _schedule_parser(commands)
    _sop_parser(commands)
    _memory_parser(commands)

    status = commands.add_parser("status", help="what is running, queued and spent")
    status.add_argument("--json", action="store_true")

    cancel = commands.add_parser("cancel", help="interrupt a queued or running run")
    cancel.add_argument("run_id")

    audit = commands.add_parser(
        "audit", help="print the audit log, verify its chain, or repair a broken one")
    audit.add_argument("action", nargs="?", choices=["verify", "repair", "head"])
    audit.add_argument("--run", dest="run_id", help="only the records of this run")
    audit.add_argument("--since", help="only records at or after this ISO-8601 time")
    audit.add_argument("--json", action="store_true")

    trace = commands.add_parser("trace", help="a run's whole story: a tree of spans, or OTLP")
    trace.add_argument("run_id")
    trace.add_argument("--json", action="store_true", help="print OTLP/JSON")
    trace.add_argument("--otlp", metavar="URL", help="POST it once to this OTLP/HTTP address")

    doctor = commands.add_parser("doctor", help="check this installation, one line per check")
    doctor.add_argument("--json", action="store_true")
    _install_parsers(commands)
    return parser, commands.found


def _install_parsers(commands: Any) -> None:
    install = commands.add_parser(
        "install", help="install bothy serve as a service (systemd or launchd) + tailscale serve")
    mode = install.add_mutually_exclusive_group()
    mode.add_argument("--serve", action="store_true",
                      help="install the service and tailscale serve for the tailnet port")
    mode.add_argument("--uninstall", action="store_true", help="undo what --serve did")
    install.add_argument("--dry-run", action="store_true",
                         help="print every check, file and command, and change nothing")
    install.add_argument("--home", help="the BOTHY_HOME (default: the user's ~/.bothy)")
    install.add_argument("--user", help="the account to run as (default: SUDO_USER)")
    install.add_argument("--manager", choices=["systemd", "launchd"],
                         help="default: systemd on Linux, launchd on macOS")
    install.add_argument("--unit", choices=["system", "user"],
                         help="systemd: a system unit with User= (default under root) or a"
                              " user unit")
    install.add_argument("--no-tailscale", action="store_true",
                         help="install the service only, without tailscale serve")
    funnel = commands.add_parser(
        "funnel", help="print the tailscale funnel commands the config implies")
    funnel.add_argument("--home", help="the BOTHY_HOME (default: $BOTHY_HOME or ~/.bothy)")


def _schedule_parser(commands: Any) -> None:
    schedule = commands.add_parser("schedule", help="cron wakes run by bothy serve")
    actions = schedule.add_subparsers(dest="action", required=True, parser_class=_Subparser)
    add = actions.add_parser("add", help="add a schedule (cron in budget.timezone)")
    add.add_argument("name", help="a short name: letters, digits, '-' or '_'")
    add.add_argument("--cron", required=True,
                     help='crontab: minute hour day-of-month month day-of-week, e.g. "0 3 * * *"'
                          " (days of week by name: mon-fri)")
    what = add.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="run this prompt")
    what.add_argument("--sop", help="follow this written procedure (see bothy sop list)")
    what.add_argument("--heartbeat", action="store_true",
                      help="look over the standing checklist; NO_REPLY when all is well")
    what.add_argument("--dream", action="store_true",
                      help="fold the day notes of --profile (memory on) into MEMORY.md, USER.md")
    add.add_argument("--profile", help="grant the tools of this profile")
    check = add.add_mutually_exclusive_group()
    check.add_argument("--verify-cmd", metavar="ARGV",
                       help="verify the work with this command (split like a shell; exit 0 = good)")
    check.add_argument("--verify-regex", metavar="RE",
                       help="verify that the final answer matches this regular expression")
    add.add_argument("--max-usd", help="reserve this much per fire instead of budget.per_run_usd")
    add.add_argument("--ref", help="tie each fire's run to this task in Cairn, e.g. ACME-12")
    add.add_argument("--report-to", metavar="PLATFORM:CHANNEL",
                     help="post its findings here (e.g. slack:C0OPS) instead of the alert channel")
    add.add_argument("--preflight-cmd", metavar="ARGV",
                     help="--heartbeat only: run this first (split like a shell); the model is"
                          " woken only if it fails or its output changed since the last fire")
    actions.add_parser("list", help="one line per schedule, with its next fire").add_argument(
        "--json", action="store_true")
    remove = actions.add_parser("rm", help="remove a schedule")
    remove.add_argument("name")
    run_now = actions.add_parser("run", help="run a schedule now, in the foreground")
    run_now.add_argument("name")


def _sop_parser(commands: Any) -> None:
    sop = commands.add_parser("sop", help="written procedures that schedules can follow")
    actions = sop.add_subparsers(dest="action", required=True, parser_class=_Subparser)
    actions.add_parser("list", help="one line per SOP").add_argument("--json", action="store_true")
    show = actions.add_parser("show", help="print one SOP")
    show.add_argument("name")
    put = actions.add_parser("set", help="write an SOP from a file, or '-' for standard input")
    put.add_argument("name")
    put.add_argument("stdin", nargs="?", metavar="-", help="read the text from standard input")
    put.add_argument("--file", help="read the text from this file")


def _memory_parser(commands: Any) -> None:
    memory = commands.add_parser("memory", help="what profiles' memory holds; undo a dream")
    actions = memory.add_subparsers(dest="action", required=True, parser_class=_Parser)
    show = actions.add_parser("show", help="persona, notes and sizes of each memory profile")
    search = actions.add_parser("search", help="search the day notes")
    search.add_argument("query")
    search.add_argument("--limit", type=int, default=20, help="at most this many results")
    preimages = actions.add_parser("preimages", help="what dreams and restores replaced")
    for reader in (show, search, preimages):
        reader.add_argument("--profile", help="only this profile")
        reader.add_argument("--json", action="store_true")
    restore = actions.add_parser("restore", help="put a preimage back (keeping one of now)")
    restore.add_argument("preimage", help="a preimage id, from bothy memory preimages")
