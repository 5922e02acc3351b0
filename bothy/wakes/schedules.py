"""Schedules: cron wakes kept in the state database and fired inside ``bothy serve`` (SPEC §5).

A schedule is a name, a crontab expression read in the budget's time zone (the day a fire
belongs to is the day its spend counts against) and what it runs: a prompt, a written
procedure (``--sop``), or the heartbeat (the standing checklist, answered ``NO_REPLY`` when
nothing needs attention). It is added with ``bothy schedule add`` and kept in the
``schedules`` table, so it survives restarts.

Firing them inside ``bothy serve`` is :mod:`bothy.wakes.schedule_runner`'s; this module holds
what a schedule is, the table that keeps them (:class:`ScheduleStore`), cron arithmetic, and
the run a fire asks for (:func:`schedule_request`).

Day of week: APScheduler 3 numbers days from Monday = 0 where crontab counts from Sunday = 0
(https://github.com/agronholm/apscheduler/issues/286), so a numeric day of week would run on
the wrong day without a word. Only names are accepted there (``mon-fri``, ``sun``).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from bothy.clock import Clock, from_us, to_us
from bothy.config import Config
from bothy.engine.checklist import Checklist
from bothy.engine.run import RunRequest
from bothy.engine.state import StateDB
from bothy.errors import UsageError
from bothy.home import BothyHome
from bothy.sops import SopLibrary

if TYPE_CHECKING:
    from bothy.engine.verification import Verification

SOURCE = "schedule"
KINDS = ("prompt", "sop", "heartbeat", "dream")
HEARTBEAT_INSTRUCTION = "If nothing needs attention, reply exactly NO_REPLY."
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")
_ONE_US = timedelta(microseconds=1)


@dataclass(frozen=True)
class Schedule:
    """One row of the ``schedules`` table. Times are microseconds since the epoch (UTC)."""

    name: str
    cron: str
    kind: str  # one of KINDS
    prompt: str | None = None
    sop: str | None = None
    profile: str | None = None
    verify_argv: list[str] | None = None
    verify_regex: str | None = None
    max_usd_micros: int | None = None  # None: budget.per_run_usd
    created_us: int = 0
    last_fire_us: int | None = None
    next_fire_us: int | None = None  # kept for `bothy status`, which cannot evaluate cron
    ref: str | None = None  # its runs' task in Cairn (docs/CAIRN.md)
    report_to: str | None = None  # where its findings go (slack:C0OPS); else the alert channel
    preflight_argv: list[str] | None = None  # a heartbeat's cheap check before the model

    @classmethod
    def from_row(cls, row: Any) -> Schedule:
        argv = row["verify_argv"]
        preflight = row["preflight_argv"]
        return cls(
            name=row["name"], cron=row["cron"], kind=row["kind"], prompt=row["prompt"],
            sop=row["sop"], profile=row["profile"],
            verify_argv=json.loads(argv) if argv is not None else None,
            verify_regex=row["verify_regex"], max_usd_micros=row["max_usd_micros"],
            created_us=row["created_us"], last_fire_us=row["last_fire_us"],
            next_fire_us=row["next_fire_us"], ref=row["ref"], report_to=row["report_to"],
            preflight_argv=json.loads(preflight) if preflight is not None else None,
        )

    def snapshot(self) -> bytes:
        """The body of a fire's wake: the schedule as it was when it fired."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_snapshot(cls, body: bytes) -> Schedule:
        """Read back :meth:`snapshot`; ValueError if ``body`` is not one."""
        try:
            document = json.loads(body)
            # A field added since the snapshot was taken (ref, report_to) takes its default.
            return cls(**{name: document[name] for name in cls.__dataclass_fields__
                          if name in document})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a schedule snapshot ({exc!r})") from exc

    @property
    def subject(self) -> str:
        """The lane its runs take: fires of one schedule never overlap."""
        return f"schedule:{self.name}"

    @property
    def what(self) -> str:
        """``heartbeat``, ``sop:NAME`` or ``prompt``, for listings."""
        return f"sop:{self.sop}" if self.kind == "sop" else self.kind

    def verification(self) -> Verification | None:
        if self.verify_argv is None and self.verify_regex is None:
            return None
        from bothy.engine.verification import Verification  # (loaded by schedules that verify)

        return Verification(argv=self.verify_argv, regex=self.verify_regex)


def schedule_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a schedule, or None."""
    if _NAME.match(name):
        return None
    return (f"{name!r} is not a schedule name: use up to 48 letters, digits, '-' or '_',"
            " starting with a letter or digit (e.g. nightly-backup)")


def cron_trigger(cron: str, timezone: str) -> Any:
    """APScheduler's trigger for the crontab expression ``cron`` in ``timezone``.

    UsageError, naming the expression and the rule, if it is not one Bothy accepts.
    """
    fields = cron.split()
    example = "five fields, minute hour day-of-month month day-of-week, e.g. '0 3 * * *'"
    if len(fields) != 5:
        raise UsageError(f"--cron {cron!r} has {len(fields)} fields; expected {example}")
    if any(ch.isdigit() for ch in fields[4]):
        raise UsageError(
            f"--cron {cron!r}: write the day of week as names (mon-fri, sun), not numbers:"
            " crontab counts 0 as Sunday but APScheduler as Monday, so a number would run on"
            " the wrong day"
        )
    # Imported here: `bothy serve` on a site without schedules never loads APScheduler.
    # APScheduler 3 ships no type hints (no py.typed): its objects are Any here.
    from apscheduler.triggers.cron import CronTrigger  # type: ignore[import-untyped]

    try:
        return CronTrigger.from_crontab(" ".join(fields), timezone=ZoneInfo(timezone))
    except ValueError as exc:
        raise UsageError(f"--cron {cron!r} is not a valid crontab expression ({exc});"
                         f" expected {example}") from None


def next_fire(trigger: Any, now: datetime) -> datetime | None:
    """The first slot after ``now``; None if the expression never fires again."""
    found: datetime | None = trigger.get_next_fire_time(None, now + _ONE_US)
    return found


def latest_fire(trigger: Any, *, after: datetime, now: datetime) -> datetime | None:
    """The last slot in (``after``, ``now``]; None if there is none.

    Walks slot by slot from ``after``: callers bound the window (by the grace) so the walk is
    short — at most one slot per minute of the window.
    """
    latest = None
    slot = next_fire(trigger, after)
    while slot is not None and slot <= now:
        latest = slot
        slot = next_fire(trigger, slot)
    return latest


def due_fire(schedule: Schedule, trigger: Any, *, now: datetime, grace_s: int) -> datetime | None:
    """The one slot of ``schedule`` to enqueue now, or None (the missed-fire rule above)."""
    floor_us = max(schedule.last_fire_us or 0, schedule.created_us,
                   to_us(now) - grace_s * 1_000_000)
    return latest_fire(trigger, after=from_us(floor_us), now=now)


def skipped_fire(
    schedule: Schedule, trigger: Any, *, now: datetime, grace_s: int
) -> datetime | None:
    """The first slot missed by more than the grace (not run), or None."""
    floor_us = max(schedule.last_fire_us or 0, schedule.created_us)
    slot = next_fire(trigger, from_us(floor_us))
    if slot is not None and to_us(slot) <= to_us(now) - grace_s * 1_000_000:
        return slot
    return None


class ScheduleStore:
    """The ``schedules`` table. Cron is read in ``timezone`` (the budget's)."""

    def __init__(self, db: StateDB, *, timezone: str, clock: Clock) -> None:
        self._db = db
        self.timezone = timezone
        self._clock = clock

    async def add(self, schedule: Schedule) -> Schedule | None:
        """Insert ``schedule`` (created now, its next fire computed); None if the name is taken.

        UsageError if its name or cron is not acceptable.
        """
        if problem := schedule_name_problem(schedule.name):
            raise UsageError(problem)
        if schedule.kind not in KINDS:
            raise ValueError(f"a schedule's kind is one of {', '.join(KINDS)}, not"
                             f" {schedule.kind!r}")
        trigger = cron_trigger(schedule.cron, self.timezone)
        now = self._clock()
        upcoming = next_fire(trigger, now)
        argv = json.dumps(schedule.verify_argv) if schedule.verify_argv is not None else None
        preflight = (json.dumps(schedule.preflight_argv)
                     if schedule.preflight_argv is not None else None)
        async with self._db.transaction():
            changed = await self._db.execute(
                "INSERT INTO schedules (name, cron, kind, prompt, sop, profile, verify_argv,"
                " verify_regex, max_usd_micros, created_us, last_fire_us, next_fire_us, ref,"
                " report_to, preflight_argv)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, ?)"
                " ON CONFLICT (name) DO NOTHING",
                (schedule.name, " ".join(schedule.cron.split()), schedule.kind, schedule.prompt,
                 schedule.sop, schedule.profile, argv, schedule.verify_regex,
                 schedule.max_usd_micros, to_us(now),
                 to_us(upcoming) if upcoming is not None else None, schedule.ref,
                 schedule.report_to, preflight),
            )
        return await self.get(schedule.name) if changed == 1 else None

    async def remove(self, name: str) -> bool:
        """Delete schedule ``name``; False if there was none. Wakes already queued still run."""
        async with self._db.transaction():
            changed = await self._db.execute("DELETE FROM schedules WHERE name = ?", (name,))
        return changed == 1

    async def get(self, name: str) -> Schedule | None:
        row = await self._db.fetch_one("SELECT * FROM schedules WHERE name = ?", (name,))
        return Schedule.from_row(row) if row is not None else None

    async def all(self) -> list[Schedule]:
        """Every schedule, by name."""
        rows = await self._db.fetch_all("SELECT * FROM schedules ORDER BY name")
        return [Schedule.from_row(row) for row in rows]

    async def fired(self, name: str, fire_us: int, next_fire_us: int | None) -> None:
        """Record that the slot at ``fire_us`` is in the inbox (the mark never moves back)."""
        async with self._db.transaction():
            await self._db.execute(
                "UPDATE schedules SET last_fire_us = MAX(COALESCE(last_fire_us, 0), ?),"
                " next_fire_us = ? WHERE name = ?",
                (fire_us, next_fire_us, name),
            )

    async def preflight_seen(self, name: str) -> str | None:
        """The hash of the output the preflight of ``name`` gave at its last fire, if any."""
        row = await self._db.fetch_one(
            "SELECT preflight_sha256 FROM schedules WHERE name = ?", (name,))
        return str(row["preflight_sha256"]) if row is not None and row["preflight_sha256"] else None

    async def set_preflight_seen(self, name: str, sha256: str | None) -> None:
        """Keep what this fire's preflight gave, for the next fire to compare with."""
        async with self._db.transaction():
            await self._db.execute(
                "UPDATE schedules SET preflight_sha256 = ? WHERE name = ?", (sha256, name))

    async def set_next_fire(self, name: str, next_fire_us: int | None) -> None:
        async with self._db.transaction():
            await self._db.execute("UPDATE schedules SET next_fire_us = ? WHERE name = ?",
                                   (next_fire_us, name))


@dataclass(frozen=True)
class Unrunnable:
    """A fired schedule that cannot become a run (its SOP or profile is gone), and why."""

    reason: str


async def schedule_request(
    schedule: Schedule,
    cfg: Config,
    home: BothyHome,
    *,
    run_id: str,
    details: dict[str, Any],
) -> RunRequest | Unrunnable:
    """The run a fire of ``schedule`` asks for: operator-written, so trusted; nobody to ask."""
    if schedule.profile is not None and schedule.profile not in cfg.profiles:
        return Unrunnable(f"its profile {schedule.profile!r} is no longer configured")
    if schedule.kind == "dream" and (schedule.profile is None
                                     or cfg.profiles[schedule.profile].memory is None):
        return Unrunnable(f"its profile {schedule.profile!r} no longer has memory on")
    prompt = await _prompt(schedule, home)
    if isinstance(prompt, Unrunnable):
        return prompt
    return RunRequest.for_wake(
        cfg, prompt=prompt, subject=schedule.subject, source=SOURCE, run_id=run_id,
        details={"schedule": schedule.name, "kind": schedule.kind, **details},
        # Capped there: a per_run_usd lowered since the schedule was added tightens it too.
        asked_usd_micros=schedule.max_usd_micros,
        profile=schedule.profile,
        trusted=True,  # the operator wrote it
        can_hold=False,  # nobody is in a thread to answer: questions decline at once
        verify=schedule.verification(),
        ref=schedule.ref,
        dream=schedule.kind == "dream",
    )


async def _prompt(schedule: Schedule, home: BothyHome) -> str | Unrunnable:
    if schedule.kind == "heartbeat":
        checklist = await asyncio.to_thread(Checklist(home.checklist_path).render)
        return (
            f"Scheduled heartbeat ({schedule.name}). Look over the standing checklist of this"
            " site and act on anything that needs attention.\n\n"
            f"Standing checklist:\n{checklist or '(the checklist is empty)'}\n\n"
            f"{HEARTBEAT_INSTRUCTION}"
        )
    if schedule.kind == "dream":
        # The memory session writes the dream's prompt from the files as the run begins.
        return f"Scheduled memory consolidation ({schedule.name}) of profile {schedule.profile}."
    if schedule.kind == "sop":
        assert schedule.sop is not None
        text = await asyncio.to_thread(SopLibrary(home.sops_dir).read, schedule.sop)
        if text is None:
            return Unrunnable(f"its SOP {schedule.sop!r} no longer exists in {home.sops_dir}")
        return (f"Scheduled job {schedule.name}: follow this written procedure"
                f" (SOP {schedule.sop}).\n\n{text}")
    assert schedule.prompt is not None
    return schedule.prompt
