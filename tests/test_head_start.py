"""Proofs of `bothy run`'s head start (bothy/engine/headstart.py): its codex is spawned as soon as
the run is checked, beside Bothy's own set-up, and the run takes it where it would have
spawned a cold one.

The real CLI as a subprocess, the real pinned codex, the scripted model; what is asserted is
what an operator sees: the printed line and exit code, `run started` and `turn started` in
the register, and (psutil) which codex processes of the site are left once the command exits.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.fakes.model_server import ModelServer, text
from tests.fakes.site import Site


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


async def _records(site: Site, run_id: str) -> list[dict[str, Any]]:
    done = await site.bothy("audit", "--run", run_id, "--json")
    assert done.code == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _record(records: list[dict[str, Any]], kind: str, event: str) -> dict[str, Any]:
    [found] = [r for r in records if (r["kind"], r["event"]) == (kind, event)]
    return found


def _codex_left(site: Site) -> list[int]:
    """Pids of live processes started with this site's CODEX_HOME (its codex app-servers)."""
    left = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get("CODEX_HOME") == str(site.codex_home):
                left.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


@pytest.mark.codex
async def test_a_run_takes_its_head_start_and_the_thread_started_ahead(
    tmp_path: Path, server: ModelServer
) -> None:
    """A plain `bothy run` answers on the codex it spawned ahead (`run started` says
    `head_start: taken`), in the thread started ahead (`turn started`: `thread: ahead`), and
    leaves no codex behind."""
    server.script(text("BOTHY"))
    site = Site(tmp_path, server.base_url)

    done = await site.bothy("run", "Reply with exactly: BOTHY", "--subject", "demo")

    assert done.code == 0, done.stderr
    outcome, run_id, *_, answer = done.stdout.split()
    assert (outcome, answer) == ("completed", "BOTHY")
    records = await _records(site, run_id)
    started = _record(records, "run", "started")
    assert started["details"]["head_start"] == "taken"
    assert _record(records, "turn", "started")["details"]["thread"] == "ahead"
    assert _record(records, "worker", "stopped")["outcome"] == "ok"
    assert len(server.requests) == 1
    assert _codex_left(site) == []


@pytest.mark.codex
async def test_a_run_refused_at_the_gate_ends_its_head_start_unused(
    tmp_path: Path, server: ModelServer
) -> None:
    """A run refused at the budget gate (an unpriced model) is refused as before: no `run
    started`, no model request; the codex spawned ahead of it is ended with the command."""
    site = Site(tmp_path, server.base_url, codex={"model": "pricey-model"})

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 3, done.stderr
    outcome, run_id, *_ = done.stdout.split()
    assert outcome == "refused"
    events = [(r["kind"], r["event"]) for r in await _records(site, run_id)]
    assert ("run", "refused") in events
    assert ("run", "started") not in events
    assert server.requests == []
    assert _codex_left(site) == []


@pytest.mark.codex
async def test_a_profile_with_its_own_codex_config_starts_cold_and_ends_the_head_start(
    tmp_path: Path, server: ModelServer
) -> None:
    """A profile whose `codex_config` makes another launch runs on a codex of its own, started
    with that config (`head_start: cold`, saying why); the one spawned ahead is ended."""
    server.script(text("Thought hard."))
    site = Site(tmp_path, server.base_url,
                profiles={"careful": {"codex_config": {"model_reasoning_effort": "high"}}})

    done = await site.bothy("run", "think", "--subject", "demo", "--profile", "careful")

    assert done.code == 0, done.stderr
    run_id = done.stdout.split()[1]
    started = _record(await _records(site, run_id), "run", "started")
    assert started["details"]["head_start"] == "cold"
    assert "codex_config" in started["details"]["cold"]
    [asked] = server.requests
    assert asked["reasoning"]["effort"] == "high"
    assert _codex_left(site) == []


async def test_a_codex_that_dies_in_its_head_start_fails_the_run_saying_why(
    tmp_path: Path,
) -> None:
    """A codex that exits while it initializes ahead of the run: the run that took it fails
    with codex's own words and exit code, as a cold start's would, nothing is left reserved,
    and `bothy status` says nothing runs."""
    dying = tmp_path / "codex"
    dying.write_text("#!/bin/sh\necho 'codex: cannot start here' >&2\nexit 3\n")
    dying.chmod(0o755)
    site = Site(tmp_path, "http://127.0.0.1:9/v1",
                codex={"command": [str(dying), "app-server"]})

    done = await site.bothy("run", "hello", "--subject", "demo")

    assert done.code == 1, done.stderr
    outcome, run_id, cost, *_ = done.stdout.split()
    assert (outcome, cost) == ("failed", "0.0000")
    assert "exit code 3" in done.stdout and "codex: cannot start here" in done.stdout
    records = await _records(site, run_id)
    assert _record(records, "run", "started")["details"]["head_start"] == "taken"
    assert _record(records, "run", "finished")["outcome"] == "failed"
    status = await site.bothy("status", "--json")
    report = json.loads(status.stdout)
    assert (report["running"], report["reserved_usd"]) == ([], "0.0000")


@pytest.mark.codex
async def test_a_head_start_no_run_took_is_ended_by_its_close(
    tmp_path: Path, server: ModelServer
) -> None:
    """Closed untaken (its run refused or stopped first), the head start's codex is ended by
    the close itself, its group empty once the close returns: not left to notice its standard
    input close when the command exits."""
    from bothy.config import load_config
    from bothy.engine.headstart import HeadStart
    from bothy.engine.launch import build_launch
    from bothy.engine.worker import ThreadParams

    site = Site(tmp_path, server.base_url)
    launch = build_launch(load_config(site.home / "config.json").codex, environ=site.env())
    head = await HeadStart.begin(launch, cwd=site.workspace, grace_s=2.0,
                                 thread=ThreadParams.plain(None, keep=False))
    [leader] = _codex_left(site)

    await head.close()

    assert leader not in _codex_left(site)
    assert _codex_left(site) == []
    assert server.requests == []


@pytest.mark.codex
async def test_a_sigkilled_run_leaves_no_codex_of_its_head_start(
    tmp_path: Path, server: ModelServer
) -> None:
    """`bothy run` SIGKILLed once its codex is spawned (before or after the run took it, as the
    kill falls): its codex, on no record until taken, ends with its standard input, and no
    codex of the site is left; the next command starts as usual."""
    from tests.fakes.shell import Shell, until

    server.script(text("Never asked, or never answered."))
    site = Site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        running = await shell.start("run", "hello", "--subject", "demo")
        await until(lambda: _codex_left(site) != [] or not running.running,
                    "`bothy run` spawned its codex")
        assert running.running, running.stderr.text()
        await running.kill()

    await until(lambda: _codex_left(site) == [], "no codex of the site left after the kill")
    assert (await site.bothy("status")).code == 0
