"""``bothy status``: what is running, queued per lane, reserved and spent today.

Read-only and fast to start: it imports neither the chat adapters nor the scheduler, and it
opens the state database with the standard library's ``sqlite3`` rather than the engine.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from bothy.clock import from_us, to_us, utc_now
from bothy.config import Config
from bothy.home import BothyHome
from bothy.money import format_usd, usd_to_micros


async def collect_status(home: BothyHome, cfg: Config) -> dict[str, Any]:
    """A JSON-able picture of the site now."""
    return await asyncio.to_thread(_collect, home, cfg, utc_now())


def _collect(home: BothyHome, cfg: Config, now: datetime) -> dict[str, Any]:
    day = now.astimezone(ZoneInfo(cfg.budget.timezone)).date().isoformat()
    report: dict[str, Any] = {
        "site": cfg.site,
        "day": day,
        "timezone": cfg.budget.timezone,
        "ceiling_usd": format_usd(usd_to_micros(cfg.budget.per_day_usd)),
        "max_workers": cfg.pool.max_workers,
        "used_usd": format_usd(0, 4),
        "reserved_usd": format_usd(0, 4),
        "running": [],
        "queued": {},
        "held_by_crashed_runs": [],
        "schedules": "not built yet",
        "chat": "not built yet",
    }
    if not home.db_path.exists():
        return report
    db = sqlite3.connect(f"file:{home.db_path}?mode=ro", uri=True, timeout=5)
    db.row_factory = sqlite3.Row
    try:
        _fill(db, report, day, to_us(now))
    finally:
        db.close()
    return report


def _fill(db: sqlite3.Connection, report: dict[str, Any], day: str, now_us: int) -> None:
    used = db.execute("SELECT COALESCE(SUM(micros), 0) FROM spend WHERE day = ?", (day,))
    report["used_usd"] = format_usd(int(used.fetchone()[0]), 4)
    live = db.execute(
        "SELECT * FROM runs WHERE (status IN ('queued', 'running') OR crashed = 1)"
        " AND expires_us > ? ORDER BY seq",
        (now_us,),
    ).fetchall()
    reserved = 0
    for row in live:
        reserved += max(row["reserved_micros"] - row["spent_micros"], 0)
        if row["status"] == "running":
            report["running"].append(_running(row, now_us))
        elif row["status"] == "queued":
            report["queued"].setdefault(row["subject"], []).append(row["run_id"])
        else:
            report["held_by_crashed_runs"].append({
                "run_id": row["run_id"],
                "held_usd": format_usd(max(row["reserved_micros"] - row["spent_micros"], 0), 4),
                "expires_at": from_us(row["expires_us"]).isoformat(),
            })
    report["reserved_usd"] = format_usd(reserved, 4)


def _running(row: sqlite3.Row, now_us: int) -> dict[str, Any]:
    started = row["started_us"] or row["admitted_us"]
    return {
        "run_id": row["run_id"],
        "subject": row["subject"],
        "elapsed_s": round((now_us - started) / 1e6, 1),
        "worker_pid": row["leader_pid"],
        "spent_usd": format_usd(row["spent_micros"], 4),
        "reserved_usd": format_usd(row["reserved_micros"], 4),
        "tokens": row["tokens"],
    }


def render_status(report: dict[str, Any]) -> str:
    lines = [
        f"site {report['site']} · {report['day']} ({report['timezone']})",
        f"spend today: {report['used_usd']} usd used, {report['reserved_usd']} usd reserved,"
        f" ceiling {report['ceiling_usd']} usd",
        f"running: {len(report['running'])} of {report['max_workers']} workers",
    ]
    for run in report["running"]:
        lines.append(
            f"  {run['run_id']}  {run['subject']}  {run['elapsed_s']}s  pid {run['worker_pid']}"
            f"  {run['spent_usd']} of {run['reserved_usd']} usd  {run['tokens']} tokens"
        )
    queued = report["queued"]
    lines.append(f"queued: {sum(len(ids) for ids in queued.values())}")
    for subject, run_ids in queued.items():
        lines.append(f"  lane {subject}: {' '.join(run_ids)}")
    for held in report["held_by_crashed_runs"]:
        lines.append(
            f"held by a crashed run: {held['run_id']} {held['held_usd']} usd until"
            f" {held['expires_at']}"
        )
    lines.append(f"schedules: {report['schedules']}")
    lines.append(f"chat connections: {report['chat']}")
    return "\n".join(lines)
