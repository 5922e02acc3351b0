"""Durable ingest through a real ``bothy serve`` (issue 18): what was answered 200 survives a
SIGKILL and runs (or is closed as ignored) exactly once; what could not be made durable is
answered 503 and never 200.

Real signed HTTP, the real daemon as a subprocess, the real codex against the scripted model
server, real signals. A failing disk is Bothy's one fault point (``BOTHY_FAULT_FSYNC``: every
fsync under the inbox fails with EIO, as Linux reports a write the disk could not take);
nothing else is replaced. Counted from the register, as an operator would.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from bothy.wakes.delivery import ignored_in
from tests.fakes import github
from tests.fakes.model_server import ModelServer, text
from tests.fakes.shell import DEADLINE_S, Shell, until
from tests.fakes.site import Site
from tests.test_serve import (
    HOOK_PATH,
    SECRET,
    Serving,
    delivery_of,
    records,
    serve_site,
    until_count,
)

WANTED, UNWANTED = 6, 120
SETTLE_S = 90.0  # a loaded machine starts six codex runs, two at a time, slowly


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_SECRET", SECRET)


async def _start_serve(shell: Shell, **extra_env: str) -> Serving:
    site = shell.site
    before = len(records(site, "serve", "ready"))
    command = await shell.start("serve", **extra_env)
    await until(lambda: len(records(site, "serve", "ready")) > before or not command.running,
                "`bothy serve` ready")
    ready = records(site, "serve", "ready")
    assert len(ready) > before, await command.finish()
    return Serving(command, int(ready[-1].details["ports"]["tailnet"]))  # type: ignore[index]


async def _send(client: httpx.AsyncClient, port: int, event: str, body: bytes,
                delivery: str) -> httpx.Response:
    return await client.post(f"http://127.0.0.1:{port}{HOOK_PATH}", content=body,
                             headers=github.headers(event, body, SECRET, delivery=delivery))


def _key(delivery: str) -> str:
    return f"{delivery}:{github.HOOK_ID}"


def _ran(site: Site) -> Counter[str]:
    """Delivery key → how many of its runs reached a worker (under any attempt's run id)."""
    woke = delivery_of(site)
    return Counter(woke[str(r.run_id)] for r in records(site, "run", "started")
                   if str(r.run_id) in woke)


def _cut_short(site: Site) -> set[str]:
    """Deliveries whose run the kill cut short: closed out loud (`wake interrupted`), never
    run again (whether its worker had been spawned is the next daemon's recovery's)."""
    return {str(r.details["delivery"]) for r in records(site, "wake", "interrupted")}


def _unresolved(site: Site, want: set[str]) -> set[str]:
    return want - set(_ran(site)) - _cut_short(site)


def _ignored(site: Site) -> Counter[str]:
    """Delivery key → how many times the register closes it as ignored (either form)."""
    return Counter(d.key for r in records(site, "wake", "ignored") for d in ignored_in(r.details))


def _kept_payloads(site: Site) -> bytes:
    """Every payload line the inbox's segments hold."""
    return b"".join(p.read_bytes() for p in sorted((site.home / "inbox").glob("wakes-*.seg")))


@pytest.mark.codex
@pytest.mark.timeout(180)
async def test_every_delivery_answered_before_a_sigkill_runs_or_is_ignored_exactly_once(
    server: ModelServer, tmp_path: Path
) -> None:
    """A burst of wanted and unwanted deliveries, SIGKILL of `bothy serve` right after the last
    200, a restart: every wanted one ran exactly once (one run that reached a worker) or was
    cut short by the kill and closed out loud (`wake interrupted`), none ran twice; every
    unwanted one is named by exactly one `wake ignored` (intake's records of a batch, a
    hundred deliveries at most each), none both, and kept no payload line; the chain
    verifies."""
    site = serve_site(tmp_path, server, pool={"max_workers": 2})
    server.script(*(text(f"Reviewed ({n}).") for n in range(3 * WANTED)))
    wanted = [(f"want-{n}", github.encode(github.pull_request_opened(n + 1)))
              for n in range(WANTED)]
    unwanted = [(f"skip-{n}", github.encode(github.push(messages=(f"Change {n}",))))
                for n in range(UNWANTED)]
    async with Shell(site) as shell:
        serving = await _start_serve(shell)
        async with httpx.AsyncClient(timeout=DEADLINE_S,
                                     limits=httpx.Limits(max_connections=16)) as client:
            answers = await asyncio.gather(
                *(_send(client, serving.port, "pull_request", body, d) for d, body in wanted),
                *(_send(client, serving.port, "push", body, d) for d, body in unwanted))
        await serving.command.kill()
        statuses = Counter((a.status_code, a.json()["status"]) for a in answers)

        restarted = await _start_serve(shell)
        want = {_key(d) for d, _ in wanted}
        with contextlib.suppress(AssertionError):  # the assertion below says which did not
            await until(lambda: not _unresolved(site, want), "every wanted delivery resolved",
                        timeout_s=SETTLE_S)
        assert not _unresolved(site, want), (sorted(_unresolved(site, want)),
                                             site.audit_lines())
        cut_short = _cut_short(site)
        await until_count(site, "run", "finished", "ok", len(want - cut_short))
        assert await restarted.stop() == 0
        verified = await shell.bothy("audit", "verify")

    assert statuses == {(200, "queued"): WANTED, (200, "ignored"): UNWANTED}
    ran = _ran(site)
    assert [key for key, n in ran.items() if n > 1] == [], "run twice"
    assert set(ran) | cut_short == want  # each ran once, or was cut short by the kill
    assert all(ran[key] == 1 for key in want - cut_short)
    assert _ignored(site) == Counter({_key(d): 1 for d, _ in unwanted})
    assert not set(_ignored(site)) & want
    batches = records(site, "wake", "ignored")
    assert len(batches) < UNWANTED and all(0 < r.details["count"] <= 100 for r in batches)
    kept = _kept_payloads(site)
    assert all(f'"{d}"'.encode() in kept for d, _ in wanted)
    assert b'"skip-' not in kept  # nothing will run them: no payload kept
    assert verified.code == 0, verified.stdout + verified.stderr


@pytest.mark.codex
@pytest.mark.timeout(120)
async def test_a_delivery_whose_fsync_fails_is_answered_503_and_never_runs_until_resent(
    server: ModelServer, tmp_path: Path
) -> None:
    """With the inbox's disk failing, deliveries are answered 503 (`webhook refused` 503 in
    the register), never 200; after a SIGKILL and a restart none of them ran or came back;
    sent again once the disk is back, each is answered 200 and runs once."""
    site = serve_site(tmp_path, server)
    server.script(*(text(f"Reviewed ({n}).") for n in range(5)))
    trigger = tmp_path / "disk-fails"
    failing = [(f"fail-{n}", github.encode(github.pull_request_opened(n + 10)))
               for n in range(3)]
    async with Shell(site) as shell:
        serving = await _start_serve(shell, BOTHY_FAULT_FSYNC=str(trigger))
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            first = await _send(client, serving.port, "pull_request",
                                github.encode(github.pull_request_opened(1)), "ok-1")
            await until_count(site, "run", "finished", "ok", 1)  # not cut short by the kill
            trigger.write_text(str(site.home / "inbox"))
            refused = await asyncio.gather(
                *(_send(client, serving.port, "pull_request", body, d) for d, body in failing))
        await serving.command.kill()
        trigger.unlink()

        restarted = await _start_serve(shell)
        ran_before_resend = _ran(site)
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            resent = await asyncio.gather(
                *(_send(client, restarted.port, "pull_request", body, d) for d, body in failing))
        await until_count(site, "run", "finished", "ok", 1 + len(failing))
        assert await restarted.stop() == 0

    assert (first.status_code, first.json()["status"]) == (200, "queued")
    assert [(a.status_code, a.json()) for a in refused] == [
        (503, {"error": "not stored; retry later"})] * len(failing)
    refusals = records(site, "webhook", "refused")
    assert sorted(str(r.details["delivery"]) for r in refusals) == sorted(d for d, _ in failing)
    assert all(r.details["status"] == 503 and "Input/output error" in str(r.details["reason"])
               for r in refusals)
    assert dict(ran_before_resend) == {_key("ok-1"): 1}
    assert records(site, "wake", "reinserted") == []
    assert [(a.status_code, a.json()["status"]) for a in resent] == [(200, "queued")] * 3
    assert _ran(site) == Counter({_key(d): 1 for d in ("ok-1", *(d for d, _ in failing))})


def _state(site: Site) -> contextlib.closing[sqlite3.Connection]:
    """The state database, opened from outside as an operator's sqlite3 would."""
    return contextlib.closing(sqlite3.connect(site.home / "state" / "bothy.sqlite3",
                                              isolation_level=None, timeout=DEADLINE_S))


def _segments(site: Site) -> list[str]:
    return sorted(p.name for p in (site.home / "inbox").glob("wakes-*.seg"))


def _push(n: int) -> bytes:
    return github.encode(github.push(messages=(f"Change {n}",)))


@pytest.mark.timeout(120)
async def test_a_delivery_answered_503_after_its_wake_ignored_is_recorded_once_when_resent(
    server: ModelServer, tmp_path: Path
) -> None:
    """The state database refuses the rows after an unwanted delivery's `wake ignored` was
    recorded: it is answered 503; sent again it is answered 200 ignored, without a second
    `wake ignored` — in the same `bothy serve`, and after a SIGKILL and a restart (it left
    no row and no payload line: only the register says it was recorded)."""
    site = serve_site(tmp_path, server)
    refuse = ("CREATE TRIGGER refuse BEFORE INSERT ON wakes"
              " BEGIN SELECT RAISE(ABORT, 'the disk is full'); END")
    async with Shell(site) as shell:
        serving = await _start_serve(shell)
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            with _state(site) as db:
                db.execute(refuse)
            refused = [await _send(client, serving.port, "push", _push(n), f"again-{n}")
                       for n in range(2)]
            with _state(site) as db:
                db.execute("DROP TRIGGER refuse")
            resent = await _send(client, serving.port, "push", _push(0), "again-0")
            later = await _send(client, serving.port, "push", _push(2), "again-2")
        await serving.command.kill()

        restarted = await _start_serve(shell)
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            after = await _send(client, restarted.port, "push", _push(1), "again-1")
        assert await restarted.stop() == 0

    assert [(a.status_code, a.json()) for a in refused] == [
        (503, {"error": "not stored; retry later"})] * 2
    assert [(a.status_code, a.json()["status"]) for a in (resent, later, after)] == [
        (200, "ignored")] * 3
    assert _ignored(site) == Counter({_key(f"again-{n}"): 1 for n in range(3)})
    with _state(site) as db:
        rows = dict(db.execute("SELECT key, status FROM wakes").fetchall())
    assert rows == {_key(f"again-{n}"): "ignored" for n in range(3)}
    assert _kept_payloads(site) == b""


@pytest.mark.codex
@pytest.mark.timeout(120)
async def test_serve_forgets_finished_deliveries_older_than_the_retention_with_their_segments(
    server: ModelServer, tmp_path: Path
) -> None:
    """`bothy serve` prunes the inbox: deliveries finished more than
    `wakes.keep_deliveries_days` ago are forgotten, rows and segment files (the payloads of
    what ran; what was ignored kept only its row), at start-up, and recorded `wake pruned`;
    newer ones and the highest-numbered segment stay; a forgotten one sent again is new."""
    site = serve_site(tmp_path, server)
    server.script(*(text(f"Reviewed ({n}).") for n in range(2)))
    async with Shell(site) as shell:
        for attempt in range(2):  # two processes: a segment each
            serving = await _start_serve(shell)
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                await _send(client, serving.port, "pull_request",
                            github.encode(github.pull_request_opened(attempt + 1)),
                            f"old-{attempt}-w")
                for n in range(2):
                    await _send(client, serving.port, "push", _push(n), f"old-{attempt}-{n}")
            await until_count(site, "run", "finished", "ok", attempt + 1)
            assert await serving.stop() == 0
        written = _segments(site)
        with _state(site) as db:  # eight days pass for the first process's
            db.execute("UPDATE wakes SET received_us = received_us - ?,"
                       " finished_us = finished_us - ? WHERE key LIKE 'old-0-%'",
                       (8 * 86_400 * 1_000_000,) * 2)

        restarted = await _start_serve(shell)
        await until(lambda: _segments(site) != written, "the old segment pruned")
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            again = await _send(client, restarted.port, "push", _push(0), "old-0-0")
        assert await restarted.stop() == 0

    assert len(written) == 2
    with _state(site) as db:
        keys = sorted(key for (key,) in db.execute("SELECT key FROM wakes"))
    assert keys == sorted([_key("old-0-0"), *(_key(f"old-1-{n}") for n in ("w", 0, 1))])
    assert _segments(site) == [written[1]]  # (the one sent again keeps no payload)
    assert (again.status_code, again.json()["status"]) == (200, "ignored")  # new, not duplicate
    [pruned] = records(site, "wake", "pruned")
    assert (pruned.details["wakes"], pruned.details["segments"]) == (3, [written[0]])
