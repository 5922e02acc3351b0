"""``bothy doctor``: one line per check, then the count; non-zero on any failure (SPEC §10).

The first eight lines are the product page's, in its order and with its labels
(:data:`SEED_CHECKS`); rows one of them adds follow (``[warn] repaired at seq N`` for each
repair of the register), then further checks (:data:`MORE_CHECKS`), then
``N passed, N warned, N failed``. Each check is a small function of the :class:`Scene` (the
home, its configuration if valid, the worker's launch if codex was found) returning a
:class:`Finding`; the table gives it its label. The eight always print: a check that needs
what is missing (a valid config, a writable state directory, codex) fails naming it. A check
covering a part not built yet says so.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import ssl
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from bothy.config import Config, load_config
from bothy.engine.audit import AuditLog
from bothy.engine.launch import Launch, build_launch, codex_version
from bothy.engine.prices import PriceTable
from bothy.errors import AuditIntegrityError, BothyError, ConfigError
from bothy.home import BothyHome, loose_mode

Status = Literal["ok", "warn", "fail"]
_MARK = {"ok": "[ok ]", "warn": "[warn]", "fail": "[fail]"}


@dataclass(frozen=True)
class Finding:
    """What one check found: its status and the sentence after the label; ``more``: rows of
    their own it adds after the page's eight (a repair of the register: one per repair)."""

    status: Status
    detail: str
    more: tuple[Check, ...] = ()


def ok(detail: str) -> Finding:
    return Finding("ok", detail)


def warn(detail: str) -> Finding:
    return Finding("warn", detail)


def fail(detail: str) -> Finding:
    return Finding("fail", detail)


@dataclass(frozen=True)
class Check:
    """One line of the doctor: ``[ok ] label: detail``."""

    status: Status
    name: str
    detail: str

    def line(self) -> str:
        return f"{_MARK[self.status]} {self.name}: {self.detail}"


@dataclass(frozen=True)
class Scene:
    """What the checks look at. A part that could not be had is None, with the reason."""

    home: BothyHome
    cfg: Config | None
    config_problem: str
    state_problem: str
    launch: Launch | None
    launch_problem: str

    def needs_config(self) -> Finding | None:
        """A failure naming the invalid config file, for a check that needs it; else None."""
        if self.cfg is not None:
            return None
        return fail(f"needs a valid config: {self.home.config_path} is not"
                    " (see 'config valid' below)")


CheckFn = Callable[[Scene], Awaitable[Finding]]


@dataclass
class DoctorReport:
    checks: list[Check]
    config_error: bool = False

    def count(self, status: Status) -> int:
        return sum(check.status == status for check in self.checks)

    @property
    def failed(self) -> int:
        return self.count("fail")

    def summary(self) -> str:
        return (f"{self.count('ok')} passed, {self.count('warn')} warned,"
                f" {self.count('fail')} failed")

    def lines(self) -> list[str]:
        return [check.line() for check in self.checks] + [self.summary()]

    def to_json(self) -> dict[str, Any]:
        return {"checks": [asdict(check) for check in self.checks], "passed": self.count("ok"),
                "warned": self.count("warn"), "failed": self.count("fail")}


async def run_doctor(home: BothyHome | None = None) -> DoctorReport:
    """Every check, in order: the page's eight, then the others."""
    scene = await asyncio.to_thread(_scene, home or BothyHome.from_env())
    checks: list[Check] = []
    added: list[Check] = []  # rows the page's eight add, printed after them
    for name, check in SEED_CHECKS:
        finding = await _safely(check, scene)
        checks.append(Check(finding.status, name, finding.detail))
        added.extend(finding.more)
    checks.extend(added)
    for name, check in MORE_CHECKS:
        finding = await _safely(check, scene)
        checks.append(Check(finding.status, name, finding.detail))
    return DoctorReport(checks, config_error=scene.cfg is None)


async def _safely(check: CheckFn, scene: Scene) -> Finding:
    """A check that trips on the machine fails with the reason, never a traceback."""
    try:
        return await check(scene)
    except (BothyError, OSError, sqlite3.Error, subprocess.SubprocessError) as exc:
        return fail(f"{type(exc).__name__}: {exc}")


def _scene(home: BothyHome) -> Scene:
    cfg, config_problem = None, ""
    try:
        cfg = load_config(home.config_path)
    except ConfigError as exc:
        config_problem = str(exc)
    launch, launch_problem = None, ""
    if cfg is not None:
        try:
            launch = build_launch(cfg.codex)
        except BothyError as exc:
            launch_problem = str(exc)
    return Scene(home, cfg, config_problem, _state_problem(home), launch, launch_problem)


def _state_problem(home: BothyHome) -> str:
    """Why nothing can be written under the state directory ("" when it can)."""
    try:
        home.ensure()
        with tempfile.NamedTemporaryFile(dir=home.state_dir, prefix=".doctor-") as probe:
            probe.write(b"probe")
            probe.flush()
            os.fsync(probe.fileno())
    except BothyError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot write in {home.state_dir}: {exc.strerror or exc}"
    return ""


# -- the product page's eight -------------------------------------------------------------


async def check_state_writable(scene: Scene) -> Finding:
    if scene.state_problem:
        return fail(scene.state_problem)
    return ok(str(scene.home.state_dir))


async def check_audit_chain(scene: Scene) -> Finding:
    path = scene.home.audit_path
    try:
        report = await asyncio.to_thread(AuditLog(path).verify)
    except OSError as exc:
        return fail(f"cannot read {path}: {exc.strerror or exc}")
    if not report.ok:
        return fail(f"broken: {report.problem}")
    if report.repaired_at:
        from bothy.commands.operate import REPAIRED_DETAIL, repaired_at

        # The seed's row warns too: a repaired register never reads as untouched.
        rows = tuple(Check("warn", repaired_at(seq), REPAIRED_DETAIL)
                     for seq in report.repaired_at)
        return Finding("warn", f"{report.count} records verified, across a repair (see below)",
                       more=rows)
    return ok(f"{report.count} records verified")


async def check_codex_present(scene: Scene) -> Finding:
    if missing := scene.needs_config():
        return missing
    if scene.launch is None:
        return fail(scene.launch_problem)
    try:
        return ok(await asyncio.to_thread(codex_version, scene.launch))
    except subprocess.TimeoutExpired:
        return fail(f"{scene.launch.argv[0]} --version did not answer within 10 s")


async def check_cairn(scene: Scene) -> Finding:
    """`cairn --version` answers within cairn.timeout_s (docs/CAIRN.md). Cairn is optional:
    when it does not, runs with a ref still work, so this warns and names what is missing."""
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    from bothy.engine.cairn import Cairn

    workspace = scene.cfg.workspace
    cwd = workspace if workspace.is_dir() else scene.home.root
    problem = await Cairn(scene.cfg.cairn, cwd=cwd).probe()
    if problem is None:
        return ok("memory and task ledger")
    return warn(f"{problem} — runs with --ref go on without a task ledger")


async def check_memory_fts5(scene: Scene) -> Finding:
    """The same probe memory search runs: create an FTS5 table, index a row, match it."""
    from bothy.memory import probe_fts5

    problem = await asyncio.to_thread(probe_fts5)
    if problem is not None:
        return warn(f"FTS5 is missing ({problem}): memory search uses a case-insensitive scan")
    forced = sorted(name for name, profile in (scene.cfg.profiles.items() if scene.cfg else [])
                    if profile.memory is not None and profile.memory.search == "scan")
    detail = "FTS5 search; missing FTS5 uses a case-insensitive scan"
    return ok(detail + (f" (profiles forcing the scan: {', '.join(forced)})" if forced else ""))


async def check_orphans(scene: Scene) -> Finding:
    """Ends and audits the worker groups a dead Bothy left (the same sweep a run makes)."""
    from bothy.runtime import Runtime

    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None  # needs_config said so
    if scene.state_problem:
        return fail(f"needs the state directory: {scene.state_problem}")
    async with Runtime.open(scene.home, scene.cfg) as rt:
        recovery = rt.recovery()
        try:
            recovered = await recovery.sweep()
        except AuditIntegrityError:
            return fail("not swept: what it ends must be recorded, and the register is broken"
                        " (see 'audit chain intact'): run bothy audit repair, then doctor again")
    named = [item.run_id for item in recovered]
    named += [f"spare app-server pgid {pgid}" for pgid in recovery.spares_ended]
    named += [f"the worker of finished run {run}" for run in recovery.workers_ended]
    left = f"{len(named)} process group(s) left by a previous instance"
    if not named:
        return ok(left)
    return ok(f"{left} ({', '.join(named)}): ended and audited")


async def check_sandbox(scene: Scene) -> Finding:
    """Start Codex's own sandbox once with a harmless command, as a shell tool would."""
    if missing := scene.needs_config():
        return missing
    if scene.launch is None:
        return fail(f"needs codex: {scene.launch_problem}")
    marker = "bothy-sandbox-ok"
    launch = scene.launch
    overrides = [arg for arg in launch.argv[1:] if arg != "app-server"]
    argv = [launch.argv[0], "sandbox", *overrides, "--", "/bin/sh", "-c", f"echo {marker}"]
    try:
        result = await asyncio.to_thread(
            subprocess.run, argv, env=launch.env, capture_output=True, text=True, timeout=30,
            check=False, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return warn("codex sandbox did not finish within 30 s — runs needing a shell will fail")
    if result.returncode == 0 and marker in result.stdout:
        return ok("codex sandbox runs a command")
    said = [line for line in result.stderr.strip().splitlines() if line.strip()]
    reason = said[-1][:200] if said else f"codex sandbox exited {result.returncode}"
    return warn(f"{reason} — runs needing a shell will fail")


_SHELL_PATIENCE_S = 10.0


async def check_model_shell(scene: Scene) -> Finding:
    """Variables named like secrets that the worker user's shell startup files export: codex
    reads those files for the model's commands, past Bothy's excludes (engine/workershell.py)."""
    from bothy.engine.launch import shell_excludes
    from bothy.engine.workershell import exported_by_startup_files, worker_shell

    if missing := scene.needs_config():
        return missing
    if scene.launch is None:
        return fail("needs codex (see 'codex present' above)")
    assert scene.cfg is not None
    workspace = scene.cfg.workspace
    cwd = workspace if workspace.is_dir() else Path(tempfile.gettempdir())
    shell = worker_shell(scene.launch.env)
    codex = scene.cfg.codex
    excludes = list(dict.fromkeys([  # the site's, and what each profile adds for its runs
        *shell_excludes(codex), *(name for profile in scene.cfg.profiles.values()
                                  for name in shell_excludes(codex, profile.codex_config))]))
    try:
        found = await exported_by_startup_files(scene.launch, excludes, cwd=cwd,
                                                timeout_s=_SHELL_PATIENCE_S)
    except TimeoutError:
        return warn(f"{shell} did not start within {_SHELL_PATIENCE_S:g} s, so what its startup"
                    " files export is unknown (codex reads them for every command the model"
                    " runs)")
    except OSError as exc:
        return warn(f"what {shell}'s startup files export is unknown: {exc}")
    if not found.names:
        return ok(f"{shell}'s startup files export no variable named like a secret")
    return warn(f"{shell}'s startup files (~/.profile, ~/.bashrc, ~/.zshrc…) export"
                f" {', '.join(found.names)}: codex reads them for every command the model runs,"
                " so the model would see those, whatever Bothy keeps out of its environment;"
                " take them out of those files (serve reads its own secrets from its"
                " service's environment or the config's secrets_file)")


async def check_alert_route(scene: Scene) -> Finding:
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    chat = scene.cfg.chat
    routes = [f"{name} {section.alert_channel}"
              for name, section in (("slack", chat.slack), ("discord", chat.discord))
              if section is not None and section.alert_channel]
    if routes:
        problem = _alert_token_problem(scene.cfg)
        if problem is not None:
            return warn(f"{', '.join(routes)}, but a command here could not post there:"
                        f" {problem}")
        return ok(", ".join(routes))
    return warn("a failure nobody hears about is not handled (set chat.slack.alert_channel"
                " or chat.discord.alert_channel)")


def _alert_token_problem(cfg: Config) -> str | None:
    """Why a command (not `bothy serve`) could not post an alert: the token of the channel's
    platform is set nowhere, or the secrets_file is refused. Nothing is sent to check."""
    from bothy.chat.oneshot import Tokens
    from bothy.errors import ChatError

    chat, tokens = cfg.chat, Tokens(cfg.secrets_file)
    try:
        if chat.slack is not None and chat.slack.alert_channel:
            tokens.get(chat.slack.bot_token_env, "chat.slack.bot_token_env")
        elif chat.discord is not None and chat.discord.alert_channel:
            tokens.get(chat.discord.token_env, "chat.discord.token_env")
    except (ChatError, ConfigError) as exc:
        return str(exc)
    return None


SEED_CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("state directory writable", check_state_writable),
    ("audit chain intact", check_audit_chain),
    ("codex present", check_codex_present),
    ("cairn reachable", check_cairn),
    ("memory FTS5", check_memory_fts5),
    ("no orphaned workers", check_orphans),
    ("sandbox can start", check_sandbox),
    ("alert route configured", check_alert_route),
)
"""The product page's eight, in its order with its labels: always the first eight lines."""


# -- further checks -------------------------------------------------------------------------


async def check_config(scene: Scene) -> Finding:
    if scene.cfg is None:
        return fail(scene.config_problem)
    return ok(f"{scene.home.config_path} (site {scene.cfg.site})")


async def check_workspace(scene: Scene) -> Finding:
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    if scene.cfg.workspace.is_dir():
        return ok(str(scene.cfg.workspace))
    return fail(f"{scene.cfg.workspace} does not exist or is not a directory: create it, or set"
                f" 'workspace' in {scene.home.config_path}")


async def check_codex_home(scene: Scene) -> Finding:
    if scene.launch is None:
        return fail("needs codex (see 'codex present' above)")
    home = scene.launch.codex_home
    if home.is_dir():
        return ok(str(home))
    return fail(f"{home} does not exist (codex will not start): create it and log in with"
                f" `codex login`, or set 'codex.home' in {scene.home.config_path}")


async def check_trusted_certificates(scene: Scene) -> Finding:
    """The CA certificates Bothy's TLS connections (Slack, Discord, an https collector) trust:
    OpenSSL skips a file that is not a PEM bundle without a word, so a wrong
    ``SSL_CERT_FILE`` would show only as refused connections later."""
    return await asyncio.to_thread(_trusted, os.environ.get("SSL_CERT_FILE"))


def _trusted(named: str | None) -> Finding:
    source = f"SSL_CERT_FILE={named}" if named else "the system's store"
    if named and os.path.exists(named) and not os.path.isfile(named):
        # (a FIFO would hold every TLS start here, and serve's, forever)
        return warn(f"{source} is not a regular file: point it at a PEM bundle, or unset it")
    # (OpenSSL skips what it cannot read rather than raise; an ssl.SSLError is an OSError,
    # which the check's caller turns into a failed line)
    count = int(ssl.create_default_context().cert_store_stats()["x509_ca"])
    if count == 0:
        return warn(f"no CA certificate is trusted ({source}): connections to Slack, Discord or"
                    " an https collector will be refused; point SSL_CERT_FILE at a PEM bundle,"
                    " or install the system's (Debian: ca-certificates)")
    return ok(f"{count} CA certificates ({source})")


async def check_prices(scene: Scene) -> Finding:
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    model = scene.cfg.codex.model
    if scene.cfg.budget.mode == "plan":
        return ok("not used: budget mode 'plan' gates on rate-limit windows, not dollars")
    if model is None:
        return warn("codex.model is not set: a run whose model has no price in budget.prices"
                    " is refused at gate 'budget'")
    if PriceTable(scene.cfg.budget.prices).lookup(model) is None:
        return fail(f"no price for model '{model}' in budget.prices")
    return ok(f"model '{model}' has a price")


async def check_config_private(scene: Scene) -> Finding:
    """Issue 10 item 7: only the operator should read the config (it names every secret's
    source, and a mistake there may hold one)."""
    path = scene.home.config_path
    mode = loose_mode(path)
    if mode is not None:
        return warn(f"{path} is mode {mode:04o}: group or others can read it; run chmod 600"
                    f" {path}")
    if not path.exists():
        return warn(f"{path} does not exist (see 'config valid')")
    return ok(f"{path} is readable by its owner only")


async def check_budget_mode(scene: Scene) -> Finding:
    """Mode 'plan' gates on the windows Codex reports: fails if it learnt there are none."""
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    budget = scene.cfg.budget
    if budget.mode == "api":
        return ok(f"mode 'api': runs gate on USD ({budget.per_day_usd} a day)")
    if scene.state_problem:
        return fail(f"needs the state directory: {scene.state_problem}")
    from bothy.clock import utc_now
    from bothy.engine.plan import PlanGate
    from bothy.engine.state import StateDB

    async with StateDB.open(scene.home.db_path) as db:
        gate = PlanGate(db, budget, PriceTable(budget.prices), clock=utc_now)
        unknown, windows = await gate.unknown(), await gate.windows()
    ignored = "per_run_usd, per_day_usd and prices are ignored"
    head = (f"mode 'plan' (ceiling {budget.plan_ceiling_percent}%,"
            f" {budget.plan_reserve_percent}% reserved per run; {ignored})")
    if unknown is not None:
        return (fail if unknown.refusing else warn)(f"{head}: window unknown: {unknown.reason}")
    seen = ", ".join(f"{name} {window.used_percent}% used" for name, window in windows.items())
    return ok(f"{head}: {seen}")


async def check_chat_connections(scene: Scene) -> Finding:
    """Each chat connection of the running `bothy serve`: its last event and last answered
    ping; a warning when one is silent past its `silent_after_s` or is being reconnected."""
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    chat = scene.cfg.chat
    configured = [name for name, section in (("slack", chat.slack), ("discord", chat.discord))
                  if section is not None]
    if not configured:
        return ok("none configured")
    from bothy.status import chat_connections, connection_line

    shown = await asyncio.to_thread(chat_connections, scene.home, scene.cfg.budget.timezone)
    if shown is None:
        return ok(f"{', '.join(configured)}: bothy serve is not running (nothing to check)")
    troubled = [name for name, entry in shown.items() if entry["state"] != "connected"
                or (entry["silent_s"] or 0) > (entry["silent_after_s"] or float("inf"))]
    unseen = [name for name in configured if name not in shown]
    detail = "; ".join([connection_line(name, entry) for name, entry in shown.items()]
                       + [f"{name}: nothing published yet" for name in unseen])
    return (warn if troubled else ok)(detail)


async def check_report_channels(scene: Scene) -> Finding:
    """Where unattended runs report: every ``report_to`` of a job, a poller or a schedule names
    a configured platform (a schedule's was checked when it was added; the config may have
    changed since), else its findings reach nobody."""
    if missing := scene.needs_config():
        return missing
    assert scene.cfg is not None
    from bothy.config import report_to_problem

    cfg = scene.cfg
    named = [(f"webhooks.{name}.jobs.{index}", job.report_to)
             for name, route in cfg.webhooks.items() for index, job in enumerate(route.jobs)]
    named += [(f"pollers.{name}.job", poller.job.report_to)
              for name, poller in cfg.pollers.items()]
    named += await asyncio.to_thread(_schedule_reports, scene.home)
    targets = [(where, target) for where, target in named if target is not None]
    problems = [f"{where}: {problem}" for where, target in targets
                if (problem := report_to_problem(target, cfg.chat))]
    if problems:
        return warn("; ".join(problems) + " — its findings reach nobody (bothy schedule rm and"
                    " add it again, or configure the platform)")
    if not targets:
        return ok("none named: findings go to the alert channel")
    return ok(", ".join(sorted({target for _, target in targets}))
              + " (whether the bot may post there is seen at the first post)")


def _schedule_reports(home: BothyHome) -> list[tuple[str, str | None]]:
    """Each schedule's ``report_to``, read-only (none before the state database exists)."""
    if not home.db_path.exists():
        return []
    db = sqlite3.connect(f"file:{home.db_path}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute("SELECT name, report_to FROM schedules ORDER BY name").fetchall()
    except sqlite3.OperationalError:  # a database from before report_to: nothing named
        return []
    finally:
        db.close()
    return [(f"schedule {name}", target) for name, target in rows]


MORE_CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("config valid", check_config),
    ("config private", check_config_private),
    ("workspace", check_workspace),
    ("codex home", check_codex_home),
    ("trusted certificates", check_trusted_certificates),
    ("prices", check_prices),
    ("budget mode", check_budget_mode),
    ("chat connections", check_chat_connections),
    ("report channels", check_report_channels),
    ("model's shell", check_model_shell),
)
