"""`bothy trace RUN` and `bothy audit --run RUN` on a register of 1,000,000 records.

A year's register is written straight to disk in the canonical form (hash-chained, as the
writer would: 5,000 runs of 200 records, interleaved in fours), then the real CLI reads one
run of 200 records from it. Printed: the whole-register scan (what `audit --run` did before the
index), the one-off rebuild of a missing index, then each command's cold start (a new process,
median) beside the 100 ms target and beside a bare `python -c pass`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench._util import REPO, figure, median, scratch
from bothy.engine.auditrecord import GENESIS_HASH, format_ts, serialise_body, with_hash

RECORDS = 1_000_000
RUN_RECORDS = 200
RUNS = 11
_EVENTS = [("run", "admitted"), ("run", "started"), ("turn", "started"), ("tool", "ran"),
           ("tool", "allowed"), ("budget", "settled")]


def _run_id(n: int) -> str:
    return f"run_20260101T{n // 3600 % 24:02d}{n // 60 % 60:02d}{n % 60:02d}Z_{n:08x}"


def _write_register(path: Path) -> str:
    """The register, chained; returns the id of a run in the middle of it."""
    started = datetime(2026, 1, 1, tzinfo=UTC)
    per_batch = 4  # four runs write side by side, as a busy site's would
    target = _run_id(RECORDS // RUN_RECORDS // 2)
    prev = GENESIS_HASH
    with path.open("wb") as f:
        lines: list[bytes] = []
        for seq in range(1, RECORDS + 1):
            i = seq - 1
            block, within = divmod(i, RUN_RECORDS * per_batch)
            run = block * per_batch + within % per_batch
            kind, event = _EVENTS[(within // per_batch) % len(_EVENTS)]
            body = serialise_body(
                seq=seq, ts=format_ts(started + timedelta(milliseconds=seq * 30)),
                kind=kind, event=event, outcome="ok", subject=f"lane:{run % 50}",
                run_id=_run_id(run), details={"n": within // per_batch, "note": "x" * 40},
                prev=prev)
            prev = hashlib.sha256(body).hexdigest()
            lines.append(with_hash(body, prev) + b"\n")
            if len(lines) == 10_000:
                f.write(b"".join(lines))
                lines.clear()
        f.write(b"".join(lines))
    return target


def _time(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    root = scratch("trace-")
    state = root / "state"
    state.mkdir(mode=0o700)
    (root / "work").mkdir()
    (root / "config.json").write_text(json.dumps({
        "site": "bench", "workspace": str(root / "work"),
        "budget": {"mode": "api", "per_run_usd": 0.5, "per_day_usd": 25.0}}))
    # .pyc files as an installed bothy has them (a shell may say not to write them).
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
           "BOTHY_HOME": str(root)}
    register = state / "audit.jsonl"
    started = time.perf_counter()
    run_id = _write_register(register)
    print(f"   register: {RECORDS:,} records, {register.stat().st_size / 1e6:,.0f} MB, written"
          f" in {time.perf_counter() - started:.1f} s; run {run_id} has {RUN_RECORDS} records")
    bothy = str(REPO / ".venv" / "bin" / "bothy")
    audit = [bothy, "audit", "--run", run_id]
    trace = [bothy, "trace", run_id]

    scan_s = _time([sys.executable, "-c", _SCAN, str(register), run_id], env)
    print(f"   a whole-register scan for the run (what audit --run did before): {scan_s:.2f} s")
    rebuild_s = _time(audit, env)  # no index yet: this call builds it from the register
    print(f"   first audit --run, rebuilding the missing index: {rebuild_s:.2f} s"
          f" ({(state / 'audit.jsonl.index').stat().st_size / 1e6:,.0f} MB index)")

    _time(trace, env)  # .pyc files written, page cache warm: what "cold" means is a new process
    trace_s = median([_time(trace, env) for _ in range(RUNS)])
    audit_s = median([_time(audit, env) for _ in range(RUNS)])
    bare_s = median([_time([sys.executable, "-c", "pass"], env) for _ in range(RUNS)])
    figure("bothy trace RUN, 200 of 1M records (median)", trace_s * 1000, "ms", 100,
           higher_is_better=False)
    figure("bothy audit --run RUN, 200 of 1M (median)", audit_s * 1000, "ms", 100,
           higher_is_better=False)
    print(f"   bare python -c pass: {bare_s * 1000:.1f} ms; trace is {trace_s / bare_s:.1f}× that,"
          f" audit --run {audit_s / bare_s:.1f}×")
    shutil.rmtree(root, ignore_errors=True)


# What `bothy audit --run` did before the index: every line of the register parsed.
_SCAN = """
import sys
from pathlib import Path
from bothy.engine.audit import AuditLog
log = AuditLog(Path(sys.argv[1]))
print(sum(1 for r in log.records() if r.run_id == sys.argv[2]))
"""
