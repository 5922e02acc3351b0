"""Commands for scheduled jobs and their written procedures (SOPs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

from bothy.commands._shared import load
from bothy.commands.foreground import (
    check_profile,
    check_ref,
    check_workspace,
    report_result,
    reservation_micros,
    run_in_foreground,
)
from bothy.errors import UsageError
from bothy.exitcodes import ExitCode

if TYPE_CHECKING:
    from bothy.config import Config
    from bothy.home import BothyHome
    from bothy.sops import SopLibrary
    from bothy.wakes.schedules import Schedule


# -- schedules and SOPs ------------------------------------------------------------------


async def cmd_schedule(args: argparse.Namespace) -> int:
    handler = {"add": _schedule_add, "list": _schedule_list, "rm": _schedule_rm,
               "run": _schedule_run}[args.action]
    return await handler(args)


async def _schedule_add(args: argparse.Namespace) -> int:
    from bothy.runtime import Runtime
    from bothy.wakes.schedules import ScheduleStore

    home, cfg = load()
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
            "max_usd_micros": added.max_usd_micros, "ref": added.ref,
            "report_to": added.report_to, "preflight_argv": added.preflight_argv})
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
    kind = ("heartbeat" if args.heartbeat else "dream" if args.dream
            else "sop" if args.sop is not None else "prompt")
    if kind == "dream":
        _dream_profile(args.profile, cfg)
    return Schedule(
        name=args.name, cron=args.cron, kind=kind, prompt=args.prompt, sop=args.sop,
        profile=check_profile(args.profile, cfg), verify_argv=_verify_argv(args.verify_cmd),
        verify_regex=_verify_regex(args.verify_regex),
        max_usd_micros=reservation_micros(args.max_usd, cfg) if args.max_usd is not None else None,
        ref=check_ref(args.ref), report_to=_report_to(args.report_to, cfg),
        preflight_argv=_preflight_argv(args.preflight_cmd, kind),
    )


def _report_to(target: str | None, cfg: Config) -> str | None:
    """Where the schedule's findings go: a channel of a platform this site has configured."""
    from bothy.config import report_to_problem

    if target is not None and (problem := report_to_problem(target, cfg.chat)):
        raise UsageError(f"--report-to {problem}")
    return target


def _preflight_argv(command: str | None, kind: str) -> list[str] | None:
    if command is None:
        return None
    if kind != "heartbeat":
        raise UsageError("--preflight-cmd goes with --heartbeat: it decides whether the"
                         " heartbeat wakes the model")
    return _argv("--preflight-cmd", command, "give the check to run first,"
                 " e.g. --preflight-cmd 'df -h /srv'")


def _dream_profile(name: str | None, cfg: Config) -> None:
    """A dream consolidates one profile's memory: --profile must name one that has it."""
    with_memory = sorted(n for n, p in cfg.profiles.items() if p.memory is not None)
    if name is None or name not in with_memory:
        known = ", ".join(with_memory) or 'none has "memory" on'
        given = f" {name!r} has no memory" if name is not None else " is missing"
        raise UsageError(f"--dream needs --profile naming a profile with memory on: --profile"
                         f"{given} (profiles with memory: {known})")


def _verify_argv(command: str | None) -> list[str] | None:
    if command is None:
        return None
    return _argv("--verify-cmd", command, "give the command that checks the work,"
                 " e.g. --verify-cmd 'make test'")


def _argv(flag: str, command: str, example: str) -> list[str]:
    """A command given as one shell-like line, split into its argv."""
    import shlex

    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UsageError(f"{flag} {command!r} cannot be split like a shell line ({exc})"
                         ) from None
    if not argv:
        raise UsageError(f"{flag} is empty: {example}")
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

    home, cfg = load()
    zone = cfg.budget.timezone
    async with Runtime.open(home, cfg) as rt:
        found = await ScheduleStore(rt.db, timezone=zone, clock=rt.clock).all()
    listed: list[dict[str, Any]] = []
    for schedule in found:
        upcoming = next_fire(cron_trigger(schedule.cron, zone), utc_now())
        listed.append({"name": schedule.name, "cron": schedule.cron, "what": schedule.what,
                       "profile": schedule.profile,
                       "next_fire": _when(to_us(upcoming) if upcoming else None, zone),
                       "last_fire": _when(schedule.last_fire_us, zone)})
    if args.json:
        print(json.dumps(listed))
        return ExitCode.OK
    if not found:
        print("(no schedules: add one with bothy schedule add NAME --cron ... --heartbeat)")
        return ExitCode.OK
    rows = []
    for item in listed:
        row = [item["name"], item["cron"], item["what"], f"next {item['next_fire']}"]
        if item["last_fire"] != "never":
            row.append(f"last {item['last_fire']}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join([*(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])), *row[3:]]))
    return ExitCode.OK


def _when(micros: int | None, zone: str) -> str:
    """A time for a person, in the budget's time zone, as every command shows one."""
    from zoneinfo import ZoneInfo

    from bothy.clock import minute_iso

    return "never" if micros is None else minute_iso(micros, ZoneInfo(zone))


async def _schedule_rm(args: argparse.Namespace) -> int:
    from bothy.runtime import Runtime
    from bothy.wakes.schedules import ScheduleStore

    home, cfg = load()
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

    home, cfg = load()
    check_workspace(home, cfg)
    async with Runtime.open(home, cfg) as rt:
        schedule = await ScheduleStore(rt.db, timezone=cfg.budget.timezone,
                                       clock=rt.clock).get(args.name)
        if schedule is None:
            raise UsageError(f"there is no schedule {args.name!r} (see bothy schedule list)")
        request = await schedule_request(schedule, cfg, home, run_id=new_run_id(rt.clock),
                                         details={"fire": "bothy schedule run"})
        if isinstance(request, Unrunnable):
            raise UsageError(f"schedule {args.name!r} cannot run: {request.reason}")
        result = await run_in_foreground(rt, request)
    return report_result(result)


async def cmd_sop(args: argparse.Namespace) -> int:
    import dataclasses

    from bothy.home import BothyHome
    from bothy.sops import SopLibrary

    home = BothyHome.from_env()
    library = SopLibrary(home.sops_dir)
    if args.action == "list":
        summaries = await asyncio.to_thread(library.summaries)
        if args.json:
            print(json.dumps([dataclasses.asdict(summary) for summary in summaries]))
            return ExitCode.OK
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
