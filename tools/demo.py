"""A day on site, offline: the real ``bothy`` CLI driving the real pinned ``codex app-server``.

The only stand-in is the model: a scripted Responses API server on 127.0.0.1 (the one the
tests use, ``tests/fakes/model_server.py``) says what "the model" answers. Everything else —
gates, reservations, process groups, the audit chain — is Bothy doing its job.

Run with ``make demo``. It builds a fresh site under ``.demo/`` and leaves it there so you can
look around: ``BOTHY_HOME=.demo/home .venv/bin/bothy audit``.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fakes.model_server import ModelServer, stall, text, tool_call  # noqa: E402
from tests.fakes.site import Site  # noqa: E402

DEMO_ROOT = REPO / ".demo"


def say(line: str = "") -> None:
    print(line, flush=True)


async def bothy(site: Site, *args: str) -> int:
    shown = " ".join(f'"{a}"' if " " in a else a for a in args)
    say(f"$ bothy {shown}")
    done = await site.bothy(*args, timeout_s=120)
    for line in (done.stdout + done.stderr).rstrip().splitlines():
        say(f"  {line}")
    say(f"  (exit {done.code})")
    say()
    return done.code


async def day(server: ModelServer, site: Site) -> None:
    """Each scene scripts what the model will say, then runs the real CLI."""
    say("06:00  Morning: is everything in place?")
    await bothy(site, "doctor")

    say("08:10  Someone asks for a quick answer.")
    server.script(text("BOTHY"))
    await bothy(site, "run", "Reply with exactly: BOTHY", "--subject", "demo")

    say("09:00  The heartbeat finds nothing to report: NO_REPLY is never shown to anyone.")
    server.script(text("NO_REPLY"))
    await bothy(site, "run", "Check the disk; if nothing needs attention, reply NO_REPLY",
                "--subject", "heartbeat")

    say("11:30  The model tries to run a command outside its sandbox: declined and audited.")
    server.script(
        tool_call("exec_command", {"cmd": "rm -rf /srv/work/cache",
                                   "sandbox_permissions": "require_escalated",
                                   "justification": "clean the cache"}),
        text("I was not allowed to clean the cache; someone should look at it."),
    )
    await bothy(site, "run", "Clean the cache in the workspace", "--subject", "cache")

    say("12:15  A stuck model is stopped at the wall clock; its process group is reaped.")
    server.script(stall("Thinking about it"))
    await bothy(site, "run", "Summarise the logs", "--subject", "logs", "--wall-clock", "2",
                "--max-usd", "0.05")

    say("14:00  A job that keeps calling tools spends its small reservation and is stopped:")
    say("       measured spend fills the reservation from the inside.")
    server.script(
        tool_call("exec_command", {"cmd": "ls"}),
        tool_call("exec_command", {"cmd": "ls -la"}),
        stall("one more look"),  # only reached if the stop loses the race with codex
    )
    await bothy(site, "run", "Inventory the workspace", "--subject", "inventory",
                "--max-usd", "0.03")
    server.discard_pending()  # the stall is only consumed if codex beat the stop

    say("17:00  The day's ceiling is close: a full 0.50 reservation no longer fits.")
    await bothy(site, "run", "Reply with exactly: LATE", "--subject", "late")
    say("       A smaller reservation still fits.")
    server.script(text("LATE"))
    await bothy(site, "run", "Reply with exactly: LATE", "--subject", "late", "--max-usd", "0.05")

    say("18:00  Evening: what happened today, and is the register intact?")
    await bothy(site, "status")
    await bothy(site, "audit")
    await bothy(site, "audit", "verify")


async def main() -> int:
    shutil.rmtree(DEMO_ROOT, ignore_errors=True)
    DEMO_ROOT.mkdir()
    say("Bothy — a day on site, offline.")
    say("The model is SCRIPTED (a fake Responses API server on 127.0.0.1); bothy and")
    say("codex app-server are the real ones. Nothing leaves this machine.")
    say()
    async with ModelServer() as server:
        site = Site(DEMO_ROOT, server.base_url, site="demo-mini",
                    budget={"per_run_usd": "0.50", "per_day_usd": "0.55"})
        await day(server, site)
        if server.unscripted:
            say(f"demo error: the model was asked {server.unscripted} unscripted question(s)")
            return 1
    say(f"The site is left in {DEMO_ROOT}/home: BOTHY_HOME={DEMO_ROOT}/home .venv/bin/bothy audit")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
