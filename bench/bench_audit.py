"""The register: appends/s with an fsync per record (one writer, four writer processes) and
the verify rate over a 100k-record chain. Figures are printed beside their targets.

Appends are measured on the repository's disk (``.bench/``), since fsync is what they cost.
The 100k-record chain for verify is built on tmpfs (``/dev/shm``) when there is one, where
fsync is nearly free, so building it takes seconds rather than a minute; elsewhere the build
is time-boxed and verify runs over however many records it reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bothy.engine.audit import AuditLog

REPO_ROOT = Path(__file__).resolve().parent.parent
SINGLE_WRITER_TARGET_PER_S = 2_000
VERIFY_TARGET_PER_S = 100_000
SINGLE_WRITER_RECORDS = 2_000
WRITER_PROCESSES = 4
RECORDS_PER_WRITER = 500
VERIFY_RECORDS = 100_000
BUILD_LIMIT_S = 25.0

_DETAILS = {"gate": "budget", "reserved_usd_micros": 500_000, "day_spent_usd_micros": 12_345_678}

_WRITER = """
import sys
from pathlib import Path
from bothy.engine.audit import AuditLog

log = AuditLog(Path(sys.argv[1]))
name, count = sys.argv[2], int(sys.argv[3])
details = {"gate": "budget", "reserved_usd_micros": 500000, "day_spent_usd_micros": 12345678}
print("ready", flush=True)
sys.stdin.readline()
for _ in range(count):
    log.append("run", "admitted", "ok", subject=f"pr:{name}",
               run_id="run_20260924T101402Z_8d41e7b2", details=details)
print("done", flush=True)
"""


def main() -> None:
    """Print append and verify rates, each with its target and the ratio to it."""
    bench_root = REPO_ROOT / ".bench"
    bench_root.mkdir(exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="audit-", dir=bench_root))
    try:
        single_per_s = _single_writer_rate(work_dir / "single" / "audit.jsonl")
        _report("append, 1 writer, fsync each", single_per_s, SINGLE_WRITER_TARGET_PER_S)
        multi_per_s = _multi_writer_rate(work_dir / "multi" / "audit.jsonl")
        _report(
            f"append, {WRITER_PROCESSES} writer processes, total",
            multi_per_s,
            SINGLE_WRITER_TARGET_PER_S,
        )
        _verify_bench(work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _single_writer_rate(path: Path) -> float:
    log = AuditLog(path)
    log.append("serve", "starting", "ok")  # create the file outside the timing
    started = time.perf_counter()
    for n in range(SINGLE_WRITER_RECORDS):
        log.append("run", "admitted", "ok", subject=f"pr:{n}", run_id=_RUN_ID, details=_DETAILS)
    return SINGLE_WRITER_RECORDS / (time.perf_counter() - started)


def _multi_writer_rate(path: Path) -> float:
    """Aggregate appends/s of concurrent writer processes, from their common start signal."""
    AuditLog(path).append("serve", "starting", "ok")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(n), str(RECORDS_PER_WRITER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for n in range(WRITER_PROCESSES)
    ]
    try:
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline() == b"ready\n"
        started = time.perf_counter()
        for writer in writers:
            assert writer.stdin is not None
            writer.stdin.write(b"go\n")
            writer.stdin.close()
        for writer in writers:
            assert writer.stdout is not None and writer.stdout.readline() == b"done\n"
        elapsed_s = time.perf_counter() - started
    finally:
        for writer in writers:
            if writer.wait(timeout=60) != 0:
                raise RuntimeError(f"an audit writer exited with code {writer.returncode}")
            if writer.stdout is not None:
                writer.stdout.close()
    report = AuditLog(path).verify()
    if not report.ok or report.count != 1 + WRITER_PROCESSES * RECORDS_PER_WRITER:
        raise RuntimeError(f"concurrent writers broke the chain: {report.describe()}")
    return WRITER_PROCESSES * RECORDS_PER_WRITER / elapsed_s


def _verify_bench(work_dir: Path) -> None:
    shm = Path("/dev/shm")
    build_dir = Path(tempfile.mkdtemp(prefix="bothy-audit-", dir=shm)) if shm.is_dir() else work_dir
    try:
        log = AuditLog(build_dir / "verify" / "audit.jsonl")
        built, build_s = _build_chain(log)
        where = "tmpfs" if build_dir != work_dir else "disk, time-boxed"
        print(
            f"   (built {built:,} records in {build_s:.1f} s: {built / build_s:,.0f}/s on {where})"
        )
        best_s = min(_time_verify(log, built) for _ in range(3))
        _report(f"verify, {built:,} records (best of 3)", built / best_s, VERIFY_TARGET_PER_S)
    finally:
        if build_dir != work_dir:
            shutil.rmtree(build_dir, ignore_errors=True)


def _build_chain(log: AuditLog) -> tuple[int, float]:
    started = time.perf_counter()
    for n in range(VERIFY_RECORDS):
        log.append("run", "admitted", "ok", subject=f"pr:{n}", run_id=_RUN_ID, details=_DETAILS)
        if n % 1000 == 999 and time.perf_counter() - started > BUILD_LIMIT_S:
            return n + 1, time.perf_counter() - started
    return VERIFY_RECORDS, time.perf_counter() - started


def _time_verify(log: AuditLog, expected: int) -> float:
    started = time.perf_counter()
    report = log.verify()
    elapsed_s = time.perf_counter() - started
    if not report.ok or report.count != expected:
        raise RuntimeError(f"the benchmark chain did not verify: {report.describe()}")
    return elapsed_s


def _report(label: str, per_s: float, target_per_s: float) -> None:
    print(
        f"   {label:<42} {per_s:>10,.0f}/s   target ≥ {target_per_s:,}/s   "
        f"{per_s / target_per_s:.2f}×",
        flush=True,
    )


_RUN_ID = "run_20260924T101402Z_8d41e7b2"
