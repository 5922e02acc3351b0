"""Webhook ingest as a sender meets it: a real ``bothy serve`` subprocess, dispatcher running.

16 keep-alive clients send small signed GitHub deliveries (realistic pull_request payloads,
distinct ids) to, in the same run and under the same load, rounds alternating:

- a bare aiohttp handler that reads the body and answers 200 (no check, nothing kept);
- an aiohttp handler that writes and fsyncs one file per delivery, then answers 200;
- a lean durable handler, the least a durable intake does: it checks the signature, parses
  the JSON, appends a line to one segment and answers 200 once the fsync covering it is done
  (group commit: one thread hop and one fsync per batch; no rows, no register, no
  dispatcher) — what this machine allows a Python intake, to set Bothy's layers against;
- the same with its rows: one SQLite transaction per group inserting a row per delivery (WAL,
  synchronous=FULL, in the same thread hop as the fsync) — the least this issue's target asks
  of a durable intake ("one fsync of an append-only segment and one SQLite transaction");
- ``bothy serve`` (its own process, its home on the repository's disk in ``.bench/``): every
  200 follows the fsync and the SQLite commit covering its delivery (group commit). The
  deliveries are wanted (the route's job takes them): the first is admitted and held by the
  scripted model, the rest are refused at the budget gate and deferred, so the dispatcher
  works through them while intake goes on, as it would on site.

After each Bothy round every delivery must be durable: a row each in the state database.
Rates are the median round; time-to-200 is pooled over the rounds. The server's CPU per
delivery (all its threads) is printed beside each.

Then, with intake quiet, the dispatcher alone for :data:`DISPATCHER_WINDOW_S`: how many of
the round's wakes it defers a second and the server's CPU for each (all threads, and of it
the main thread's), and how many it had deferred while the round was sent. Its deferrals
share the event loop, the GIL and the two cores with intake: this is what the intake round
competes with, measured alone.

Then unwanted deliveries (no job takes them: closed as ignored at intake, recorded ``wake
ignored``): a burst of 10,000, its rate, and then one wanted delivery: how long after its 200
its run starts (``wake received``, ``run admitted``, ``run started`` — the worker spawned).

The load generator is a separate process speaking HTTP/1.1 over raw asyncio sockets (no
client library), so that it is not the bottleneck; its own CPU time is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._util import REPO, figure, free_port, median, percentile, scratch

DELIVERIES = 2_000
CLIENTS = 16
ROUNDS = 2
BURST = 10_000
RATIO_TARGET = 0.5
P99_TARGET_MS = 10.0
UNWANTED_TARGET_PER_S = 2_000
WANTED_AFTER_BURST_TARGET_MS = 100.0
DISPATCHER_WINDOW_S = 2.0
SECRET = "bench-secret-8d41e7b2"
PATH = "/hooks/github"
_READY_S = 30.0

# The sender: reads requests (one JSON line each: the raw HTTP request, latin-1) from a file,
# waits for a port on stdin, sends them over CLIENTS keep-alive connections, and prints one
# JSON line: elapsed, latencies, statuses, its own CPU, and when the last request's 200 came.
_SENDER = r"""
import asyncio, json, resource, sys, time

async def main(path, clients):
    with open(path) as f:
        requests = [json.loads(line).encode("latin-1") for line in f]
    port = int(sys.stdin.readline())
    latencies, statuses = [], {}
    queue = iter(requests)
    last_200_at = [None]

    async def client():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for request in queue:
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            status = head.split(b" ", 2)[1].decode()
            statuses[status] = statuses.get(status, 0) + 1
            if request is requests[-1]:
                last_200_at[0] = time.time()
        writer.close()

    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    print(json.dumps({"elapsed_s": elapsed, "latencies_s": latencies, "statuses": statuses,
                      "cpu_s": cpu, "last_200_at": last_200_at[0]}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

# How every reference server serves its ``answer``: on a free loopback port, printed first.
_SERVE = r"""
async def main():
    runner = web.ServerRunner(web.Server(answer, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

# The lean durable handler (see the module docstring): the secret in argv[2], the segment in
# the directory argv[1]; with argv[3] "rows", the least the issue asks: also one SQLite
# transaction of the batch's rows (WAL, synchronous=FULL, as Bothy's state), in the same hop.
_LEAN = r"""
import asyncio, hmac, json, os, sqlite3, sys
from aiohttp import web

secret = sys.argv[2].encode()
fd = os.open(os.path.join(sys.argv[1], "segment"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
waiting, committing, size = [], [False], [0]
db = None
if sys.argv[3:] == ["rows"]:
    db = sqlite3.connect(os.path.join(sys.argv[1], "state.sqlite3"), isolation_level=None,
                         check_same_thread=False)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = FULL")
    db.execute("CREATE TABLE wakes (id INTEGER PRIMARY KEY, key TEXT UNIQUE, event TEXT,"
               " at INTEGER, bytes INTEGER)")

def append(batch):
    os.write(fd, b"".join(line for line, _, _ in batch))
    os.fsync(fd)
    if db is not None:
        db.execute("BEGIN IMMEDIATE")
        at = size[0]
        for line, key, event in batch:
            db.execute("INSERT INTO wakes (key, event, at, bytes) VALUES (?, ?, ?, ?)"
                       " ON CONFLICT (key) DO NOTHING", (key, event, at, len(line)))
            at += len(line)
        db.execute("COMMIT")
    size[0] += sum(len(line) for line, _, _ in batch)

async def commit():
    global waiting
    while waiting:
        batch, waiting = waiting, []
        await asyncio.to_thread(append, [entry for entry, _ in batch])
        for _, done in batch:
            done.set_result(None)
    committing[0] = False

async def answer(request):
    body = await request.read()
    given = request.headers.get("X-Hub-Signature-256", "").removeprefix("sha256=")
    if not hmac.compare_digest(given, hmac.new(secret, body, "sha256").hexdigest()):
        return web.json_response({"error": "bad signature"}, status=401)
    payload = json.loads(body)
    event = request.headers.get("X-GitHub-Event")
    delivery = request.headers.get("X-GitHub-Delivery")
    line = json.dumps({"event": event, "delivery": delivery, "action": payload.get("action"),
                       "body": body.decode()}).encode()
    done = asyncio.get_running_loop().create_future()
    waiting.append(((line + b"\n", delivery, event), done))
    if not committing[0]:
        committing[0] = True
        asyncio.ensure_future(commit())
    await done
    return web.json_response({"status": "queued"})
""" + _SERVE

# A baseline server: answers 200 after reading the body; with a directory argument, after
# writing and fsyncing one file per delivery there (in a thread, as a careful handler would).
_BASELINE = r"""
import asyncio, itertools, os, sys
from aiohttp import web

directory = sys.argv[1] if len(sys.argv) > 1 else None
names = itertools.count()

def keep(body):
    fd = os.open(os.path.join(directory, f"{next(names)}.json"),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)

async def answer(request):
    body = await request.read()
    if directory is not None:
        await asyncio.to_thread(keep, body)
    return web.json_response({"status": "ok"})
""" + _SERVE


@dataclass
class _Round:
    rate_per_s: float
    latencies_ms: list[float]
    statuses: dict[str, int]
    server_cpu_us: float  # per delivery, user + kernel, every thread of the server process
    main_cpu_us: float  # per delivery, of it its main thread's (the event loop's)
    client_cpu_s: float
    last_200_at: float


@dataclass
class _Dispatching:
    """The dispatcher alone after a Bothy round: wakes deferred during the round and after."""

    during_round: int  # deferred by the time the round's last answer came
    caught_up: bool  # nothing was left to defer by the window's end (per_s a lower bound)
    per_s: float  # deferred a second once intake was quiet
    cpu_us: float  # the server's CPU per deferral, every thread
    main_cpu_us: float  # of it the main thread's


def main() -> None:
    """Alternate the servers' rounds; then the unwanted burst and the wanted delivery."""
    sys.path.insert(0, str(REPO))
    root = scratch("webhooks-")
    print("   load average before: {:.2f} {:.2f} {:.2f} (2 cores shared: absolute figures swing,"
          " the ratios measured side by side less so)".format(*os.getloadavg()), flush=True)
    try:
        wanted = root / "wanted.jsonl"
        _write_requests(wanted, "pull_request", DELIVERIES, "want")
        rounds: dict[str, list[_Round]] = {"bare": [], "file": [], "lean": [], "rows": [],
                                           "bothy": []}
        durable: list[str] = []
        dispatching: list[_Dispatching] = []
        for n in range(ROUNDS):
            rounds["bare"].append(asyncio.run(_baseline_round(wanted, None)))
            (root / f"files-{n}").mkdir()
            rounds["file"].append(asyncio.run(_baseline_round(wanted, root / f"files-{n}")))
            (root / f"lean-{n}").mkdir()
            rounds["lean"].append(asyncio.run(_lean_round(wanted, root / f"lean-{n}")))
            (root / f"rows-{n}").mkdir()
            rounds["rows"].append(asyncio.run(_lean_round(wanted, root / f"rows-{n}",
                                                          rows=True)))
            measured, alone, verdict = asyncio.run(_bothy_round(root / f"site-{n}", wanted))
            rounds["bothy"].append(measured)
            dispatching.append(alone)
            durable.append(verdict)
        _report_rounds(rounds, durable)
        _report_dispatching(dispatching)
        asyncio.run(_burst_then_wanted(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _report_rounds(rounds: dict[str, list[_Round]], durable: list[str]) -> None:
    labels = {"bare": "bare aiohttp 200", "file": "aiohttp + one fsynced file each",
              "lean": "lean durable handler (signature, JSON, one segment, group commit)",
              "rows": "the same, with its rows in SQLite (one transaction per group)",
              "bothy": "bothy serve (durable, dispatcher running)"}
    for name, label in labels.items():
        _print_rounds(label, rounds[name])
    rate = {name: median([r.rate_per_s for r in rs]) for name, rs in rounds.items()}
    p99 = percentile([ms for r in rounds["bothy"] for ms in r.latencies_ms], 99)
    figure("durable ingest through bothy serve (deliveries/s)", rate["bothy"], "/s",
           rate["bare"] * RATIO_TARGET, higher_is_better=True)
    figure("ratio to the bare handler (×100)", 100 * rate["bothy"] / rate["bare"], "%",
           100 * RATIO_TARGET, higher_is_better=True)
    print(f"   ratio to one fsynced file per delivery: {rate['bothy'] / rate['file']:.2f}×",
          flush=True)
    print(f"   the lean durable handler: {rate['lean'] / rate['bare']:.2f}× the bare handler;"
          f" with its rows in SQLite (the least this target asks: a segment fsync and one"
          f" SQLite transaction per group, nothing else) {rate['rows'] / rate['bare']:.2f}×;"
          f" bothy serve {rate['bothy'] / rate['rows']:.2f}× the latter", flush=True)
    cpu = {name: median([r.server_cpu_us for r in rs]) for name, rs in rounds.items()}
    print(f"   server CPU per delivery: bothy {cpu['bothy']:,.0f} us, bare {cpu['bare']:,.0f} us"
          f" ({cpu['bothy'] / cpu['bare']:.1f}×; on a machine whose CPU is the limit, 0.5× the"
          f" bare rate needs at most {1 / RATIO_TARGET:.0f}×)", flush=True)
    main = {name: median([r.main_cpu_us for r in rs]) for name, rs in rounds.items()}
    # The event loop's thread holds the GIL for the requests; the others (fsyncs, SQLite's
    # thread, the register's commits) mostly wait on the disk, but need the GIL for their
    # Python and take it from the loop: the main thread's figure is the one that caps the rate.
    print(f"   of it on the main thread (the event loop): bothy {main['bothy']:,.0f} us,"
          f" bare {main['bare']:,.0f} us ({main['bothy'] / main['bare']:.1f}×)", flush=True)
    figure("time-to-200 p99, bothy serve (ms)", p99, "ms", P99_TARGET_MS,
           higher_is_better=False)
    early = len(rounds["bothy"][0].latencies_ms) // 5  # answers in the order they came
    first = [ms for r in rounds["bothy"] for ms in r.latencies_ms[:early]]
    rest = [ms for r in rounds["bothy"] for ms in r.latencies_ms[early:]]
    print(f"   of each round's first fifth of answers (the connections opening, the first"
          f" delivery's run starting beside intake): p99 {percentile(first, 99):.2f} ms; of the"
          f" rest: p99 {percentile(rest, 99):.2f} ms", flush=True)
    for n, verdict in enumerate(durable, start=1):
        print(f"   durable after round {n}: {verdict}", flush=True)


def _report_dispatching(dispatching: list[_Dispatching]) -> None:
    during = ", ".join(f"{d.during_round:,}" for d in dispatching)
    print(f"   the dispatcher had deferred {during} of {DELIVERIES:,} by each round's last"
          f" answer; alone after it: {median([d.per_s for d in dispatching]):,.0f} deferrals/s,"
          f" server CPU {median([d.cpu_us for d in dispatching]):,.0f} us each"
          f" ({median([d.main_cpu_us for d in dispatching]):,.0f} on its main thread)"
          + ("; it ran out of wakes to defer, so that rate is a lower bound"
             if any(d.caught_up for d in dispatching) else ""), flush=True)
    print("   load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)


def _print_rounds(label: str, rounds: list[_Round]) -> None:
    latencies = [ms for r in rounds for ms in r.latencies_ms]
    statuses: dict[str, int] = {}
    for r in rounds:
        for status, count in r.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    rates = ", ".join(f"{r.rate_per_s:,.0f}" for r in rounds)
    print(f"   {label}: {rates} deliveries/s; time-to-200 p50 {median(latencies):.2f} ms,"
          f" p99 {percentile(latencies, 99):.2f} ms; server CPU"
          f" {median([r.server_cpu_us for r in rounds]):,.0f} us/delivery; client CPU"
          f" {median([r.client_cpu_s for r in rounds]):.2f} s/round; statuses {statuses}",
          flush=True)


def _write_requests(path: Path, event: str, count: int, prefix: str) -> None:
    """Raw HTTP/1.1 requests, one JSON string (latin-1) a line."""
    from tests.fakes import github  # the same realistic payloads the tests send

    with path.open("w") as out:
        for n in range(count):
            if event == "pull_request":
                payload = github.pull_request_opened(number=n + 1, title=f"Change {n}")
            else:
                payload = github.push(messages=(f"Change {n}",))
            body = github.encode(payload)
            headers = github.headers(event, body, SECRET, delivery=f"{prefix}-{n:05d}")
            head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            request = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
                       f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            out.write(json.dumps(request.decode("latin-1")) + "\n")


async def _send(requests: Path, port: int, server_pid: int) -> _Round:
    """Run the sender against ``port``; the server's CPU is read from /proc around it."""
    sender = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SENDER, str(requests), str(CLIENTS),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    before, main_before = _cpu_s(server_pid), _cpu_s(server_pid, server_pid)
    out, _ = await sender.communicate(f"{port}\n".encode())
    after, main_after = _cpu_s(server_pid), _cpu_s(server_pid, server_pid)
    if sender.returncode != 0:
        raise RuntimeError(f"the sender exited with code {sender.returncode}")
    result: dict[str, Any] = json.loads(out)
    count = len(result["latencies_s"])
    return _Round(
        rate_per_s=count / result["elapsed_s"],
        latencies_ms=[s * 1000 for s in result["latencies_s"]],
        statuses=result["statuses"],
        server_cpu_us=(after - before) / count * 1e6,
        main_cpu_us=(main_after - main_before) / count * 1e6,
        client_cpu_s=result["cpu_s"],
        last_200_at=result["last_200_at"],
    )


def _cpu_s(pid: int, thread: int | None = None) -> float:
    """User + kernel CPU seconds of process ``pid`` (all its threads), or of one ``thread``."""
    stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _lean_round(requests: Path, directory: Path, *, rows: bool = False) -> _Round:
    return await _reference_round(requests, _LEAN, str(directory), SECRET,
                                  *(["rows"] if rows else []))


async def _baseline_round(requests: Path, directory: Path | None) -> _Round:
    return await _reference_round(requests, _BASELINE,
                                  *([str(directory)] if directory is not None else []))


async def _reference_round(requests: Path, script: str, *args: str) -> _Round:
    """One round against a reference server (``script``, run with ``args``)."""
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(await server.stdout.readline())
        return await _send(requests, port, server.pid)
    finally:
        server.terminate()
        await server.wait()


# -- bothy serve ----------------------------------------------------------------------------


async def _bothy_round(home_root: Path, requests: Path) -> tuple[_Round, _Dispatching, str]:
    from tests.fakes.model_server import ModelServer, stall

    async with ModelServer() as model:
        model.script(stall())  # the first run holds the day's budget: the rest are refused
        async with _serving(home_root, model.base_url) as (port, pid, site):
            measured = await _send(requests, port, pid)
            alone = await _dispatcher_alone(site.home, pid)
        rows = _count_rows(site.home)
    verdict = "yes" if rows == DELIVERIES else "NO"
    return measured, alone, f"{verdict}: {rows:,} of {DELIVERIES:,} deliveries have their row"


async def _dispatcher_alone(home: Path, pid: int) -> _Dispatching:
    """Deferrals so far, then the dispatcher's rate and CPU over a quiet window."""
    during = await asyncio.to_thread(_count_deferred, home)
    cpu, main_cpu = _cpu_s(pid), _cpu_s(pid, pid)
    await asyncio.sleep(DISPATCHER_WINDOW_S)
    deferred = await asyncio.to_thread(_count_deferred, home) - during
    each = max(1, deferred)
    caught_up = during + deferred >= DELIVERIES - 1  # (the first delivery's run is held)
    return _Dispatching(during_round=during, caught_up=caught_up,
                        per_s=deferred / DISPATCHER_WINDOW_S,
                        cpu_us=(_cpu_s(pid) - cpu) / each * 1e6,
                        main_cpu_us=(_cpu_s(pid, pid) - main_cpu) / each * 1e6)


async def _burst_then_wanted(root: Path) -> None:
    from tests.fakes.model_server import ModelServer, text

    burst, one = root / "burst.jsonl", root / "one.jsonl"
    _write_requests(burst, "push", BURST, "skip")
    _write_requests(one, "pull_request", 1, "after-burst")
    async with ModelServer() as model:
        model.script(text("Reviewed."))
        async with _serving(root / "site-burst", model.base_url) as (port, pid, site):
            flood = await _send(burst, port, pid)
            after = await _send(one, port, pid)
            marks = await _wait_for_run(site)
    ignored = flood.statuses.get("200", 0)
    figure(f"unwanted deliveries, burst of {BURST:,} (ignored/s)", flood.rate_per_s, "/s",
           UNWANTED_TARGET_PER_S, higher_is_better=True)
    print(f"   burst: {ignored:,} answered 200 ignored; time-to-200 p99"
          f" {percentile(flood.latencies_ms, 99):.2f} ms; server CPU"
          f" {flood.server_cpu_us:,.0f} us/delivery ({flood.main_cpu_us:,.0f} on its main"
          f" thread); client CPU {flood.client_cpu_s:.2f} s", flush=True)
    for event, at in marks.items():
        print(f"   after the burst, 200 → {event}: {(at - after.last_200_at) * 1000:,.1f} ms",
              flush=True)
    figure("after the burst, 200 → run started (ms)",  # the words: its run starts
           (marks["run started"] - after.last_200_at) * 1000, "ms",
           WANTED_AFTER_BURST_TARGET_MS, higher_is_better=False)


async def _wait_for_run(site: Any) -> dict[str, float]:
    """When the wanted delivery's run was received, admitted and started (register times)."""
    from bothy.engine.audit import AuditLog

    wanted = {"wake received", "run admitted", "run started"}
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        marks: dict[str, float] = {}
        for record in AuditLog(site.audit_path).records():
            name = f"{record.kind} {record.event}"
            if name in wanted and name not in marks:
                marks[name] = record.ts.timestamp()
        if set(marks) == wanted:
            return marks
        await asyncio.sleep(0.05)
    raise RuntimeError("the wanted delivery's run did not start")


@asynccontextmanager
async def _serving(home_root: Path, model_url: str) -> AsyncIterator[tuple[int, int, Any]]:
    """A real `bothy serve` on a fresh site: yields its port, pid and the site."""
    from tests.fakes.site import Site

    port = free_port()
    site = Site(home_root, model_url,
                listen={"tailnet_port": port},
                budget={"per_run_usd": "0.50", "per_day_usd": "0.50"},
                wakes={"retry_first_s": 3600, "shutdown_grace_s": 2.0},
                webhooks={"github": {"path": PATH, "secret_env": ["BENCH_SECRET"], "jobs": [
                    {"event": "pull_request", "prompt": "Review #{pull_request.number}.",
                     "subject": "pr:{pull_request.number}"}]}})
    with (home_root / "serve.log").open("wb") as log:
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bothy", "serve", env=site.env(BENCH_SECRET=SECRET),
            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            await _until_ready(site, serve)
            yield port, serve.pid, site
        finally:
            if serve.returncode is None:
                serve.terminate()
            await serve.wait()


async def _until_ready(site: Any, serve: asyncio.subprocess.Process) -> None:
    from bothy.engine.audit import AuditLog

    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if serve.returncode is not None:
            raise RuntimeError(f"bothy serve exited with code {serve.returncode}")
        if site.audit_path.exists() and any(
                (r.kind, r.event) == ("serve", "ready")
                for r in AuditLog(site.audit_path).records()):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("bothy serve was not ready in time")


def _count_rows(home: Path) -> int:
    return _count(home, "SELECT count(*) FROM wakes")


def _count_deferred(home: Path) -> int:
    """Wakes the dispatcher has refused and queued again (read beside a running serve)."""
    return _count(home, "SELECT count(*) FROM wakes WHERE attempts > 0")


def _count(home: Path, query: str) -> int:
    import sqlite3

    db = sqlite3.connect(f"file:{home / 'state' / 'bothy.sqlite3'}?mode=ro", uri=True)
    try:
        return int(db.execute(query).fetchone()[0])
    finally:
        db.close()


