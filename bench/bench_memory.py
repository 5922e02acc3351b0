"""Memory: search over 10,000 day notes (target ≤ 5 ms median) and a write including the
secret scan (target ≤ 2 ms median).

Both go through the real store a run's tools use, on disk (not tmpfs): the search opens the
profile's SQLite index, runs the quoted FTS5 query and returns the ranked notes; the write
scans the text, takes the profile's lock, reads MEMORY.md, checks the cap and replaces the
file atomically (fsync of the file and of its directory). The scan fallback's search is
printed beside FTS5's.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
import time
from datetime import UTC, datetime, timedelta

from bench._util import figure, median, percentile, scratch

NOTES = 10_000
SEARCHES = 300
WRITES = 200
_WORDS = ["deploy", "backup", "staging", "host", "bucket", "certificate", "rotation", "disk",
          "latency", "outage", "runbook", "ticket", "customer", "invoice", "migration", "cron",
          "alert", "webhook", "poll", "thread"]


def _stores() -> tuple[object, object, str]:
    from bothy.config import MemoryConfig
    from bothy.memory import MemoryStore, SecretScan
    from bothy.memory.index import SearchMode

    root = scratch("memory-")
    cfg = MemoryConfig(memory_chars=100_000, day_chars=1_000_000)
    scan = SecretScan(held=["bothy-held-secret-value"])
    fts = MemoryStore(root / "fts", "fts", cfg, scan=scan, search=SearchMode(True, "FTS5"))
    plain = MemoryStore(root / "scan", "scan", cfg, scan=scan,
                        search=SearchMode(False, "scan"))
    return fts, plain, str(root)


def _fill(store: object, rng: random.Random) -> None:
    from bothy.memory import MemoryStore

    assert isinstance(store, MemoryStore)
    start = datetime(2026, 9, 1, tzinfo=UTC)
    # Filling through note() would fsync 10,000 times; the index rows are what a search reads.
    store.index.add("2026-09-01", 1, "warm-up", run_id=None, trusted=True)
    rows = []
    for i in range(NOTES):
        words = " ".join(rng.choice(_WORDS) for _ in range(14))
        day = (start + timedelta(days=i // 110)).strftime("%Y-%m-%d")
        rows.append((day, i + 2, f"{words} ACME-{i}", None, 1))
    with sqlite3.connect(store.index.path) as db:
        db.executemany("INSERT INTO notes (day, n, text, run_id, trusted) VALUES (?,?,?,?,?)",
                       rows)
        if store.index.fts5:
            db.execute("INSERT INTO notes_fts (notes_fts) VALUES ('rebuild')")


def _search_ms(store: object, rng: random.Random) -> list[float]:
    from bothy.memory import MemoryStore

    assert isinstance(store, MemoryStore)
    samples = []
    for _ in range(SEARCHES):
        query = f"{rng.choice(_WORDS)} ACME-{rng.randrange(NOTES)}"
        started = time.perf_counter()
        store.search(query)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _write_ms(store: object) -> list[float]:
    from bothy.memory import MemoryStore

    assert isinstance(store, MemoryStore)
    samples = []
    for i in range(WRITES):
        text = f"Entry {i}: the staging host for ACME-{i} is stg-{i % 7}; deploys on Tuesdays."
        started = time.perf_counter()
        store.edit("memory", [{"action": "add", "content": text}])
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _scan_ms() -> list[float]:
    from bothy.memory import SecretScan

    scan = SecretScan(held=["bothy-held-secret-value"])
    samples = []
    for i in range(WRITES):
        text = f"Entry {i}: the staging host for ACME-{i} is stg-{i % 7}; deploys on Tuesdays."
        started = time.perf_counter()
        scan.find(text)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def main() -> None:
    rng = random.Random(13)
    fts, plain, root = _stores()
    try:
        for store in (fts, plain):
            _fill(store, rng)
        search = _search_ms(fts, rng)
        figure("search over 10,000 day notes, FTS5 (p50)", median(search), "ms", 5,
               higher_is_better=False)
        print(f"   {'  p95':<46} {percentile(search, 95):>12,.2f} ms")
        scan = _search_ms(plain, rng)
        print(f"   {'the same, case-insensitive scan fallback (p50)':<46}"
              f" {median(scan):>12,.2f} ms  (no target)")
        writes = _write_ms(fts)
        figure("a memory write including the scan (p50)", median(writes), "ms", 2,
               higher_is_better=False)
        print(f"   {'  p95':<46} {percentile(writes, 95):>12,.2f} ms")
        scans = _scan_ms()
        print(f"   {'  of which the secret scan (p50)':<46} {median(scans):>12,.3f} ms"
              "  (the rest is the lock and two fsyncs: file, then directory)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
