"""``bothy status``: what is running, queued per lane, reserved and spent today.

Read-only and fast to start (a benchmark holds it to its target): no event loop, no chat or
scheduler imports, the state database read with the standard library's ``sqlite3``, and the
configuration validated with pydantic only when it changed. After a full validation, the few
figures status needs are kept in ``state/config.validated`` beside the very bytes of the file
they came from; while the file is byte-for-byte the same, status reads them from there. An
edited config is always validated again before anything in it is used. (The bytes, not a
hash of them: comparing a few kilobytes costs nothing, while ``hashlib`` and the module that
writes files atomically are a fifth of a cold start.)
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from datetime import UTC, datetime, tzinfo

from bothy.clock import minute_iso, to_us, utc_now
from bothy.errors import StateCorruptError
from bothy.home import BothyHome
from bothy.money import format_usd

_TRACES_SHOWN = 5  # runs whose trace waits, listed by name (the rest counted)
_AT_ONCE = "as soon as bothy serve takes it"  # a wake a stop queued again (no time to wait for)

TYPE_CHECKING = False  # typing is for mypy only here (a cold start's milliseconds)
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any


class StatusView:
    """The part of the configuration status shows. (A plain class: ``typing.NamedTuple``
    would import typing, milliseconds of every cold start.)"""

    __slots__ = ("budget_mode", "ceiling_micros", "max_workers", "plan_ceiling_percent",
                 "plan_reserve_percent", "site", "timezone")

    def __init__(self, site: str, timezone: str, ceiling_micros: int, max_workers: int,
                 budget_mode: str = "api", plan_ceiling_percent: int = 0,
                 plan_reserve_percent: int = 0) -> None:
        self.site = site
        self.timezone = timezone
        self.ceiling_micros = ceiling_micros
        self.max_workers = max_workers
        self.budget_mode = budget_mode
        self.plan_ceiling_percent = plan_ceiling_percent
        self.plan_reserve_percent = plan_reserve_percent

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


def status_view(home: BothyHome) -> StatusView:
    """The figures status needs, from a validated config (raises ConfigError otherwise)."""
    stamp = home.state_dir / "config.validated"
    try:
        config = _as_text(home.config_path.read_bytes())
        kept = json.loads(stamp.read_text())
        if kept.get("config") == config:
            return StatusView(**kept["view"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no stamp, a stale one, or no config file: validate properly below
    return _validate(home, stamp)


def _as_text(raw: bytes) -> str:
    """The config file's bytes as JSON can keep them, exactly (latin-1 maps each byte to one
    character and back)."""
    return raw.decode("latin-1")


def _validate(home: BothyHome, stamp: Path) -> StatusView:
    from bothy.atomicfile import write_atomically
    from bothy.config import load_config
    from bothy.money import usd_to_micros

    raw = home.config_path.read_bytes() if home.config_path.exists() else b""
    cfg = load_config(home.config_path)
    view = StatusView(cfg.site, cfg.budget.timezone, usd_to_micros(cfg.budget.per_day_usd),
                      cfg.pool.max_workers, cfg.budget.mode, cfg.budget.plan_ceiling_percent,
                      cfg.budget.plan_reserve_percent)
    if home.state_dir.is_dir():
        record = {"config": _as_text(raw), "view": view.as_dict()}
        with contextlib.suppress(OSError):  # the stamp only saves time; never fail status on it
            write_atomically(stamp, json.dumps(record).encode())
    return view


def _zone(name: str) -> tzinfo:
    """The budget's time zone. UTC, the default, is the standard library's fixed zone: it shows
    every time as ``ZoneInfo("UTC")`` would (offset +00:00, no transitions), without importing
    zoneinfo and sysconfig's data on the way, a sixth of status's own start (issue 18)."""
    if name == "UTC":
        return UTC
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


def collect_status(home: BothyHome, view: StatusView) -> dict[str, Any]:
    """A JSON-able picture of the site now."""
    return _collect(home, view, utc_now())


def _collect(home: BothyHome, view: StatusView, now: datetime) -> dict[str, Any]:
    day = now.astimezone(_zone(view.timezone)).date().isoformat()
    report: dict[str, Any] = {
        "site": view.site,
        "day": day,
        "timezone": view.timezone,
        "ceiling_usd": format_usd(view.ceiling_micros),
        "max_workers": view.max_workers,
        "used_usd": format_usd(0, 4),
        "reserved_usd": format_usd(0, 4),
        "running": [],
        "queued": {},
        "held_by_crashed_runs": [],
        "held_questions": [],
        "wakes_waiting": [],
        "schedules": [],
        "serve": "not running",
        "chat": {},
        "chat_connections": {},
        "spares": [],
        "budget_mode": view.budget_mode,
        "plan": {"ceiling_percent": view.plan_ceiling_percent,
                 "reserve_percent": view.plan_reserve_percent, "reserved_percent": 0,
                 "windows": []},
    }
    serve_pid = _serve(home, report, now)
    waiting = _traces_waiting(home)
    if waiting is not None:  # only on a site whose bothy serve exports traces (config otel)
        report["traces_waiting"] = waiting
    if not home.db_path.exists() or home.db_path.stat().st_size == 0:
        return report  # none yet, or an empty file no serve has made tables in: nothing ran
    zone = _zone(view.timezone)
    db = sqlite3.connect(f"file:{home.db_path}?mode=ro", uri=True, timeout=5)
    db.row_factory = sqlite3.Row
    try:
        if _unmade(db):
            return report  # a command stopped (killed) before it made the tables: nothing ran
        _fill(db, report, day, to_us(now), zone)
        _plan(db, report, now, zone)
        report["held_questions"] = _held_questions(db, zone, to_us(now))
        report["wakes_waiting"] = _wakes_waiting(db, zone)
        report["schedules"] = _schedules(db, zone, to_us(now))
        report["spares"] = _spares(db, zone, serve_pid)
    except sqlite3.DatabaseError as exc:
        corrupt = StateCorruptError.from_sqlite(home.db_path, exc)
        if corrupt is None:
            raise
        raise corrupt from exc
    finally:
        db.close()
    return report


def _unmade(db: sqlite3.Connection) -> bool:
    """Whether the state database has no tables yet: they are made in one transaction, with
    its ``user_version`` (engine/state.py), so a file whose version is still 0 holds none."""
    return int(db.execute("PRAGMA user_version").fetchone()[0]) == 0


# The runs that hold a reservation (queued, running, or cut short by a crash, until they
# expire), and what open plan-mode runs hold of the windows.
_LIVE_RUNS = ("SELECT * FROM runs WHERE (status IN ('queued', 'running') OR crashed = 1)"
              " AND expires_us > ? ORDER BY seq")
_PLAN_RESERVED = ("SELECT COALESCE(SUM(p.percent), 0) FROM plan_reservations p JOIN runs r"
                  " USING (run_id) WHERE (r.status IN ('queued', 'running') OR r.crashed = 1)"
                  " AND r.expires_us > ?")


def _fill(
    db: sqlite3.Connection, report: dict[str, Any], day: str, now_us: int, zone: tzinfo
) -> None:
    used = db.execute("SELECT COALESCE(SUM(micros), 0) FROM spend WHERE day = ?", (day,))
    report["used_usd"] = format_usd(int(used.fetchone()[0]), 4)
    live = db.execute(_LIVE_RUNS, (now_us,)).fetchall()
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
                "expires_at": minute_iso(row["expires_us"], zone),
            })
    report["reserved_usd"] = format_usd(reserved, 4)


def _plan(db: sqlite3.Connection, report: dict[str, Any], now: datetime, zone: tzinfo) -> None:
    """The rate-limit windows last seen, aged as the plan gate ages them (bothy.engine.windows:
    a window past its reset counts as reset), and the open plan reservations."""
    try:
        rows = db.execute("SELECT * FROM plan_windows ORDER BY name").fetchall()
        reserved = db.execute(_PLAN_RESERVED, (to_us(now),)).fetchone()[0]
    except sqlite3.OperationalError:  # a database from before plan mode: nothing seen yet
        return
    report["plan"]["reserved_percent"] = int(reserved)
    now_us = to_us(now)
    for row in rows:
        resets_us, length = row["resets_at_us"], row["window_mins"]
        used = row["used_percent"]
        if (resets_us is not None and resets_us <= now_us) or (
                resets_us is None and length is not None
                and row["seen_us"] + length * 60_000_000 <= now_us):
            used, resets_us = 0, None
        report["plan"]["windows"].append({
            "name": row["name"], "used_percent": used, "window_mins": length,
            "seen_s_ago": round((now_us - row["seen_us"]) / 1e6),
            "resets_at": _local(resets_us, zone),
        })


def _schedules(db: sqlite3.Connection, zone: tzinfo, now_us: int) -> list[dict[str, Any]]:
    """Each schedule with its next fire as ``bothy serve`` last computed it (evaluating cron
    here would mean importing APScheduler). A next fire in the past means nobody fired it."""
    try:
        rows = db.execute("SELECT name, cron, kind, sop, last_fire_us, next_fire_us"
                          " FROM schedules ORDER BY name").fetchall()
    except sqlite3.OperationalError:  # a database from before schedules: none yet
        return []
    found = []
    for row in rows:
        upcoming = row["next_fire_us"]
        found.append({
            "name": row["name"],
            "cron": row["cron"],
            "what": f"sop:{row['sop']}" if row["kind"] == "sop" else row["kind"],
            "next_fire": _local(upcoming, zone),
            "overdue": upcoming is not None and upcoming < now_us,
            "last_fire": _local(row["last_fire_us"], zone),
        })
    return found


def _local(micros: int | None, zone: tzinfo) -> str | None:
    return minute_iso(micros, zone) if micros else None


def _held_questions(db: sqlite3.Connection, zone: tzinfo, now_us: int) -> list[dict[str, Any]]:
    """Questions a running run is waiting on a person for (SPEC §6)."""
    rows = _rows(
        db, "SELECT q.run_id, r.subject, q.kind, q.tool, q.text, q.deadline_us FROM questions q"
        " JOIN runs r ON r.run_id = q.run_id WHERE q.status = 'pending' AND r.status = 'running'"
        " AND q.deadline_us > ? ORDER BY q.id", (now_us,))
    return [{"run_id": row["run_id"], "subject": row["subject"], "kind": row["kind"],
             "tool": row["tool"], "question": row["text"],
             "held_until": minute_iso(row["deadline_us"], zone)} for row in rows]


def _traces_waiting(home: BothyHome) -> list[dict[str, Any]] | None:
    """The runs whose trace the exporter has not delivered yet, from its queue file (whose
    format bothy/traceexport.py owns: ``runs`` of run_id, attempts, problem); None without one."""
    try:
        runs = json.loads(home.otel_queue_path.read_bytes())["runs"]
        return [{"run_id": str(run["run_id"]), "attempts": int(run["attempts"]),
                 "problem": str(run.get("problem") or "")} for run in runs]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [{"run_id": "-", "attempts": 0, "problem": f"unreadable queue file: {exc}"}]


def _rows(db: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> list[sqlite3.Row]:
    try:
        return db.execute(sql, params).fetchall()
    except sqlite3.OperationalError:  # a database from before this table: nothing in it yet
        return []


def _wakes_waiting(db: sqlite3.Connection, zone: tzinfo) -> list[dict[str, Any]]:
    """Wakes refused at a gate and queued again for a later try, or queued again by a stop
    before their run reached a worker (no time: they run as soon as a serve takes them)."""
    rows = _rows(
        db, "SELECT source, route, key, attempts, next_try_us, note FROM wakes"
        " WHERE status = 'queued' AND attempts > 0 ORDER BY next_try_us", ())
    return [{"source": row["source"], "route": row["route"], "key": row["key"],
             "attempts": row["attempts"],
             "next_try": (minute_iso(row["next_try_us"], zone) if row["next_try_us"] > 0
                          else _AT_ONCE),
             "note": row["note"]} for row in rows]


def _spares(db: sqlite3.Connection, zone: tzinfo, serve_pid: int | None) -> list[dict[str, Any]]:
    """The spare app-servers no run has taken (engine/spare.py): the running serve's, or one
    left by a serve that died (ended by the next start or ``bothy doctor``)."""
    rows = _rows(db, "SELECT pgid, leader_pid, leader_start, owner_pid, started_us FROM spares"
                 " ORDER BY pgid", ())
    spares = []
    for row in rows:
        owner_alive = row["owner_pid"] == serve_pid
        spares.append({"pgid": row["pgid"], "pid": row["leader_pid"],
                       "started_at": minute_iso(row["started_us"], zone),
                       "owner_alive": owner_alive,
                       "alive": owner_alive or _same_process(row["leader_pid"],
                                                             row["leader_start"])})
    return spares


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


def _serve(home: BothyHome, report: dict[str, Any], now: datetime) -> int | None:
    """The daemon's published state, if its process is still the one that wrote it; its pid
    then."""
    published = _published(home)
    if published is None:
        return None
    pid = int(published["pid"])
    if not _serve_alive(home, pid, published.get("pid_start")):
        report["serve"] = f"not running (pid {pid} is gone: it did not stop cleanly)"
        return None
    report["serve"] = f"{published.get('state', '?')} (pid {pid}, ports {published.get('ports')})"
    report["chat"] = published.get("chat") or {}
    report["chat_connections"] = _connections(published, now, _zone(report["timezone"]))
    return pid


def _published(home: BothyHome) -> dict[str, Any] | None:
    try:
        published = json.loads((home.state_dir / "serve.json").read_text())
        int(published["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return published if isinstance(published, dict) else None


def chat_connections(home: BothyHome, zone: str) -> dict[str, dict[str, Any]] | None:
    """Each chat connection of the running ``bothy serve`` as status shows it (what it last
    heard, how long it has been silent); None when no daemon is running."""
    published = _published(home)
    if published is None or not _serve_alive(home, int(published["pid"]),
                                             published.get("pid_start")):
        return None
    return _connections(published, utc_now(), _zone(zone))


def _connections(
    published: dict[str, Any], now: datetime, zone: tzinfo
) -> dict[str, dict[str, Any]]:
    """What the daemon's liveness watch published (bothy/chat/liveness.py), aged to ``now``."""
    heard = published.get("chat_heard")
    if not isinstance(heard, dict):
        return {}
    now_us = to_us(now)
    shown: dict[str, dict[str, Any]] = {}
    for name, view in heard.items():
        if not isinstance(view, dict):
            continue
        times = {key: view.get(f"{key}_at_us") for key in ("connected", "last_event",
                                                           "last_ping")}
        known = [t for t in times.values() if isinstance(t, int)]
        entry: dict[str, Any] = {"state": view.get("state", "?")}
        for key, micros in times.items():
            known_at = micros if isinstance(micros, int) else None
            entry[f"{key}_at"] = _local(known_at, zone)
            entry[f"{key}_s_ago"] = (None if known_at is None
                                     else round((now_us - known_at) / 1e6))
        entry["silent_s"] = round((now_us - max(known)) / 1e6) if known else None
        entry["silent_after_s"] = view.get("silent_after_s")
        entry["reconnects"] = view.get("reconnects", 0)
        entry["problem"] = view.get("problem")
        shown[str(name)] = entry
    return shown


def connection_line(name: str, entry: dict[str, Any]) -> str:
    """One chat connection for a person: ``slack: last event 3 s ago, last ping 1 s ago…``."""
    def ago(key: str) -> str:
        seconds = entry.get(f"{key}_s_ago")
        return "never" if seconds is None else f"{seconds} s ago"

    line = f"{name}: last event {ago('last_event')}, last ping {ago('last_ping')}"
    if entry.get("connected_s_ago") is not None:
        line += f", connected {ago('connected')}"
    if entry.get("reconnects"):
        line += f", reconnected {entry['reconnects']} time(s)"
    bound, silent = entry.get("silent_after_s"), entry.get("silent_s")
    if isinstance(bound, int | float) and isinstance(silent, int) and silent > bound:
        line += f"; silent {silent} s (more than silent_after_s, {bound:g} s)"
    if entry.get("problem"):
        line += f"; {entry['state']}, last failure: {entry['problem']}"
    return line


def _serve_alive(home: BothyHome, pid: int, start: object) -> bool:
    """Whether the serve that published ``pid`` (started at ``start``) still runs: its lock
    says so (bothy/servelock.py), or, where the lock cannot tell, the process table."""
    from bothy.servelock import serve_alive

    alive = serve_alive(home.state_dir / "serve.lock", pid)
    return _same_process(pid, start) if alive is None else alive


def _same_process(pid: int, start: object) -> bool:
    # Imported here: only a published daemon needs the process table (and psutil).
    from bothy.engine.proctable import matches, read_row

    row = read_row(pid)
    return row is not None and row.is_live and isinstance(start, str) and matches(row.start, start)


def render_status(report: dict[str, Any]) -> str:
    lines = [
        f"site {report['site']} · {report['day']} ({report['timezone']})",
        *_budget_lines(report),
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
    lines.append(f"held questions: {len(report['held_questions'])}")
    for asked in report["held_questions"]:
        lines.append(f"  {asked['run_id']} {asked['subject']} asks: {asked['question']} held"
                     f" until {asked['held_until']} (bothy answer {asked['run_id']} TEXT)")
    lines.append(f"wakes waiting to be retried: {len(report['wakes_waiting'])}")
    for wake in report["wakes_waiting"]:
        lines.append(f"  {wake['source']} {wake['route']} {wake['key']} next try"
                     f" {wake['next_try']}: {wake['note']}")
    lines.append(f"schedules: {len(report['schedules'])}")
    for schedule in report["schedules"]:
        when = f"next {schedule['next_fire'] or 'never'}"
        if schedule["overdue"]:
            when = f"due {schedule['next_fire']}, not fired (is bothy serve running?)"
        last = f"  last {schedule['last_fire']}" if schedule["last_fire"] else ""
        lines.append(f"  {schedule['name']}  {schedule['cron']}  {schedule['what']}  {when}{last}")
    lines.append(f"bothy serve: {report['serve']}")
    for spare in report["spares"]:
        gone = ("" if spare["owner_alive"] else
                " — its bothy serve is gone: the next start or bothy doctor ends it"
                if spare["alive"] else
                " — its bothy serve is gone and it has exited: the next start or bothy doctor"
                " forgets it")
        lines.append(f"  spare app-server: pid {spare['pid']} (group {spare['pgid']}), started"
                     f" {spare['started_at']}{gone}")
    chat = report["chat"]
    shown = ", ".join(f"{name} {state}" for name, state in chat.items()) or "none"
    lines.append(f"chat connections: {shown}")
    for name, entry in report["chat_connections"].items():
        lines.append("  " + connection_line(name, entry))
    if "traces_waiting" in report:
        waiting = report["traces_waiting"]
        lines.append(f"traces waiting for the otel receiver: {len(waiting)}")
        for run in waiting[:_TRACES_SHOWN]:
            tried = (f"{run['attempts']} failed attempt(s), last: {run['problem']}"
                     if run["attempts"] else "not tried yet")
            lines.append(f"  {run['run_id']}  {tried}")
        if len(waiting) > _TRACES_SHOWN:
            lines.append(f"  … and {len(waiting) - _TRACES_SHOWN} more")
    return "\n".join(lines)


def _budget_lines(report: dict[str, Any]) -> list[str]:
    """Dollars in mode 'api'; in mode 'plan' the windows, their age and reset times."""
    plan = report["plan"]
    lines = []
    if report["budget_mode"] == "plan":
        lines.append(f"plan: ceiling {plan['ceiling_percent']}%, {plan['reserve_percent']}%"
                     f" reserved per run, {plan['reserved_percent']}% reserved now")
    else:
        lines.append(f"spend today: {report['used_usd']} usd used, {report['reserved_usd']} usd"
                     f" reserved, ceiling {report['ceiling_usd']} usd")
    for window in plan["windows"]:
        length = f"{window['window_mins']} min window" if window["window_mins"] else "window"
        resets = f"resets {window['resets_at']}" if window["resets_at"] else "reset unknown"
        lines.append(f"  {window['name']} {length}: {window['used_percent']}% used,"
                     f" seen {window['seen_s_ago']} s ago, {resets}")
    if report["budget_mode"] == "plan" and not plan["windows"]:
        lines.append("  no rate-limit window seen yet (the next run learns them)")
    return lines
