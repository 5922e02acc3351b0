"""`bothy install`: the service (systemd or launchd) and its tailnet door (`tailscale serve`).

    target.py    who it is for, which manager, where files go (BOTHY_INSTALL_ROOT)
    envfile.py   the 0600 environment file: BOTHY_HOME and the secrets the config names
    systemd.py   the unit and its systemctl steps (+ the lingering check of a user unit)
    launchd.py   the LaunchAgent plist and its launchctl steps
    tailscale.py `tailscale serve` for the tailnet port; the `tailscale funnel` lines
    plan.py      the plan: checks, files, commands; printed by --dry-run, carried out by --serve
    envexec.py   what the LaunchAgent runs: load the environment file, exec `bothy serve`
"""

from __future__ import annotations

import os
import subprocess

from bothy.config import Config
from bothy.install import launchd, systemd, tailscale
from bothy.install.envfile import build_env_file, secret_names
from bothy.install.plan import Plan, WriteFile, carry_out, plan_lines
from bothy.install.target import LAUNCHD_LABEL, UNIT_NAME, Target, resolve_target

__all__ = [
    "Plan",
    "Target",
    "carry_out",
    "install_plan",
    "plan_lines",
    "resolve_target",
    "uninstall_plan",
]


def _title(target: Target, verb: str) -> str:
    who = f"{target.account.name} (uid {target.account.uid})"
    if target.manager == "launchd":
        what = f"LaunchAgent {LAUNCHD_LABEL} in {target.launchd_domain}, for {who}"
    else:
        what = f"systemd {target.scope} unit {UNIT_NAME}, running as {who}"
    return f"bothy install{verb}: {what}, BOTHY_HOME={target.bothy_home}"


def install_plan(
    target: Target, config: Config, *, with_tailscale: bool, environ: dict[str, str]
) -> Plan:
    """Everything `bothy install --serve` would do, found out without changing anything."""
    plan = Plan(_title(target, ""))
    _check_home(plan, target)
    _check_interpreter(plan, target)
    env = build_env_file(target.env_file, target.bothy_home, secret_names(config), environ)
    plan.problems += env.problems
    env_step = WriteFile(target.env_file, env.content, 0o600, target.account, shown=env.shown)
    if target.manager == "systemd":
        systemd.plan_install(plan, target, env_step)
        restart = shlex_restart(target)
    else:
        launchd.plan_install(plan, target, env_step)
        restart = "bothy install --serve"
    for name, key in env.missing.items():
        plan.notes.append(f"{name} is missing (named by {key}): add it to {target.env_file} as"
                          f" {name}=…, then `{restart}`")
    if with_tailscale:
        tailscale.plan_serve(plan, config, target.account.name)
    if config.listen.public_port is not None:
        plan.notes.append("public routes are not opened by install: `bothy funnel` prints the"
                          " tailscale funnel commands")
    return plan


def uninstall_plan(target: Target, config: Config | None, *, with_tailscale: bool) -> Plan:
    """Everything `bothy install --uninstall` would undo. BOTHY_HOME is left as it is."""
    plan = Plan(_title(target, " --uninstall"))
    if target.manager == "systemd":
        systemd.plan_uninstall(plan, target)
    else:
        launchd.plan_uninstall(plan, target)
    if with_tailscale and config is not None:
        tailscale.plan_unserve(plan, config, target.account.name)
    if target.env_file.exists():
        plan.notes.append(f"kept {target.env_file} (it holds the secrets) and everything else in"
                          f" {target.bothy_home}")
    return plan


def shlex_restart(target: Target) -> str:
    return " ".join(systemd.systemctl(target, "restart", UNIT_NAME))


def _check_home(plan: Plan, target: Target) -> None:
    try:
        info = target.bothy_home.stat()
    except OSError as exc:
        plan.problems.append(f"BOTHY_HOME {target.bothy_home} cannot be used: {exc.strerror}")
        return
    if info.st_uid != target.account.uid:
        plan.problems.append(
            f"BOTHY_HOME {target.bothy_home} belongs to uid {info.st_uid}, not to"
            f" {target.account.name}, who will run the service: `sudo chown -R"
            f" {target.account.name} {target.bothy_home}` (or name the right one with --home)")


def _check_interpreter(plan: Plan, target: Target) -> None:
    """The service runs `python -m bothy` as the account: see that it can, before relying on it."""
    if not target.as_root or target.account.uid == 0:
        return
    try:
        done = subprocess.run(
            [target.python, "-m", "bothy", "--version"], user=target.account.uid,
            group=target.account.gid, extra_groups=[], cwd="/", stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=30, check=False,
            env={"PATH": os.defpath, "HOME": str(target.account.home)},
        )
        failed = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        problem = None if done.returncode == 0 else failed[0]
    except (OSError, subprocess.SubprocessError) as exc:
        problem = str(exc)
    if problem:
        plan.notes.append(
            f"warning: {target.account.name} cannot run {target.python} -m bothy ({problem}):"
            f" the service will fail to start; install Bothy where {target.account.name} can"
            " read it (a virtualenv outside /root, or as that user), then rerun")
