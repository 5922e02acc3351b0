"""Soak: does a long-running serve's memory level off? (``python -m bench.soak [MENTIONS]``)

Not part of ``make bench``: 2,400 mentions take half an hour here. One ``python -m bothy
serve`` with Slack, as an operator starts it, answers ``MENTIONS`` Slack mentions one after
another (each waited on until its answer is posted, as ``bench_chat`` (a) sends them); its
VmRSS is printed at start and after every 300. The heap is trimmed every
``footprint.TRIM_EVERY_S`` (five minutes), so the figures between trims go up and down; what
should not happen is a climb that goes on (bothy/footprint.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from bench._util import run_against_fakes
from bench.bench_chat import IDLE_S, _rss_mb, _serving, _site, _slack_mention

EVERY = 300


def main(mentions: int = 2_400) -> None:
    async def soak(root: Path) -> None:
        from tests.fakes.model_server import ModelServer, text
        from tests.fakes.slack import FakeSlack

        async with ModelServer() as model, FakeSlack(ack_timeout_s=5.0) as slack:
            site = _site(root / "site", model, slack=slack)
            site.config["budget"]["per_day_usd"] = "100000.00"  # the soak, not the ceiling
            site.write_config(site.config)
            model.script(*(text(f"Answer {n}.") for n in range(mentions)))
            async with _serving(site, ["-m", "bothy", "serve"]) as serve:
                await asyncio.sleep(IDLE_S)
                started = time.monotonic()
                print(f"   idle after start: VmRSS {_rss_mb(serve.process.pid):.2f} MB",
                      flush=True)
                for n in range(mentions):
                    await _slack_mention(slack, model, n)
                    if (n + 1) % EVERY == 0:
                        minutes = (time.monotonic() - started) / 60
                        print(f"   after {n + 1:,} mentions ({minutes:.0f} min): VmRSS"
                              f" {_rss_mb(serve.process.pid):.2f} MB", flush=True)
                await serve.stop()

    run_against_fakes("soak-", soak)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2_400)
