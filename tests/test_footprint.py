"""A long-running serve's memory levels off: SQLite's page cache is held small, and the C heap's
free pages are given back (bothy/footprint.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bothy.engine.state import StateDB
from bothy.footprint import SQLITE_PAGE_CACHE_KIB, keep_heap_trimmed, trim_heap

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


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim; macOS trims itself")
def test_the_free_pages_between_live_chunks_are_given_back() -> None:
    shown = subprocess.run([sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True,
                           check=True, timeout=60)
    gave_back, before_mb, after_mb = shown.stdout.split()
    assert gave_back == "True"
    assert float(before_mb) - float(after_mb) > 30, shown.stdout  # of ~56 MB freed


def test_trimming_is_repeatable_and_never_fails() -> None:
    assert trim_heap() in (True, False)
    assert trim_heap() in (True, False)


async def test_the_heap_is_trimmed_at_each_interval_until_stopped() -> None:
    trims: list[int] = []
    stop = asyncio.Event()

    def counted() -> bool:
        trims.append(len(trims))  # called in a worker thread, one at a time
        return True

    task = asyncio.create_task(keep_heap_trimmed(stop, every_s=0.05, trim=counted))
    await asyncio.sleep(0.32)
    stop.set()
    await asyncio.wait_for(task, 1.0)
    assert 3 <= len(trims) <= 7
    held = len(trims)
    await asyncio.sleep(0.15)
    assert len(trims) == held  # stopped means stopped


async def test_the_state_database_holds_a_small_page_cache(tmp_path: Path) -> None:
    async with StateDB.open(tmp_path / "bothy.sqlite3") as db:
        assert await db.scalar("PRAGMA cache_size") == -SQLITE_PAGE_CACHE_KIB
