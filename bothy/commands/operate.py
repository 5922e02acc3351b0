"""Commands that look after the site: the register, the doctor, the checklist, profiles,
and the daemon.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING

from bothy.commands._shared import load
from bothy.errors import UsageError
from bothy.exitcodes import ExitCode

if TYPE_CHECKING:
    from bothy.engine.audit import AuditLog


async def cmd_audit(args: argparse.Namespace) -> int:
    """``bothy audit verify | repair | head``; a plain read is :func:`read_audit`."""
    import asyncio

    from bothy.engine.audit import AuditLog
    from bothy.home import BothyHome

    if args.action is None:
        return read_audit(args)
    home = BothyHome.from_env()
    log = AuditLog(home.audit_path)
    if args.action == "repair":
        return await _repair(log)
    if args.action == "head":
        return await _head(log, as_json=args.json)
    # verify (argparse allows no other action)
    report = await asyncio.to_thread(log.verify)
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(report)))
    elif report.ok:
        print(f"audit chain intact: {report.count} records verified")
    else:
        print(f"audit chain broken: {report.problem}")
    if not args.json:
        for seq in report.repaired_at:
            print(f"[warn] {repaired_at(seq)}: {REPAIRED_DETAIL}")
    return ExitCode.OK if report.ok else ExitCode.FAILED


def read_audit(args: argparse.Namespace) -> int:
    """``bothy audit [--run RUN] [--since ISO] [--json]``: synchronous, with no event loop and
    no writer: a run's records are read through the index by run id, not the whole file."""
    from bothy.home import BothyHome

    path = BothyHome.from_env().audit_path
    since = _since(args.since) if args.since else None
    if args.run_id is not None:
        from bothy.commands.tracing import indexing
        from bothy.engine.auditindex import RunIndex

        records = [record for record in RunIndex(path, on_rebuild=indexing).records(args.run_id)
                   if since is None or record.ts >= since]
    else:
        from bothy.engine.audit import AuditLog

        records = list(AuditLog(path).records(since=since))
    for record in records:
        print(record.to_json() if args.json else record.human_line())
    if not records:
        print(f"bothy: {_nothing(args.run_id, args.since)} ({path})", file=sys.stderr)
    return ExitCode.OK


REPAIRED_DETAIL = ("records before it were set aside by 'bothy audit repair' (the kept file is"
                   " named in that record)")


def repaired_at(seq: int) -> str:
    """``repaired at seq N``: what verify and doctor say of each repair, forever after (the
    issue's form, ``[warn] repaired at seq N``, as a line of its own)."""
    return f"repaired at seq {seq}"


async def _head(log: AuditLog, *, as_json: bool) -> int:
    """The verified head (seq and hash of the last record): what to publish or compare with a
    copy kept elsewhere."""
    import asyncio

    report = await asyncio.to_thread(log.verify)
    if not report.ok:
        print(f"audit chain broken: {report.problem}")
        return ExitCode.FAILED
    if as_json:
        print(json.dumps({"seq": report.last_seq, "hash": report.last_hash,
                          "repaired_at": list(report.repaired_at)}))
    elif report.last_seq == 0:
        print(f"bothy: the register is empty ({log.path})", file=sys.stderr)
    else:
        print(f"head {report.last_seq:04d} {report.last_hash}")
    return ExitCode.OK


async def _repair(log: AuditLog) -> int:
    """Keep a broken register aside and start a new segment; refused while serve runs."""
    import asyncio

    from bothy.clock import utc_now
    from bothy.home import BothyHome
    from bothy.runtime import site_alerts
    from bothy.servelock import serve_holding

    home = BothyHome.from_env()
    with serve_holding(home.state_dir / "serve.lock", doing="repair the register"):
        done = await asyncio.to_thread(log.repair)
        if done is None:
            print(f"audit chain intact: nothing to repair ({log.path})")
            return ExitCode.OK
        print(f"audit chain broken: {done.problem}")
        print(f"kept the broken file untouched as {done.kept}")
        print(f"started a new segment at record {done.record.seq:04d} (audit repaired), after "
              f"the last good record {done.record.seq - 1:04d}")
        _, cfg = load()
        alerts = site_alerts(cfg, log, clock=utc_now)
        await alerts.raise_alert(
            "the register", f"repaired at seq {done.record.seq}: {done.problem}; the broken "
            f"file is kept as {done.kept.name}", subject=None, level="critical")
    return ExitCode.OK


def _nothing(run_id: str | None, since: str | None) -> str:
    """What an empty answer means, said rather than left blank."""
    if run_id is None and since is None:
        return "the register is empty"
    of_run = f" of run {run_id}" if run_id else ""
    after = f" since {since}" if since else ""
    return f"no record{of_run}{after} in the register"


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
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print("\n".join(report.lines()))
    if report.config_error:
        return ExitCode.CONFIG
    return ExitCode.FAILED if report.failed else ExitCode.OK


async def cmd_checklist(args: argparse.Namespace) -> int:
    import asyncio

    from bothy.engine.checklist import Checklist
    from bothy.home import BothyHome

    checklist = Checklist(BothyHome.from_env().checklist_path)
    if args.json:
        print(json.dumps(await asyncio.to_thread(checklist.items)))
        return ExitCode.OK
    text = await asyncio.to_thread(checklist.render)
    print(text or "(the checklist is empty)")
    return ExitCode.OK


async def cmd_profile(args: argparse.Namespace) -> int:
    from bothy.commands.profile_text import describe_profile, profile_lines

    _, cfg = load()
    if args.action == "list":
        if args.json:
            print(json.dumps([{"name": name, "sandbox": profile.sandbox, "tools": profile.tools,
                               "mcp_servers": sorted(profile.mcp_servers)}
                              for name, profile in sorted(cfg.profiles.items())]))
            return ExitCode.OK
        for line in profile_lines(cfg) or ["(no profiles configured)"]:
            print(line)
        return ExitCode.OK
    if args.name not in cfg.profiles:
        known = ", ".join(sorted(cfg.profiles)) or "none are configured"
        raise UsageError(f"no profile {args.name!r} ({known})")
    profile = cfg.profiles[args.name]
    if args.json:
        print(json.dumps({"name": args.name, **profile.model_dump(mode="json")}))
        return ExitCode.OK
    print(describe_profile(args.name, profile))
    return ExitCode.OK


async def cmd_daemon(args: argparse.Namespace) -> int:
    """`bothy serve`: run the daemon in this process until a stop signal."""
    import gc

    # Start-up builds what lives on (modules, config, connections) and next to no garbage,
    # yet the collector would walk it all many times over, ~100 ms here (issue 18). The
    # daemon turns collection back on once it is ready (bothy/daemon.py).
    gc.disable()
    from bothy.engine.chaincheck import ChainCheck
    from bothy.home import BothyHome

    # First of all, the register's walk: on a second core, beside the imports below, when
    # the register is long enough to gain (engine/chaincheck.py).
    home = BothyHome.from_env()
    chain = await ChainCheck.start(home.audit_path)
    try:
        import asyncio

        from bothy.aiohttpimport import import_aiohttp

        # Before the daemon's modules: the CA bundle parsed once, not twice, and in a thread
        # while the modules below are imported and the config validated (aiohttpimport.py).
        trusted = import_aiohttp()
        from bothy.commands.foreground import check_workspace
        from bothy.daemon import Daemon

        home, cfg = load(home)
        check_workspace(home, cfg)  # every run it starts would fail: say which key, stay down
        await asyncio.wrap_future(trusted)  # before the daemon can open a TLS connection
        return await Daemon(home, cfg, chain=chain).serve()
    finally:
        await chain.close()  # a start that failed before its check: the walk is nobody's
