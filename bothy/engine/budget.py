"""The budget gate (rule 1): budget is reserved, not measured.

A run reserves its worst case (``per_run_usd`` or a smaller ``--max-usd``) before it starts,
in one writing statement that reads what is already used and reserved under the write lock
(as a ``BEGIN IMMEDIATE`` transaction would), so five processes that each see 40 of 50 used
cannot all start; a run that cannot fit is refused on a committed snapshot of those figures,
reserving nothing (:meth:`BudgetGate.admit`). While the run works, measured
spend fills the reservation from the inside (a ledger row per increment, dated the day it was
measured); at the end the run settles at what it really cost and releases the rest. A run
whose owner died (``crashed``) keeps its reservation, since nobody knows what its worker
spent after the last measurement, until ``expires_us``; the owner refreshes that while
it lives, so a crashed run's reservation lapses ``reservation_expiry_s`` after its last sign
of life. All money is integer micro-dollars.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from bothy.clock import Clock, to_us
from bothy.config import BudgetConfig, Price
from bothy.engine.prices import PriceTable
from bothy.engine.state import StateDB
from bothy.engine.windows import WindowStore
from bothy.money import format_usd, usd_to_micros


@dataclass(frozen=True)
class Ticket:
    """What a wake asks of the gates."""

    run_id: str
    subject: str
    source: str
    requested_micros: int
    owner_pid: int
    owner_start: str | None
    model: str | None = None


@dataclass(frozen=True)
class Admitted:
    """The run holds a reservation and waits in its lane."""

    run_id: str
    reserved_micros: int
    used_micros: int
    already_reserved_micros: int
    ceiling_micros: int
    # Set by the plan gate: what the audit record shows instead of the dollar figures.
    figures: dict[str, str] = field(default_factory=dict)
    learning: bool = False  # admitted, with no window known, to learn the plan's windows


@dataclass(frozen=True)
class Refused:
    """A gate said no. ``message`` carries every figure the operator needs."""

    gate: str
    message: str
    figures: dict[str, str]

    def sentence(self) -> str:
        return f"refused at gate '{self.gate}': {self.message}"


@dataclass(frozen=True)
class Settlement:
    run_id: str
    cost_micros: int
    reserved_micros: int
    released_micros: int
    figures: dict[str, str] = field(default_factory=dict)  # the plan gate's, as above


@dataclass(frozen=True)
class DaySummary:
    day: str
    used_micros: int
    reserved_micros: int
    ceiling_micros: int


class BudgetGate:
    """Admission by money, shared by every Bothy process through the state database."""

    # A run's measured cost is held against its dollar reservation (not in plan mode).
    reserves_dollars = True
    # ``admit`` answers without waiting: a wake's `wake received` can be recorded with the
    # decision, in its commit (the plan gate may wait behind its learner: not there).
    decides_at_once = True

    def __init__(
        self, db: StateDB, cfg: BudgetConfig, prices: PriceTable, *, clock: Clock
    ) -> None:
        self._db = db
        self._cfg = cfg
        self._prices = prices
        self._clock = clock
        self._zone = ZoneInfo(cfg.timezone)
        self.ceiling_micros = usd_to_micros(cfg.per_day_usd)
        self.per_run_micros = usd_to_micros(cfg.per_run_usd)

    def day_of(self, moment: datetime) -> str:
        """The budget day a moment falls in (``budget.timezone``, UTC by default)."""
        return moment.astimezone(self._zone).date().isoformat()

    def price(self, model: str) -> Price | Refused:
        """The model's price, or a refusal: a model without a price fails closed."""
        price = self._prices.lookup(model)
        if price is not None:
            return price
        return Refused(
            gate="budget",
            message=(
                f"no price for model '{model}' in budget.prices (add input_per_mtok, "
                "cached_input_per_mtok and output_per_mtok for it)"
            ),
            figures={"model": model},
        )

    async def admit(
        self, ticket: Ticket, *, on_wait: Callable[[str], None] | None = None
    ) -> Admitted | Refused:
        """Reserve the ticket's worst case, or refuse with every figure.

        Two round trips to the database, neither holding it between them (a ``bothy
        serve``'s intake shares the connection), unless the figures moved: the day's
        figures, read in one statement as one committed snapshot, refuse at once a ticket
        they cannot hold; otherwise one writing statement inserts the run only if those
        figures still stand and the ticket fits (it takes the write lock before it reads, as
        BEGIN IMMEDIATE would, so two processes can never both pass a ceiling they together
        exceed). A refusal needs no lock: it reserves nothing, and its figures are a moment
        at which the ticket did not fit. If the figures moved in between (another run
        admitted, spent or settled), the decision is taken again in one ``BEGIN IMMEDIATE``
        transaction. An admission cancelled once its statement has run keeps its row: a
        queued run that no record names, whose reservation the sweep of a dead owner's runs
        releases.

        ``on_wait`` is told why admission waits, when it does (the plan gate's learner).
        """
        if ticket.model is not None and isinstance(price := self.price(ticket.model), Refused):
            return price
        now = self._clock()
        summary = await self._snapshot(now)
        total = summary.used_micros + summary.reserved_micros + ticket.requested_micros
        if total > self.ceiling_micros:
            return _over_ceiling(summary, ticket.requested_micros, total)
        if not await self._insert_if_unchanged(ticket, summary, to_us(now)):
            return await self._admit_in_transaction(ticket, now)
        return self._admitted(ticket, summary)

    async def _admit_in_transaction(self, ticket: Ticket, now: datetime) -> Admitted | Refused:
        """The decision in one BEGIN IMMEDIATE transaction: read, then reserve or refuse."""
        async with self._db.transaction():
            summary = await self._summary(now)
            total = summary.used_micros + summary.reserved_micros + ticket.requested_micros
            if total > self.ceiling_micros:
                return _over_ceiling(summary, ticket.requested_micros, total)
            await self._insert_run(ticket, ticket.requested_micros, to_us(now))
        return self._admitted(ticket, summary)

    def _admitted(self, ticket: Ticket, summary: DaySummary) -> Admitted:
        return Admitted(
            run_id=ticket.run_id,
            reserved_micros=ticket.requested_micros,
            used_micros=summary.used_micros,
            already_reserved_micros=summary.reserved_micros,
            ceiling_micros=self.ceiling_micros,
        )

    async def _insert_if_unchanged(self, ticket: Ticket, seen: DaySummary, now_us: int) -> bool:
        """The run's row, queued, in one statement that inserts it only while the day's
        figures are still ``seen`` and the ticket fits under the ceiling; whether it did."""
        rows = await self._db.atomic(
            "INSERT INTO runs (run_id, subject, source, status, reserved_micros, model,"
            " admitted_us, expires_us, owner_pid, owner_start)"
            f" SELECT ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ? FROM ({_FIGURES}) AS day"
            " WHERE day.used = ? AND day.reserved = ? AND day.used + day.reserved + ? <= ?"
            " RETURNING run_id",
            (
                ticket.run_id,
                ticket.subject,
                ticket.source,
                ticket.requested_micros,
                ticket.model,
                now_us,
                now_us + self._cfg.reservation_expiry_s * 1_000_000,
                ticket.owner_pid,
                ticket.owner_start,
                seen.day,
                now_us,
                seen.used_micros,
                seen.reserved_micros,
                ticket.requested_micros,
                self.ceiling_micros,
            ),
        )
        return len(rows) == 1

    async def _insert_run(self, ticket: Ticket, reserved_micros: int, now_us: int) -> None:
        """The run's row, queued (call inside the admitting transaction)."""
        await self._db.execute(
            "INSERT INTO runs (run_id, subject, source, status, reserved_micros, model,"
            " admitted_us, expires_us, owner_pid, owner_start)"
            " VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
            (
                ticket.run_id,
                ticket.subject,
                ticket.source,
                reserved_micros,
                ticket.model,
                now_us,
                now_us + self._cfg.reservation_expiry_s * 1_000_000,
                ticket.owner_pid,
                ticket.owner_start,
            ),
        )

    async def observe(self, run_id: str, params: dict[str, Any]) -> str | None:
        """Codex reported rate limits (``account/rateLimits/updated``): keep the windows.

        Return why the run must stop, if it must; in mode 'api' the windows are only kept
        (``bothy status`` shows them) and never stop a run.
        """
        await WindowStore(self._db, clock=self._clock).record(run_id, params)
        return None

    async def fill(self, run_id: str, cost_micros: int, tokens: int) -> int:
        """Record the run's measured cost so far; return it. Increments land on today."""
        now = self._clock()
        async with self._db.transaction():
            spent = await self._db.scalar(
                "SELECT spent_micros FROM runs WHERE run_id = ?", (run_id,)
            )
            delta = cost_micros - spent
            if delta > 0:
                await self._db.execute(
                    "INSERT INTO spend (run_id, day, micros, at_us) VALUES (?, ?, ?, ?)",
                    (run_id, self.day_of(now), delta, to_us(now)),
                )
            await self._db.execute(
                "UPDATE runs SET spent_micros = MAX(spent_micros, ?), tokens = ?"
                " WHERE run_id = ?",
                (cost_micros, tokens, run_id),
            )
        return max(spent, cost_micros)

    async def refresh(self, run_id: str) -> None:
        """The owner is alive: push the reservation's expiry forward."""
        expires_us = to_us(self._clock()) + self._cfg.reservation_expiry_s * 1_000_000
        await self._db.atomic(
            "UPDATE runs SET expires_us = ? WHERE run_id = ? AND status != 'finished'",
            (expires_us, run_id),
        )

    async def settle(
        self, run_id: str, *, outcome: str, reason: str | None, final_text: str | None
    ) -> Settlement:
        """Close the run at what it really cost and release the rest of its reservation."""
        now_us = to_us(self._clock())
        async with self._db.transaction():
            row = await self._db.fetch_one(
                "SELECT reserved_micros, spent_micros FROM runs WHERE run_id = ?", (run_id,)
            )
            await self._db.execute(
                "UPDATE runs SET status = 'finished', outcome = ?, reason = ?, final_text = ?,"
                " finished_us = ? WHERE run_id = ?",
                (outcome, reason, final_text, now_us, run_id),
            )
        reserved = int(row["reserved_micros"]) if row else 0
        spent = int(row["spent_micros"]) if row else 0
        return Settlement(run_id, spent, reserved, max(reserved - spent, 0))

    async def today(self) -> DaySummary:
        return await self._summary(self._clock())

    async def _summary(self, now: datetime) -> DaySummary:
        """The day's figures, read on the connection as it stands (inside a transaction of
        the caller's, the transaction's view)."""
        day = self.day_of(now)
        row = await self._db.fetch_one(_FIGURES, (day, to_us(now)))
        return self._day_summary(day, row)

    async def _snapshot(self, now: datetime) -> DaySummary:
        """The day's figures as one committed snapshot, read in a turn of the connection's
        own (never inside another coroutine's transaction): one round trip."""
        day = self.day_of(now)
        rows = await self._db.atomic(_FIGURES, (day, to_us(now)))
        return self._day_summary(day, rows[0] if rows else None)

    def _day_summary(self, day: str, row: sqlite3.Row | None) -> DaySummary:
        used = int(row["used"]) if row is not None else 0
        reserved = int(row["reserved"]) if row is not None else 0
        return DaySummary(day, used, reserved, self.ceiling_micros)


# What a day has used and what open runs hold reserved, in one statement (one snapshot);
# parameters: the day, now in microseconds.
_FIGURES = (
    "SELECT COALESCE((SELECT SUM(micros) FROM spend WHERE day = ?), 0) AS used,"
    " COALESCE((SELECT SUM(MAX(reserved_micros - spent_micros, 0)) FROM runs"
    " WHERE (status IN ('queued', 'running') OR crashed = 1) AND expires_us > ?), 0)"
    " AS reserved"
)


def _over_ceiling(summary: DaySummary, requested: int, total: int) -> Refused:
    figures = {
        "would_reach_usd": format_usd(total),
        "ceiling_usd": format_usd(summary.ceiling_micros),
        "used_usd": format_usd(summary.used_micros),
        "reserved_usd": format_usd(summary.reserved_micros),
        "requested_usd": format_usd(requested),
    }
    message = (
        f"would reach {figures['would_reach_usd']} usd against a {figures['ceiling_usd']}"
        f" ceiling ({figures['used_usd']} used, {figures['reserved_usd']} already reserved,"
        f" {figures['requested_usd']} requested)"
    )
    return Refused(gate="budget", message=message, figures=figures)


def budget_gate(
    db: StateDB, cfg: BudgetConfig, prices: PriceTable, *, clock: Clock
) -> BudgetGate:
    """The gate of ``budget.mode``: dollars ('api') or rate-limit windows ('plan')."""
    if cfg.mode == "plan":
        from bothy.engine.plan import PlanGate  # (only a plan-mode site loads it; it imports us)

        return PlanGate(db, cfg, prices, clock=clock)
    return BudgetGate(db, cfg, prices, clock=clock)
