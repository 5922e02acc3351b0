"""Who the service is installed for, with which service manager, and where its files go.

Under ``sudo`` the service belongs to the invoking user (``SUDO_USER``), never to root;
``BOTHY_HOME`` is ``--home``, else ``BOTHY_HOME`` if the environment still carries it (sudo
resets the environment, so it is there only if the operator passed it), else that user's
``~/.bothy``.

Files outside ``BOTHY_HOME`` (the unit, the plist) are placed under an install root, ``/``
unless ``BOTHY_INSTALL_ROOT`` names another directory: like ``DESTDIR`` for packagers, it
lets the tests and a staging build write the files somewhere harmless. The commands
(``systemctl``, ``launchctl``, ``tailscale``) are still found on ``PATH`` and run.
"""

from __future__ import annotations

import os
import platform
import pwd
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Manager = Literal["systemd", "launchd"]
Scope = Literal["system", "user"]

UNIT_NAME = "bothy.service"
LAUNCHD_LABEL = "org.bothy.serve"
ENV_FILE_NAME = "service.env"


@dataclass(frozen=True)
class Account:
    """The user the service runs as."""

    name: str
    uid: int
    gid: int
    home: Path


@dataclass(frozen=True)
class Target:
    """Everything the plan needs to know about where and for whom it installs."""

    manager: Manager
    scope: Scope  # systemd: a system unit with User=, or a user unit; launchd: always "user"
    account: Account
    bothy_home: Path
    install_root: Path
    euid: int
    python: str  # the interpreter that runs `python -m bothy serve`

    @property
    def as_root(self) -> bool:
        return self.euid == 0

    @property
    def env_file(self) -> Path:
        """The 0600 environment file of the service: BOTHY_HOME and the secrets."""
        return self.bothy_home / ENV_FILE_NAME

    @property
    def logs_dir(self) -> Path:
        return self.bothy_home / "logs"

    def placed(self, path: Path) -> Path:
        """``path`` (absolute) under the install root."""
        return self.install_root / path.relative_to(path.anchor)

    @property
    def unit_path(self) -> Path:
        """Where the systemd unit goes, as the service manager sees it."""
        if self.scope == "system":
            return Path("/etc/systemd/system") / UNIT_NAME
        return self.account.home / ".config/systemd/user" / UNIT_NAME

    @property
    def plist_path(self) -> Path:
        return self.account.home / "Library/LaunchAgents" / f"{LAUNCHD_LABEL}.plist"

    @property
    def launchd_domain(self) -> str:
        return f"gui/{self.account.uid}"


def resolve_target(
    *,
    user: str | None,
    home: str | None,
    manager: str | None,
    unit: str | None,
    environ: dict[str, str] | None = None,
) -> Target | str:
    """The target of ``bothy install``, or a sentence saying why there is none."""
    env = dict(os.environ if environ is None else environ)
    euid = os.geteuid()
    account = _account(user, env, euid)
    if isinstance(account, str):
        return account
    chosen = _manager(manager)
    if isinstance(chosen, str) and chosen not in ("systemd", "launchd"):
        return chosen
    scope: Scope = "user"
    if chosen == "systemd":
        scope = "system" if (unit or ("system" if euid == 0 else "user")) == "system" else "user"
        if scope == "system" and euid != 0:
            return ("a system unit needs root: run `sudo bothy install …`, or `--unit user`"
                    " for a user unit")
    elif unit is not None:
        return "--unit applies to systemd only; launchd installs a per-user LaunchAgent"
    configured = home or env.get("BOTHY_HOME")
    bothy_home = Path(configured).expanduser() if configured else account.home / ".bothy"
    if not bothy_home.is_absolute():
        bothy_home = Path.cwd() / bothy_home
    root = Path(env.get("BOTHY_INSTALL_ROOT") or "/")
    if not root.is_absolute():
        return f"BOTHY_INSTALL_ROOT must be an absolute directory (got {str(root)!r})"
    return Target(
        manager=chosen,  # type: ignore[arg-type]  # narrowed above: systemd or launchd
        scope=scope,
        account=account,
        bothy_home=bothy_home,
        install_root=root,
        euid=euid,
        python=sys.executable,
    )


def _account(user: str | None, env: dict[str, str], euid: int) -> Account | str:
    name = user or (env.get("SUDO_USER") if euid == 0 else None)
    try:
        entry = pwd.getpwnam(name) if name else pwd.getpwuid(euid)
    except KeyError:
        source = "--user" if user else "SUDO_USER"
        return f"there is no user {name!r} on this machine (from {source})"
    if entry.pw_uid != euid and euid != 0:
        return f"installing for {entry.pw_name} needs root: run it with sudo"
    if entry.pw_uid == 0 and not user:
        return ("refusing to install Bothy to run as root: run `sudo bothy install …` from the"
                " account that should own it, or name it with --user NAME")
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def _manager(manager: str | None) -> str:
    if manager:
        return manager
    system = platform.system()
    if system == "Linux":
        return "systemd"
    if system == "Darwin":
        return "launchd"
    return f"no service manager Bothy knows on {system}: systemd (Linux) or launchd (macOS)"
