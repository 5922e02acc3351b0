"""The plan gate (rule 1 on a ChatGPT plan): what runs out is a rate-limit window, not money.

``budget.mode: "plan"``. A run reserves ``plan_reserve_percent`` of every window before it
starts, in the same ``BEGIN IMMEDIATE`` transaction that reads the last windows seen and the
open reservations of other runs, so five processes racing for the last few percent cannot
all start. The gate always reads the latest windows plus every open reservation: the windows
are account-wide and shared with other clients, so a run's own share cannot be measured, and
its reservation is released when it ends (the change observed over the run is recorded when
it settles). A window seen above the ceiling during a run stops it (``budget_limit``).

Before any window is known (a fresh site), one run is admitted to learn them (audited
``plan window unknown``); runs arriving behind it wait for what it learns. If it ended having
reached the model and still nothing is known, the provider sends no windows and later runs
are refused at gate 'plan' (``window unknown``); ``bothy doctor`` fails that check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from bothy.clock import Clock, to_us
from bothy.config import BudgetConfig, Price
from bothy.engine.budget import Admitted, BudgetGate, Refused, Settlement, Ticket
from bothy.engine.prices import PriceTable
from bothy.engine.recovery import owner_alive
from bothy.engine.state import RunRow, StateDB
from bothy.engine.windows import Window, WindowStore

GATE = "plan"
_NO_PRICE = Price(input_per_mtok=Decimal(0), cached_input_per_mtok=Decimal(0),
                  output_per_mtok=Decimal(0))
_WAIT_POLL_S = 0.25
# A learner that ended so has talked to the model: if no window came, none will.
_TAUGHT_OUTCOMES = ("completed", "verified", "unverified", "timed_out", "token_limit",
                    "budget_limit", "turn_limit")
# A reservation is open while its run is, or while a crashed run's reservation is held.
_OPEN = ("(r.status IN ('queued', 'running') OR r.crashed = 1) AND r.expires_us > ?")
# What open runs hold reserved, in percent of the windows; the open runs learning them.
_RESERVED_PERCENT = ("SELECT SUM(p.percent) FROM plan_reservations p JOIN runs r USING (run_id)"
                     f" WHERE {_OPEN}")
_LEARNERS = ("SELECT r.* FROM plan_reservations p JOIN runs r USING (run_id)"
             f" WHERE p.learning = 1 AND r.crashed = 0 AND {_OPEN} ORDER BY r.seq")


@dataclass(frozen=True)
class _Wait:
    reason: str


@dataclass(frozen=True)
class Unknown:
    """No window known, and why (for ``bothy doctor``)."""

    refusing: bool
    reason: str


class PlanGate(BudgetGate):
    """Admission by the plan's rate-limit windows, shared through the state database."""

    reserves_dollars = False
    decides_at_once = False  # a run behind the learner waits in admit (recorded received)

    def __init__(
        self, db: StateDB, cfg: BudgetConfig, prices: PriceTable, *, clock: Clock
    ) -> None:
        super().__init__(db, cfg, prices, clock=clock)
        self._windows = WindowStore(db, clock=clock)
        self._zone = ZoneInfo(cfg.timezone)
        self.ceiling_percent = cfg.plan_ceiling_percent
        self.reserve_percent = cfg.plan_reserve_percent

    def price(self, model: str) -> Price | Refused:
        """Dollars mean nothing on a plan: a model without a price is allowed (and costs 0)."""
        return self._prices.lookup(model) or _NO_PRICE

    async def admit(
        self, ticket: Ticket, *, on_wait: Callable[[str], None] | None = None
    ) -> Admitted | Refused:
        """Reserve a share of every window, learn them first, or refuse with every figure."""
        said = None
        while True:
            decision = await self._try_admit(ticket)
            if not isinstance(decision, _Wait):
                return decision
            if on_wait is not None and decision.reason != said:
                on_wait(decision.reason)
                said = decision.reason
            await asyncio.sleep(_WAIT_POLL_S)

    async def _try_admit(self, ticket: Ticket) -> Admitted | Refused | _Wait:
        now = self._clock()
        now_us = to_us(now)
        async with self._db.transaction():
            windows = await self.windows(now)
            if not windows:
                return await self._learn(ticket, now_us)
            reserved = await self._db.scalar(_RESERVED_PERCENT, (now_us,))
            for window in windows.values():
                total = window.used_percent + reserved + self.reserve_percent
                if total > self.ceiling_percent:
                    return self._over_ceiling(window, reserved, total, now)
            await self._reserve(ticket, now_us, windows, learning=False)
        figures = {f"{name}_used_percent": str(window.used_percent)
                   for name, window in windows.items()}
        figures.update(reserved_percent=str(self.reserve_percent),
                       already_reserved_percent=str(reserved),
                       ceiling_percent=str(self.ceiling_percent))
        return Admitted(ticket.run_id, 0, 0, 0, 0, figures=figures)

    async def _learn(self, ticket: Ticket, now_us: int) -> Admitted | Refused | _Wait:
        """No window known: wait behind the run learning them, be that run, or refuse."""
        rows = await self._db.fetch_all(_LEARNERS, (now_us,))
        # A learner whose bothy died learns nothing: do not wait for its reservation to lapse.
        learner = next((row for row in map(RunRow.from_row, rows) if owner_alive(row)), None)
        if learner is not None:
            return _Wait(f"behind {learner.run_id}, which is learning the plan's"
                         " rate-limit windows")
        unknown = await self.unknown()
        if unknown is not None and unknown.refusing:
            return Refused(GATE, f"window unknown: {unknown.reason}",
                           {"window": "unknown"})
        await self._reserve(ticket, now_us, {}, learning=True)
        return Admitted(ticket.run_id, 0, 0, 0, 0, learning=True,
                        figures={"window": "unknown", "reserved_percent": "0",
                                 "ceiling_percent": str(self.ceiling_percent)})

    async def _reserve(
        self, ticket: Ticket, now_us: int, windows: dict[str, Window], *, learning: bool
    ) -> None:
        await self._insert_run(ticket, 0, now_us)
        primary, secondary = windows.get("primary"), windows.get("secondary")
        await self._db.execute(
            "INSERT INTO plan_reservations (run_id, percent, learning, primary_at_admit,"
            " secondary_at_admit) VALUES (?, ?, ?, ?, ?)",
            (ticket.run_id, 0 if learning else self.reserve_percent, int(learning),
             primary.used_percent if primary else None,
             secondary.used_percent if secondary else None),
        )

    async def windows(self, now: datetime | None = None) -> dict[str, Window]:
        """The windows as they stand now (those past their reset count as reset)."""
        moment = now or self._clock()
        return {name: window.current(moment)
                for name, window in (await self._windows.load()).items()}

    async def unknown(self) -> Unknown | None:
        """Why no window is known, or None when one is."""
        if await self._windows.load():
            return None
        taught = await self._db.fetch_one(
            "SELECT r.run_id, r.outcome FROM plan_reservations p JOIN runs r USING (run_id)"
            f" WHERE p.learning = 1 AND r.status = 'finished' AND r.outcome IN"
            f" ({', '.join('?' for _ in _TAUGHT_OUTCOMES)}) ORDER BY r.seq DESC LIMIT 1",
            _TAUGHT_OUTCOMES,
        )
        if taught is None:
            return Unknown(False, "no run has reported the plan's rate-limit windows yet (the"
                                  " next run is admitted to learn them)")
        return Unknown(True, f"{taught['run_id']} ended {taught['outcome']} and Codex reported"
                             " no rate-limit window: the provider sends none, so plan mode"
                             " cannot gate (use budget.mode \"api\")")

    async def observe(self, run_id: str, params: dict[str, Any]) -> str | None:
        """Keep the windows Codex reported; say why the run must stop if one crossed."""
        for window in await self._windows.record(run_id, params):
            if window.used_percent > self.ceiling_percent:
                return (f"{window.name} window at {window.used_percent}% crossed the"
                        f" {self.ceiling_percent}% ceiling ({self._resets(window)})")
        return None

    async def settle(
        self, run_id: str, *, outcome: str, reason: str | None, final_text: str | None
    ) -> Settlement:
        """Release the run's share; record the change in each window seen over the run."""
        settled = await super().settle(run_id, outcome=outcome, reason=reason,
                                       final_text=final_text)
        row = await self._db.fetch_one(
            "SELECT percent, primary_at_admit, secondary_at_admit FROM plan_reservations"
            " WHERE run_id = ?", (run_id,),
        )
        figures = {"released_percent": str(row["percent"] if row else 0)}
        for name, window in (await self.windows()).items():
            before = row[f"{name}_at_admit"] if row else None
            figures[f"{name}_used_percent"] = str(window.used_percent)
            if before is not None:
                figures[f"{name}_observed_change_percent"] = str(window.used_percent - before)
        return Settlement(run_id, settled.cost_micros, settled.reserved_micros,
                          settled.released_micros, figures=figures)

    def _over_ceiling(self, window: Window, reserved: int, total: int, now: datetime) -> Refused:
        figures = {
            "window": window.name,
            "would_reach_percent": str(total),
            "ceiling_percent": str(self.ceiling_percent),
            "used_percent": str(window.used_percent),
            "reserved_percent": str(reserved),
            "requested_percent": str(self.reserve_percent),
            "resets_at": window.resets_at.isoformat() if window.resets_at else "unknown",
        }
        message = (
            f"{window.name} window would reach {total}% against a{_an(self.ceiling_percent)}"
            f" {self.ceiling_percent}% ceiling ({window.used_percent}% used, {reserved}% already"
            f" reserved, {self.reserve_percent}% requested; {self._resets(window, now)})"
        )
        return Refused(GATE, message, figures)

    def _resets(self, window: Window, now: datetime | None = None) -> str:
        if window.resets_at is None:
            return "reset time unknown"
        local = window.resets_at.astimezone(self._zone)
        today = (now or self._clock()).astimezone(self._zone).date()
        shown = f"{local:%H:%M}" if local.date() == today else f"{local:%Y-%m-%d %H:%M}"
        return f"resets {shown} {local.tzname()}"


def _an(percent: int) -> str:
    """'an 85% ceiling', 'a 90% ceiling': the article of the number as it is read."""
    spoken = str(percent)
    return "n" if spoken.startswith("8") or spoken in ("11", "18") else ""
