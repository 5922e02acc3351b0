"""`bothy install` and `bothy funnel`: synchronous, no event loop (they only run commands).

The plan is printed on stdout, one line per check, file (with its content and mode) and
command; problems and failures on stderr, exit 1. A configuration error is 78 as everywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bothy.config import Config, load_config
from bothy.errors import ConfigError, UsageError
from bothy.exitcodes import ExitCode
from bothy.home import BothyHome
from bothy.install import (
    Plan,
    carry_out,
    install_plan,
    plan_lines,
    resolve_target,
    uninstall_plan,
)
from bothy.install.tailscale import funnel_lines, funnel_on, probe_node, serve_config


def cmd_install(args: argparse.Namespace) -> int:
    if not (args.dry_run or args.serve or args.uninstall):
        raise UsageError("say what to do: --dry-run (print the plan), --serve (install the"
                         " service and tailscale serve) or --uninstall (undo it)")
    target = resolve_target(user=args.user, home=args.home, manager=args.manager,
                            unit=args.unit)
    if isinstance(target, str):
        print(f"bothy: install: {target}", file=sys.stderr)
        return ExitCode.FAILED
    with_tailscale = not args.no_tailscale
    if args.uninstall:
        plan = uninstall_plan(target, _config_or_none(target.bothy_home),
                              with_tailscale=with_tailscale)
    else:
        config = load_config(target.bothy_home / "config.json")
        plan = install_plan(target, config, with_tailscale=with_tailscale,
                            environ=dict(os.environ))
    if plan.problems:
        for line in plan_lines(plan):
            print(line)
        for problem in plan.problems:
            print(f"problem: {problem}", file=sys.stderr)
        print(f"bothy: install: nothing was changed ({len(plan.problems)} problem(s) above)",
              file=sys.stderr)
        return ExitCode.FAILED
    done = "removed" if args.uninstall else "installed"
    if args.dry_run:
        for line in plan_lines(plan):
            print(line)
        print(_dry_run_tail(plan, args))
        return ExitCode.OK
    failure = carry_out(plan, lambda line: print(line, flush=True))
    if failure:
        print(f"bothy: install: {failure}", file=sys.stderr)
        return ExitCode.FAILED
    if plan.steps:
        print(f"{done}: {len(plan.steps)} step(s) done")
    else:
        print(f"nothing to change: already {done}")
    return ExitCode.OK


def _dry_run_tail(plan: Plan, args: argparse.Namespace) -> str:
    command = "bothy install --uninstall" if args.uninstall else "bothy install --serve"
    if not plan.steps:
        return f"dry run: nothing to change; `{command}` would change nothing"
    return f"dry run: nothing was changed; `{command}` carries out the {len(plan.steps)} step(s)"


def _config_or_none(home: Path) -> Config | None:
    try:
        return load_config(home / "config.json")
    except ConfigError as exc:
        print(f"note: the configuration cannot be read, so tailscale serve is left alone: {exc}")
        return None


def cmd_funnel(args: argparse.Namespace) -> int:
    """Print the `tailscale funnel` commands the config implies; check that they can work."""
    home = BothyHome(Path(args.home).absolute()) if args.home else BothyHome.from_env()
    config = load_config(home.config_path)
    if config.listen.public_port is None:
        for line in funnel_lines(config, None):
            print(line)
        return ExitCode.OK
    checks = Plan("bothy funnel")
    node = probe_node(checks)
    for line in funnel_lines(config, node):
        print(line)
    if node is not None:
        current = serve_config(os.environ.get("USER", "this user"))
        port = config.listen.funnel_port
        if isinstance(current, str):
            checks.problems.append(current)
        elif funnel_on(current, port):
            print(f"# Funnel is already on for port {port}")
    for problem in checks.problems:
        print(f"bothy: funnel: {problem}", file=sys.stderr)
    return ExitCode.FAILED if checks.problems else ExitCode.OK
