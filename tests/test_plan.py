"""The plan gate (``budget.mode: "plan"``): admission by the plan's rate-limit windows.

In-process tests drive :class:`PlanGate` with an injected clock and the windows as Codex
reports them (``account/rateLimits/updated`` params); the cross-process proofs with the real
codex and the scripted model's ``x-codex-*`` headers are in ``tests/test_plan_runs.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from bothy.config import BudgetConfig
from bothy.engine.budget import Admitted, Refused, Ticket
from bothy.engine.plan import PlanGate
from bothy.engine.prices import PriceTable
from bothy.engine.procgroup import process_start_time
from bothy.engine.state import StateDB


class _Clock:
    """A clock a test moves by hand."""

    def __init__(self, iso: str) -> None:
        self.now = datetime.fromisoformat(iso)

    def __call__(self) -> datetime:
        return self.now

    def set(self, iso: str) -> None:
        self.now = datetime.fromisoformat(iso)


def _unix(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp())


def limits(primary: int | None, secondary: int | None = None, *,
           primary_resets: str = "2026-12-01T14:20:00+00:00",
           secondary_resets: str = "2026-12-05T09:00:00+00:00") -> dict[str, Any]:
    """``account/rateLimits/updated`` params as codex 0.171.0 sends them."""
    def window(used: int | None, minutes: int, resets: str) -> dict[str, Any] | None:
        if used is None:
            return None
        return {"usedPercent": used, "windowDurationMins": minutes, "resetsAt": _unix(resets)}

    return {"rateLimits": {"limitId": "codex", "limitName": None,
                           "primary": window(primary, 300, primary_resets),
                           "secondary": window(secondary, 10080, secondary_resets),
                           "credits": None, "planType": None}}


@asynccontextmanager
async def _gate(path: Path, clock: _Clock, **budget: Any) -> AsyncIterator[PlanGate]:
    cfg = BudgetConfig.model_validate({"mode": "plan", "plan_ceiling_percent": 85,
                                       "plan_reserve_percent": 2, **budget})
    async with StateDB.open(path) as db:
        yield PlanGate(db, cfg, PriceTable({}), clock=clock)


def _ticket(n: int, model: str | None = "unpriced-model") -> Ticket:
    return Ticket(f"run_{n}", f"lane:{n}", "test", 0, os.getpid(),
                  process_start_time(os.getpid()), model)


async def _seen(gate: PlanGate, params: dict[str, Any], run_id: str = "run_seen") -> None:
    """Windows seen by some run (one above the ceiling would stop that run: not ours)."""
    await gate.observe(run_id, params)


async def test_refusal_names_the_window_and_every_figure(tmp_path: Path) -> None:
    """At 78% used, three 2% reservations fit under 85% and the fourth is refused in full."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        await _seen(gate, limits(78, 40))
        decisions = [await gate.admit(_ticket(n)) for n in range(4)]
        assert [type(d) for d in decisions] == [Admitted, Admitted, Admitted, Refused]
        refused = decisions[3]
        assert isinstance(refused, Refused)
        assert refused.sentence() == (
            "refused at gate 'plan': primary window would reach 86% against an 85% ceiling"
            " (78% used, 6% already reserved, 2% requested; resets 14:20 UTC)")
        assert refused.figures == {
            "window": "primary", "would_reach_percent": "86", "ceiling_percent": "85",
            "used_percent": "78", "reserved_percent": "6", "requested_percent": "2",
            "resets_at": "2026-12-01T14:20:00+00:00"}


async def test_secondary_window_refuses_too_with_its_reset_day(tmp_path: Path) -> None:
    """The weekly window is gated like the primary; a reset on another day shows its date."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock, plan_ceiling_percent=90) as gate:
        await _seen(gate, limits(10, 89))
        refused = await gate.admit(_ticket(1))
        assert isinstance(refused, Refused)
        assert refused.message == (
            "secondary window would reach 91% against a 90% ceiling (89% used, 0% already"
            " reserved, 2% requested; resets 2026-12-05 09:00 UTC)")


async def test_a_finished_run_releases_its_share_and_settles_at_the_observed_change(
    tmp_path: Path,
) -> None:
    """A run's reservation is released when it ends; its settlement names the change seen."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        await _seen(gate, limits(81, 40))
        first = await gate.admit(_ticket(1))
        assert isinstance(first, Admitted)
        assert first.figures == {"primary_used_percent": "81", "secondary_used_percent": "40",
                                 "reserved_percent": "2", "already_reserved_percent": "0",
                                 "ceiling_percent": "85"}
        assert isinstance(await gate.admit(_ticket(2)), Admitted)  # 81 + 2 + 2 = 85
        assert isinstance(await gate.admit(_ticket(3)), Refused)
        await _seen(gate, limits(81, 43), "run_1")
        settled = await gate.settle("run_1", outcome="completed", reason=None, final_text="")
        assert settled.figures == {
            "released_percent": "2", "primary_used_percent": "81",
            "primary_observed_change_percent": "0", "secondary_used_percent": "43",
            "secondary_observed_change_percent": "3"}
        assert isinstance(await gate.admit(_ticket(3)), Admitted)  # 81 + 2 (run_2) + 2 = 85
        assert isinstance(await gate.admit(_ticket(4)), Refused)


async def test_a_window_past_its_reset_counts_as_reset(tmp_path: Path) -> None:
    """A window last seen at 99% admits again once its reset time has passed."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        await _seen(gate, limits(99, 40))
        assert isinstance(await gate.admit(_ticket(1)), Refused)
        clock.set("2026-12-01T14:20:00+00:00")
        admitted = await gate.admit(_ticket(2))
        assert isinstance(admitted, Admitted)
        assert admitted.figures["primary_used_percent"] == "0"


async def test_a_window_seen_crossing_the_ceiling_says_why_the_run_stops(tmp_path: Path) -> None:
    """An update above the ceiling during a run is the reason it is stopped."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        assert await gate.observe("run_1", limits(85, 40)) is None  # at the ceiling: still fine
        assert await gate.observe("run_1", limits(87, 40)) == (
            "primary window at 87% crossed the 85% ceiling (resets 14:20 UTC)")


async def test_a_fresh_site_admits_one_run_to_learn_and_the_next_waits_for_it(
    tmp_path: Path,
) -> None:
    """No window known: the first run is admitted to learn; the second waits, then is gated."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        learner = await gate.admit(_ticket(1))
        assert isinstance(learner, Admitted) and learner.learning
        waits: list[str] = []
        waiting = asyncio.Event()

        def on_wait(reason: str) -> None:
            waits.append(reason)
            waiting.set()

        second = asyncio.create_task(gate.admit(_ticket(2), on_wait=on_wait))
        async with asyncio.timeout(5):
            await waiting.wait()
        assert waits == ["behind run_1, which is learning the plan's rate-limit windows"]
        assert not second.done()
        await _seen(gate, limits(84, 40), "run_1")
        async with asyncio.timeout(5):
            decision = await second
        assert isinstance(decision, Refused)  # 84 + 0 (the learner reserved nothing) + 2 > 85
        assert decision.figures["would_reach_percent"] == "86"


async def test_no_window_after_the_learner_refuses_later_runs(tmp_path: Path) -> None:
    """A learner that talked to the model and learnt nothing: later runs are refused."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        assert (await gate.unknown()) is not None
        assert isinstance(await gate.admit(_ticket(1)), Admitted)
        await gate.settle("run_1", outcome="failed", reason="boom", final_text="")
        again = await gate.admit(_ticket(2))  # a failed learner taught nothing: learn again
        assert isinstance(again, Admitted) and again.learning
        await gate.settle("run_2", outcome="completed", reason=None, final_text="")
        refused = await gate.admit(_ticket(3))
        assert isinstance(refused, Refused)
        assert refused.sentence() == (
            "refused at gate 'plan': window unknown: run_2 ended completed and Codex reported no"
            " rate-limit window: the provider sends none, so plan mode cannot gate (use"
            " budget.mode \"api\")")
        unknown = await gate.unknown()
        assert unknown is not None and unknown.refusing


async def test_windows_survive_a_restart(tmp_path: Path) -> None:
    """The windows are kept in state with the time they were seen."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        await _seen(gate, limits(30, None))
        await _seen(gate, limits(None, 12))  # sparse: the primary is kept
    clock.set("2026-12-01T13:05:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        windows = await gate.windows()
        assert {name: w.used_percent for name, w in windows.items()} == {
            "primary": 30, "secondary": 12}
        assert windows["primary"].seen_at == datetime.fromisoformat("2026-12-01T13:02:00+00:00")


async def test_a_learner_whose_bothy_died_is_not_waited_for(tmp_path: Path) -> None:
    """A learner left by a dead process blocks nobody: the next run is admitted to learn."""
    clock = _Clock("2026-12-01T13:02:00+00:00")
    async with _gate(tmp_path / "bothy.sqlite3", clock) as gate:
        dead = Ticket("run_dead", "lane:dead", "test", 0, os.getpid(), "not-this-process", None)
        assert isinstance(await gate.admit(dead), Admitted)
        async with asyncio.timeout(5):
            again = await gate.admit(_ticket(2))
        assert isinstance(again, Admitted) and again.learning
