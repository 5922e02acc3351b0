"""`bothy install` and `bothy funnel`, driven as an operator would: the real CLI as a subprocess.

systemctl, launchctl, loginctl and tailscale are fakes on PATH (tests/fakes/service_tools.py)
that record their arguments; files go under BOTHY_INSTALL_ROOT (never the real /etc), and the
generated unit is checked by the real `systemd-analyze verify`. Installing for another user
needs root (as `sudo bothy install` does), so those tests run as root, like CI.
"""

from __future__ import annotations

import json
import os
import plistlib
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.service_tools import calls, install_fakes, load_state

PROBES = {("systemctl", "is-enabled"), ("systemctl", "is-active"), ("launchctl", "print"),
          ("loginctl", "show-user"), ("tailscale", "status"), ("tailscale", "serve status")}


def _is_probe(call: list[str]) -> bool:
    words = [word for word in call[1:] if not word.startswith("-")]
    return (call[0], words[0]) in PROBES or (call[0], " ".join(words[:2])) in PROBES

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="installing for another user needs"
                                " root, as `sudo bothy install` does")


def _service_account() -> pwd.struct_passwd:
    """A user that is neither root nor nobody (systemd warns about User=nobody); without
    root, the one running the tests."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    for entry in pwd.getpwall():
        if 0 < entry.pw_uid < 65534 and entry.pw_name != "nobody":
            return entry
    pytest.skip("no user account other than root and nobody on this machine")


class Box:
    """A machine to install on: a BOTHY_HOME owned by the service user, an install root,
    and the fakes on PATH."""

    def __init__(self, root: Path, config: dict[str, Any] | None = None) -> None:
        self.account = _service_account()
        self.root = root
        self.home = root / "home"
        self.install_root = root / "install-root"
        self.bin = root / "bin"
        self.state = root / "fake-state"
        for directory in (self.home, self.install_root, self.state):
            directory.mkdir()
        if os.geteuid() == 0:
            os.chown(self.home, self.account.pw_uid, self.account.pw_gid)
        install_fakes(self.bin)
        self.write_config(config or {
            "site": "acme-mini", "workspace": str(root),
            "budget": {"per_run_usd": "0.50", "per_day_usd": "25.00"},
            "webhooks": {"github": {"path": "/hooks/github", "secret_env": ["GH_SECRET"]}},
            "chat": {"slack": {}},
        })

    def write_config(self, config: dict[str, Any]) -> None:
        (self.home / "config.json").write_text(json.dumps(config))

    def bothy(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        environ = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "SUDO_USER": self.account.pw_name,
            "BOTHY_INSTALL_ROOT": str(self.install_root),
            "FAKE_TOOLS_DIR": str(self.state),
            "GH_SECRET": "s3cret-value",
            **env,
        }
        return subprocess.run(
            [sys.executable, "-m", "bothy", *args, "--home", str(self.home)],
            env=environ, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=60, check=False,
        )

    def calls(self) -> list[list[str]]:
        return calls(self.state)

    def changes(self) -> list[list[str]]:
        """The recorded calls that change something (not the read-only checks)."""
        return [call for call in self.calls() if not _is_probe(call)]

    def forget_calls(self) -> None:
        (self.state / "calls.jsonl").unlink(missing_ok=True)

    @property
    def unit(self) -> Path:
        return self.install_root / "etc/systemd/system/bothy.service"

    @property
    def plist(self) -> Path:
        home = Path(self.account.pw_dir).relative_to("/")
        return self.install_root / home / "Library/LaunchAgents/org.bothy.serve.plist"


def _run_lines(stdout: str) -> list[list[str]]:
    import shlex

    return [shlex.split(line.removeprefix("run: ")) for line in stdout.splitlines()
            if line.startswith("run: ")]


def _files_shown(stdout: str) -> dict[str, tuple[str, str]]:
    """`write PATH (mode M, owner O)` blocks of the plan: path -> (header, content)."""
    shown: dict[str, tuple[str, str]] = {}
    current: str | None = None
    for line in stdout.splitlines():
        if line.startswith("write "):
            current = line.split()[1]
            shown[current] = (line, "")
        elif current and line.startswith("  | "):
            header, body = shown[current]
            shown[current] = (header, body + line[4:] + "\n")
        elif current and line == "  |":
            header, body = shown[current]
            shown[current] = (header, body + "\n")
        else:
            current = None
    return shown


@needs_root
def test_dry_run_prints_every_file_and_command_and_changes_nothing(tmp_path: Path) -> None:
    """--dry-run shows each file with mode and content, secrets as <set>/<missing>, each
    command; nothing is written and only read-only checks run."""
    box = Box(tmp_path)
    done = box.bothy("install", "--dry-run")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"write {box.unit} (mode 0644, owner root)" in out
    assert f"write {box.home}/service.env (mode 0600, owner {box.account.pw_name})" in out
    assert "  | RestartPreventExitStatus=78" in out and f"  | User={box.account.pw_name}" in out
    assert "  | GH_SECRET=<set>" in out and "  | SLACK_BOT_TOKEN=<missing>" in out
    assert "s3cret-value" not in out
    assert _run_lines(out) == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "bothy.service"],
        ["systemctl", "restart", "bothy.service"],
        ["tailscale", "serve", "--bg", "--yes", "--https=9443", "http://127.0.0.1:8765"],
    ]
    assert "note: SLACK_BOT_TOKEN is missing (named by chat.slack.bot_token_env)" in out
    assert out.splitlines()[-1].startswith("dry run: nothing was changed")
    assert not box.unit.exists() and not (box.home / "service.env").exists()
    assert box.changes() == []


@needs_root
def test_serve_does_exactly_what_the_dry_run_printed(tmp_path: Path) -> None:
    """--serve prints the dry run's lines and does just that: the same files, contents, modes
    and owners, the same commands; nothing under BOTHY_HOME belongs to root."""
    box = Box(tmp_path)
    planned = box.bothy("install", "--dry-run")
    box.forget_calls()
    done = box.bothy("install", "--serve")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:-1] == planned.stdout.splitlines()[:-1]
    assert done.stdout.splitlines()[-1] == "installed: 6 step(s) done"
    assert box.changes() == _run_lines(planned.stdout)

    shown = _files_shown(planned.stdout)
    assert set(shown) == {str(box.unit), str(box.home / "service.env")}
    assert box.unit.read_text() == shown[str(box.unit)][1]
    assert oct(box.unit.stat().st_mode & 0o777) == "0o644" and box.unit.stat().st_uid == 0
    env_file = box.home / "service.env"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    text = env_file.read_text()
    assert f"BOTHY_HOME={box.home}\n" in text and "GH_SECRET=s3cret-value\n" in text
    assert "# missing: SLACK_BOT_TOKEN (named by chat.slack.bot_token_env)" in text
    for path in [box.home, *box.home.rglob("*")]:
        if path.name != "config.json":  # written by the test, not by bothy
            assert path.stat().st_uid == box.account.pw_uid, path
    assert load_state(box.state)["serve"]["TCP"] == {"9443": {"HTTPS": True}}


@needs_root
def test_a_second_install_changes_nothing_and_says_so(tmp_path: Path) -> None:
    """Run twice: the second run only checks, and says there is nothing to change."""
    box = Box(tmp_path)
    assert box.bothy("install", "--serve").returncode == 0
    box.forget_calls()
    again = box.bothy("install", "--serve")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == "nothing to change: already installed"
    assert f"unchanged: {box.unit}" in again.stdout
    assert "unchanged: tailscale serve https://mini.tail1234.ts.net:9443/" in again.stdout
    assert box.changes() == []
    planned = box.bothy("install", "--dry-run")
    assert planned.stdout.splitlines()[-1].startswith("dry run: nothing to change")


@needs_root
def test_a_changed_secret_rewrites_the_env_file_and_restarts(tmp_path: Path) -> None:
    """A new secret value in the installer's environment is written and the service
    restarted; the unit itself is not reloaded."""
    box = Box(tmp_path)
    assert box.bothy("install", "--serve").returncode == 0
    box.forget_calls()
    done = box.bothy("install", "--serve", GH_SECRET="rotated", SLACK_BOT_TOKEN="xoxb-1")
    assert done.returncode == 0, done.stderr
    assert box.changes() == [["systemctl", "restart", "bothy.service"]]
    text = (box.home / "service.env").read_text()
    assert "GH_SECRET=rotated\n" in text and "SLACK_BOT_TOKEN=xoxb-1\n" in text


def _verify(unit: Path, *, user: bool, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`; .ci/run"
                    " installs it)")
    env = dict(os.environ)
    argv = [tool, "verify", str(unit)]
    if user:  # a user manager needs a runtime directory (research §C.1)
        runtime = tmp_path / "xdg-runtime"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        argv = [tool, "--user", "verify", str(unit)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


@needs_root
def test_the_system_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The real `systemd-analyze verify` accepts the unit with nothing on stderr (it exits 0
    on unknown keys, so stderr is the signal)."""
    box = Box(tmp_path)
    assert box.bothy("install", "--serve", "--no-tailscale").returncode == 0
    verified = _verify(box.unit, user=False, tmp_path=tmp_path)
    assert (verified.returncode, verified.stderr) == (0, "")


@needs_root
def test_a_user_unit_passes_verify_and_says_whether_lingering_is_on(tmp_path: Path) -> None:
    """--unit user: the user's own manager is driven, the unit verifies, and the operator is
    told that without lingering it does not start at boot."""
    box = Box(tmp_path)
    name = box.account.pw_name
    done = box.bothy("install", "--serve", "--unit", "user", "--no-tailscale", FAKE_LINGER="no")
    assert done.returncode == 0, done.stderr
    machine = f"--machine={name}@"
    assert box.changes() == [
        ["systemctl", "--user", machine, "daemon-reload"],
        ["systemctl", "--user", machine, "enable", "bothy.service"],
        ["systemctl", "--user", machine, "restart", "bothy.service"],
    ]
    assert (f"note: lingering is off for {name}: the user unit starts only when {name} logs"
            f" in, not at boot. To start it at boot: sudo loginctl enable-linger {name}"
            in done.stdout)
    home = Path(box.account.pw_dir).relative_to("/")
    unit = box.install_root / home / ".config/systemd/user/bothy.service"
    assert unit.stat().st_uid == box.account.pw_uid
    assert "User=" not in unit.read_text() and "WantedBy=default.target" in unit.read_text()
    verified = _verify(unit, user=True, tmp_path=tmp_path)
    assert (verified.returncode, verified.stderr) == (0, "")

    again = box.bothy("install", "--serve", "--unit", "user", "--no-tailscale", FAKE_LINGER="yes")
    assert f"note: lingering is on for {name}: the user unit starts at boot" in again.stdout


@needs_root
def test_uninstall_undoes_the_install_and_keeps_the_secrets(tmp_path: Path) -> None:
    """--uninstall stops and disables the unit, removes it, turns the tailnet door off, keeps
    BOTHY_HOME; a second uninstall has nothing to do."""
    box = Box(tmp_path)
    assert box.bothy("install", "--serve").returncode == 0
    box.forget_calls()
    done = box.bothy("install", "--uninstall")
    assert done.returncode == 0, done.stderr
    assert box.changes() == [
        ["systemctl", "disable", "--now", "bothy.service"],
        ["systemctl", "daemon-reload"],
        ["tailscale", "serve", "--https=9443", "off"],
    ]
    assert f"remove {box.unit}" in done.stdout
    assert not box.unit.exists()
    assert (box.home / "service.env").exists()
    assert load_state(box.state)["serve"]["TCP"] == {}
    again = box.bothy("install", "--uninstall")
    assert again.stdout.splitlines()[-1] == "nothing to change: already removed"


@needs_root
def test_a_failing_systemctl_is_a_clear_non_zero_failure(tmp_path: Path) -> None:
    """A start that systemd refuses stops the install with exit 1 and says where to look."""
    box = Box(tmp_path)
    done = box.bothy("install", "--serve", FAKE_SYSTEMCTL_FAIL="restart")
    assert done.returncode == 1
    assert "bothy: install: systemctl could not start the service (exit 1): Job for" in done.stderr
    assert "journalctl -u bothy.service" in done.stderr


def _plist_install(box: Box, **env: str) -> subprocess.CompletedProcess[str]:
    return box.bothy("install", "--serve", "--manager", "launchd", "--no-tailscale", **env)


@needs_root
def test_the_launchagent_round_trips_with_the_expected_keys(tmp_path: Path) -> None:
    """The plist parses with plistlib to the keys and types launchd needs: KeepAlive so a 75
    is relaunched and a clean exit is not, a throttle, launchd's config-error mode, logs, no
    secret inline; the job is enabled before it is bootstrapped in the user's GUI domain."""
    box = Box(tmp_path)
    done = _plist_install(box)
    assert done.returncode == 0, done.stderr
    raw = box.plist.read_bytes()
    plist = plistlib.loads(raw)
    assert plistlib.loads(plistlib.dumps(plist, fmt=plistlib.FMT_XML)) == plist
    expected_types = {
        "Label": str, "ProgramArguments": list, "EnvironmentVariables": dict,
        "WorkingDirectory": str, "RunAtLoad": bool, "KeepAlive": dict,
        "ThrottleInterval": int, "ExitTimeOut": int, "ProcessType": str, "Umask": int,
        "StandardOutPath": str, "StandardErrorPath": str,
    }
    assert {key: type(value) for key, value in plist.items()} == expected_types
    assert plist["Label"] == "org.bothy.serve"
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 10 and plist["RunAtLoad"] is True
    assert plist["EnvironmentVariables"]["BOTHY_SERVICE_MANAGER"] == "launchd"
    assert all(isinstance(arg, str) for arg in plist["ProgramArguments"])
    assert plist["ProgramArguments"][-3:] == ["-m", "bothy", "serve"]
    for key in ("WorkingDirectory", "StandardOutPath", "StandardErrorPath"):
        assert Path(plist[key]).is_absolute()
    assert Path(plist["StandardOutPath"]).parent == box.home / "logs"
    assert b"s3cret-value" not in raw
    assert box.plist.stat().st_uid == box.account.pw_uid
    assert (box.home / "logs").stat().st_uid == box.account.pw_uid
    uid = box.account.pw_uid
    assert box.changes() == [
        ["launchctl", "enable", f"gui/{uid}/org.bothy.serve"],
        ["launchctl", "bootstrap", f"gui/{uid}", str(box.plist)],
    ]
    box.forget_calls()
    again = _plist_install(box)
    assert again.stdout.splitlines()[-1] == "nothing to change: already installed"
    assert box.changes() == []


@needs_root
def test_a_job_left_disabled_is_enabled_before_bootstrap(tmp_path: Path) -> None:
    """A job disabled by an earlier uninstall would fail bootstrap with 5; enabling it first
    makes the install work."""
    box = Box(tmp_path)
    done = _plist_install(box, FAKE_LAUNCHCTL_DISABLED=f"gui/{box.account.pw_uid}/org.bothy.serve")
    assert done.returncode == 0, done.stderr


@needs_root
def test_a_bootstrap_io_error_is_retried(tmp_path: Path) -> None:
    """`Bootstrap failed: 5: Input/output error` (the old job still tearing down) is tried
    again, saying so, and the install succeeds."""
    box = Box(tmp_path)
    done = _plist_install(box, FAKE_LAUNCHCTL_EIO="1")
    assert done.returncode == 0, done.stderr
    assert "retry: `launchctl bootstrap" in done.stdout
    assert "5: Input/output error" in done.stdout
    bootstraps = [call for call in box.changes() if call[1] == "bootstrap"]
    assert len(bootstraps) == 2


@needs_root
def test_a_headless_mac_is_explained(tmp_path: Path) -> None:
    """Error 125 (no GUI session for the user) is not retried: it is explained, exit 1."""
    box = Box(tmp_path)
    done = _plist_install(box, FAKE_LAUNCHCTL_HEADLESS="1")
    assert done.returncode == 1
    assert f"{box.account.pw_name} has no GUI session on this Mac (error 125" in done.stderr
    assert "turn on automatic login" in done.stderr
    assert len([call for call in box.changes() if call[1] == "bootstrap"]) == 1


@needs_root
def test_the_launchagent_command_reads_the_env_file_and_parks_a_config_error(
    tmp_path: Path,
) -> None:
    """Running the plist's ProgramArguments with its EnvironmentVariables (as launchd would)
    loads the env file and, on a configuration error, exits 0 with state/config-error.txt
    rather than the 78 launchd would relaunch forever."""
    box = Box(tmp_path)
    assert _plist_install(box).returncode == 0
    plist = plistlib.loads(box.plist.read_bytes())
    environment = {**plist["EnvironmentVariables"], "PATH": os.environ["PATH"]}
    (box.home / "state").mkdir()
    def start_as_launchd_would() -> str:
        done = subprocess.run(plist["ProgramArguments"], env=environment,
                              cwd=plist["WorkingDirectory"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return (box.home / "state" / "config-error.txt").read_text()

    # GH_SECRET came from the env file (the route's check passed); codex is not on PATH.
    error = start_as_launchd_would()
    assert "codex command 'codex' not found on PATH" in error
    env_file = box.home / "service.env"
    env_file.write_text(env_file.read_text().replace("GH_SECRET=s3cret-value\n", ""))
    # With a codex and its home in place, the daemon reaches the routes' secrets.
    config = json.loads((box.home / "config.json").read_text())
    (tmp_path / "codex-home").mkdir()
    config["codex"] = {"command": [shutil.which("true")], "home": str(tmp_path / "codex-home")}
    box.write_config(config)
    error = start_as_launchd_would()
    assert "webhooks.github.secret_env: none of GH_SECRET is set" in error


@pytest.mark.parametrize(("mode", "message"), [
    ("missing", "tailscale is not installed (not on PATH)"),
    ("down", "tailscale is not answering"),
    ("logged_out", "tailscale is not logged in (state NeedsLogin): run `sudo tailscale up`"),
    ("https_off", "HTTPS is not enabled on this tailnet"),
])
@needs_root
def test_tailscale_that_cannot_serve_stops_the_install_before_it_starts(
    tmp_path: Path, mode: str, message: str
) -> None:
    """Tailscale missing, down, logged out or without HTTPS: exit 1, the reason, and nothing
    changed at all."""
    box = Box(tmp_path)
    if mode == "missing":
        (box.bin / "tailscale").unlink()
    done = box.bothy("install", "--serve", FAKE_TAILSCALE=mode)
    assert done.returncode == 1
    assert message in done.stderr
    assert "nothing was changed (1 problem(s) above)" in done.stderr
    assert not box.unit.exists() and box.changes() == []


@pytest.mark.parametrize(("mode", "message"), [
    ("access_denied", "(Access denied: `tailscale serve --bg --yes --https=9443"),
    ("noop", "tailscale serve exited 0 but port 9443 is not served"),
])
@needs_root
def test_tailscale_refusing_to_serve_is_a_clear_failure(
    tmp_path: Path, mode: str, message: str
) -> None:
    """`tailscale serve` answering Access denied, or exiting 0 having served nothing: exit 1
    with the reason, never a silent success."""
    box = Box(tmp_path)
    done = box.bothy("install", "--serve", FAKE_TAILSCALE=mode)
    assert done.returncode == 1
    assert message in done.stderr
    if mode == "access_denied":
        assert "sudo tailscale set --operator=" in done.stderr


@needs_root
def test_a_missing_config_is_a_configuration_error(tmp_path: Path) -> None:
    """No config.json: nothing to install yet, exit 78 with what to create."""
    box = Box(tmp_path)
    (box.home / "config.json").unlink()
    done = box.bothy("install", "--dry-run")
    assert done.returncode == 78
    assert "config.json does not exist" in done.stderr


def test_root_without_sudo_is_refused(tmp_path: Path) -> None:
    """As root with no SUDO_USER, Bothy will not install itself to run as root."""
    if os.geteuid() != 0:
        pytest.skip("checks what happens as root")
    box = Box(tmp_path)
    done = box.bothy("install", "--dry-run", SUDO_USER="")
    assert done.returncode == 1
    assert "refusing to install Bothy to run as root" in done.stderr


def test_install_without_a_mode_is_a_usage_error(tmp_path: Path) -> None:
    """`bothy install` alone says which modes there are (exit 64)."""
    box = Box(tmp_path)
    done = box.bothy("install")
    assert done.returncode == 64
    assert "--dry-run (print the plan), --serve" in done.stderr


def _funnel_config(box: Box, **listen: Any) -> None:
    box.write_config({
        "site": "acme-mini", "workspace": str(box.root),
        "budget": {"per_run_usd": "0.50", "per_day_usd": "25.00"},
        "listen": {"public_port": 8766, **listen},
        "webhooks": {"github": {"path": "/hooks/github", "secret_env": ["GH_SECRET"],
                                "public": True}},
    })


def test_funnel_prints_the_commands_the_config_implies(tmp_path: Path) -> None:
    """`bothy funnel` prints the tailscale funnel command for the public listener on the
    configured Funnel port, the public URL of each public route, and how to close it."""
    box = Box(tmp_path)
    _funnel_config(box, funnel_port=8443)
    done = box.bothy("funnel")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "# open the public listener (listen.public_port 8766) to the internet on port 8443:",
        "tailscale funnel --bg --yes --https=8443 http://127.0.0.1:8766",
        "# webhooks.github: https://mini.tail1234.ts.net:8443/hooks/github",
        "# to close it: tailscale funnel --https=8443 off",
    ]
    assert box.changes() == []


def test_funnel_with_tailscale_logged_out_fails_clearly(tmp_path: Path) -> None:
    """The commands are still printed, but a Tailscale that cannot run them is exit 1."""
    box = Box(tmp_path)
    _funnel_config(box)
    done = box.bothy("funnel", FAKE_TAILSCALE="logged_out")
    assert done.returncode == 1
    assert "tailscale funnel --bg --yes --https=443 http://127.0.0.1:8766" in done.stdout
    assert "bothy: funnel: tailscale is not logged in" in done.stderr


def test_funnel_without_a_public_port_has_nothing_to_open(tmp_path: Path) -> None:
    box = Box(tmp_path)
    done = box.bothy("funnel")
    assert done.returncode == 0
    assert "listen.public_port is not set" in done.stdout


@pytest.mark.parametrize(("listen", "key"), [
    ({"funnel_port": 8080}, "listen.funnel_port: Tailscale Funnel only opens ports 443, 8443,"
                            " 10000"),
    ({"serve_port": 443}, "listen.serve_port: keep the tailnet door off Funnel's ports"),
])
def test_ports_tailscale_would_refuse_are_configuration_errors(
    tmp_path: Path, listen: dict[str, int], key: str
) -> None:
    """A Funnel port Tailscale does not allow, or a serve port that would take one away from
    Funnel, is refused in config: exit 78 naming the key."""
    box = Box(tmp_path)
    _funnel_config(box, **listen)
    done = box.bothy("funnel")
    assert done.returncode == 78
    assert key in done.stderr
