"""`bothy status` cold start: median wall time, and its ratio to a bare `python3 -c pass`.

Three sites: one with the config's default budget zone (UTC), as a site that never set one
meets it; one in Europe/Paris, whose status also loads the zone from the system's tz
database (zoneinfo); and one with a real `bothy serve` running, as a site with the service
installed meets it (status then asks the serve's lock, bothy/servelock.py, whether the
published daemon still runs; the process table, through psutil, only where the lock cannot
tell); and a fourth, like the first, whose state database holds ``AGED_RUNS`` finished runs
(a busy site's half year: status sums what open runs hold, and must find them without reading
the rest). All four figures are printed, so the first is not the only one seen.
Where valgrind is installed, also the instructions each executes (callgrind), which the load
of a shared machine does not move: wall times here swing twofold from one minute to the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench._util import REPO, figure, free_port, median, scratch

RUNS = 15
AGED_RUNS = 100_000


def _time(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _instructions(argv: list[str], env: dict[str, str]) -> int | None:
    """The instructions ``argv`` executes, counted by callgrind; None without valgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    done = subprocess.run([valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
                          env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    counted = re.search(r"Collected : (\d+)", done.stderr)
    return int(counted.group(1)) if counted else None


def _site(root: Path, timezone: str | None, **more: object) -> dict[str, str]:
    """A site that has run before (its state database exists: status reads it, never makes
    it), and the environment that names it."""
    (root / "work").mkdir(parents=True)
    budget: dict[str, object] = {"mode": "api", "per_run_usd": 0.5, "per_day_usd": 25.0}
    if timezone is not None:
        budget["timezone"] = timezone
    (root / "config.json").write_text(json.dumps({
        "site": "bench", "workspace": str(root / "work"), "pool": {"max_workers": 2},
        "budget": budget, **more,
    }))
    # As a site meets it: an installed bothy has its bytecode compiled (pip does that), so the
    # test environment's PYTHONDONTWRITEBYTECODE would measure compiling, not starting.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["BOTHY_HOME"] = str(root)
    _time([str(REPO / ".venv" / "bin" / "bothy"), "schedule", "list"], env)
    _time([str(REPO / ".venv" / "bin" / "bothy"), "status"], env)  # the stamp, the page cache
    return env


def _age_state(root: Path, runs: int) -> None:
    """``runs`` finished runs, each with its spend, over the last half year, written into the
    site's state database as Bothy's own rows are."""
    import sqlite3

    now_us, span_us = int(time.time() * 1e6), 182 * 86_400 * 10**6
    db = sqlite3.connect(root / "state" / "bothy.sqlite3", isolation_level=None)
    db.execute("BEGIN")
    for n in range(runs):
        at_us = now_us - span_us + n * (span_us // runs)
        run_id = f"run_20260601T000000Z_{n:08x}"
        db.execute("INSERT INTO runs (run_id, subject, source, status, outcome, reserved_micros,"
                   " spent_micros, admitted_us, started_us, finished_us, expires_us, owner_pid)"
                   " VALUES (?, ?, 'webhook', 'finished', 'completed', 500000, 12300, ?, ?, ?,"
                   " ?, 1)", (run_id, f"pr:{n % 500}", at_us, at_us, at_us + 5_000_000,
                               at_us + 3_600_000_000))
        day = time.strftime("%Y-%m-%d", time.gmtime(at_us / 1e6))
        db.execute("INSERT INTO spend (run_id, day, micros, at_us) VALUES (?, ?, 12300, ?)",
                   (run_id, day, at_us + 5_000_000))
    db.execute("COMMIT")
    db.close()


@contextlib.contextmanager
def _serving(root: Path, env: dict[str, str]) -> Iterator[None]:
    """A real `bothy serve` on the site at ``root`` until the block ends (no spare: its codex
    would share the two cores with what is measured)."""
    log = (root / "serve.log").open("wb")
    serve = subprocess.Popen([str(REPO / ".venv" / "bin" / "bothy"), "serve"], env=env,
                             stdout=log, stderr=log, start_new_session=True)
    try:
        published = root / "state" / "serve.json"
        deadline = time.monotonic() + 60
        while not (published.exists() and '"ready"' in published.read_text()):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bothy serve not ready: {(root / 'serve.log').read_text()}")
            time.sleep(0.05)
        yield
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()


def main() -> None:
    root = scratch("status-")
    utc, paris = _site(root / "utc", None), _site(root / "paris", "Europe/Paris")
    aged = _site(root / "aged", None)
    _age_state(root / "aged", AGED_RUNS)
    (root / "served" / "codex-home").mkdir(parents=True)
    served = _site(root / "served", None, listen={"tailnet_port": free_port()}, codex={
        "command": [str(REPO / "node_modules" / ".bin" / "codex"), "app-server"],
        "home": str(root / "served" / "codex-home"), "spare": False})
    bothy = [str(REPO / ".venv" / "bin" / "bothy"), "status"]
    bare = [sys.executable, "-c", "pass"]
    with _serving(root / "served", served):
        # Side by side, one of each in turn, so that a change in the machine's load meets all.
        turns = [(_time(bothy, utc), _time(bare, utc), _time(bothy, paris), _time(bothy, served),
                  _time(bothy, aged)) for _ in range(RUNS)]
        served_ir = _instructions(bothy, served)
    status_s, bare_s, paris_s, served_s, aged_s = (median([turn[i] for turn in turns])
                                                   for i in range(5))
    figure("bothy status cold start (median)", status_s * 1000, "ms", 60, higher_is_better=False)
    print(f"   bare python3 -c pass: {bare_s * 1000:.1f} ms; bothy status is"
          f" {status_s / bare_s:.2f}× that ({(status_s - bare_s) * 1000:.1f} ms of its own);"
          f" with budget.timezone Europe/Paris {paris_s * 1000:.1f} ms ({paris_s / bare_s:.2f}×);"
          f" beside a running bothy serve {served_s * 1000:.1f} ms ({served_s / bare_s:.2f}×);"
          f" with {AGED_RUNS:,} finished runs in its state database {aged_s * 1000:.1f} ms"
          f" ({aged_s / bare_s:.2f}×)")
    status_ir, bare_ir = _instructions(bothy, utc), _instructions(bare, utc)
    paris_ir = _instructions(bothy, paris)
    if status_ir and bare_ir and paris_ir and served_ir:
        print(f"   instructions (callgrind): bothy status {status_ir / 1e6:.0f} M, bare python"
              f" {bare_ir / 1e6:.0f} M: {status_ir / bare_ir:.2f}×; in Europe/Paris"
              f" {paris_ir / 1e6:.0f} M: {paris_ir / bare_ir:.2f}×; beside a running serve"
              f" {served_ir / 1e6:.0f} M: {served_ir / bare_ir:.2f}×")
    shutil.rmtree(root, ignore_errors=True)
