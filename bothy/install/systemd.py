"""The systemd unit of ``bothy serve`` and the ``systemctl`` steps that install it.

The unit honours the exit-code contract (contracts.md §4): ``Restart=on-failure`` restarts a
75 or a crash, ``RestartPreventExitStatus=78`` leaves a configuration error down (the unit
shows ``failed``), and a clean exit 0 (SIGTERM handled) is not restarted. ``BOTHY_HOME`` and
the secrets come from the 0600 environment file, never inline.

A system unit (the default under sudo) runs as ``User=`` the invoking user; a user unit
(``--unit user``, or without root) runs in that user's manager, which starts at boot only
with lingering on — the plan says whether it is.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path

from bothy.install.plan import Outcome, Plan, RemoveFile, Run, WriteFile, run_command
from bothy.install.target import UNIT_NAME, Target

RESTART_SEC = 5
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_SEC = 300
TIMEOUT_STOP_SEC = 60  # above wakes.shutdown_grace_s (20 s by default) plus a worker's stop


def unit_text(target: Target) -> str:
    """The unit file, as systemd will read it."""
    user_line = f"User={target.account.name}\n" if target.scope == "system" else ""
    wanted_by = "multi-user.target" if target.scope == "system" else "default.target"
    path = os.pathsep.join(dict.fromkeys(
        [str(Path(target.python).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
    exec_start = shlex.join([target.python, "-m", "bothy", "serve"])
    return (
        "# Written by `bothy install`; `bothy install --uninstall` removes it.\n"
        "[Unit]\n"
        "Description=Bothy, a supervised Codex harness (bothy serve)\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_SEC}\n"
        f"StartLimitBurst={START_LIMIT_BURST}\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"{user_line}"
        f"EnvironmentFile={target.env_file}\n"
        f"Environment=PATH={path}\n"
        f"WorkingDirectory={target.bothy_home}\n"
        f"ExecStart={exec_start}\n"
        "Restart=on-failure\n"
        f"RestartSec={RESTART_SEC}\n"
        "RestartPreventExitStatus=78\n"
        f"TimeoutStopSec={TIMEOUT_STOP_SEC}\n"
        "KillMode=control-group\n"
        "UMask=0077\n"
        "\n"
        "[Install]\n"
        f"WantedBy={wanted_by}\n"
    )


def systemctl(target: Target, *args: str) -> tuple[str, ...]:
    """``systemctl`` for the target's manager: the system one, or the user's."""
    if target.scope == "system":
        return ("systemctl", *args)
    if target.as_root:  # root reaching a user's manager (systemd ≥ 248)
        return ("systemctl", "--user", f"--machine={target.account.name}@", *args)
    return ("systemctl", "--user", *args)


def _user_bus_env(target: Target) -> tuple[tuple[str, str], ...]:
    """A user's own `systemctl --user` over SSH needs XDG_RUNTIME_DIR to find its bus."""
    if target.scope == "user" and not target.as_root and not os.environ.get("XDG_RUNTIME_DIR"):
        return (("XDG_RUNTIME_DIR", f"/run/user/{target.account.uid}"),)
    return ()


def _probe(plan: Plan, target: Target, verb: str) -> str:
    argv = systemctl(target, verb, UNIT_NAME)
    outcome = run_command(argv, env=dict(_user_bus_env(target)))
    if outcome.code == 127:
        plan.problems.append("systemctl is not on PATH: this machine has no systemd to install"
                             " into (or PATH is wrong under sudo)")
        return "unknown"
    state = outcome.stdout.strip() or outcome.text or f"exit {outcome.code}"
    plan.checks.append(f"check: {shlex.join(argv)} -> {state}")
    return state


def _failed(action: str) -> Callable[[Outcome], str]:
    def explain(outcome: Outcome) -> str:
        return (f"systemctl could not {action} (exit {outcome.code}): {outcome.text}. See"
                f" `journalctl -u {UNIT_NAME}` (or `--user-unit`) and docs/RUNBOOK.md")
    return explain


def plan_install(plan: Plan, target: Target, env_file: WriteFile) -> None:
    """Add the unit, the environment file and the systemctl steps that are not in place."""
    enabled = _probe(plan, target, "is-enabled")
    active = _probe(plan, target, "is-active")
    unit = WriteFile(target.placed(target.unit_path), unit_text(target).encode(), 0o644,
                     target.account if target.scope == "user" else None)
    steps_before = len(plan.steps)
    plan.write(unit)
    unit_changed = len(plan.steps) > steps_before
    plan.write(env_file)
    changed = len(plan.steps) > steps_before
    env = _user_bus_env(target)
    if unit_changed:
        plan.steps.append(Run(systemctl(target, "daemon-reload"), env=env,
                              explain=_failed("reload its units")))
    if enabled != "enabled":
        plan.steps.append(Run(systemctl(target, "enable", UNIT_NAME), env=env,
                              explain=_failed("enable the unit")))
    if changed or active != "active":
        plan.steps.append(Run(systemctl(target, "restart", UNIT_NAME), env=env,
                              explain=_failed("start the service")))
    if target.scope == "user":
        _linger(plan, target)


def plan_uninstall(plan: Plan, target: Target) -> None:
    enabled = _probe(plan, target, "is-enabled")
    active = _probe(plan, target, "is-active")
    unit = target.placed(target.unit_path)
    env = _user_bus_env(target)
    if enabled == "enabled" or active == "active":
        plan.steps.append(Run(systemctl(target, "disable", "--now", UNIT_NAME), env=env))
    if unit.exists():
        plan.steps.append(RemoveFile(unit))
        plan.steps.append(Run(systemctl(target, "daemon-reload"), env=env))
    else:
        plan.unchanged.append(f"absent: {unit}")


def _linger(plan: Plan, target: Target) -> None:
    """A user manager runs at boot only with lingering on (Hermes #43748: no linger, no start)."""
    argv = ("loginctl", "show-user", target.account.name, "--property=Linger", "--value")
    outcome = run_command(argv)
    if outcome.code == 127:
        plan.notes.append("loginctl is not on PATH: cannot tell whether lingering is on")
        return
    linger = outcome.stdout.strip() if outcome.code == 0 else "no"
    plan.checks.append(f"check: {shlex.join(argv)} -> {outcome.stdout.strip() or outcome.text}")
    if linger == "yes":
        plan.notes.append(f"lingering is on for {target.account.name}: the user unit starts at"
                          " boot")
    else:
        plan.notes.append(
            f"lingering is off for {target.account.name}: the user unit starts only when"
            f" {target.account.name} logs in, not at boot. To start it at boot:"
            f" sudo loginctl enable-linger {target.account.name}")
