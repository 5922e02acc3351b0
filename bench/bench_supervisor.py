"""Supervisor overhead: `bothy run` start → turn/start sent, minus codex's own initialize time.

The real CLI runs against the real pinned codex and the scripted model server. The `turn
started` audit record carries when turn/start was sent (unix time) and how long the
app-server took from spawn to its initialize answer; the difference from the moment this
benchmark launched `bothy run` is Bothy's own cost: interpreter start, imports, config, state,
the gates, spawning, and thread/start.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from datetime import datetime

from bench._util import REPO, figure, median, scratch

RUNS = 7


async def _measure() -> tuple[list[float], list[float], list[float]]:
    sys.path.insert(0, str(REPO))
    from tests.fakes.model_server import ModelServer, text
    from tests.fakes.site import Site

    overheads, inside, inits = [], [], []
    root = scratch("supervisor-")
    async with ModelServer() as server:
        site = Site(root, server.base_url)
        # As a site meets it: an installed bothy has its bytecode compiled (pip does that); an
        # empty PYTHONDONTWRITEBYTECODE is unset for Python, so the first run writes the .pyc.
        site.extra_env["PYTHONDONTWRITEBYTECODE"] = ""
        server.script(text("BOTHY"))
        await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "warm")
        for _ in range(RUNS):
            server.script(text("BOTHY"))
            launched = time.time()
            done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "bench")
            if done.code != 0:
                raise RuntimeError(f"bench run failed: {done.stdout} {done.stderr[-500:]}")
            run_id = done.stdout.split()[1]
            listing = await site.bothy("audit", "--run", run_id, "--json")
            records = [json.loads(line) for line in listing.stdout.splitlines()]
            turn = next(r for r in records if r["kind"] == "turn" and r["event"] == "started")
            wake = next(r for r in records if r["kind"] == "wake")
            details = turn["details"]
            sent = details["turn_start_sent_unix"]
            woken = datetime.fromisoformat(wake["ts"]).timestamp()
            inits.append(details["initialize_ms"])
            overheads.append((sent - launched) * 1000 - details["initialize_ms"])
            inside.append((sent - woken) * 1000 - details["initialize_ms"])
    shutil.rmtree(root, ignore_errors=True)
    return overheads, inside, inits


def main() -> None:
    overheads, inside, inits = asyncio.run(_measure())
    figure("bothy run → turn/start, minus codex init", median(overheads), "ms", 80,
           higher_is_better=False)
    print(f"   of which the supervisor itself (wake recorded → turn/start, minus codex init):"
          f" median {median(inside):.1f} ms; the rest is interpreter start, imports, config"
          " and state")
    print(f"   codex app-server's own initialize (spawn → answer): median {median(inits):.1f} ms")
