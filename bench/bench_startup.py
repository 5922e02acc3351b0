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

(a') As (a), with half a year's register written beforehand (``AGED_WAKES`` runs and
``AGED_IGNORED`` deliveries no job wanted, over ``AGED_SPAN``): what an aged site's start
and idle memory cost (the chain is verified before serve appends to it; the rest of what
serve reads of it at start is a recent stretch).

Beside each site's starts, taking turns with them: the libraries alone. One more start, under
``-X importtime``, names every module serve imported on its way to ready; then an interpreter
spawned the same way imports the ones that are not Bothy's (asyncio, aiohttp, pydantic,
slack-bolt, discord.py… as serve imports aiohttp: engine-free ``bothy.aiohttpimport``, whose
CA store load it awaits as serve does) and says so: spawn → that line, and its RSS then.
What serve takes beyond them is Bothy's own: its modules, the config, the state, the
register's check, the listeners and the connections. So a target is read beside the part of
it no change to Bothy can reach.

Then the serve process's resident set (psutil's RSS) after ``IDLE_S`` idle: Slack alone
(a), and both connected (b), with the spare app-server's beside it, and where (b)'s lies
(Linux: ``/proc/PID/smaps_rollup``): anonymous pages (Python's objects, above all the code
of every module imported, and the C libraries' heaps) and file-backed ones (the
interpreter's and the extension modules' own pages, counted in RSS though shared), and how
many threads hold it. Targets are printed goals, never assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench._util import REPO, figure, free_port, made, median, run_against_fakes

STARTS = 5
# The register of a busy site after half a year (~25 MB): its wakes' runs, and the deliveries
# no job wanted (GitHub sends a site many), spread over the months.
AGED_SPAN = timedelta(days=182)
AGED_WAKES = 6_000
AGED_IGNORED = 60_000
_AGING_LANES = 32
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
        slack_only = await _starts(site, idle=True)
        figure("serve start → ready, Slack (median ms)", median(slack_only.ready_ms), "ms",
               SLACK_READY_TARGET_MS, higher_is_better=False)
        slack_only.explain(f"{STARTS} starts", bare_ms)
        _note(f"idle RSS of serve with Slack alone, after {IDLE_S:g} s: {slack_only.idle_mb:.2f}"
              " MB")
        aged = _site(root / "aged", model, slack)
        held = await _age_register(aged)
        aged_starts = await _starts(aged, idle=True, alone=False)
        _note(f"(a') the same site with half a year's register ({held:,} records,"
              f" {aged.audit_path.stat().st_size / 1e6:.0f} MB: {AGED_WAKES:,} runs,"
              f" {AGED_IGNORED:,} deliveries ignored): ready median"
              f" {median(aged_starts.ready_ms):.0f} ms, serve's CPU by ready"
              f" {median(aged_starts.cpu_ms):.0f} ms, idle RSS {aged_starts.idle_mb:.2f} MB."
              " serve verifies the whole chain before its first record (docs/AUDIT.md), so"
              " its start grows with the register; what else it reads of it at start is the"
              " last week or so (wakes/history.py)")
        _note(f"   the last start's walk of the chain: {_chain_walk(aged)}")
        certificates = Certificates.create(made(root / "tls"))
        try:
            opened = open_discord_network(made(root / "netns"), certificates)
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
    _note("MB = 10^6 bytes; psutil's rss of the serve process alone; beside it, the spare"
          f" app-server waiting (codex, its whole process group): {both.spare_mb:.1f} MB")
    _note(f"of it, the libraries alone (above): {both.libraries_mb:.1f} MB; the rest,"
          f" {both.idle_mb - both.libraries_mb:.1f} MB, is Bothy's own: its modules, the config"
          " (validating it maps pydantic-core's compiled code), the state, threads and"
          " connections")
    if both.rollup:
        _note(f"smaps_rollup's walk of it: Rss {both.rollup['Rss']:.1f} MB, of which anonymous"
              f" {both.rollup['Anonymous']:.1f} MB (Python's objects, most of them the imported"
              " modules' code; the C libraries' heaps) and file-backed"
              f" {both.rollup['Rss'] - both.rollup['Anonymous']:.1f} MB (the interpreter's and"
              f" the libraries' mapped pages); {both.threads} threads")


@dataclass
class _Starts:
    """What ``STARTS`` starts of one site measured (ms), and the last one's idle RSS (MB)."""

    ready_ms: list[float] = field(default_factory=list)  # spawn → `serve ready`
    starting_ms: list[float] = field(default_factory=list)  # spawn → `serve starting`
    cpu_ms: list[float] = field(default_factory=list)  # the serve's own CPU (user + system)
    main_cpu_ms: list[float] = field(default_factory=list)  # ... its main thread's alone
    idle_mb: float = 0.0
    spare_mb: float = 0.0  # the spare app-server's group, beside the idle serve (0: none yet)
    rollup: dict[str, float] = field(default_factory=dict)  # the idle serve's smaps_rollup (MB)
    threads: int = 0  # ... and its threads
    bench_cpu_ms: float = 0.0  # this process's CPU (the fakes, the polls) per start
    libraries_ms: list[float] = field(default_factory=list)  # spawn → the libraries imported
    libraries_mb: float = 0.0  # ... the last one's RSS then
    libraries: list[str] = field(default_factory=list)  # what serve imported, Bothy's aside

    def explain(self, what: str, bare_ms: list[float]) -> None:
        connecting = [r - s for r, s in zip(self.ready_ms, self.starting_ms, strict=True)]
        _note(f"{what}: {_list(self.ready_ms)} ms; bare `python -c pass` {median(bare_ms):.0f}"
              " ms spawned the same way")
        _note(f"spawn → `serve starting` (interpreter, imports, the chat libraries' among"
              " them, config, state, the register's check) median"
              f" {median(self.starting_ms):.0f} ms; starting → ready (recovery, listeners,"
              f" chat connections) {median(connecting):.0f} ms")
        _note(f"serve's own CPU time by ready, median {median(self.cpu_ms):.0f} ms, with its"
              " children's (the register's check, when a process of its own made it) (less"
              " sensitive to a loaded machine than the wall clock), of which its main thread"
              f" {median(self.main_cpu_ms):.0f} ms (the way to ready: the CA store loads in a"
              " thread beside it); the bench's own CPU (the fakes, the polls)"
              f" {self.bench_cpu_ms:.0f} ms per start")
        if self.libraries_ms:
            _note(f"the libraries alone: the {len(self.libraries)} modules serve imported"
                  " that are not Bothy's, imported as serve imports them by an interpreter"
                  f" spawned the same way, taking turns with the starts:"
                  f" {_list(self.libraries_ms)} ms, median"
                  f" {median(self.libraries_ms):.0f}; Bothy's own part of ready (its modules,"
                  " config, state, the register's check, listeners, connections) is the"
                  f" rest, ~{median(self.ready_ms) - median(self.libraries_ms):.0f} ms;"
                  f" the libraries' RSS then {self.libraries_mb:.1f} MB")


async def _starts(site: Any, *, idle: bool = False, alone: bool = True) -> _Starts:
    """``STARTS`` starts of `bothy serve`; the last one idles ``IDLE_S`` for its RSS if asked;
    with ``alone``, each followed by the libraries alone (see the module)."""
    import psutil

    measured = _Starts(libraries=await _libraries(site) if alone else [])
    bench_cpu = time.process_time()
    for n in range(STARTS):
        async with _serving(site) as (process, ready_s, starting_s):
            serving = psutil.Process(process.pid)
            cpu = serving.cpu_times()  # the children it waited for too: the chain's check
            measured.cpu_ms.append(
                (cpu.user + cpu.system + cpu.children_user + cpu.children_system) * 1000)
            main = next(t for t in serving.threads() if t.id == process.pid)
            measured.main_cpu_ms.append((main.user_time + main.system_time) * 1000)
            measured.ready_ms.append(ready_s * 1000)
            measured.starting_ms.append(starting_s * 1000)
            if idle and n == STARTS - 1:
                await asyncio.sleep(IDLE_S)  # idle on purpose: the memory of a serve that waits
                measured.idle_mb = serving.memory_info().rss / 1e6
                measured.rollup = _rollup_mb(process.pid)
                measured.threads = serving.num_threads()
                measured.spare_mb = _spare_mb(site)
        if alone:
            alone_ms, measured.libraries_mb = await _libraries_alone(site, measured.libraries)
            measured.libraries_ms.append(alone_ms)
    measured.bench_cpu_ms = (time.process_time() - bench_cpu) * 1000 / STARTS
    return measured


async def _libraries(site: Any) -> list[str]:
    """The modules one `bothy serve` start imports by ready (its ``-X importtime`` lines, in
    the order they completed), Bothy's own left out."""
    async with _serving(site, PYTHONPROFILEIMPORTTIME="1"):
        pass
    names = []
    for line in (site.root / "serve.log").read_text().splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) != 3 or not fields[0].strip().isdigit():
            continue  # the column heads, or a line of serve's own
        name = fields[2].strip()
        if name != "bothy" and not name.startswith("bothy."):
            names.append(name)
    if not names:
        raise RuntimeError("serve's -X importtime lines were not in its log")
    return names


_LIBRARIES_ALONE = """
import importlib, sys
from bothy.aiohttpimport import import_aiohttp  # aiohttp as serve imports it (engine-free)

trusted = import_aiohttp()
for name in sys.stdin.read().split():
    try:
        importlib.import_module(name)
    except ImportError:  # another platform's, tried and missed by serve too (nt, _winapi)
        pass
trusted.result()  # serve awaits its CA store too
import psutil  # imported by serve as well: among the names above

print(psutil.Process().memory_info().rss, flush=True)
sys.stdin.close()
"""


async def _libraries_alone(site: Any, names: list[str]) -> tuple[float, float]:
    """``names`` imported by an interpreter spawned as serve is: spawn → imported (ms), and
    its RSS then (MB)."""
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *site.launch_prefix, sys.executable, "-c", _LIBRARIES_ALONE, env=_env(site), cwd=REPO,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("\n".join(names).encode())
    process.stdin.close()
    rss = await process.stdout.readline()
    imported_ms = (time.perf_counter() - started) * 1000
    await process.wait()
    if process.returncode != 0 or not rss.strip().isdigit():
        raise RuntimeError(f"the libraries alone exited {process.returncode}: {rss!r}")
    return imported_ms, int(rss) / 1e6


def _chain_walk(site: Any) -> str:
    """What the last `serve starting` record says of the whole-chain check before it."""
    from tests.fakes.shell import audit_records

    details = audit_records(site, lambda r: (r.kind, r.event) == ("serve", "starting"))[-1].details
    walk_ms, waited_ms = details["chain_verify_ms"], details["chain_waited_ms"]
    where = ("in a process of its own beside the start (engine/chaincheck.py)"
             if details["chain_beside"] else "in serve's own process")
    return (f"{details['chain_verified']:,} records in {walk_ms:,} ms, {where}; serve waited"
            f" {waited_ms:,} ms for it")


def _rollup_mb(pid: int) -> dict[str, float]:
    """``/proc/PID/smaps_rollup``'s sizes (``Rss``, ``Anonymous``…) in MB; empty where there is
    none (not Linux, or a kernel before 4.14)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    sizes = {}
    for line in text.splitlines()[1:]:  # the first line names the address range
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            sizes[name] = int(rest.split()[0]) * 1024 / 1e6
    return sizes


def _spare_mb(site: Any) -> float:
    """The resident set of the spare app-server's process group serve started, in MB."""
    import psutil

    from bothy.engine.procgroup import live_members
    from tests.fakes.shell import audit_records

    spares = audit_records(site, lambda r: (r.kind, r.event) == ("spare", "started"))
    total = 0.0
    for pid in live_members(int(spares[-1].details["pgid"])) if spares else ():
        with contextlib.suppress(psutil.NoSuchProcess):
            total += psutil.Process(pid).memory_info().rss / 1e6
    return total


async def _age_register(site: Any) -> int:
    """Half a year of a busy site's register, written through the real writer (group commit,
    many writers at once) on a clock that walks through those months: ``AGED_WAKES`` wakes,
    each with the records of its run, and ``AGED_IGNORED`` deliveries no job wanted, closed in
    intake's batches of 100. Returns how many records it holds."""
    from bothy.engine.audit import AuditLog
    from bothy.wakes.delivery import IGNORED_PER_RECORD, ignored_batch_details

    site.home.joinpath("state").mkdir(parents=True, exist_ok=True)
    batches = AGED_IGNORED // IGNORED_PER_RECORD
    records = AGED_WAKES * 6 + batches
    start = datetime.now(UTC) - AGED_SPAN
    step = AGED_SPAN / records
    ticks = itertools.count()  # one reading per record: the months go by record by record
    log = AuditLog(site.audit_path, clock=lambda: start + step * next(ticks))

    async def lane_of(lane: int) -> None:
        """Its share of the wakes, and after every tenth, a batch of ignored deliveries: the
        months' records interleave as a site's do."""
        for n in range(lane, AGED_WAKES, _AGING_LANES):
            await _aged_wake(log, n)
            if n % (AGED_WAKES // batches) == 0:
                await log.record("wake", "ignored", "refused", subject="github",
                                 details=ignored_batch_details("github", [
                                     (_unwanted(n * IGNORED_PER_RECORD + k), "no job wants it")
                                     for k in range(IGNORED_PER_RECORD)]))

    await asyncio.gather(*(lane_of(lane) for lane in range(_AGING_LANES)))
    return records


async def _aged_wake(log: Any, n: int) -> None:
    """The records of one wake and its run, as a site's register holds them."""
    from bothy.engine.auditindex import wake_id_for
    from bothy.wakes.delivery import wake_details

    run_id = f"run_20260601T000000Z_{n:08x}"
    wake = {"wake_id": wake_id_for(run_id)}
    subject = f"pr:{n % 500}"
    await log.record("wake", "received", "ok", subject=subject, details={
        **wake, **wake_details("github", "pull_request", "opened", f"{n}:hook", 0, 1)})
    await log.record("run", "admitted", "ok", subject=subject, run_id=run_id,
                     details={**wake, "reserved_usd": "0.50"})
    await log.record("run", "started", "ok", subject=subject, run_id=run_id,
                     details={"pgid": 4242, "head_start": "taken"})
    await log.record("turn", "started", "ok", subject=subject, run_id=run_id,
                     details={"model": "gpt-5-codex", "thread": "ahead"})
    await log.record("run", "finished", "ok", subject=subject, run_id=run_id,
                     details={"outcome": "completed", "cost_usd": "0.0123",
                              "answer": "Reviewed: two nits, no blocker. " * 4})
    await log.record("budget", "settled", "ok", subject=subject, run_id=run_id,
                     details={"usd": "0.0123", "released_usd": "0.4877"})


def _unwanted(n: int) -> Any:
    from bothy.wakes.delivery import Delivery

    return Delivery(route="github", key=f"unwanted-{n}:hook", event="check_run",
                    action="completed", headers={}, body=b"", received_at=datetime.now(UTC))


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
async def _serving(
    site: Any, **extra_env: str,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, float, float]]:
    """Spawn `bothy serve` on ``site`` (``extra_env`` added to its environment); yield it,
    spawn → `serve ready` and spawn → `serve starting` (s: interpreter, imports, config,
    state, the register); SIGTERM it on the way out (SIGKILL if it will not stop)."""
    tail = _Tail(site.audit_path)
    log_path = site.root / "serve.log"
    with log_path.open("wb") as log:
        spawned = time.time()
        process = await asyncio.create_subprocess_exec(
            *site.launch_prefix, sys.executable, "-m", "bothy", "serve",
            env={**_env(site), **extra_env}, cwd=REPO, stdin=asyncio.subprocess.DEVNULL,
            stdout=log, stderr=log)
        try:
            async with asyncio.timeout(DEADLINE_S):
                while "ready" not in tail.seen:
                    if process.returncode is not None:
                        raise RuntimeError(f"serve exited {process.returncode} before ready:\n"
                                           + log_path.read_text()[-2000:])
                    # Another process's file: nothing to await but a short poll, which reads
                    # only what was appended since (the bench shares the serve's two cores,
                    # and an aged register is long). The figure is the record's own
                    # timestamp, so the poll's period does not enter it.
                    await asyncio.sleep(0.02)
                    tail.read()
            yield (process, tail.seen["ready"] - spawned, tail.seen["starting"] - spawned)
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(DEADLINE_S):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


class _Tail:
    """The `serve` records appended to a register after this was made: ``seen`` maps each
    event (``starting``, ``ready``) to its record's own timestamp (s since the epoch)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = path.stat().st_size if path.exists() else 0
        self.seen: dict[str, float] = {}

    def read(self) -> None:
        if not self._path.exists():
            return
        with self._path.open("rb") as register:
            register.seek(self._offset)
            appended = register.read()
        complete = appended[:appended.rfind(b"\n") + 1]  # a line being written waits
        self._offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)  # a register line is one JSON object (docs/AUDIT.md)
            if record["kind"] == "serve":
                self.seen[record["event"]] = datetime.fromisoformat(record["ts"]).timestamp()


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
    return Site(made(root), model.base_url, listen={"tailnet_port": free_port()}, chat=chat)


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def _note(text: str) -> None:
    print(f"      {text}", flush=True)



