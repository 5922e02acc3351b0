"""The per-user LaunchAgent of ``bothy serve`` and the ``launchctl`` steps that load it.

launchd cannot filter exit codes (contracts.md §4.3), so: ``KeepAlive`` is
``{SuccessfulExit: false}`` — a 75 or a crash is relaunched, a clean exit 0 is not — and
``BOTHY_SERVICE_MANAGER=launchd`` makes a configuration error exit 0 after writing
``state/config-error.txt`` instead of looping on 78. Secrets stay in the 0600 environment
file, which :mod:`bothy.install.envexec` loads before it execs ``bothy serve``.

The launchctl failures the anchors met (research §C.2) are handled: the job is enabled
before every bootstrap (a job left disabled fails with 5: Input/output error); a bootstrap
failing with 5 or 37 right after a bootout is retried (bounded); 125 (no GUI session for the
user: SSH into a Mac nobody is logged in to) is explained, not retried.
"""

from __future__ import annotations

import plistlib
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bothy.install.plan import MakeDir, Outcome, Plan, RemoveFile, Run, WriteFile, run_command
from bothy.install.target import LAUNCHD_LABEL, Target

THROTTLE_INTERVAL_S = 10  # launchd's own floor; a faster relaunch is held back anyway
EXIT_TIMEOUT_S = 60  # SIGTERM → SIGKILL; above wakes.shutdown_grace_s plus a worker's stop
_RETRIED_CODES = frozenset({5, 37})  # Input/output error; Operation already in progress
_NO_GUI_SESSION = 125  # "Domain does not support specified action"


def plist_value(target: Target) -> dict[str, Any]:
    """The LaunchAgent, as a plist dictionary."""
    python = target.python
    path = ":".join(dict.fromkeys([str(Path(python).parent), "/opt/homebrew/bin",
                                   "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]))
    return {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": [python, "-m", "bothy.install.envexec", str(target.env_file), "--",
                             python, "-m", "bothy", "serve"],
        "EnvironmentVariables": {
            "BOTHY_HOME": str(target.bothy_home),
            "BOTHY_SERVICE_MANAGER": "launchd",
            "PATH": path,
        },
        "WorkingDirectory": str(target.bothy_home),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_INTERVAL_S,
        "ExitTimeOut": EXIT_TIMEOUT_S,
        # Unset, launchd throttles the job's CPU and I/O (gitlab-runner#29089: builds 6x slower).
        "ProcessType": "Interactive",
        "Umask": 0o077,
        "StandardOutPath": str(target.logs_dir / "serve.out.log"),
        "StandardErrorPath": str(target.logs_dir / "serve.err.log"),
    }


def plist_bytes(target: Target) -> bytes:
    return plistlib.dumps(plist_value(target), fmt=plistlib.FMT_XML, sort_keys=True)


def _service(target: Target) -> str:
    return f"{target.launchd_domain}/{LAUNCHD_LABEL}"


def _explain_bootstrap(target: Target) -> Callable[[Outcome], str]:
    def explain(outcome: Outcome) -> str:
        if outcome.code == _NO_GUI_SESSION:
            return (f"launchctl cannot load the LaunchAgent: {target.account.name} has no GUI"
                    f" session on this Mac (error 125: {outcome.text}). A LaunchAgent runs in a"
                    f" logged-in desktop session: log in as {target.account.name} on the Mac's"
                    " screen once (for a headless Mac mini, turn on automatic login), then rerun"
                    " `bothy install --serve`")
        return (f"launchctl could not load the LaunchAgent (exit {outcome.code}): {outcome.text}."
                f" See docs/RUNBOOK.md; `launchctl print {_service(target)}` shows its state")
    return explain


def plan_install(plan: Plan, target: Target, env_file: WriteFile) -> None:
    """Add the plist, the logs directory, the environment file and the launchctl steps."""
    loaded = _loaded(plan, target)
    plist_path = target.placed(target.plist_path)
    before = len(plan.steps)
    plan.write(WriteFile(plist_path, plist_bytes(target), 0o644, target.account))
    plan.make_dir(MakeDir(target.logs_dir, 0o700, target.account))
    plan.write(env_file)
    changed = len(plan.steps) > before
    if loaded and changed:
        plan.steps.append(Run(("launchctl", "bootout", _service(target))))
    if changed or not loaded:
        plan.steps.append(Run(("launchctl", "enable", _service(target))))
        plan.steps.append(Run(
            ("launchctl", "bootstrap", target.launchd_domain, str(plist_path)),
            retry=lambda outcome: outcome.code in _RETRIED_CODES,
            explain=_explain_bootstrap(target),
        ))


def plan_uninstall(plan: Plan, target: Target) -> None:
    loaded = _loaded(plan, target)
    if loaded:
        plan.steps.append(Run(("launchctl", "bootout", _service(target))))
    plist_path = target.placed(target.plist_path)
    if plist_path.exists():
        plan.steps.append(RemoveFile(plist_path))
    else:
        plan.unchanged.append(f"absent: {plist_path}")


def _loaded(plan: Plan, target: Target) -> bool:
    argv = ("launchctl", "print", _service(target))
    outcome = run_command(argv)
    if outcome.code == 127:
        plan.problems.append("launchctl is not on PATH: this is not a Mac, or PATH is wrong")
        return False
    plan.checks.append(f"check: {shlex.join(argv)} -> "
                       f"{'loaded' if outcome.code == 0 else 'not loaded'}")
    return outcome.code == 0
