"""What `bothy serve` imports for what its config uses (issue 18: only the libraries the
config needs are loaded, for start-up time and idle memory).

Each check runs in a fresh interpreter, as serve's process starts: the modules serve's start
imports for a site with Slack and no schedule, then its schedule timers started on an empty
table, must not have loaded APScheduler or discord.py; a schedule in the table loads
APScheduler for its timer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import asyncio, sys
from pathlib import Path

import bothy.daemon, bothy.chat.slack
from bothy.clock import utc_now
from bothy.engine.audit import AuditLog
from bothy.engine.state import StateDB
from bothy.wakes.inbox import Inbox
from bothy.wakes.schedule_runner import ScheduleRunner
from bothy.wakes.schedules import Schedule, ScheduleStore

def loaded(top):
    return any(name == top or name.startswith(top + ".") for name in sys.modules)

async def main(root, with_schedule):
    async with StateDB.open(root / "bothy.sqlite3") as db:
        audit = AuditLog(root / "audit.jsonl")
        store = ScheduleStore(db, timezone="UTC", clock=utc_now)
        if with_schedule:
            await store.add(Schedule("nightly", "0 3 * * *", "heartbeat"))
        runner = ScheduleRunner(store, Inbox(root / "inbox", db, clock=utc_now,
                                             audit=audit),
                                audit=audit, grace_s=3600, clock=utc_now,
                                on_enqueued=lambda: None)
        await runner.start()
        timers = sorted(runner.next_fires())
        await runner.stop()
    print(loaded("apscheduler"), loaded("discord"), timers)

asyncio.run(main(Path(sys.argv[1]), sys.argv[2] == "1"))
"""


def _serve_start(tmp_path: Path, *, with_schedule: bool) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path), "1" if with_schedule else "0"],
        capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_a_site_without_schedules_never_loads_apscheduler_nor_an_unused_chat_library(
    tmp_path: Path,
) -> None:
    """serve's modules for Slack, and its schedule timers on an empty table, leave APScheduler
    and discord.py unloaded."""
    assert _serve_start(tmp_path, with_schedule=False) == "False False []"


def test_a_schedule_in_the_table_loads_apscheduler_for_its_timer(tmp_path: Path) -> None:
    """With a schedule in the table, its timer is APScheduler's."""
    assert _serve_start(tmp_path, with_schedule=True) == "True False ['nightly']"
