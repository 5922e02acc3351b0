"""Plan mode across processes: the real ``bothy run``, the real codex, real rate-limit headers.

The scripted model sets ``x-codex-primary-*`` / ``x-codex-secondary-*`` headers on its replies;
codex turns them into ``account/rateLimits/updated``, which every run keeps in state. Each
``bothy run`` is its own process, so what one run learnt and another is gated on has crossed
a restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bothy.config import load_config
from bothy.home import BothyHome
from bothy.runtime import Runtime
from tests.fakes.model_server import (
    ModelServer,
    RateLimits,
    RateLimitWindow,
    stall,
    text,
    tool_call,
)
from tests.fakes.shell import Command, Shell, audit_records, of_run
from tests.fakes.site import Site

pytestmark = pytest.mark.codex


@pytest.fixture
async def server() -> AsyncIterator[ModelServer]:
    async with ModelServer() as model:
        yield model


def _plan_site(tmp_path: Path, base_url: str, **settings: Any) -> Site:
    """A site in plan mode with no dollar keys and no price for its model."""
    site = Site(tmp_path, base_url, pool={"max_workers": 2})
    site.config["budget"] = {"mode": "plan", "plan_ceiling_percent": 85,
                             "plan_reserve_percent": 2, **settings}
    site.write_config(site.config)
    return site


def _reset_in(seconds: int) -> tuple[int, str]:
    """A reset time ``seconds`` from now, and how a refusal shows it (today, in UTC)."""
    at = int(time.time()) + seconds
    shown = datetime.fromtimestamp(at, UTC)
    when = f"{shown:%H:%M}" if shown.date() == datetime.now(UTC).date() else \
        f"{shown:%Y-%m-%d %H:%M}"
    return at, f"resets {when} UTC"


def _limits(primary: int, secondary: int | None = None, *, reset_at: int) -> RateLimits:
    return RateLimits(
        primary=RateLimitWindow(primary, 300, reset_at),
        secondary=None if secondary is None else RateLimitWindow(secondary, 10080,
                                                                 reset_at + 86_400),
    )


async def _seed_windows(site: Site, primary: int, secondary: int, reset_at: int) -> None:
    """Windows as a run of this site saw them earlier, through the engine itself."""
    home = BothyHome(site.home)
    cfg = load_config(home.config_path)
    params = {"rateLimits": {"limitId": "codex", "primary": {
        "usedPercent": primary, "windowDurationMins": 300, "resetsAt": reset_at},
        "secondary": {"usedPercent": secondary, "windowDurationMins": 10080,
                      "resetsAt": reset_at + 86_400}}}
    async with Runtime.open(home, cfg) as rt:
        await rt.supervisor().budget.observe("run_seen_earlier", params)


def _events(site: Site, run_id: str) -> list[tuple[str, str, str]]:
    return [(r.kind, r.event, r.outcome) for r in audit_records(site, of_run(run_id))]


@pytest.mark.timeout(120)
async def test_five_concurrent_runs_on_a_nearly_spent_window_admit_three_and_refuse_two(
    server: ModelServer, tmp_path: Path
) -> None:
    """At 78% used, 85% ceiling, 2% each: three of five racing `bothy run`s start, two are
    refused with every figure, and status shows the window, its age and its reset."""
    server.script(*(stall() for _ in range(5)))
    site = _plan_site(tmp_path, server.base_url)
    reset_at, resets = _reset_in(3600)
    await _seed_windows(site, 78, 40, reset_at)
    async with Shell(site) as shell:
        runs = [await shell.start("run", "hold on", "--subject", f"job:{n}") for n in range(5)]
        admitted: list[tuple[Command, str]] = []
        refused: list[Command] = []
        for run in runs:
            run_id = await run.admitted()
            if run_id is None:
                refused.append(run)
            else:
                admitted.append((run, run_id))

        assert len(admitted) == 3
        for run in refused:
            done = await run.finish()
            assert done.code == 3
            outcome, run_id, rest = done.stdout.split(" ", 2)
            assert (outcome, rest) == ("refused", (
                "0.0000 usd refused at gate 'plan': primary window would reach 86% against an"
                f" 85% ceiling (78% used, 6% already reserved, 2% requested; {resets})\n"))
            assert _events(site, run_id) == [("wake", "received", "ok"),
                                             ("run", "refused", "refused")]
            record = audit_records(site, lambda r, i=run_id: r.run_id == i)[-1]
            assert record.details["gate"] == "plan"
            assert record.details["would_reach_percent"] == "86"

        await server.wait_for_requests(2)
        status = await shell.bothy("status")
        assert "plan: ceiling 85%, 2% reserved per run, 6% reserved now\n" in status.stdout
        assert "  primary 300 min window: 78% used, seen " in status.stdout
        assert "  secondary 10080 min window: 40% used, seen " in status.stdout
        for _run, run_id in admitted:
            await shell.bothy("cancel", run_id)
        for run, _ in admitted:
            assert (await run.finish()).code == 5
        status = await shell.bothy("status")
        assert "plan: ceiling 85%, 2% reserved per run, 0% reserved now\n" in status.stdout


async def test_a_fresh_site_learns_the_windows_and_later_runs_settle_at_the_observed_change(
    server: ModelServer, tmp_path: Path
) -> None:
    """No window known: the first run is admitted to learn them (audited); the next run, a new
    process, is gated on what it learnt and settles at the change it saw."""
    reset_at, _ = _reset_in(7200)
    server.script(text("learnt", rate_limits=_limits(40, 10, reset_at=reset_at)),
                  text("again", rate_limits=_limits(43, 11, reset_at=reset_at)))
    site = _plan_site(tmp_path, server.base_url)

    first = await site.bothy("run", "hello", "--subject", "learn")
    assert first.code == 0, first.stderr
    first_id = first.stdout.split()[1]
    assert ("plan", "window", "unknown") in _events(site, first_id)

    second = await site.bothy("run", "hello again", "--subject", "learn")
    assert second.code == 0, second.stderr
    second_id = second.stdout.split()[1]
    admitted = audit_records(site, lambda r: r.run_id == second_id and r.event == "admitted")
    assert admitted[0].details["primary_used_percent"] == "40"
    settled = audit_records(site, lambda r: r.run_id == second_id and r.event == "settled")
    assert settled[0].details["primary_observed_change_percent"] == "3"
    assert settled[0].details["secondary_observed_change_percent"] == "1"
    assert settled[0].details["released_percent"] == "2"

    status = await site.bothy("status")
    assert "  primary 300 min window: 43% used, seen " in status.stdout
    doctor = await site.bothy("doctor")
    assert ("[ok ] budget mode: mode 'plan' (ceiling 85%, 2% reserved per run; per_run_usd,"
            " per_day_usd and prices are ignored): primary 43% used, secondary 11% used"
            ) in doctor.stdout


async def test_runs_behind_the_learner_wait_and_are_refused_if_it_learnt_nothing(
    server: ModelServer, tmp_path: Path
) -> None:
    """A provider that sends no windows: the run behind the learner waits for it, then is
    refused at gate 'plan' (window unknown), and doctor fails the check naming why."""
    release = asyncio.Event()
    server.script(text("no headers here", after=release))
    site = _plan_site(tmp_path, server.base_url)
    async with Shell(site) as shell:
        learner = await shell.start("run", "first", "--subject", "a")
        learner_id = await learner.admitted()
        await server.wait_for_requests(1)
        behind = await shell.start("run", "second", "--subject", "b")
        await behind.line(f"^bothy: waiting: behind {learner_id}, which is learning the plan's"
                          " rate-limit windows$")
        release.set()
        assert (await learner.finish()).code == 0
        done = await behind.finish()

    assert done.code == 3
    assert done.stdout.split(" ", 4)[4] == (
        f"refused at gate 'plan': window unknown: {learner_id} ended completed and Codex"
        " reported no rate-limit window: the provider sends none, so plan mode cannot gate"
        " (use budget.mode \"api\")\n")
    doctor = await site.bothy("doctor")
    assert doctor.code == 1
    assert f"[fail] budget mode: mode 'plan' (ceiling 85%, 2% reserved per run; per_run_usd," \
           f" per_day_usd and prices are ignored): window unknown: {learner_id} ended" \
           " completed" in doctor.stdout


async def test_a_window_crossing_the_ceiling_mid_run_stops_it(
    server: ModelServer, tmp_path: Path
) -> None:
    """The model's second response reports 90% against an 85% ceiling: budget_limit, exit 4.

    Codex reports a response's rate limits once the response is complete (observed: not when
    its headers arrive), so the crossing is seen after the second tool call is asked for.
    """
    reset_at, resets = _reset_in(1800)
    server.script(tool_call("exec_command", {"cmd": "echo one"},
                            rate_limits=_limits(80, reset_at=reset_at)),
                  tool_call("exec_command", {"cmd": "echo two"},
                            rate_limits=_limits(90, reset_at=reset_at)),
                  text("never asked for"))
    site = _plan_site(tmp_path, server.base_url)
    await _seed_windows(site, 70, 20, reset_at)

    done = await site.bothy("run", "work", "--subject", "w")

    assert done.code == 4, done.stderr
    outcome, run_id, _cost, _usd, reason = done.stdout.split(" ", 4)
    assert (outcome, reason) == (
        "budget_limit", f"primary window at 90% crossed the 85% ceiling ({resets})\n")
    assert _events(site, run_id)[-1] == ("run", "finished", "budget_limit")
    status = await site.bothy("status")
    assert "  primary 300 min window: 90% used, seen " in status.stdout
