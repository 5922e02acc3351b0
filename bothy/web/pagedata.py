"""What each page shows, read from the site's state: plain values for the templates.

Synchronous on purpose (the site calls it in a worker thread, off the event loop): the state
database is read with the standard library's ``sqlite3``, read-only, as ``bothy status`` reads
it, and the status document is ``bothy status --json``'s own (:func:`bothy.status.collect_status`,
its one owner). A run's records are ``bothy audit --run``'s (read through the register's
run-id index, ``RunIndex``), its spans ``bothy trace``'s (:func:`bothy.trace.build_spans`).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from bothy.clock import from_us, to_us
from bothy.engine.run import Outcome
from bothy.home import BothyHome
from bothy.money import format_usd
from bothy.status import collect_status, connection_line, status_view
from bothy.trace import build_spans
from bothy.web.charts import plan_chart, spend_chart, waterfall
from bothy.web.register import RegisterView

if TYPE_CHECKING:
    from bothy.engine.audit import AuditRecord

__all__ = ["FILTERS", "BadFilter", "PageData", "RunFilter"]

RUNS_PER_PAGE = 100
_ALERTS_SHOWN = 10
_SPEND_BUCKET_US = 300 * 1_000_000
_LANE_MAX_CHARS = 200
# What a run's "outcome" may be filtered on: how it ended, or that it has not yet.
FILTERS = ("queued", "running", *(outcome.value for outcome in Outcome))


@dataclass(frozen=True)
class BadFilter:
    """A query string the runs page cannot use: what was wrong and what would do."""

    message: str


@dataclass(frozen=True)
class RunFilter:
    """Which runs the runs page lists: an outcome (or queued, running), a lane, older than."""

    outcome: str | None = None
    lane: str | None = None
    before: int | None = None  # show runs older than this seq (the "older" link)

    @classmethod
    def parse(cls, query: dict[str, str]) -> RunFilter | BadFilter:
        """From ``?outcome=&lane=&before=``; empty values mean no filter."""
        outcome = query.get("outcome") or None
        if outcome is not None and outcome not in FILTERS:
            return BadFilter(f"outcome {outcome[:40]!r} is not one of: {', '.join(FILTERS)}")
        lane = query.get("lane") or None
        if lane is not None and len(lane) > _LANE_MAX_CHARS:
            return BadFilter(f"lane is longer than {_LANE_MAX_CHARS} characters")
        before_text = query.get("before") or None
        before = None
        if before_text is not None:
            if not before_text.isdigit() or len(before_text) > 18:
                return BadFilter(f"before {before_text[:40]!r} is not a run's number")
            before = int(before_text)
        return cls(outcome, lane, before)

    def query(self, **changes: object) -> str:
        """This filter as a query string, with ``changes`` applied (for links)."""
        from urllib.parse import urlencode

        values = {"outcome": self.outcome, "lane": self.lane, "before": self.before, **changes}
        return urlencode({k: v for k, v in values.items() if v is not None})


class PageData:
    """The figures of every page, for one site."""

    def __init__(self, home: BothyHome, *, started_at: datetime) -> None:
        self._home = home
        self._started_at = started_at
        self._register = RegisterView(home.audit_path)

    # -- the overview ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``bothy status --json``'s document, exactly."""
        return collect_status(self._home, status_view(self._home))

    def overview(self, now: datetime) -> dict[str, Any]:
        status = self.status()
        zone = ZoneInfo(status["timezone"])
        day_start, day_end = _day_bounds(status["day"], zone)
        register = self._register.state()
        page: dict[str, Any] = {
            "status": status,
            "uptime": _elapsed(now - self._started_at),
            "chat_lines": [connection_line(name, entry)  # `bothy status`'s own wording
                           for name, entry in status.get("chat_connections", {}).items()],
            "lanes": _lanes(status),
            "spend_chart": None, "plan_chart": None,
            "runs_today": {},
            "register": register,
            "alerts": [_alert(r, zone) for r in register.alerts[-_ALERTS_SHOWN:]][::-1],
            "schedules": sorted(status["schedules"],
                                key=lambda s: (s["next_fire"] is None, s["next_fire"] or "")),
        }
        with self._db() as db:
            if db is not None:
                page["runs_today"] = _runs_today(db, to_us(day_start))
                spends = _spend_steps(db, status["day"])
            else:
                spends = []
        if status["budget_mode"] == "plan":
            plan = status["plan"]
            page["plan_chart"] = plan_chart(plan["windows"],
                                            ceiling_percent=plan["ceiling_percent"],
                                            reserved_percent=plan["reserved_percent"])
        else:
            page["spend_chart"] = spend_chart(
                spends, day_start_us=to_us(day_start), day_end_us=to_us(day_end),
                now_us=to_us(now), used_micros=_micros(status["used_usd"]),
                reserved_micros=_micros(status["reserved_usd"]),
                ceiling_micros=_micros(status["ceiling_usd"]))
        return page

    # -- the runs ----------------------------------------------------------------------------

    def runs(self, chosen: RunFilter) -> dict[str, Any]:
        """The latest runs matching ``chosen``, newest first, and the lanes to filter on."""
        zone = ZoneInfo(status_view(self._home).timezone)
        where, params = ["1 = 1"], []
        if chosen.outcome in ("queued", "running"):
            where.append("status = ?")
            params.append(chosen.outcome)
        elif chosen.outcome is not None:
            where.append("status = 'finished' AND outcome = ?")
            params.append(chosen.outcome)
        if chosen.lane is not None:
            where.append("subject = ?")
            params.append(chosen.lane)
        if chosen.before is not None:
            where.append("seq < ?")
            params.append(str(chosen.before))
        rows: list[dict[str, Any]] = []
        lanes: list[str] = []
        with self._db() as db:
            if db is not None:
                found = db.execute(
                    "SELECT seq, run_id, subject, source, status, outcome, spent_micros,"
                    " reserved_micros, admitted_us, started_us, finished_us, reason FROM runs"
                    f" WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?",
                    (*params, RUNS_PER_PAGE + 1)).fetchall()
                rows = [_run_row(row, zone) for row in found]
                lanes = [row[0] for row in db.execute(
                    "SELECT DISTINCT subject FROM runs ORDER BY subject LIMIT 500")]
        more = len(rows) > RUNS_PER_PAGE
        return {"runs": rows[:RUNS_PER_PAGE], "lanes": lanes, "filter": chosen,
                "filters": FILTERS, "older": rows[RUNS_PER_PAGE - 1]["seq"] if more else None}

    def run(self, run_id: str) -> dict[str, Any] | None:
        """One run: its row, its register lines, its spans drawn as a waterfall, its answer and
        its task in Cairn; None if neither the state nor the register knows it."""
        zone = ZoneInfo(status_view(self._home).timezone)
        with self._db() as db:
            row = None if db is None else db.execute(
                "SELECT seq, run_id, subject, source, status, outcome, spent_micros,"
                " reserved_micros, admitted_us, started_us, finished_us, reason, final_text,"
                " model, tokens FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        records = self._records(run_id)
        if row is None and not records:
            return None
        spans = build_spans(run_id, records)
        chart, rows = waterfall(spans)
        refs = [str(r.details["ref"]) for r in records
                if r.kind == "cairn" and isinstance(r.details.get("ref"), str)]
        return {
            "run_id": run_id,
            "row": _run_row(row, zone) if row is not None else None,
            "final_text": row["final_text"] if row is not None else None,
            "model": row["model"] if row is not None else None,
            "tokens": row["tokens"] if row is not None else None,
            "records": [{"line": r.human_line(), "details": json.dumps(dict(r.details),
                                                                       sort_keys=True)}
                        for r in records],
            "chart": chart, "rows": rows, "spans": spans,
            "cairn_ref": refs[0] if refs else None,
            "cairn": [f"{r.event} {r.outcome}" for r in records if r.kind == "cairn"],
        }

    def run_json(self, run_id: str) -> dict[str, Any] | None:
        """The run for the JSON API: its row's figures and its trace as OTLP/JSON."""
        from bothy import __version__
        from bothy.trace import otlp_request

        page = self.run(run_id)
        if page is None:
            return None
        return {"run": page["row"], "final_text": page["final_text"],
                "cairn_ref": page["cairn_ref"],
                "register": [r["line"] for r in page["records"]],
                "trace": otlp_request(run_id, page["spans"], version=__version__)}

    def _records(self, run_id: str) -> list[AuditRecord]:
        """The run's records, its wake's first, as ``bothy audit --run`` reads them."""
        from bothy.engine.auditindex import RunIndex  # through the run-id index

        return RunIndex(self._home.audit_path).records(run_id)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection | None]:
        if not self._home.db_path.exists():
            yield None
            return
        db = sqlite3.connect(f"file:{self._home.db_path}?mode=ro", uri=True, timeout=5)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()


# -- pieces ------------------------------------------------------------------------------------


def _day_bounds(day: str, zone: ZoneInfo) -> tuple[datetime, datetime]:
    start = datetime.fromisoformat(day).replace(tzinfo=zone)
    end = (start + timedelta(days=1, hours=2)).replace(hour=0, tzinfo=zone)  # across DST
    return start, end


def _micros(usd: str) -> int:
    from decimal import Decimal

    from bothy.money import usd_to_micros

    return usd_to_micros(Decimal(usd))


def _elapsed(delta: timedelta) -> str:
    seconds = max(int(delta.total_seconds()), 0)
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h {minutes} min"
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {seconds} s"


def _lanes(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Every lane with work: the run in it now, and the runs waiting behind it."""
    lanes: dict[str, dict[str, Any]] = {}
    for run in status["running"]:
        lanes.setdefault(run["subject"], {"lane": run["subject"], "running": [], "queued": []})
        lanes[run["subject"]]["running"].append(run["run_id"])
    for subject, run_ids in status["queued"].items():
        lanes.setdefault(subject, {"lane": subject, "running": [], "queued": []})
        lanes[subject]["queued"].extend(run_ids)
    return sorted(lanes.values(), key=lambda lane: str(lane["lane"]))


def _spend_steps(db: sqlite3.Connection, day: str) -> list[tuple[int, int]]:
    """Today's spend as (end of a five-minute bucket, micro-dollars in it), oldest first: at
    most 288 steps to draw, however many runs the day had (the total is exact)."""
    return [(int(row[0]), int(row[1])) for row in db.execute(
        "SELECT MAX(at_us), SUM(micros) FROM spend WHERE day = ?"
        " GROUP BY at_us / ? ORDER BY 1", (day, _SPEND_BUCKET_US))]


def _runs_today(db: sqlite3.Connection, since_us: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in db.execute(
            "SELECT CASE status WHEN 'finished' THEN outcome ELSE status END, COUNT(*)"
            # Runs are numbered as they are admitted: walk back from the newest (by rowid,
            # no index needed) to the last one admitted before the day began.
            " FROM runs WHERE seq > COALESCE((SELECT seq FROM runs WHERE admitted_us < ?"
            " ORDER BY seq DESC LIMIT 1), 0) GROUP BY 1 ORDER BY 1", (since_us,)):
        counts[str(row[0])] = int(row[1])
    return counts


def _alert(record: Any, zone: ZoneInfo) -> dict[str, Any]:
    details = record.details
    return {"when": record.ts.astimezone(zone).isoformat(timespec="seconds"),
            "event": record.event, "level": str(details.get("level", "")),
            "about": str(details.get("about", "")), "reason": str(details.get("reason", "")),
            "subject": record.subject, "run_id": record.run_id}


def _run_row(row: sqlite3.Row, zone: ZoneInfo) -> dict[str, Any]:
    began, ended = row["started_us"] or row["admitted_us"], row["finished_us"]
    duration = None if ended is None else _seconds(max(ended - began, 0) / 1e6)
    shown = row["outcome"] if row["status"] == "finished" else row["status"]
    return {
        "seq": row["seq"], "run_id": row["run_id"], "lane": row["subject"],
        "source": row["source"], "outcome": shown or "?",
        "cost_usd": format_usd(row["spent_micros"], 4),
        "reserved_usd": format_usd(row["reserved_micros"], 4),
        "admitted": _local(row["admitted_us"], zone),
        "finished": _local(ended, zone) if ended else None,
        "duration": duration, "reason": row["reason"],
    }


def _local(micros: int, zone: ZoneInfo) -> str:
    return from_us(micros).astimezone(zone).isoformat(timespec="seconds")


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
