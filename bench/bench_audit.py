"""The register: appends/s with an fsync per record (one writer, four writer processes), with
group commit (16 concurrent in-process writers, each awaiting its record before the next) and
the verify rate over a 100k-record chain. Figures are printed beside their targets.

The 16 writers are measured side by side in the same run, three rounds each: as coroutines
awaiting ``record`` (group commit: records that arrive together share one write and one fsync)
and, as the baseline, as 16 threads calling the blocking ``append`` (one fsync each, which is
what ``record`` did before group commit). Every chain must verify, with seq in file order.
The median and range of each are printed, with the load average they ran under.

Appends are measured on the repository's disk (``.bench/``), since fsync is what they cost.
The 100k-record chain for verify is built on tmpfs (``/dev/shm``) when there is one, where
fsync is nearly free, so building it takes seconds rather than a minute; elsewhere the build
is time-boxed and verify runs over however many records it reached.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bothy.engine.audit import AuditLog

REPO_ROOT = Path(__file__).resolve().parent.parent
SINGLE_WRITER_TARGET_PER_S = 2_000
VERIFY_TARGET_PER_S = 100_000
SINGLE_WRITER_RECORDS = 2_000
WRITER_PROCESSES = 4
RECORDS_PER_WRITER = 500
CONCURRENT_WRITERS = 16
RECORDS_PER_CONCURRENT_WRITER = 1_000
GROUP_COMMIT_TARGET_PER_S = 10_000
GROUP_COMMIT_ROUNDS = 3
BARE_FSYNCS = 200
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
        _group_commit_bench(work_dir)
        _verify_bench(work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _group_commit_bench(work_dir: Path) -> None:
    """16 threads (one fsync each) and 16 coroutines (group commit), side by side, three
    rounds: the median and the range of each, the load they ran under, and their ratio."""
    threads: list[float] = []
    grouped: list[float] = []
    cpu_us: list[float] = []
    load_before = os.getloadavg()[0]
    for n in range(GROUP_COMMIT_ROUNDS):
        threads.append(_threads_rate(work_dir / f"threads-{n}" / "audit.jsonl"))
        rate, cpu = asyncio.run(_coroutines_rate(work_dir / f"grouped-{n}" / "audit.jsonl"))
        grouped.append(rate)
        cpu_us.append(cpu)
    load_after = os.getloadavg()[0]
    for label, rates in ((f"append, {CONCURRENT_WRITERS} threads, fsync each", threads),
                         (f"record, {CONCURRENT_WRITERS} coroutines, group commit", grouped)):
        if rates is threads:  # the baseline the target is measured beside, not held to it
            print(f"   {label:<42} {statistics.median(rates):>10,.0f}/s   (the baseline: what"
                  " `record` did before group commit; no target)", flush=True)
        else:
            _report(label, statistics.median(rates), GROUP_COMMIT_TARGET_PER_S)
        print(f"      median of {len(rates)} rounds: "
              + ", ".join(f"{r:,.0f}" for r in sorted(rates)) + "/s", flush=True)
    print(f"      CPU per record with group commit (the process's, all threads):"
          f" {statistics.median(cpu_us):.0f} µs median"
          f" ({min(cpu_us):.0f}–{max(cpu_us):.0f})", flush=True)
    times_s = _bare_fsync_times_s(work_dir / "bare")
    mean_s = statistics.fmean(times_s)
    print(f"      a bare write and fsync of {CONCURRENT_WRITERS} lines here: median"
          f" {statistics.median(times_s) * 1e3:.2f} ms, mean {mean_s * 1e3:.2f},"
          f" p90 {times_s[len(times_s) * 9 // 10] * 1e3:.2f}: one commit at a time of"
          f" {CONCURRENT_WRITERS} by the disk alone ≤ {CONCURRENT_WRITERS / mean_s:,.0f}/s",
          flush=True)
    ratio = statistics.median(grouped) / statistics.median(threads)
    print(f"   group commit / fsync each: {ratio:.2f}× (load average {load_before:.1f} before,"
          f" {load_after:.1f} after, on {os.cpu_count()} cores)", flush=True)


def _bare_fsync_times_s(directory: Path) -> list[float]:
    """Times of one write and fsync of sixteen register-sized lines, sorted, on the same disk
    just after the rounds: what the disk alone allows one commit at a time under this load."""
    directory.mkdir()
    line = b"x" * 330 + b"\n"
    fd = os.open(directory / "lines", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    times: list[float] = []
    try:
        for _ in range(BARE_FSYNCS):
            started = time.perf_counter()
            os.write(fd, line * CONCURRENT_WRITERS)
            os.fsync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
    return sorted(times)


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


def _threads_rate(path: Path) -> float:
    log = AuditLog(path)
    log.append("serve", "starting", "ok")
    go = threading.Event()

    def writer(n: int) -> None:
        go.wait()
        for _ in range(RECORDS_PER_CONCURRENT_WRITER):
            log.append("run", "admitted", "ok", subject=f"pr:{n}", run_id=_RUN_ID,
                       details=_DETAILS)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(CONCURRENT_WRITERS)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    go.set()
    for thread in threads:
        thread.join()
    elapsed_s = time.perf_counter() - started
    _check_chain(log)
    return CONCURRENT_WRITERS * RECORDS_PER_CONCURRENT_WRITER / elapsed_s


async def _coroutines_rate(path: Path) -> tuple[float, float]:
    """Records/s of 16 coroutines, and the process's CPU µs per record meanwhile."""
    log = AuditLog(path)
    await log.record("serve", "starting", "ok")

    async def writer(n: int) -> None:
        for _ in range(RECORDS_PER_CONCURRENT_WRITER):
            await log.record("run", "admitted", "ok", subject=f"pr:{n}", run_id=_RUN_ID,
                             details=_DETAILS)

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(writer(n) for n in range(CONCURRENT_WRITERS)))
    elapsed_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    await asyncio.to_thread(_check_chain, log)
    records = CONCURRENT_WRITERS * RECORDS_PER_CONCURRENT_WRITER
    return records / elapsed_s, cpu_s / records * 1e6


def _check_chain(log: AuditLog) -> None:
    """Every record there, the chain intact, and seq in file order (chain order)."""
    report = log.verify()
    expected = 1 + CONCURRENT_WRITERS * RECORDS_PER_CONCURRENT_WRITER
    seqs = [record.seq for record in log.records()]
    if not report.ok or report.count != expected or seqs != list(range(1, expected + 1)):
        raise RuntimeError(f"concurrent writers broke the chain: {report.describe()}")


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
