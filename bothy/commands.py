"""What each ``bothy`` command does. Returns exit codes; ``bothy.cli`` parses and exits.

Heavy imports (the engine, pydantic models) happen inside the command that needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from bothy.errors import ConfigError, UsageError
from bothy.exitcodes import OUTCOME_EXIT, ExitCode

if TYPE_CHECKING:
    from bothy.config import Config
    from bothy.engine.run import RunRequest, RunResult
    from bothy.home import BothyHome
    from bothy.runtime import Runtime
    from bothy.sops import SopLibrary
    from bothy.wakes.schedules import Schedule


def _load() -> tuple[BothyHome, Config]:
    from bothy.config import load_config
    from bothy.home import BothyHome

    home = BothyHome.from_env()
    return home, load_config(home.config_path)


async def cmd_run(args: argparse.Namespace) -> int:
    from bothy.engine.run import RunRequest
    from bothy.runtime import Runtime

    home, cfg = _load()
    request = RunRequest(
        prompt=_read_prompt(args.prompt),
        subject=_subject(args.subject),
        source="cli",
        max_usd_micros=_max_usd(args.max_usd, cfg),
        wall_clock_s=_tighter(args.wall_clock, "--wall-clock", cfg.limits.wall_clock_s,
                              "limits.wall_clock_s"),
        max_tokens=_tighter(args.max_tokens, "--max-tokens", cfg.limits.max_tokens,
                            "limits.max_tokens"),
        profile=_profile(args.profile, cfg),
        # A foreground run may hold a question: answered at the terminal or by `bothy answer`.
        can_hold=True,
    )
    _check_workspace(home, cfg)
    async with Runtime.open(home, cfg) as rt:
        result = await _foreground(rt, request)
    return _report(result)


def _check_workspace(home: BothyHome, cfg: Config) -> None:
    from bothy.engine.supervisor import workspace_problem

    if problem := workspace_problem(cfg.workspace):
        raise ConfigError(f"{problem} (config key 'workspace' in {home.config_path})",
                          path=home.config_path, key="workspace")


async def _foreground(rt: Runtime, request: RunRequest) -> RunResult:
    """Run ``request`` here, showing progress on stderr; a first signal stops it gracefully."""
    from bothy.engine.questions import QuestionBoard

    supervisor = rt.supervisor()
    await supervisor.recovery.sweep()
    progress = _progress()
    answers = _TerminalAnswers(progress, QuestionBoard(rt.db, clock=rt.clock))
    try:
        result: RunResult = await _until_signal(
            lambda: supervisor.execute(request, answers), supervisor.stopping
        )
    finally:
        answers.close()
    if hasattr(progress, "finish"):
        progress.finish()
    return result


def _report(result: RunResult) -> int:
    """Print a run's one line (outcome, id, cost, answer or reason); return its exit code."""
    from bothy.money import format_usd

    answered = result.outcome in ("completed", "verified")
    shown = result.answer if answered else (result.reason or "")
    cost = format_usd(result.cost_micros, 4)
    print(f"{result.outcome} {result.run_id} {cost} usd {shown}".rstrip())
    return OUTCOME_EXIT.get(result.outcome, ExitCode.FAILED)


class _TerminalAnswers:
    """Passes progress through; when a question is shown and stdin is a terminal, the next
    line typed answers it (as ``bothy answer`` would from another shell)."""

    def __init__(self, inner: Any, board: Any) -> None:
        self._inner = inner
        self._board = board
        self._run_id: str | None = None
        self._reading = False
        self._pending: set[asyncio.Task[Any]] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def question(self, run_id: str, text: str) -> None:
        self._inner.question(run_id, text)
        self._run_id = run_id
        if sys.stdin.isatty() and not self._reading:
            asyncio.get_running_loop().add_reader(sys.stdin.fileno(), self._line)
            self._reading = True

    def _line(self, *_: Any) -> None:
        line = sys.stdin.readline().strip()
        if line and self._run_id is not None:
            by = f"{os.environ.get('USER', 'operator')}@terminal"
            task = asyncio.ensure_future(self._board.answer(self._run_id, line, by))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def close(self) -> None:
        if self._reading:
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            self._reading = False


async def _until_signal(work: Callable[[], Awaitable[Any]], stopping: asyncio.Event) -> Any:
    """Run ``work``. A first SIGINT/SIGTERM only records the wish (``stopping``): the run
    stops itself, settles and reaps its group. A second one skips the waits."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work())

    def on_signal() -> None:
        if stopping.is_set():
            task.cancel("a second stop signal")
        stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        return await task
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _progress() -> Any:
    from bothy.progress import PlainProgress, TerminalProgress

    return TerminalProgress() if sys.stderr.isatty() else PlainProgress()


def _profile(name: str | None, cfg: Config) -> str | None:
    if name is not None and name not in cfg.profiles:
        known = ", ".join(sorted(cfg.profiles)) or "none are configured"
        raise UsageError(f"--profile {name!r} is not a configured profile ({known})")
    return name


def _read_prompt(prompt: str) -> str:
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise UsageError("the prompt is empty: give the text to run, or '-' to read stdin")
    return text


def _subject(subject: str) -> str:
    if not subject or any(ch.isspace() for ch in subject) or len(subject) > 200:
        raise UsageError(f"--subject {subject!r} must be one word (no spaces), e.g. pr:42")
    return subject


def _tighter(value: int | None, flag: str, configured: int | None, key: str) -> Any:
    """A flag may tighten a configured limit, never loosen it."""
    if value is None:
        return configured
    if value <= 0:
        raise UsageError(f"{flag} must be a positive number, not {value}")
    if configured is not None and value > configured:
        raise UsageError(
            f"{flag} {value} is above the configured {key} ({configured}): a flag may tighten"
            " a limit, not loosen it"
        )
    return value


def _max_usd(value: str | None, cfg: Config) -> int:
    from bothy.money import usd_to_micros

    per_run = usd_to_micros(cfg.budget.per_run_usd)
    if value is None:
        return per_run
    try:
        amount = usd_to_micros(Decimal(value))
    except (InvalidOperation, ValueError, OverflowError):
        raise UsageError(f"--max-usd {value!r} is not an amount in usd, e.g. 0.25") from None
    if amount <= 0:
        raise UsageError(f"--max-usd must be more than 0, not {value}")
    if amount > per_run:
        raise UsageError(
            f"--max-usd {value} is more than budget.per_run_usd ({cfg.budget.per_run_usd}):"
            " a run may reserve less than the per-run limit, never more"
        )
    return amount


async def cmd_cancel(args: argparse.Namespace) -> int:
    from bothy.runtime import Runtime

    home, cfg = _load()
    async with Runtime.open(home, cfg) as rt:
        return await _cancel(rt, args.run_id)


async def _cancel(rt: Runtime, run_id: str) -> int:
    from bothy.engine.pool import WorkerPool

    row = await rt.db.run(run_id)
    if row is None:
        raise UsageError(f"no run {run_id!r} in this site's state (see `bothy status`)")
    if row.status == "finished":
        print(f"{run_id} already finished: {row.outcome}")
        return ExitCode.FAILED
    await WorkerPool(rt.db, rt.cfg.pool, clock=rt.clock).request_cancel(run_id)
    await rt.audit.record("run", "cancel-requested", "ok", subject=row.subject, run_id=run_id)
    await rt.recovery().sweep()  # an orphan has nobody to hear the request: end it here
    deadline = asyncio.get_running_loop().time() + rt.cfg.limits.stop_grace_s + 15
    while asyncio.get_running_loop().time() < deadline:
        current = await rt.db.run(run_id)
        if current is not None and current.status == "finished":
            print(f"{current.outcome} {run_id}")
            return ExitCode.OK
        await asyncio.sleep(0.1)
    print(f"cancel requested for {run_id}; it has not finished yet (see `bothy status`)")
    return ExitCode.TEMPFAIL


async def cmd_audit(args: argparse.Namespace) -> int:
    from bothy.engine.audit import AuditLog
    from bothy.home import BothyHome

    home = BothyHome.from_env()
    log = AuditLog(home.audit_path)
    if args.action == "verify":
        report = await asyncio.to_thread(log.verify)
        if report.ok:
            print(f"audit chain intact: {report.count} records verified")
            return ExitCode.OK
        print(f"audit chain broken: {report.problem}")
        return ExitCode.FAILED
    since = _since(args.since) if args.since else None
    records = await asyncio.to_thread(lambda: list(log.records(run_id=args.run_id, since=since)))
    for record in records:
        print(record.to_json() if args.json else record.human_line())
    return ExitCode.OK


def _since(value: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(
            f"--since {value!r} is not an ISO-8601 time, e.g. 2026-09-24T10:00Z"
        ) from None
    if moment.tzinfo is None:
        raise UsageError(f"--since {value!r} needs a time zone, e.g. 2026-09-24T10:00+00:00")
    return moment


async def cmd_doctor(args: argparse.Namespace) -> int:
    from bothy.doctor import run_doctor

    report = await run_doctor()
    for line in report.lines():
        print(line)
    if report.config_error:
        return ExitCode.CONFIG
    return ExitCode.FAILED if report.failed else ExitCode.OK




async def cmd_answer(args: argparse.Namespace) -> int:
    from bothy.engine.questions import Delivered, QuestionBoard
    from bothy.runtime import Runtime

    home, cfg = _load()
    text = args.text.strip()
    if not text:
        raise UsageError("the answer is empty: give yes, no, or the text to send")
    by = f"{os.environ.get('USER', 'operator')}@shell"
    async with Runtime.open(home, cfg) as rt:
        row = await rt.db.run(args.run_id)
        if row is None:
            raise UsageError(f"no run {args.run_id!r} in this site's state (see `bothy status`)")
        result = await QuestionBoard(rt.db, clock=rt.clock).answer(args.run_id, text, by)
        if isinstance(result, Delivered):
            await rt.audit.record("answer", "received", "ok", subject=row.subject,
                                  run_id=args.run_id, details={"by": by, "answer": text,
                                                               "question": result.question})
            print(f"answered {args.run_id}: {result.question}")
            return ExitCode.OK
        await rt.audit.record("answer", "late", "ok", subject=row.subject, run_id=args.run_id,
                              details={"by": by, "answer": text,
                                       "note": "nothing was waiting: the run had moved on"})
        print(f"{args.run_id} has no pending question: the run had moved on (recorded as late)")
        return ExitCode.FAILED


async def cmd_checklist(args: argparse.Namespace) -> int:
    from bothy.engine.checklist import Checklist
    from bothy.home import BothyHome

    checklist = Checklist(BothyHome.from_env().checklist_path)
    text = await asyncio.to_thread(checklist.render)
    print(text or "(the checklist is empty)")
    return ExitCode.OK


async def cmd_profile(args: argparse.Namespace) -> int:
    from bothy.profiles import describe_profile, profile_lines

    _, cfg = _load()
    if args.action == "list":
        for line in profile_lines(cfg) or ["(no profiles configured)"]:
            print(line)
        return ExitCode.OK
    if args.name not in cfg.profiles:
        known = ", ".join(sorted(cfg.profiles)) or "none are configured"
        raise UsageError(f"no profile {args.name!r} ({known})")
    print(describe_profile(args.name, cfg.profiles[args.name]))
    return ExitCode.OK


async def cmd_serve(args: argparse.Namespace) -> int:
    from bothy.daemon import Daemon

    home, cfg = _load()
    return await Daemon(home, cfg).serve()


# -- schedules and SOPs ------------------------------------------------------------------


async def cmd_schedule(args: argparse.Namespace) -> int:
    handler = {"add": _schedule_add, "list": _schedule_list, "rm": _schedule_rm,
               "run": _schedule_run}[args.action]
    return await handler(args)


async def _schedule_add(args: argparse.Namespace) -> int:
    from bothy.runtime import Runtime
    from bothy.wakes.schedules import ScheduleStore

    home, cfg = _load()
    schedule = await _new_schedule(args, home, cfg)
    async with Runtime.open(home, cfg) as rt:
        added = await ScheduleStore(rt.db, timezone=cfg.budget.timezone, clock=rt.clock).add(
            schedule)
        if added is None:
            raise UsageError(f"there is already a schedule {schedule.name!r}: remove it first"
                             f" (bothy schedule rm {schedule.name}) to replace it")
        await rt.audit.record("schedule", "added", "ok", subject=added.subject, details={
            "cron": added.cron, "what": added.what, "profile": added.profile,
            "verify_argv": added.verify_argv, "verify_regex": added.verify_regex,
            "max_usd_micros": added.max_usd_micros})
    print(f"added {added.name}: {added.what} at '{added.cron}' ({cfg.budget.timezone}),"
          f" next fire {_when(added.next_fire_us, cfg.budget.timezone)}")
    return ExitCode.OK


async def _new_schedule(args: argparse.Namespace, home: BothyHome, cfg: Config) -> Schedule:
    """The schedule the flags describe; UsageError saying which flag is wrong."""
    from bothy.sops import SopLibrary
    from bothy.wakes.schedules import Schedule, cron_trigger, schedule_name_problem

    if problem := schedule_name_problem(args.name):
        raise UsageError(problem)
    cron_trigger(args.cron, cfg.budget.timezone)
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty: give the text the schedule should run")
    if args.sop is not None:
        missing = await asyncio.to_thread(SopLibrary(home.sops_dir).missing, args.sop)
        if missing:
            raise UsageError(f"--sop {args.sop}: {missing}")
    kind = "heartbeat" if args.heartbeat else "sop" if args.sop is not None else "prompt"
    return Schedule(
        name=args.name, cron=args.cron, kind=kind, prompt=args.prompt, sop=args.sop,
        profile=_profile(args.profile, cfg), verify_argv=_verify_argv(args.verify_cmd),
        verify_regex=_verify_regex(args.verify_regex),
        max_usd_micros=_max_usd(args.max_usd, cfg) if args.max_usd is not None else None,
    )


def _verify_argv(command: str | None) -> list[str] | None:
    import shlex

    if command is None:
        return None
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UsageError(f"--verify-cmd {command!r} cannot be split like a shell line ({exc})"
                         ) from None
    if not argv:
        raise UsageError("--verify-cmd is empty: give the command that checks the work,"
                         " e.g. --verify-cmd 'make test'")
    return argv


def _verify_regex(pattern: str | None) -> str | None:
    import re

    if pattern is None:
        return None
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"--verify-regex {pattern!r} is not a regular expression ({exc})"
                         ) from None
    return pattern


async def _schedule_list(args: argparse.Namespace) -> int:
    from bothy.clock import to_us, utc_now
    from bothy.runtime import Runtime
    from bothy.wakes.schedules import ScheduleStore, cron_trigger, next_fire

    home, cfg = _load()
    zone = cfg.budget.timezone
    async with Runtime.open(home, cfg) as rt:
        found = await ScheduleStore(rt.db, timezone=zone, clock=rt.clock).all()
    if not found:
        print("(no schedules: add one with bothy schedule add NAME --cron ... --heartbeat)")
        return ExitCode.OK
    rows = []
    for schedule in found:
        upcoming = next_fire(cron_trigger(schedule.cron, zone), utc_now())
        row = [schedule.name, schedule.cron, schedule.what,
               f"next {_when(to_us(upcoming) if upcoming else None, zone)}"]
        if schedule.last_fire_us is not None:
            row.append(f"last {_when(schedule.last_fire_us, zone)}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join([*(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])), *row[3:]]))
    return ExitCode.OK


def _when(micros: int | None, zone: str) -> str:
    """A time for a person, in the budget's time zone: ``2026-09-25 03:00 CEST``."""
    from zoneinfo import ZoneInfo

    from bothy.clock import from_us

    if micros is None:
        return "never"
    return f"{from_us(micros).astimezone(ZoneInfo(zone)):%Y-%m-%d %H:%M %Z}"


async def _schedule_rm(args: argparse.Namespace) -> int:
    from bothy.runtime import Runtime
    from bothy.wakes.schedules import ScheduleStore

    home, cfg = _load()
    async with Runtime.open(home, cfg) as rt:
        store = ScheduleStore(rt.db, timezone=cfg.budget.timezone, clock=rt.clock)
        if not await store.remove(args.name):
            raise UsageError(f"there is no schedule {args.name!r} (see bothy schedule list)")
        await rt.audit.record("schedule", "removed", "ok", subject=f"schedule:{args.name}")
    print(f"removed {args.name}")
    return ExitCode.OK


async def _schedule_run(args: argparse.Namespace) -> int:
    """Run a schedule now, here, as its fire would: the same request, shown like bothy run."""
    from bothy.engine.run import new_run_id
    from bothy.runtime import Runtime
    from bothy.wakes.schedules import ScheduleStore, Unrunnable, schedule_request

    home, cfg = _load()
    _check_workspace(home, cfg)
    async with Runtime.open(home, cfg) as rt:
        schedule = await ScheduleStore(rt.db, timezone=cfg.budget.timezone,
                                       clock=rt.clock).get(args.name)
        if schedule is None:
            raise UsageError(f"there is no schedule {args.name!r} (see bothy schedule list)")
        request = await schedule_request(schedule, cfg, home, run_id=new_run_id(rt.clock),
                                         details={"fire": "bothy schedule run"})
        if isinstance(request, Unrunnable):
            raise UsageError(f"schedule {args.name!r} cannot run: {request.reason}")
        result = await _foreground(rt, request)
    return _report(result)


async def cmd_sop(args: argparse.Namespace) -> int:
    from bothy.home import BothyHome
    from bothy.sops import SopLibrary

    home = BothyHome.from_env()
    library = SopLibrary(home.sops_dir)
    if args.action == "list":
        summaries = await asyncio.to_thread(library.summaries)
        for summary in summaries:
            print(f"{summary.name}  {summary.size_bytes} bytes  {summary.title}".rstrip())
        if not summaries:
            print("(no SOPs: write one with bothy sop set NAME --file FILE)")
        return ExitCode.OK
    if args.action == "show":
        text = await asyncio.to_thread(library.read, args.name)
        if text is None:
            raise UsageError(f"there is no SOP {args.name!r} (see bothy sop list)")
        print(text, end="" if text.endswith("\n") else "\n")
        return ExitCode.OK
    return await _sop_set(args, home, library)


async def _sop_set(args: argparse.Namespace, home: BothyHome, library: SopLibrary) -> int:
    import hashlib
    from pathlib import Path

    from bothy.engine.audit import AuditLog

    if (args.file is None) == (args.stdin is None):
        raise UsageError("give the SOP's text with --file FILE, or '-' to read standard input"
                         " (one of the two)")
    if args.stdin is not None and args.stdin != "-":
        raise UsageError(f"unexpected {args.stdin!r}: use --file {args.stdin} to read a file,"
                         " or '-' for standard input")
    library.path(args.name)  # a bad name is refused before anything is read
    try:
        data = await asyncio.to_thread(
            sys.stdin.buffer.read if args.file is None else Path(args.file).read_bytes)
    except OSError as exc:
        raise UsageError(f"--file {args.file} cannot be read: {exc.strerror or exc}") from None
    home.ensure()
    size = await asyncio.to_thread(library.write, args.name, data)
    await AuditLog(home.audit_path).record("sop", "saved", "ok", subject=f"sop:{args.name}",
                                           details={"bytes": size,
                                                    "sha256": hashlib.sha256(data).hexdigest()})
    print(f"saved SOP {args.name} ({size} bytes)")
    return ExitCode.OK
