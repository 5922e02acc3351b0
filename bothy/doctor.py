"""``bothy doctor``: one line per check, then the count; non-zero on any failure (SPEC §10).

Checks that cover parts not built yet say so with ``[warn]`` rather than pretending.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from bothy.config import Config, load_config
from bothy.engine.audit import AuditLog
from bothy.engine.launch import Launch, build_launch, codex_version
from bothy.engine.prices import PriceTable
from bothy.errors import BothyError, ConfigError
from bothy.home import BothyHome
from bothy.runtime import Runtime

Status = Literal["ok", "warn", "fail"]
_MARK = {"ok": "[ok ]", "warn": "[warn]", "fail": "[fail]"}


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str

    def line(self) -> str:
        return f"{_MARK[self.status]} {self.name}: {self.detail}"


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    config_error: bool = False

    @property
    def failed(self) -> int:
        return sum(check.status == "fail" for check in self.checks)

    def lines(self) -> list[str]:
        counts = {status: sum(c.status == status for c in self.checks) for status in _MARK}
        summary = f"{counts['ok']} passed, {counts['warn']} warned, {counts['fail']} failed"
        return [check.line() for check in self.checks] + [summary]


async def run_doctor(home: BothyHome | None = None) -> DoctorReport:
    home = home or BothyHome.from_env()
    report = DoctorReport()
    try:
        cfg = load_config(home.config_path)
    except ConfigError as exc:
        report.checks.append(Check("fail", "config", str(exc)))
        report.config_error = True
        return report
    report.checks.append(Check("ok", "config", f"{home.config_path} is valid (site {cfg.site})"))
    report.checks.append(_state_writable(home))
    if report.checks[-1].status == "fail":
        return report
    report.checks.append(await _audit_chain(home))
    launch_check, launch = _codex_launch(cfg)
    report.checks.append(launch_check)
    if launch is not None:
        report.checks.append(await _codex_version(launch))
        report.checks.append(await _sandbox(launch))
    async with Runtime.open(home, cfg) as rt:
        report.checks.append(await _orphans(rt))
    report.checks += [_workspace(cfg), _prices(cfg), _budget_mode(), _fts5()]
    report.checks += [
        Check("warn", "cairn", "not configured (the Cairn ledger is not built yet)"),
        _alert_route(cfg),
    ]
    return report


def _state_writable(home: BothyHome) -> Check:
    try:
        home.ensure()
        with tempfile.NamedTemporaryFile(dir=home.state_dir, prefix=".doctor-") as probe:
            probe.write(b"probe")
            probe.flush()
            os.fsync(probe.fileno())
    except (BothyError, OSError) as exc:
        return Check("fail", "state directory", f"{home.state_dir} is not writable: {exc}")
    return Check("ok", "state directory", f"{home.state_dir} is writable")


async def _audit_chain(home: BothyHome) -> Check:
    report = await asyncio.to_thread(AuditLog(home.audit_path).verify)
    if report.ok:
        return Check("ok", "audit chain", f"intact ({report.count} records verified)")
    return Check("fail", "audit chain", f"broken: {report.problem}")


def _codex_launch(cfg: Config) -> tuple[Check, Launch | None]:
    try:
        launch = build_launch(cfg.codex)
    except BothyError as exc:
        return Check("fail", "codex", str(exc)), None
    return Check("ok", "codex command", launch.argv[0]), launch


async def _codex_version(launch: Launch) -> Check:
    try:
        version = await asyncio.to_thread(codex_version, launch)
    except (BothyError, OSError, subprocess.TimeoutExpired) as exc:
        return Check("fail", "codex version", str(exc))
    return Check("ok", "codex version", version)


async def _sandbox(launch: Launch) -> Check:
    """Start Codex's own sandbox once with a harmless command."""
    marker = "bothy-sandbox-ok"
    overrides = [arg for arg in launch.argv[1:] if arg != "app-server"]
    argv = [launch.argv[0], "sandbox", *overrides, "--", "/bin/sh", "-c", f"echo {marker}"]

    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=launch.env, capture_output=True, text=True,
                              timeout=30, check=False, cwd=tempfile.gettempdir())

    try:
        result = await asyncio.to_thread(probe)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("fail", "sandbox", f"could not start: {exc}")
    if result.returncode == 0 and marker in result.stdout:
        return Check("ok", "sandbox", "codex sandbox starts and runs a command")
    tail = (result.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return Check("fail", "sandbox", f"codex sandbox exited {result.returncode}: {tail}")


async def _orphans(rt: Runtime) -> Check:
    recovered = await rt.recovery().sweep()
    if not recovered:
        return Check("ok", "orphaned workers", "none")
    names = ", ".join(item.run_id for item in recovered)
    return Check("ok", "orphaned workers",
                 f"ended {len(recovered)} left by a previous instance ({names}); audited")


def _workspace(cfg: Config) -> Check:
    if cfg.workspace.is_dir():
        return Check("ok", "workspace", str(cfg.workspace))
    return Check("fail", "workspace", f"{cfg.workspace} does not exist or is not a directory")


def _prices(cfg: Config) -> Check:
    if cfg.codex.model is None:
        return Check("warn", "prices", "codex.model is not set: a run whose model has no price"
                     " in budget.prices is refused at gate 'budget'")
    if PriceTable(cfg.budget.prices).lookup(cfg.codex.model) is None:
        return Check("fail", "prices", f"no price for model '{cfg.codex.model}' in budget.prices")
    return Check("ok", "prices", f"model '{cfg.codex.model}' has a price")


def _alert_route(cfg: Config) -> Check:
    routes = [f"{name} {section.alert_channel}"
              for name, section in (("slack", cfg.chat.slack), ("discord", cfg.chat.discord))
              if section is not None and section.alert_channel]
    if routes:
        return Check("ok", "alert route", ", ".join(routes))
    return Check("warn", "alert route", "not configured: a failure nobody hears about is not"
                 " handled (set chat.slack.alert_channel or chat.discord.alert_channel)")


def _budget_mode() -> Check:
    return Check("warn", "budget plan mode", "not built yet: budgets gate on USD (mode 'api') only")


def _fts5() -> Check:
    try:
        db = sqlite3.connect(":memory:")
        try:
            db.execute("CREATE VIRTUAL TABLE probe USING fts5(body)")
        finally:
            db.close()
    except sqlite3.OperationalError:
        return Check("warn", "memory search", "SQLite has no FTS5: memory search will fall back"
                     " to a plain scan (memory itself is not built yet)")
    return Check("ok", "memory search", "SQLite FTS5 available (memory itself is not built yet)")


CheckFn = Callable[[], Awaitable[Check]]
