"""Fakes of ``systemctl``, ``launchctl``, ``loginctl`` and ``tailscale`` for `bothy install`.

They cannot run here for real (no booted systemd, no Mac, no tailnet), so each is a small
program put on PATH that records its arguments (``$FAKE_TOOLS_DIR/calls.jsonl``), keeps its
state (``state.json``) and answers with the real tool's output, exit codes and error texts
(research §C). Environment variables make it fail each way an operator can meet:

- ``FAKE_SYSTEMCTL_FAIL=VERB``  that verb fails as systemd says it ("Job for … failed")
- ``FAKE_LINGER=yes|no``        what ``loginctl show-user --property=Linger`` answers
- ``FAKE_LAUNCHCTL_EIO=N``      the first N bootstraps fail with 5: Input/output error
- ``FAKE_LAUNCHCTL_HEADLESS=1`` no GUI session: bootstrap fails with 125
- ``FAKE_LAUNCHCTL_DISABLED=gui/UID/LABEL``  a service left disabled by an earlier tool
- ``FAKE_TAILSCALE=ok|down|logged_out|https_off|access_denied|noop``

launchctl's state models the real trap: bootstrapping a job that is disabled, or already
loaded, fails with 5: Input/output error.
"""

from __future__ import annotations

import json
import os
import plistlib
import sys
from pathlib import Path
from typing import Any

TOOLS = ("systemctl", "launchctl", "loginctl", "tailscale")
NODE = "mini.tail1234.ts.net"
_REPO = Path(__file__).resolve().parents[2]


def install_fakes(bin_dir: Path, tools: tuple[str, ...] = TOOLS) -> None:
    """Write one executable per tool into ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        script = bin_dir / tool
        script.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            f"sys.path.insert(0, {str(_REPO)!r})\n"
            "from tests.fakes.service_tools import main\n"
            f"raise SystemExit(main({tool!r}, sys.argv[1:]))\n"
        )
        script.chmod(0o755)


def calls(state_dir: Path) -> list[list[str]]:
    """Every recorded invocation, as ``[tool, *args]``."""
    path = state_dir / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def load_state(state_dir: Path) -> dict[str, Any]:
    path = state_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_state(state_dir: Path, state: dict[str, Any]) -> None:
    (state_dir / "state.json").write_text(json.dumps(state, indent=2))


def main(tool: str, args: list[str]) -> int:
    state_dir = Path(os.environ["FAKE_TOOLS_DIR"])
    with (state_dir / "calls.jsonl").open("a") as log:
        log.write(json.dumps([tool, *args]) + "\n")
    state = load_state(state_dir)
    code = {"systemctl": _systemctl, "launchctl": _launchctl, "loginctl": _loginctl,
            "tailscale": _tailscale}[tool](state, args)
    save_state(state_dir, state)
    return code


def _err(text: str, code: int) -> int:
    print(text, file=sys.stderr)
    return code


def _systemctl(state: dict[str, Any], args: list[str]) -> int:
    options = [arg for arg in args if arg.startswith("-")]
    words = [arg for arg in args if not arg.startswith("-")]
    scope = "system"
    if "--user" in options:
        machine = next((o.split("=", 1)[1] for o in options if o.startswith("--machine=")), "")
        scope = f"user:{machine}"
    units = state.setdefault("systemd", {}).setdefault(scope, {})
    verb, names = words[0], words[1:]
    if os.environ.get("FAKE_SYSTEMCTL_FAIL") == verb:
        unit = names[0] if names else "bothy.service"
        return _err(f"Job for {unit} failed because the control process exited with error"
                    f" code.\nSee \"systemctl status {unit}\" and \"journalctl -xeu {unit}\""
                    " for details.", 1)
    if verb == "daemon-reload":
        state["systemd"]["reloads"] = state["systemd"].get("reloads", 0) + 1
        return 0
    unit = units.setdefault(names[0], {"enabled": False, "active": False, "known": False})
    if verb == "is-enabled":
        if not unit["known"]:
            return _err(f"Failed to get unit file state for {names[0]}: No such file or"
                        " directory", 1)
        print("enabled" if unit["enabled"] else "disabled")
        return 0 if unit["enabled"] else 1
    if verb == "is-active":
        print("active" if unit["active"] else "inactive")
        return 0 if unit["active"] else 3
    if verb == "enable":
        unit.update(enabled=True, known=True)
        return 0
    if verb == "disable":
        unit["enabled"] = False
        if "--now" in options:
            unit["active"] = False
        return 0
    if verb in ("start", "restart"):
        unit.update(active=True, known=True)
        return 0
    return _err(f"Unknown command verb {verb}.", 1)


def _loginctl(state: dict[str, Any], args: list[str]) -> int:
    if args[:1] != ["show-user"]:
        return _err(f"Unknown command verb {args[0]}.", 1)
    linger = os.environ.get("FAKE_LINGER", "no")
    if linger == "absent":
        return _err(f"Failed to get user: User {args[1]} is not logged in or lingering", 1)
    print(linger)
    return 0


def _launchctl(state: dict[str, Any], args: list[str]) -> int:
    jobs = state.setdefault("launchd", {"loaded": [], "disabled": [], "bootstraps": 0})
    left_disabled = os.environ.get("FAKE_LAUNCHCTL_DISABLED")  # a service a past tool disabled
    if left_disabled and not jobs.get("seeded"):
        jobs["seeded"] = True
        jobs["disabled"].append(left_disabled)
    verb = args[0]
    if verb == "print":
        if args[1] in jobs["loaded"]:
            print(f"{args[1]} = {{\n\tactive count = 1\n\tstate = running\n}}")
            return 0
        label = args[1].rsplit("/", 1)[-1]
        return _err(f'Could not find service "{label}" in domain for user gui: '
                    f"{args[1].split('/')[1]}", 113)
    if verb == "enable":
        jobs["disabled"] = [job for job in jobs["disabled"] if job != args[1]]
        return 0
    if verb == "disable":
        jobs["disabled"].append(args[1])
        return 0
    if verb == "bootout":
        if args[1] not in jobs["loaded"]:
            return _err("Boot-out failed: 3: No such process", 3)
        jobs["loaded"].remove(args[1])
        return 0
    if verb == "bootstrap":
        return _bootstrap(jobs, args[1], Path(args[2]))
    return _err(f'Unrecognized subcommand: {verb}', 64)


def _bootstrap(jobs: dict[str, Any], domain: str, plist: Path) -> int:
    if os.environ.get("FAKE_LAUNCHCTL_HEADLESS") == "1":
        return _err("Bootstrap failed: 125: Domain does not support specified action", 125)
    jobs["bootstraps"] += 1
    if jobs["bootstraps"] <= int(os.environ.get("FAKE_LAUNCHCTL_EIO", "0")):
        return _err("Bootstrap failed: 5: Input/output error", 5)
    try:
        label = plistlib.loads(plist.read_bytes())["Label"]
    except (OSError, ValueError, KeyError):
        return _err("Bootstrap failed: 5: Input/output error", 5)
    service = f"{domain}/{label}"
    if service in jobs["disabled"] or service in jobs["loaded"]:
        return _err("Bootstrap failed: 5: Input/output error", 5)
    jobs["loaded"].append(service)
    return 0


_ACCESS_DENIED = (
    "sending serve config: Access denied: serve config denied\n\n"
    "Use 'sudo tailscale serve --bg --yes 8765'.\n"
    "To not require root, use 'sudo tailscale set --operator=$USER' once."
)


def _tailscale(state: dict[str, Any], args: list[str]) -> int:
    mode = os.environ.get("FAKE_TAILSCALE", "ok")
    if mode == "down":
        return _err("failed to connect to local tailscaled; it doesn't appear to be running"
                    " (sudo systemctl start tailscaled ?)", 1)
    if args[:2] == ["status", "--json"]:
        running = mode != "logged_out"
        print(json.dumps({
            "BackendState": "Running" if running else "NeedsLogin",
            "Self": {"DNSName": f"{NODE}." if running else ""},
            "CertDomains": [NODE] if running and mode != "https_off" else None,
        }, indent=2))
        return 0
    if args[:1] == ["serve"]:
        return _serve(state, mode, args[1:])
    return _err(f"unknown subcommand: {args[0]}", 1)


def _serve(state: dict[str, Any], mode: str, args: list[str]) -> int:
    config = state.get("serve")
    if args[:2] == ["status", "--json"]:
        print(json.dumps(config, indent=2) if config else "null")
        return 0
    if mode == "access_denied":
        return _err(_ACCESS_DENIED, 1)
    port = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--https="))
    target = [arg for arg in args if not arg.startswith("--")][-1]
    if target == "off":
        if not config or port not in config.get("TCP", {}):
            return _err("error: failed to remove web serve: handler does not exist", 1)
        del config["TCP"][port]
        del config["Web"][f"{NODE}:{port}"]
        return 0
    if mode == "https_off":
        print("Serve is not enabled on your tailnet.\nTo enable, visit:\n\n"
              "         https://login.tailscale.com/f/serve?node=n123\n")
        return 0
    if mode == "noop":
        return 0
    config = state.setdefault("serve", {"TCP": {}, "Web": {}})
    config["TCP"][port] = {"HTTPS": True}
    config["Web"][f"{NODE}:{port}"] = {"Handlers": {"/": {"Proxy": target}}}
    print(f"Available within your tailnet:\n\nhttps://{NODE}:{port}/\n|-- proxy {target}\n\n"
          "Serve started and running in the background.")
    return 0
