"""The status pages with 10,000 runs in state: overview, runs and run page render times
through a real ``bothy serve``, beside the same server's static stylesheet (the baseline: the
HTTP path with no state read and no template).

The site is written directly (a state database with 10,000 finished runs over 50 lanes and a
day of spend rows, and a register holding each run's seven records, chained and hashed as
Bothy writes them) so that the bench measures reading, not the months it took to get there;
``bothy serve`` then verifies that register whole at its start, as it does on a real site, and
a run's page builds the run-id index on its first read (the first load is not timed).
Times are wall-clock per request from a client on loopback, one request at a time: what a
person loading the page waits for.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench._util import REPO, figure, free_port, median, percentile, scratch
from bothy.engine.auditrecord import GENESIS_HASH, format_ts, serialise_body, with_hash
from bothy.engine.run import wake_id_for

RUNS = 10_000
LANES = 50
LOADS = 25
TARGET_MS = 50
_READY_S = 120.0
_PER_PAGE_S = 10.0  # a slow page is loaded fewer times (at least three)



def _site(root: Path, port: int) -> None:
    (root / "work").mkdir()
    (root / "state").mkdir(mode=0o700)
    (root / "config.json").write_text(json.dumps({
        "site": "bench", "workspace": str(root / "work"), "pool": {"max_workers": 2},
        "budget": {"mode": "api", "per_run_usd": 0.5, "per_day_usd": 25.0},
        "codex": {"command": [str(REPO / "node_modules" / ".bin" / "codex"), "app-server"]},
        "listen": {"tailnet_port": port},
    }))


def _runs(now: datetime) -> list[dict[str, Any]]:
    """10,000 finished runs, one every 30 s back from now, most completed."""
    runs = []
    for i in range(RUNS):
        admitted = now - timedelta(seconds=30 * (RUNS - i))
        outcome = "failed" if i % 10 == 3 else "timed_out" if i % 20 == 7 else "completed"
        stamp = admitted.strftime("%Y%m%dT%H%M%SZ")
        runs.append({"run_id": f"run_{stamp}_{i:08x}", "subject": f"pr:{i % LANES}",
                     "source": "webhook" if i % 2 else "cli", "outcome": outcome,
                     "admitted": admitted, "spent": 1_500 + (i % 97) * 100,
                     "final": f"Reviewed change {i}: <b>fine</b> & done."})
    return runs


def _state(db_path: Path, runs: list[dict[str, Any]], day: str) -> None:
    """The schema as Bothy makes it (``StateDB``), then the rows in one transaction."""
    import asyncio

    from bothy.engine.state import StateDB

    async def create() -> None:
        async with StateDB.open(db_path):
            pass

    asyncio.run(create())
    db = sqlite3.connect(db_path)
    with db:
        for seq, run in enumerate(runs, 1):
            admitted = _us(run["admitted"])
            db.execute(
                "INSERT INTO runs (seq, run_id, subject, source, status, outcome,"
                " reserved_micros, spent_micros, tokens, model, admitted_us, started_us,"
                " finished_us, expires_us, owner_pid, final_text, reason) VALUES"
                " (?, ?, ?, ?, 'finished', ?, 500000, ?, 1200, 'fake-model', ?, ?, ?, ?, 1, ?, ?)",
                (seq, run["run_id"], run["subject"], run["source"], run["outcome"],
                 run["spent"], admitted, admitted + 200_000, admitted + 9_000_000,
                 admitted + 3_600_000_000, run["final"],
                 None if run["outcome"] == "completed" else "scripted"))
            if run["admitted"].date().isoformat() == day:
                db.execute("INSERT INTO spend (run_id, day, micros, at_us) VALUES (?, ?, ?, ?)",
                           (run["run_id"], day, run["spent"], admitted + 9_000_000))
    db.close()


def _register(path: Path, runs: list[dict[str, Any]]) -> int:
    """Each run's records, chained as Bothy chains them; how many were written."""
    prev, seq = GENESIS_HASH, 0
    with path.open("wb") as out:
        for run in runs:
            for offset_ms, kind, event, outcome, details in _story(run):
                seq += 1
                body = serialise_body(
                    seq=seq, ts=format_ts(run["admitted"] + timedelta(milliseconds=offset_ms)),
                    kind=kind, event=event, outcome=outcome, subject=run["subject"],
                    run_id=None if kind == "wake" else run["run_id"], details=details,
                    prev=prev)
                prev = hashlib.sha256(body).hexdigest()
                out.write(with_hash(body, prev) + b"\n")
    path.chmod(0o600)
    return seq


def _story(run: dict[str, Any]) -> list[tuple[int, str, str, str, dict[str, Any]]]:
    cost = f"{run['spent'] / 1e6:.6f}"
    ended = "ok" if run["outcome"] == "completed" else run["outcome"]
    return [
        (-50, "wake", "received", "ok", {"wake_id": wake_id_for(run["run_id"]),
                                         "source": run["source"], "trusted": False}),
        (0, "run", "admitted", "ok", {"reserved_usd": "0.500000", "ceiling_usd": "25.000000",
                                      "used_usd": "1.000000", "already_reserved_usd": "0"}),
        (200, "run", "started", "ok", {"pgid": 4242, "leader_pid": 4242}),
        (900, "turn", "started", "ok", {"model": "fake-model", "turn_id": "t1"}),
        (8_800, "worker", "stopped", "ok", {"exit_code": 0, "how": "terminated in 0.1s"}),
        (8_900, "budget", "settled", "ok", {"cost_usd": cost, "reserved_usd": "0.500000",
                                            "released_usd": "0.4"}),
        (9_000, "run", "finished", ended, {"outcome": run["outcome"], "cost_usd": cost,
                                           "reason": None, "final_chars": 40}),
    ]


def _us(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000)


def _serve(root: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BOTHY_HOME": str(root),
           "PATH": f"{REPO / 'node_modules' / '.bin'}:{os.environ.get('PATH', '')}"}
    env.pop("BOTHY_WEB_TOKEN", None)
    serve = subprocess.Popen([str(REPO / ".venv" / "bin" / "bothy"), "serve"], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    published = root / "state" / "serve.json"
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline and serve.poll() is None:
        if published.exists():
            return serve
        time.sleep(0.05)
    serve.kill()
    raise SystemExit(f"bothy serve did not get ready: {serve.stderr.read().decode()[-2000:]}"
                     if serve.stderr else "bothy serve did not get ready")


def _time(client: httpx.Client, path: str) -> list[float]:
    answer = client.get(path)
    assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
    took: list[float] = []
    spent_until = time.monotonic() + _PER_PAGE_S
    while len(took) < LOADS and (len(took) < 3 or time.monotonic() < spent_until):
        started = time.perf_counter()
        again = client.get(path)
        took.append((time.perf_counter() - started) * 1000)
        assert again.status_code == 200 and len(again.content) >= len(answer.content) // 2, path
    return took


def main() -> None:
    root = scratch("web-")
    port = free_port()
    _site(root, port)
    now = datetime.now(UTC)
    runs = _runs(now)
    _state(root / "state" / "bothy.sqlite3", runs, now.date().isoformat())
    records = _register(root / "state" / "audit.jsonl", runs)
    serve = _serve(root)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            pages = {
                "overview /bothy/": "/bothy/",
                "runs /bothy/runs (newest 100)": "/bothy/runs",
                "runs filtered by lane and outcome": "/bothy/runs?lane=pr%3A7&outcome=failed",
                "run page, newest run": f"/bothy/runs/{runs[-1]['run_id']}",
                "run page, a run from 3 days ago": f"/bothy/runs/{runs[RUNS // 2]['run_id']}",
            }
            baseline = _time(client, "/bothy/static/site.css")
            print(f"   {RUNS:,} runs in state, {records:,} records in the register"
                  f" ({(root / 'state' / 'audit.jsonl').stat().st_size / 1e6:.1f} MB)")
            for label, path in pages.items():
                took = _time(client, path)
                figure(f"{label} (median)", median(took), "ms", TARGET_MS,
                       higher_is_better=False)
                print(f"      p95 {percentile(took, 95):.1f} ms")
            print(f"   baseline: the stylesheet from the same server, median"
                  f" {median(baseline):.1f} ms (no state read, no template)")
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    import shutil

    shutil.rmtree(root, ignore_errors=True)
