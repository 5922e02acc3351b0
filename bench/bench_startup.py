"""`bothy serve` start → ready, and its idle memory, as an operator meets them (issue 18).

The real `python -m bothy serve` runs as a subprocess, with its bytecode compiled as an
installed site has it (this machine's PYTHONDONTWRITEBYTECODE is left out of its
environment, else the figure would include compiling). Measured: spawn → the ``serve
ready`` audit record's own timestamp (the daemon writes it once the state, recovery, the
listeners and every chat connection are up), the median of ``STARTS`` starts; beside it a
bare ``python -c pass`` spawned the same way.

(a) Slack alone, against the fake Slack (tests/fakes/slack.py) in this process, reached
through the config's ``api_url``. (b) Slack and Discord: discord.py has no base URL, so
`bothy serve` runs in a network namespace where Discord's real host names lead to the fake
Discord in this process (tests/fakes/netns.py; needs root — skipped, saying why, without).
Both starts go through ``nsenter`` there, the bare interpreter's too.

Then, with both connected, the serve process's resident set (psutil's RSS) after ``IDLE_S``
idle. Targets are printed goals, never assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._util import REPO, figure, median, run_against_fakes

STARTS = 5
IDLE_S = 2.0
BOTH_READY_TARGET_MS = 400
SLACK_READY_TARGET_MS = 350
RSS_TARGET_MB = 64
DEADLINE_S = 30.0
SLACK_OPERATOR = "UOPERATOR"
DISCORD_OPERATOR = "1100000000000000002"  # tests/fakes/discord.py ALICE_ID


def main() -> None:
    """Measure (a) serve with Slack, (b) serve with Slack and Discord, and (b)'s idle RSS."""
    run_against_fakes("startup-", _bench)


async def _bench(root: Path) -> None:
    from tests.fakes.discord import Certificates
    from tests.fakes.model_server import ModelServer
    from tests.fakes.netns import NamespaceUnavailable, open_discord_network
    from tests.fakes.slack import FakeSlack

    async with ModelServer() as model, FakeSlack(ack_timeout_s=5.0) as slack:
        site = _site(root / "slack", model, slack)
        bare_ms = await _bare_ms(site)
        slack_only = await _starts(site)
        figure("serve start → ready, Slack (median ms)", median(slack_only.ready_ms), "ms",
               SLACK_READY_TARGET_MS, higher_is_better=False)
        slack_only.explain(f"{STARTS} starts", bare_ms)
        certificates = Certificates.create(_mkdir(root / "tls"))
        try:
            opened = open_discord_network(_mkdir(root / "netns"), certificates)
            network = await opened.__aenter__()
        except NamespaceUnavailable as exc:
            _note(f"(b) Slack + Discord skipped: {exc}")
            return
        try:
            both_site = await network.attach(_site(root / "both", model, slack, discord=True),
                                             ports=[model.port, slack.port])
            bare_ms = await _bare_ms(both_site)
            both = await _starts(both_site, idle=True)
        finally:
            await opened.__aexit__(None, None, None)
    figure("serve start → ready, Slack + Discord (median ms)", median(both.ready_ms), "ms",
           BOTH_READY_TARGET_MS, higher_is_better=False)
    both.explain(f"{STARTS} starts in the namespace", bare_ms)
    figure(f"idle RSS of serve, both connected, after {IDLE_S:g} s (MB)", both.idle_mb, "MB",
           RSS_TARGET_MB, higher_is_better=False)
    _note("MB = 10^6 bytes; psutil's rss of the serve process alone")


@dataclass
class _Starts:
    """What ``STARTS`` starts of one site measured (ms), and the last one's idle RSS (MB)."""

    ready_ms: list[float] = field(default_factory=list)  # spawn → `serve ready`
    starting_ms: list[float] = field(default_factory=list)  # spawn → `serve starting`
    cpu_ms: list[float] = field(default_factory=list)  # the serve's own CPU (user + system)
    idle_mb: float = 0.0
    bench_cpu_ms: float = 0.0  # this process's CPU (the fakes, the polls) per start

    def explain(self, what: str, bare_ms: list[float]) -> None:
        connecting = [r - s for r, s in zip(self.ready_ms, self.starting_ms, strict=True)]
        _note(f"{what}: {_list(self.ready_ms)} ms; bare `python -c pass` {median(bare_ms):.0f}"
              " ms spawned the same way")
        _note(f"spawn → `serve starting` (interpreter, imports, config, state) median"
              f" {median(self.starting_ms):.0f} ms; starting → ready (recovery, listeners,"
              f" chat) {median(connecting):.0f} ms")
        _note(f"serve's own CPU time by ready, median {median(self.cpu_ms):.0f} ms (less"
              " sensitive to a loaded machine than the wall clock); the bench's own CPU"
              f" (the fakes, the polls) {self.bench_cpu_ms:.0f} ms per start")


async def _starts(site: Any, *, idle: bool = False) -> _Starts:
    """``STARTS`` starts of `bothy serve`; the last one idles ``IDLE_S`` for its RSS if asked."""
    import psutil

    measured = _Starts()
    bench_cpu = time.process_time()
    for n in range(STARTS):
        async with _serving(site) as (process, ready_s, starting_s):
            cpu = psutil.Process(process.pid).cpu_times()
            measured.cpu_ms.append((cpu.user + cpu.system) * 1000)
            measured.ready_ms.append(ready_s * 1000)
            measured.starting_ms.append(starting_s * 1000)
            if idle and n == STARTS - 1:
                await asyncio.sleep(IDLE_S)  # idle on purpose: the memory of a serve that waits
                measured.idle_mb = psutil.Process(process.pid).memory_info().rss / 1e6
    measured.bench_cpu_ms = (time.process_time() - bench_cpu) * 1000 / STARTS
    return measured


async def _bare_ms(site: Any) -> list[float]:
    """``python -c pass`` spawned as `bothy serve` is (same prefix, same environment)."""
    times = []
    for _ in range(STARTS):
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            *site.launch_prefix, sys.executable, "-c", "pass", env=_env(site))
        await process.wait()
        times.append((time.perf_counter() - started) * 1000)
    return times


@contextlib.asynccontextmanager
async def _serving(site: Any) -> AsyncIterator[tuple[asyncio.subprocess.Process, float, float]]:
    """Spawn `bothy serve` on ``site``; yield it, spawn → `serve ready` and spawn → `serve
    starting` (s: interpreter, imports, config, state, the register); SIGTERM it
    on the way out (SIGKILL if it will not stop)."""
    from tests.fakes.shell import audit_records

    before = len(audit_records(site, _ready))
    log_path = site.root / "serve.log"
    with log_path.open("wb") as log:
        spawned = time.time()
        process = await asyncio.create_subprocess_exec(
            *site.launch_prefix, sys.executable, "-m", "bothy", "serve", env=_env(site),
            cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            async with asyncio.timeout(DEADLINE_S):
                size = _size(site.audit_path)
                while (grown := _size(site.audit_path)) == size or len(
                        found := audit_records(site, _ready)) == before:
                    size = grown
                    if process.returncode is not None:
                        raise RuntimeError(f"serve exited {process.returncode} before ready:\n"
                                           + log_path.read_text()[-2000:])
                    # Another process's file: nothing to await but a short poll, which reads
                    # the register only once it has grown (the bench shares the serve's two
                    # cores). The figure is the record's own timestamp, so the poll's period
                    # does not enter it.
                    await asyncio.sleep(0.02)
            starting = audit_records(site, _starting)[-1].ts.timestamp() - spawned
            yield process, found[-1].ts.timestamp() - spawned, starting
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(DEADLINE_S):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _ready(record: Any) -> bool:
    return bool((record.kind, record.event) == ("serve", "ready"))


def _starting(record: Any) -> bool:
    return bool((record.kind, record.event) == ("serve", "starting"))


def _env(site: Any) -> dict[str, str]:
    """The site's environment with the chat tokens, bytecode allowed as on an installed site."""
    from tests.fakes.slack import APP_TOKEN, BOT_TOKEN

    env = site.env(SLACK_BOT_TOKEN=BOT_TOKEN, SLACK_APP_TOKEN=APP_TOKEN)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return dict(env)


def _site(root: Path, model: Any, slack: Any, *, discord: bool = False) -> Any:
    from tests.fakes.discord import ALERT_CHANNEL_ID
    from tests.fakes.site import Site

    chat: dict[str, Any] = {"slack": {"api_url": slack.api_url,
                                      "allowed_users": [SLACK_OPERATOR]}}
    if discord:
        chat["discord"] = {"allowed_users": [DISCORD_OPERATOR],
                           "alert_channel": ALERT_CHANNEL_ID}
    return Site(_mkdir(root), model.base_url, listen={"tailnet_port": _free_port()}, chat=chat)


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def _note(text: str) -> None:
    print(f"      {text}", flush=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
