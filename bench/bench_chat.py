"""Chat through a real serving daemon: start-up, idle memory, and how fast a mention is seen
and answered (issue 5, "Measure").

(a) ``python -m bothy serve`` runs as a subprocess, exactly as an operator starts it, with
Slack configured; the fake Slack (Web API + Socket Mode, tests/fakes/slack.py) and the scripted
model server run in this process, on loopback. Measured: spawn → the ``serve ready`` audit
record (its own timestamp, not when this process noticed it); the serve process's VmRSS after
``IDLE_S`` idle; then, one mention at a time (a cold one first, reported apart, then
``MENTIONS``): mention sent on the socket → the fake receiving ``reactions.add``, and mention →
the answer's ``chat.postMessage`` less the model request's own time (request received → reply
written, as the model server saw it; it answers at once).

(b) ``python -m bothy serve`` again, with Slack *and* Discord configured, inside a network
namespace where Discord's real host names lead to the fake Discord in this process (TLS
verified against a throwaway CA named by ``SSL_CERT_FILE``; tests/fakes/netns.py, needs
root: skipped, saying why, without). discord.py runs exactly as in production. Measured: the
same figures, with both connections open; Discord's mention latencies, its mentions paced as
(a)'s are.

In (a) a second `python -m bothy serve` runs beside the first with `codex.spare: false`, on a
fake Slack of its own, and a third with a spare whose thread made ahead never fits (its chat
profile offers a tool, which a thread started ahead cannot have: the run starts its own thread
on the spare, as every run on a spare did before threads were made ahead); the mentions go to
each in turn: mention → answer less the model, on the spare's thread, on the spare with a
thread of its own, and cold, measured side by side in one run (issue 18). Each mention
to the first is sent once its spare is ready again, and every mention half a second after the
last answer (a person's mentions are further apart than a spare's start). The spare's own
VmRSS (its process group) is printed beside serve's.

Where the time of an answer goes is split by the run's audit records (``run started``: the
worker's group spawned; ``turn started``; ``run finished``; and ``worker stopped``, which now
comes after the answer: it is posted before codex is stopped), their timestamps put on this
process's monotonic clock. Targets are printed goals (issues 5 and 18), never assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._util import REPO, figure, free_port, made, median, percentile, run_against_fakes

MENTIONS = 20
IDLE_S = 2.0
APART_S = 0.5  # (a): between an answer and the next mention, to either serve
# Issue 18's targets (as bench_startup's): ready with Slack, with Slack and Discord, and idle
# RSS both connected; issue 5's for serve with Slack alone (issue 18 sets none for it).
SLACK_READY_TARGET_MS = 350
BOTH_READY_TARGET_MS = 400
SLACK_RSS_TARGET_MB = 85
BOTH_RSS_TARGET_MB = 64
REACTION_TARGET_MS = 100
OVERHEAD_TARGET_MS = 120  # issue 18 (issue 5 asked 300)
DEADLINE_S = 30.0
SLACK_OPERATOR = "UOPERATOR"
SLACK_CHANNEL = "CWORK"
DISCORD_OPERATOR = "1100000000000000002"  # tests/fakes/discord.py ALICE_ID

@dataclass
class _Mention:
    """One mention's moments, on this process's monotonic clock (seconds)."""

    subject: str  # the run's subject: "<platform>:<thread>"
    sent: float  # the mention left the fake
    reacted: float  # the fake got the reaction
    asked: float  # the model server got the request
    answered: float  # the model server had written its reply
    posted: float  # the fake got the answer's post

    @property
    def reaction_ms(self) -> float:
        return (self.reacted - self.sent) * 1000

    @property
    def overhead_ms(self) -> float:
        """Mention → answer, less the model's own time."""
        return ((self.posted - self.sent) - (self.answered - self.asked)) * 1000


@dataclass
class _Started:
    """A serve subprocess, and when it wrote ``serve starting`` and ``serve ready``."""

    process: asyncio.subprocess.Process
    starting_s: float  # after spawn
    ready_s: float  # after spawn

    async def stop(self) -> int:
        """SIGTERM, then its exit code."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(DEADLINE_S):
            return await self.process.wait()


def main() -> None:
    """Measure (a) `bothy serve` with Slack and (b) with Slack and Discord."""
    run_against_fakes("chat-", _bench)


async def _bench(root: Path) -> None:
    from tests.fakes.discord import Certificates
    from tests.fakes.model_server import ModelServer
    from tests.fakes.netns import NamespaceUnavailable, open_discord_network
    from tests.fakes.slack import FakeSlack

    async with (ModelServer() as model, FakeSlack(ack_timeout_s=5.0) as slack,
                FakeSlack(ack_timeout_s=5.0) as slack_cold,
                FakeSlack(ack_timeout_s=5.0) as slack_unfit):
        slack_connect_s = await _slack_serve(root / "slack", model, slack, slack_cold,
                                             slack_unfit)
        certificates = Certificates.create(made(root / "tls"))
        try:
            opened = open_discord_network(made(root / "netns"), certificates)
            network = await opened.__aenter__()
        except NamespaceUnavailable as exc:
            print(f"   (b) Slack + Discord skipped: {exc}", flush=True)
            return
        try:
            await _both_serve(root / "both", model, slack, network, slack_connect_s)
        finally:
            await opened.__aexit__(None, None, None)


# ---------------------------------------------------------------- (a) bothy serve with Slack


async def _slack_serve(root: Path, model: Any, slack: Any, slack_cold: Any,
                       slack_unfit: Any) -> float:
    """(a); returns its `serve starting` → `serve ready` time, for (b) to compare with."""
    site = _site(root / "spare", model, slack=slack)
    cold_site = _site(root / "cold", model, slack=slack_cold, spare=False)
    unfit_site = _site(root / "unfit", model, slack=slack_unfit, unfit=True)
    print("   (a) `python -m bothy serve`, Slack connected to the fake Slack; beside it a second"
          " serve with `codex.spare: false` and a third whose chat profile offers a tool (the"
          " spare's thread made ahead never fits it), each with its own fake Slack, mentions"
          " sent to each in turn:", flush=True)
    async with _serving(site, ["-m", "bothy", "serve"]) as serve:
        await asyncio.sleep(IDLE_S)  # idle on purpose: the memory of a serve that waits
        idle_mb = _rss_mb(serve.process.pid)
        spare_mb = _spare_rss_mb(site)
        async with (_serving(cold_site, ["-m", "bothy", "serve"]) as cold_serve,
                    _serving(unfit_site, ["-m", "bothy", "serve"]) as unfit_serve):
            await asyncio.sleep(IDLE_S)
            cold_idle_mb = _rss_mb(cold_serve.process.pid)
            warm, unfit, cold = await _side_by_side(model, [
                (site, lambda n: _slack_mention(slack, model, n)),
                (unfit_site, lambda n: _slack_mention(slack_unfit, model, n)),
                (None, lambda n: _slack_mention(slack_cold, model, n))])
            cold_code = await cold_serve.stop()
            await unfit_serve.stop()
        await asyncio.sleep(IDLE_S)
        after_mb = _rss_mb(serve.process.pid)
        code = await serve.stop()
    figure("start → serve ready, Slack connected (ms)", serve.ready_s * 1000, "ms",
           SLACK_READY_TARGET_MS, higher_is_better=False)
    _note(f"spawn → `serve starting` (interpreter, imports, the chat library's among them,"
          f" state, the register's check) {serve.starting_s * 1000:.0f} ms;"
          " starting → ready (recovery, listeners, Slack's connection)"
          f" {(serve.ready_s - serve.starting_s) * 1000:.0f} ms")
    figure(f"idle VmRSS of serve after {IDLE_S:g} s (MB = 10^6 B; issue 5's target)", idle_mb,
           "MB", SLACK_RSS_TARGET_MB, higher_is_better=False)
    _note(f"beside it, the spare app-server waiting (codex, its whole group): {spare_mb:.1f} MB;"
          f" the serve without a spare: {cold_idle_mb:.1f} MB")
    _note(f"after {len(warm)} runs and {IDLE_S:g} s idle again: {after_mb:.1f} MB (codex"
          " workers are processes of their own, not counted)")
    _latencies("Slack", site, warm)
    _latencies("Slack, on the spare, its thread made ahead unfit (a tool)", unfit_site, unfit)
    _latencies("Slack, no spare (cold)", cold_site, cold)
    warm_p50, unfit_p50, cold_p50 = (median([m.overhead_ms for m in ms[1:]])
                                     for ms in (warm, unfit, cold))
    _note(f"side by side: mention → answer − model p50 {warm_p50:.0f} ms on the spare against"
          f" {cold_p50:.0f} ms cold ({cold_p50 - warm_p50:.0f} ms sooner,"
          f" {warm_p50 / cold_p50:.2f} of cold); on the spare with a thread of its own"
          f" {unfit_p50:.0f} ms")
    _note(f"serve exited {code}, the one without a spare {cold_code}, after SIGTERM")
    return serve.ready_s - serve.starting_s


async def _side_by_side(model: Any, serves: list[tuple[Any, Callable[[int], Any]]]
                        ) -> list[list[_Mention]]:
    """A mention to each serve in turn (a site: it keeps a spare, and its mention waits for it
    to be ready again; None: it keeps none), ``MENTIONS + 1`` times, each ``APART_S`` after
    the last answer: a person's mentions are further apart than a spare's start (~0.2 s
    here), and codex still works for a while after its initialize answer."""
    from tests.fakes.model_server import text

    model.script(*(text(f"Answer {n}.") for n in range(len(serves) * (MENTIONS + 1))))
    mentions: list[list[_Mention]] = [[] for _ in serves]
    for n in range(MENTIONS + 1):
        for k, (site, one) in enumerate(serves):
            if site is not None:
                await _spare_ready(site, n + 1)
            await asyncio.sleep(APART_S)
            mentions[k].append(await one(len(serves) * n + k))
    return mentions


async def _spare_ready(site: Any, count: int) -> None:
    """Until the site has recorded ``count`` `spare started` records."""
    from tests.fakes.shell import audit_records

    def started() -> int:
        return len(audit_records(site, lambda r: (r.kind, r.event) == ("spare", "started")))

    async with asyncio.timeout(DEADLINE_S):
        # Another process's register: there is nothing to await, only a poll.
        while started() < count:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def _spare_rss_mb(site: Any) -> float:
    """VmRSS of the spare app-server waiting now, its whole process group, in MB."""
    from bothy.engine.procgroup import live_members
    from tests.fakes.shell import audit_records

    spares = audit_records(site, lambda r: (r.kind, r.event) == ("spare", "started"))
    if not spares:
        raise RuntimeError("no spare app-server was started")
    return sum(_rss_mb(pid) for pid in live_members(int(spares[-1].details["pgid"])))


async def _slack_mention(slack: Any, model: Any, n: int) -> _Mention:
    """One Slack mention, waited on until its answer is posted; the fakes' own times."""
    served = len(model.timings)
    ts = slack.send_mention(SLACK_OPERATOR, SLACK_CHANNEL, f"ping {n}")
    await slack.wait_for(lambda: any(p.thread_ts == ts for p in slack.posts),
                         timeout_s=DEADLINE_S)
    envelopes = set(slack.envelopes_of(ts))
    sent = min(d.at for d in slack.deliveries if d.envelope_id in envelopes and d.sent)
    reacted = min(c.at for c in slack.calls_to("reactions.add")
                  if c.args.get("timestamp") == ts)
    posted = min(p.at for p in slack.posts if p.thread_ts == ts)
    return _mention(n, f"slack:{ts}", model.timings[served:], sent, reacted, posted)


# ---------------------------------------------------------------- (b) Slack and Discord


async def _both_serve(root: Path, model: Any, slack: Any, network: Any,
                      slack_connect_s: float) -> None:
    site = await network.attach(_site(root, model, slack=slack, discord=True),
                                ports=[model.port, slack.port])
    discord = network.fake
    print("   (b) `bothy serve` with Slack and Discord, in a network namespace where Discord's"
          " host names lead to the fake Discord:", flush=True)
    async with _serving(site, ["-m", "bothy", "serve"]) as serve:
        await asyncio.sleep(IDLE_S)
        idle_mb = _rss_mb(serve.process.pid)
        [mentions] = await _side_by_side(
            model, [(site, lambda n: _discord_mention(discord, model, n))])
        code = await serve.stop()
    connect_s = serve.ready_s - serve.starting_s
    figure("start → serve ready, Slack + Discord (ms)", serve.ready_s * 1000, "ms",
           BOTH_READY_TARGET_MS, higher_is_better=False)
    _note(f"spawn → `serve starting` {serve.starting_s * 1000:.0f} ms; starting → ready"
          f" {connect_s * 1000:.0f} ms, about {(connect_s - slack_connect_s) * 1000:.0f} ms"
          " more than (a): the adapters connect side by side; Discord is ready once the"
          " guilds its READY named have arrived")
    figure(f"idle VmRSS, both connected, after {IDLE_S:g} s (MB)", idle_mb, "MB",
           BOTH_RSS_TARGET_MB, higher_is_better=False)
    _latencies("Discord", site, mentions)
    _note("Discord's times are when this process saw the fake record the reaction and the"
          " post (the fake keeps no times; it wakes this loop on each request)")
    _note(f"daemon exited {code} after SIGTERM")


async def _discord_mention(discord: Any, model: Any, n: int) -> _Mention:
    """One Discord mention, waited on until its answer is posted."""
    from tests.fakes.discord import CHANNEL_ID

    served = len(model.timings)
    seen: dict[str, float] = {}
    sent = time.monotonic()
    mention = await discord.send_mention(DISCORD_OPERATOR, CHANNEL_ID, f"ping {n}")

    def noted() -> bool:
        now = time.monotonic()
        if "reacted" not in seen and any(r.message_id == mention for r in discord.reactions):
            seen["reacted"] = now
        if "posted" not in seen and discord.posts_in(mention):
            seen["posted"] = now
        return len(seen) == 2

    await discord.wait_for(noted, f"the answer to mention {n}", timeout_s=DEADLINE_S)
    return _mention(n, f"discord:{mention}", model.timings[served:], sent, seen["reacted"],
                    seen["posted"])


# ---------------------------------------------------------------- mentions and their parts


def _mention(n: int, subject: str, timings: list[tuple[float, float]], sent: float,
             reacted: float, posted: float) -> _Mention:
    if len(timings) != 1:
        raise RuntimeError(f"mention {n}: {len(timings)} model requests, expected 1")
    asked, answered = timings[0]
    return _Mention(subject, sent, reacted, asked, answered, posted)


def _latencies(platform: str, site: Any, mentions: list[_Mention]) -> None:
    cold, warm = mentions[0], mentions[1:]
    reactions = [m.reaction_ms for m in warm]
    overheads = [m.overhead_ms for m in warm]
    figure(f"{platform}: mention → first reaction, p50 (ms)", median(reactions), "ms",
           REACTION_TARGET_MS, higher_is_better=False)
    figure(f"{platform}: mention → first reaction, p99 (ms)", percentile(reactions, 99), "ms",
           REACTION_TARGET_MS, higher_is_better=False)
    figure(f"{platform}: mention → answer − model, p50 (ms)", median(overheads), "ms",
           OVERHEAD_TARGET_MS, higher_is_better=False)
    figure(f"{platform}: mention → answer − model, p99 (ms)", percentile(overheads, 99), "ms",
           OVERHEAD_TARGET_MS, higher_is_better=False)
    _note(f"{len(warm)} mentions one at a time, after a cold first one (reaction"
          f" {cold.reaction_ms:.0f} ms, answer − model {cold.overhead_ms:.0f} ms); the p99 of"
          f" {len(warm)} is their maximum")
    parts = _parts(site, warm)
    _note("where mention → answer goes (medians, ms): "
          + "; ".join(f"{name} {median(values):.0f}" for name, values in parts.items()))
    _note("the way to the model split (medians, ms): "
          + "; ".join(f"{name} {median(values):.0f}"
                      for name, values in _split(site, warm).items()))
    taken = sum(1 for m in warm if _spare_of(site, m) == "taken")
    _note(f"{taken} of {len(warm)} ran on a spare app-server (started ahead: `→ run started`"
          " then includes no spawn, `→ turn started` no codex initialize); the others spawned"
          " `codex app-server` for the run")
    if taken:
        ahead = sum(1 for m in warm if _thread_of(site, m) == "ahead")
        _note(f"{ahead} of {taken} on the spare took the thread it had started ahead"
              " (`turn started` thread: ahead); the others started their own on it")


def _thread_of(site: Any, mention: _Mention) -> str | None:
    """How the mention's run came by its thread (`turn started`): ahead, started, resumed."""
    from tests.fakes.shell import audit_records

    turns = audit_records(site, lambda r: (r.kind, r.event) == ("turn", "started")
                          and r.subject == mention.subject)
    return str(turns[0].details.get("thread")) if turns else None


def _spare_of(site: Any, mention: _Mention) -> str | None:
    """What the mention's `run started` says of the spare: taken, cold, or nothing (off)."""
    from tests.fakes.shell import audit_records

    started = audit_records(site, lambda r: (r.kind, r.event) == ("run", "started")
                            and r.subject == mention.subject)
    return str(started[0].details.get("spare")) if started else None


def _parts(site: Any, mentions: list[_Mention]) -> dict[str, list[float]]:
    """Each mention's time cut at its run's audit records (their wall-clock timestamps put on
    this process's monotonic clock; both processes read the same system clock)."""
    from tests.fakes.shell import audit_records

    offset = time.time() - time.monotonic()
    moments: dict[tuple[str, str], float] = {}
    for record in audit_records(site, lambda r: r.kind in ("run", "turn", "worker")):
        key = (str(record.subject), f"{record.kind} {record.event}")
        moments.setdefault(key, record.ts.timestamp() - offset)
    names = ("mention → reaction", "→ `run started` (admitted, group spawned)",
             "→ `turn started` (codex up, thread)", "→ model request",
             "model (left out)", "→ `run finished` (settled, recorded)", "→ answer posted")
    parts: dict[str, list[float]] = {name: [] for name in names}
    after_answer = "then `worker stopped` (codex's exit, after the answer)"
    parts[after_answer] = []
    for m in mentions:
        started = moments.get((m.subject, "run started"))
        turn = moments.get((m.subject, "turn started"))
        finished = moments.get((m.subject, "run finished"))
        stopped = moments.get((m.subject, "worker stopped"))
        if started is None or turn is None or finished is None or stopped is None:
            continue
        cuts = (m.sent, m.reacted, started, turn, m.asked, m.answered, finished, m.posted)
        for name, (before, after) in zip(names, itertools.pairwise(cuts), strict=True):
            parts[name].append((after - before) * 1000)
        parts[after_answer].append((stopped - m.posted) * 1000)
    return {name: values for name, values in parts.items() if values}


def _split(site: Any, mentions: list[_Mention]) -> dict[str, list[float]]:
    """Mention → model request cut into codex's own steps (its answer to thread/start; from
    turn/start sent to the model request) and the rest, Bothy's own (the chat adapter, intake,
    gates, slot, the durable steps that do not overlap codex's), by the `wake received` and
    `run started` records and the times `turn started` carries."""
    from tests.fakes.shell import audit_records

    offset = time.time() - time.monotonic()
    moments: dict[tuple[str, str], Any] = {}
    for record in audit_records(site, lambda r: (r.kind, r.event) in (
            ("wake", "received"), ("run", "started"), ("turn", "started"))):
        moments.setdefault((str(record.subject), f"{record.kind} {record.event}"), record)
    names = ("mention → `wake received`", "→ `run started`", "codex's thread/start",
             "Bothy from the worker taken (cold: spawned) to turn/start, codex aside",
             "codex: turn/start → model request", "Bothy's own in all",
             "codex's own in all")
    initialize = "codex's initialize (cold runs only: the spare's was done ahead)"
    parts: dict[str, list[float]] = {name: [] for name in (*names, initialize)}
    for m in mentions:
        received = moments.get((m.subject, "wake received"))
        started = moments.get((m.subject, "run started"))
        turn = moments.get((m.subject, "turn started"))
        if received is None or started is None or turn is None:
            continue
        thread_ms = float(turn.details.get("thread_start_ms") or 0.0)
        turn_sent = float(turn.details["turn_start_sent_unix"]) - offset
        taken_to_turn_ms = float(turn.details["to_turn_start_ms"])
        init_ms = 0.0 if started.details.get("spare") == "taken" else float(
            turn.details["initialize_ms"])
        if init_ms:
            parts[initialize].append(init_ms)
        codex_ms = init_ms + thread_ms + (m.asked - turn_sent) * 1000
        values = ((received.ts.timestamp() - offset - m.sent) * 1000,
                  (started.ts.timestamp() - received.ts.timestamp()) * 1000, thread_ms,
                  taken_to_turn_ms - thread_ms - init_ms, (m.asked - turn_sent) * 1000,
                  (m.asked - m.sent) * 1000 - codex_ms, codex_ms)
        for name, value in zip(names, values, strict=True):
            parts[name].append(value)
    return {name: values for name, values in parts.items() if values}


def _note(text: str) -> None:
    print(f"      {text}", flush=True)


# ---------------------------------------------------------------- a serve process


@contextlib.asynccontextmanager
async def _serving(site: Any, argv: list[str], *,
                   env: dict[str, str] | None = None) -> AsyncIterator[_Started]:
    """Spawn ``python ARGV`` on ``site``; yield once ``serve ready`` is in the audit. On the
    way out: SIGKILL it if still running, end the worker groups the site recorded."""
    from bothy.engine.procgroup import end_orphan_group
    from tests.fakes.shell import recorded_groups
    from tests.fakes.slack import APP_TOKEN, BOT_TOKEN

    tokens = {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN, **(env or {})}
    log_path = site.root / "serve.log"
    with log_path.open("wb") as log:
        spawned = time.time()
        process = await asyncio.create_subprocess_exec(
            *site.launch_prefix, sys.executable, *argv, env=site.env(**tokens), cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            ready = await _serve_record(site, "ready", lambda: process.returncode is not None)
            if ready is None:
                raise RuntimeError(f"serve exited {process.returncode} before it was ready:\n"
                                   + log_path.read_text()[-2000:])
            starting = await _serve_record(site, "starting", lambda: True)
            assert starting is not None
            yield _Started(process, starting - spawned, ready - spawned)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            for record in await asyncio.to_thread(recorded_groups, site.home):
                await end_orphan_group(record, grace_s=1.0, kill_wait_s=5.0)


async def _serve_record(site: Any, event: str, gave_up: Callable[[], bool]) -> float | None:
    """The wall-clock time of the site's last ``serve EVENT`` record, once there is one."""
    from tests.fakes.shell import audit_records

    async with asyncio.timeout(DEADLINE_S):
        while True:
            found = audit_records(site, lambda r: (r.kind, r.event) == ("serve", event))
            if found:
                return found[-1].ts.timestamp()
            if gave_up():
                return None
            # Another process's file: nothing to await but a short poll. The figure is the
            # record's own timestamp, so the poll's period does not enter it.
            await asyncio.sleep(0.02)


def _site(root: Path, model: Any, *, slack: Any, discord: bool = False,
          spare: bool = True, unfit: bool = False) -> Any:
    """A site with Slack (and Discord); ``unfit``: its chat profile offers a tool (bothy_note),
    so that a mention's thread never fits the one the spare made ahead."""
    from tests.fakes.discord import ALERT_CHANNEL_ID
    from tests.fakes.site import Site

    chat: dict[str, Any] = {"slack": {"api_url": slack.api_url,
                                      "allowed_users": [SLACK_OPERATOR]}}
    profiles: dict[str, Any] = {}
    if unfit:
        chat["slack"]["profile"] = "noting"
        profiles["noting"] = {"tools": ["bothy_note"]}
    if discord:
        chat["discord"] = {"allowed_users": [DISCORD_OPERATOR],
                           "alert_channel": ALERT_CHANNEL_ID}
    return Site(made(root), model.base_url, listen={"tailnet_port": free_port()}, chat=chat,
                codex={"spare": spare}, profiles=profiles)


def _rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS), in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for pid {pid}")



