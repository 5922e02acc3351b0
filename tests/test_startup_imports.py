"""What `bothy serve` imports for what its config uses (issue 18: only the libraries the
config needs are loaded, for start-up time and idle memory).

Each check runs in a fresh interpreter, as serve's process starts: the modules serve's start
imports for a site with Slack and no schedule, then its schedule timers started on an empty
table, must not have loaded APScheduler, discord.py, the poller, the verification or the
preflight; a schedule in the table loads APScheduler for its timer. aiohttp, imported as serve
imports it, parses the CA bundle for its verifying TLS context only (in a thread, beside the
rest of the start), which still verifies once the import's future is done.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import asyncio, sys
from pathlib import Path

import pytest

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
    print(loaded("apscheduler"), loaded("discord"), loaded("bothy.wakes.poller"),
          loaded("bothy.engine.verification"), loaded("bothy.wakes.preflight"), timers)

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
    """serve's modules for Slack, and its schedule timers on an empty table, leave APScheduler,
    discord.py, the poller (no poller configured), a run's verification and a heartbeat's
    preflight (no schedule verifies or has one) unloaded."""
    assert _serve_start(tmp_path, with_schedule=False) == "False False False False False []"


def test_a_schedule_in_the_table_loads_apscheduler_for_its_timer(tmp_path: Path) -> None:
    """With a schedule in the table, its timer is APScheduler's (and a heartbeat with no
    verification and no preflight loads neither)."""
    assert _serve_start(tmp_path, with_schedule=True) == "True False False False False ['nightly']"


_TLS_SCRIPT = """
import asyncio, ssl, sys

from bothy.aiohttpimport import import_aiohttp

before = ssl.SSLContext.set_default_verify_paths
trusted = import_aiohttp()
import aiohttp
from aiohttp import connector, web

async def main(cert_pem, key_pem):
    await asyncio.wrap_future(trusted)  # as serve waits, before its first connection
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert_pem, key_pem)
    app = web.Application()
    app.router.add_get("/", lambda request: web.Response(text="verified"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:  # the default, verifying context
            async with session.get(f"https://127.0.0.1:{port}/") as response:
                answer = await response.text()
    finally:
        await runner.cleanup()
    print(connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"],
          connector._SSL_CONTEXT_UNVERIFIED.cert_store_stats()["x509_ca"],
          ssl.SSLContext.set_default_verify_paths is before, answer)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_serve_imports_aiohttp_parsing_the_ca_bundle_once_and_still_verifies(
    tmp_path: Path,
) -> None:
    """The verifying context holds the CA bundle and verifies a server it signed; the
    context that verifies nothing holds none; ``ssl`` is as it was."""
    from tests.fakes.discord import Certificates

    certificates = Certificates.create(tmp_path)
    environ = {**os.environ, "SSL_CERT_FILE": str(certificates.ca_pem),
               "SSL_CERT_DIR": str(tmp_path / "no-such-dir")}
    done = subprocess.run(
        [sys.executable, "-c", _TLS_SCRIPT, str(certificates.cert_pem),
         str(certificates.key_pem)],
        capture_output=True, text=True, timeout=60, check=True, env=environ)
    assert done.stdout.strip() == "1 0 True verified"


_RUN_PATH_SCRIPT = """
import sys
import bothy.cli, bothy.commandline, bothy.commands.foreground, bothy.progress, bothy.runtime
import bothy.engine.supervisor, bothy.waits

later = ("bothy.engine.turn", "bothy.engine.toolbox", "bothy.engine.questions",
         "bothy.engine.verdicts", "bothy.engine.checklist")
print(sorted(name for name in later if name in sys.modules))
"""


def test_a_runs_set_up_leaves_what_its_worker_needs_unloaded() -> None:
    """What `bothy run` imports for its set-up (the CLI, the run command, the site, the
    supervisor) loads neither the turn's stream, the tools, the question board, the approvals
    nor the checklist, which load once the run has its worker, while codex starts."""
    done = subprocess.run([sys.executable, "-c", _RUN_PATH_SCRIPT], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


_MIMETYPES_SCRIPT = """
import mimetypes, sys

mimetypes.knownfiles = [sys.argv[1]]  # the system's table, as /etc/mime.types would be
from bothy.aiohttpimport import import_aiohttp

import_aiohttp().result()
from aiohttp import web_fileresponse

unread = not mimetypes.inited
served = [web_fileresponse.CONTENT_TYPES.guess_type(name)[0] for name in ("a.json", "b.gz")]
print(unread, served, mimetypes.guess_type("c.bothyrecord")[0])
"""


def test_serve_imports_aiohttp_leaving_the_system_mime_table_unread_until_a_guess(
    tmp_path: Path,
) -> None:
    """aiohttp's own table still knows its types, the system's table is not read while
    serve starts, and the first guess of a type only that table names still finds it."""
    table = tmp_path / "mime.types"
    table.write_text("application/x-bothy-record\tbothyrecord\n")
    done = subprocess.run([sys.executable, "-c", _MIMETYPES_SCRIPT, str(table)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == (
        "True ['application/json', 'application/gzip'] application/x-bothy-record")


_FROZENLIST_SCRIPT = """
import asyncio, os

from bothy.aiohttpimport import import_aiohttp

import_aiohttp().result()
import frozenlist
from aiohttp import web

prepared = []

async def note(request, response):  # a signal's receiver
    prepared.append(response.status)

async def main():
    app = web.Application()
    app.on_response_prepare.append(note)
    app.router.add_get("/", lambda request: web.Response(text="answered"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
    answer = await reader.read()
    writer.close()
    await runner.cleanup()
    return answer.endswith(b"answered")

with open("/proc/self/maps") as maps:
    cxx = "libstdc++" in maps.read()
print(frozenlist.FrozenList is frozenlist.PyFrozenList, cxx,
      "FROZENLIST_NO_EXTENSIONS" in os.environ, asyncio.run(main()), prepared)
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_serve_imports_aiohttp_with_pythons_frozenlist_and_no_cxx_runtime() -> None:
    """aiohttp's signal lists are frozenlist's Python ones: no C++ runtime is mapped, the
    variable that chose them is gone from the environment, and a signal still fires."""
    environ = {k: v for k, v in os.environ.items() if k != "FROZENLIST_NO_EXTENSIONS"}
    done = subprocess.run([sys.executable, "-c", _FROZENLIST_SCRIPT], capture_output=True,
                          text=True, timeout=60, check=True, env=environ)
    assert done.stdout.strip() == "True False False True [200]"


_BEFORE_THE_SPAWN = """
import sys

from bothy.commands.foreground import check_workspace
from bothy.config import load_config
from bothy.home import BothyHome
import bothy.cli, bothy.commandline, bothy.engine.headstart, bothy.engine.worker

home = BothyHome.from_env()
check_workspace(home, load_config(home.config_path))
print(sorted(name for name in ("bothy.engine.supervisor", "bothy.engine.state",
                               "bothy.engine.audit", "bothy.runtime", "aiosqlite",
                               "bothy.engine.threadinputs", "bothy.engine.turn")
             if name in sys.modules))
"""


def test_a_runs_way_to_its_spawn_leaves_the_set_up_unloaded(tmp_path: Path) -> None:
    """What `bothy run` loads to check its workspace and spawn its codex (its head start:
    bothy/engine/headstart.py) leaves out the supervisor, the site's state database and
    register, what a thread started ahead reads, and the turn: they load while codex
    starts, not before it."""
    from tests.fakes.site import Site

    site = Site(tmp_path, "http://127.0.0.1:9/v1")
    done = subprocess.run([sys.executable, "-c", _BEFORE_THE_SPAWN], env=site.env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
