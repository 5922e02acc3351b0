"""A day on site, offline: the real ``bothy`` CLI driving the real pinned ``codex app-server``.

The only stand-in is the model: a scripted Responses API server on 127.0.0.1 (the one the
tests use, ``tests/fakes/model_server.py``) says what "the model" answers. Everything else —
gates, reservations, process groups, the audit chain — is Bothy doing its job.

Run with ``make demo``. It builds a fresh site under ``.demo/`` and leaves it there so you can
look around: ``BOTHY_HOME=.demo/home .venv/bin/bothy audit``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fakes import github  # noqa: E402
from tests.fakes.model_server import ModelServer, stall, text, tool_call  # noqa: E402
from tests.fakes.site import Site  # noqa: E402
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, FakeSlack  # noqa: E402

HOOK_SECRET = "demo-webhook-secret"
OPERATOR = "UOPERATOR"
SERVE_ENV = {"GH_SECRET": HOOK_SECRET, "SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN}

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


async def serve_scenes(server: ModelServer, site: Site, slack: FakeSlack) -> None:
    """`bothy serve` wakes on its own: a signed GitHub delivery, then a Slack mention."""
    say("13:00  `bothy serve` starts: a webhook listener on 127.0.0.1 and Slack (a fake Slack on")
    say("       loopback, driven by the real slack-bolt).")
    process = await site.start("serve", **SERVE_ENV)
    await _until(lambda: _count(site, "serve", "ready") > 0, "bothy serve ready")
    port = site.config["listen"]["tailnet_port"]

    say("13:05  GitHub delivers a signed pull_request event; Bothy answers 200 once it is on disk.")
    server.script(text("Reviewed PR #42: the disk check looks right."))
    finished_before = _count(site, "run", "finished")
    payload = github.pull_request_opened(42, title="Fix the disk check")
    body = github.encode(payload)
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"http://127.0.0.1:{port}/hooks/github", content=body,
                                   headers=github.headers("pull_request", body, HOOK_SECRET))
    say(f"  POST /hooks/github -> {answer.status_code} {answer.text}")
    await _until(lambda: _count(site, "run", "finished") > finished_before,
                 "the pull request's run")

    say("13:20  Someone mentions the bot in Slack; it reacts and answers in the thread.")
    server.script(text("Backups ran at 03:00 and took 12 minutes."))
    ts = slack.send_mention(OPERATOR, "CWORK", "did the backups run?")
    await _until(lambda: any(p.thread_ts == ts for p in slack.posts), "the answer in Slack")
    for post in slack.posts:
        if post.thread_ts == ts:
            say(f"  slack thread {ts}: {post.text}")
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.wait(), 60)
    say(f"  bothy serve stopped (exit {process.returncode})")
    say()


def _count(site: Site, kind: str, event: str) -> int:
    path = site.audit_path
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if (rec := json.loads(line))["kind"] == kind and rec["event"] == event)


async def _until(condition: object, what: str, timeout_s: float = 60.0) -> None:
    assert callable(condition)
    async with asyncio.timeout(timeout_s):
        # Another process's files: there is no event to await, only a look every 100 ms.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def day(server: ModelServer, site: Site, slack: FakeSlack) -> None:
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

    await serve_scenes(server, site, slack)

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
    for name in [n for n in os.environ if n.lower().endswith("_proxy")]:
        del os.environ[name]  # slack_sdk would send even loopback calls through a proxy
    async with ModelServer() as server, FakeSlack() as slack:
        site = Site(
            DEMO_ROOT, server.base_url, site="demo-mini",
            budget={"per_run_usd": "0.50", "per_day_usd": "0.60"},
            listen={"tailnet_port": _free_port()},
            webhooks={"github": {
                "path": "/hooks/github", "secret_env": ["GH_SECRET"],
                "jobs": [{"event": "pull_request", "actions": ["opened"],
                          "prompt": "Review pull request #{pull_request.number}:"
                                    " {pull_request.title}",
                          "subject": "pr:{pull_request.number}", "max_usd": "0.05"}],
            }},
            chat={"slack": {"api_url": slack.api_url, "allowed_users": [OPERATOR]}},
        )
        await day(server, site, slack)
        if server.unscripted:
            say(f"demo error: the model was asked {server.unscripted} unscripted question(s)")
            return 1
    say(f"The site is left in {DEMO_ROOT}/home: BOTHY_HOME={DEMO_ROOT}/home .venv/bin/bothy audit")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
