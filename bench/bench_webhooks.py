"""Webhook ingest over loopback: signed deliveries against the real listener and the real inbox.

2,000 signed GitHub deliveries (distinct ids, realistic pull_request payloads) are sent at
concurrency 32 to a ``WebhookListener`` whose ``Inbox`` is on the repository's disk
(``.bench/``), so every 200 waits for the payload file's fsync, the directory fsync and the
SQLite commit (both group-committed, see ``bothy.wakes.inbox``). The same deliveries go to a
bare aiohttp handler that reads the body and answers 200 without checking or persisting
anything, in the same run. Rounds alternate (bare, then Bothy) so that both see the same
machine; rates are the median round, latencies are pooled over the rounds. After each Bothy
round all 2,000 deliveries must be durable: a queued row and a payload file each.

The server's CPU time per delivery (user + kernel, all its threads) is printed beside the
rates: it is what the bare handler does not spend, and on a small machine it sets the rate.

The load generator runs in a child process, as a real sender would, so that it does not take
the listener's event loop (it still takes one of the machine's cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from bench._util import REPO, figure, median, percentile, scratch
from bothy.clock import utc_now
from bothy.config import WebhookRoute
from bothy.engine.audit import AuditLog
from bothy.engine.state import StateDB
from bothy.wakes.inbox import Inbox
from bothy.wakes.webhook import WebhookListener

DELIVERIES = 2_000
CONCURRENCY = 32
ROUNDS = 3
RATE_TARGET_PER_S = 1_000
RATIO_TARGET = 0.5
SECRET = "bench-secret-8d41e7b2"
PATH = "/hooks/github"

# The sender: reads the deliveries (JSON lines: headers, body) from a file, waits for a port
# on stdin, sends them all at the given concurrency and prints one JSON line of results.
_SENDER = r"""
import asyncio, json, sys, time
import aiohttp

async def main(path, concurrency):
    with open(path) as f:
        deliveries = [json.loads(line) for line in f]
    port = int(sys.stdin.readline())
    url = f"http://127.0.0.1:{port}/hooks/github"
    latencies, statuses = [], {}
    queue = iter(deliveries)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def worker():
            for d in queue:
                body = d["body"].encode()
                started = time.perf_counter()
                async with s.post(url, data=body, headers=d["headers"]) as r:
                    await r.read()
                latencies.append(time.perf_counter() - started)
                statuses[r.status] = statuses.get(r.status, 0) + 1
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed_s": elapsed, "latencies_s": latencies, "statuses": statuses}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@dataclass
class _Round:
    rate_per_s: float
    latencies_ms: list[float]
    statuses: dict[str, int]
    server_cpu_us: float  # per delivery, user + kernel, every thread of this process
    server_kernel_us: float


def main() -> None:
    """Alternate bare and Bothy rounds; print rates, latencies, the ratio and durability."""
    root = scratch("webhooks-")
    try:
        deliveries = root / "deliveries.jsonl"
        _write_deliveries(deliveries)
        bare: list[_Round] = []
        bothy: list[_Round] = []
        durable: list[str] = []
        for n in range(ROUNDS):
            bare.append(asyncio.run(_measured(_bare_listener(), deliveries)))
            listening, check = _bothy_listener(root / f"round-{n}")
            bothy.append(asyncio.run(_measured(listening, deliveries)))
            durable.append(check())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for label, rounds in (("bare aiohttp 200", bare), ("bothy listener + inbox", bothy)):
        _print_rounds(label, rounds)
    bothy_rate = median([r.rate_per_s for r in bothy])
    bare_rate = median([r.rate_per_s for r in bare])
    figure("webhook ingest, durable (deliveries/s)", bothy_rate, "/s", RATE_TARGET_PER_S,
           higher_is_better=True)
    figure("ratio to the bare handler (×100)", 100 * bothy_rate / bare_rate, "%",
           100 * RATIO_TARGET, higher_is_better=True)
    for n, verdict in enumerate(durable, start=1):
        print(f"   durable after round {n}: {verdict}", flush=True)


def _print_rounds(label: str, rounds: list[_Round]) -> None:
    latencies = [ms for r in rounds for ms in r.latencies_ms]
    statuses: dict[str, int] = {}
    for r in rounds:
        for status, count in r.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    rates = ", ".join(f"{r.rate_per_s:,.0f}" for r in rounds)
    print(f"   {label}: {rates} deliveries/s; time-to-200 p50 {median(latencies):.2f} ms,"
          f" p99 {percentile(latencies, 99):.2f} ms; server CPU"
          f" {median([r.server_cpu_us for r in rounds]):,.0f} us/delivery"
          f" ({median([r.server_kernel_us for r in rounds]):,.0f} us kernel);"
          f" statuses {statuses}", flush=True)


def _write_deliveries(path: Path) -> None:
    sys.path.insert(0, str(REPO))
    from tests.fakes import github  # the same realistic payloads the tests send

    with path.open("w") as out:
        for n in range(DELIVERIES):
            body = github.encode(github.pull_request_opened(number=n + 1, title=f"Change {n}"))
            headers = github.headers("pull_request", body, SECRET, delivery=f"bench-{n:05d}")
            out.write(json.dumps({"headers": headers, "body": body.decode()}) + "\n")


def _bothy_listener(
    root: Path,
) -> tuple[AbstractAsyncContextManager[int], Callable[[], str]]:
    """The real listener and inbox under ``root``, and a check that everything is durable."""
    root.mkdir()

    @asynccontextmanager
    async def listening() -> AsyncIterator[int]:
        async with StateDB.open(root / "bothy.sqlite3") as db:
            inbox = Inbox(root / "inbox", db, clock=utc_now)
            listener = WebhookListener(
                {"github": WebhookRoute(kind="github", path=PATH, secret_env=["BENCH_SECRET"])},
                public=False, inbox=inbox, audit=AuditLog(root / "audit.jsonl"),
                environ={"BENCH_SECRET": SECRET}, clock=utc_now,
            )
            port = await listener.start("127.0.0.1", 0)
            try:
                yield port
            finally:
                await listener.stop()

    def check() -> str:
        return asyncio.run(_durable(root))

    return listening(), check


async def _durable(root: Path) -> str:
    async with StateDB.open(root / "bothy.sqlite3") as db:
        rows = await db.scalar("SELECT count(*) FROM wakes WHERE status = 'queued'")
    files = sum(1 for name in os.listdir(root / "inbox") if name.endswith(".json"))
    verdict = "yes" if rows == files == DELIVERIES else "NO"
    return f"{verdict}: {rows:,} queued rows, {files:,} payload files"


@asynccontextmanager
async def _bare_listener() -> AsyncIterator[int]:
    async def answer(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.json_response({"status": "ok"})

    runner = web.ServerRunner(web.Server(answer, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def _measured(listening: AbstractAsyncContextManager[int], deliveries: Path) -> _Round:
    async with listening as port:
        sender = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SENDER, str(deliveries), str(CONCURRENCY),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        before = resource.getrusage(resource.RUSAGE_SELF)
        out, _ = await sender.communicate(f"{port}\n".encode())
        after = resource.getrusage(resource.RUSAGE_SELF)
    if sender.returncode != 0:
        raise RuntimeError(f"the sender exited with code {sender.returncode}")
    result: dict[str, Any] = json.loads(out)
    kernel_s = after.ru_stime - before.ru_stime
    cpu_s = after.ru_utime - before.ru_utime + kernel_s
    return _Round(
        rate_per_s=len(result["latencies_s"]) / result["elapsed_s"],
        latencies_ms=[s * 1000 for s in result["latencies_s"]],
        statuses=result["statuses"],
        server_cpu_us=cpu_s / DELIVERIES * 1e6,
        server_kernel_us=kernel_s / DELIVERIES * 1e6,
    )
