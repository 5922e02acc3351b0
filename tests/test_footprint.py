"""A long-running serve's memory levels off: SQLite's page cache is held small, and the C heap's
free pages are given back (bothy/footprint.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import platform
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from bothy.config import load_config
from bothy.daemon import Daemon
from bothy.engine.audit import AuditLog
from bothy.engine.state import StateDB
from bothy.footprint import SQLITE_PAGE_CACHE_KIB, _malloc_trim, keep_heap_trimmed
from bothy.home import BothyHome
from tests.fakes.shell import until
from tests.fakes.site import Site
from tests.test_serve import free_port

_FRAGMENTED = textwrap.dedent("""
    import sys
    from bothy.footprint import trim_heap

    def rss_mb():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024

    chunks = [bytes(3000) for _ in range(20_000)]  # 60 MB from the C heap, chunk by chunk
    kept = chunks[::16]  # one in sixteen lives on: the pages between them are free, not given back
    del chunks
    before = rss_mb()
    gave_back = trim_heap()
    print(gave_back, before, rss_mb())
""")


_GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def test_the_heap_can_be_trimmed_wherever_there_is_glibc() -> None:
    assert (_malloc_trim() is not None) == _GLIBC


@pytest.mark.skipif(not _GLIBC, reason="glibc's malloc_trim (macOS's allocator trims itself)")
def test_the_free_pages_between_live_chunks_are_given_back() -> None:
    shown = subprocess.run([sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True,
                           check=True, timeout=60)
    gave_back, before_mb, after_mb = shown.stdout.split()
    assert gave_back == "True"
    assert float(before_mb) - float(after_mb) > 30, shown.stdout  # of ~56 MB freed


async def test_the_heap_is_trimmed_at_each_interval_until_stopped() -> None:
    trims: list[int] = []
    third = threading.Event()
    stop = asyncio.Event()

    def counted() -> bool:  # called in a worker thread, one at a time
        trims.append(len(trims))
        if len(trims) == 3:
            third.set()
        return True

    task = asyncio.create_task(keep_heap_trimmed(stop, every_s=0.05, trim=counted))
    assert await asyncio.to_thread(third.wait, 5.0)
    stop.set()
    await asyncio.wait_for(task, 1.0)
    assert len(trims) in (3, 4)  # at most one more, already under way when stop came


async def test_a_stop_ends_it_at_once_not_at_the_next_interval() -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(keep_heap_trimmed(stop, every_s=3600.0, trim=lambda: True))
    done, _ = await asyncio.wait({task}, timeout=0.05)
    assert not done  # waiting out its hour
    stop.set()
    await asyncio.wait_for(task, 0.5)


async def test_the_state_database_holds_a_small_page_cache(tmp_path: Path) -> None:
    async with StateDB.open(tmp_path / "bothy.sqlite3") as db:
        assert await db.scalar("PRAGMA cache_size") == -SQLITE_PAGE_CACHE_KIB


async def test_the_registers_index_holds_a_small_page_cache(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl")
    await audit.record("run", "admitted", "ok", run_id="run_20261206T000000Z_0a1b2c3d")
    [writer] = _open_connections_to(audit.index.path)  # its writer, kept for the next records
    assert writer.execute("PRAGMA cache_size").fetchone()[0] == -SQLITE_PAGE_CACHE_KIB
    audit.index.close()


def _open_connections_to(database: Path) -> list[sqlite3.Connection]:
    """This process's open SQLite connections to ``database`` (found among its objects: a
    connection is one the garbage collector tracks)."""
    found = []
    for candidate in gc.get_objects():
        if isinstance(candidate, sqlite3.Connection):
            with contextlib.suppress(sqlite3.ProgrammingError):  # closed
                files = [row[2] for row in candidate.execute("PRAGMA database_list")]
                if str(database) in files:
                    found.append(candidate)
    return found


async def test_a_ready_serve_trims_its_heap_until_it_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon keeps the heap trimmed while it serves, and the loop ends with it."""
    caplog.set_level(logging.DEBUG, logger="bothy.footprint")

    def trims() -> int:
        return sum(r.name == "bothy.footprint" and r.msg.startswith("heap trimmed")
                   for r in caplog.records)

    site = Site(tmp_path / "site", "http://127.0.0.1:9", codex={"spare": False},
                listen={"tailnet_port": free_port()})
    daemon = Daemon(BothyHome(site.home), load_config(site.home / "config.json"),
                    heap_trim_every_s=0.05)
    serving = asyncio.create_task(daemon.serve())
    try:
        await until(lambda: trims() >= 3 or serving.done(), "three trims while serving")
        assert not serving.done()
    finally:
        daemon.stop()
        assert await asyncio.wait_for(serving, 30) == 0  # its loop ended with serve
