"""Tailscale's doors: ``tailscale serve`` for the tailnet port, ``tailscale funnel`` for public.

Facts this relies on (research §C.3, tailscale ``cmd/tailscale/cli/serve_v2.go``): the same
``--bg`` command on the same port is accepted again and overwrites its handler; ``serve`` on a
port that has Funnel turns Funnel off (so ``listen.serve_port`` is never a Funnel port);
``tailscale serve status --json`` prints ``null`` when nothing is served; when HTTPS is not
enabled on the tailnet ``tailscale serve`` may print a URL and exit 0 having configured
nothing, or wait for an admin — so it runs under a bound and is confirmed from ``serve status``
afterwards; as a non-operator user on Linux it fails with "Access denied".
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bothy.config import Config
from bothy.install.plan import Outcome, Plan, Run, run_command

SERVE_TIMEOUT_S = 30.0
_ADMIN_DNS = "https://login.tailscale.com/admin/dns"


@dataclass(frozen=True)
class Node:
    """What ``tailscale status --json`` says about this machine."""

    dns_name: str  # e.g. "mini.tailnet.ts.net" (no trailing dot)
    https: bool  # the tailnet hands out certificates (CertDomains is not empty)


def local_target(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def probe_node(plan: Plan) -> Node | None:
    """Check that tailscale is installed, running and logged in, with HTTPS; else a problem."""
    argv = ("tailscale", "status", "--json")
    outcome = run_command(argv)
    if outcome.code == 127:
        plan.problems.append(
            "tailscale is not installed (not on PATH): install Tailscale and log in"
            " (`sudo tailscale up`), then rerun; or pass --no-tailscale to install the service"
            " without its tailnet door")
        return None
    if outcome.code != 0:
        plan.problems.append(f"tailscale is not answering (`{shlex.join(argv)}` exit"
                             f" {outcome.code}: {outcome.text}): start tailscaled (or the"
                             " Tailscale app), then rerun")
        return None
    try:
        status = json.loads(outcome.stdout)
        state = str(status.get("BackendState", ""))
        dns_name = str((status.get("Self") or {}).get("DNSName", "")).rstrip(".")
        https = bool(status.get("CertDomains"))
    except (ValueError, AttributeError):
        plan.problems.append(f"`{shlex.join(argv)}` printed something that is not its JSON"
                             f" status: {outcome.stdout[:120]!r}")
        return None
    plan.checks.append(f"check: {shlex.join(argv)} -> {state or 'no state'}"
                       f"{', ' + dns_name if dns_name else ''}"
                       f", HTTPS {'on' if https else 'off'}")
    if state != "Running":
        plan.problems.append(f"tailscale is not logged in (state {state or 'unknown'}): run"
                             " `sudo tailscale up` and log in, then rerun")
        return None
    if not https:
        plan.problems.append(
            "HTTPS is not enabled on this tailnet, so `tailscale serve` cannot open an https://"
            f" door (it would print a link and configure nothing): enable HTTPS certificates on"
            f" the DNS page of the admin console ({_ADMIN_DNS}), then rerun")
        return None
    return Node(dns_name, https)


def serve_config(user: str) -> dict[str, Any] | str:
    """``tailscale serve status --json`` as a dict ({} for ``null``), or the problem."""
    argv = ("tailscale", "serve", "status", "--json")
    outcome = run_command(argv)
    if outcome.code != 0:
        return _refusal(outcome, argv, user)
    try:
        value = json.loads(outcome.stdout or "null")
    except ValueError:
        return f"`{shlex.join(argv)}` printed something that is not JSON: {outcome.stdout[:120]!r}"
    return value if isinstance(value, dict) else {}


def proxy_on(config: dict[str, Any], port: int) -> str | None:
    """What the HTTPS door on ``port`` proxies to at its root, if it is served."""
    if not ((config.get("TCP") or {}).get(str(port)) or {}).get("HTTPS"):
        return None
    for host_port, web in (config.get("Web") or {}).items():
        if str(host_port).rsplit(":", 1)[-1] == str(port):
            handler = ((web or {}).get("Handlers") or {}).get("/") or {}
            return str(handler.get("Proxy")) if handler.get("Proxy") else None
    return None


def funnel_on(config: dict[str, Any], port: int) -> bool:
    return any(str(host_port).rsplit(":", 1)[-1] == str(port) and bool(on)
               for host_port, on in (config.get("AllowFunnel") or {}).items())


def _refusal(outcome: Outcome, argv: tuple[str, ...], user: str) -> str:
    if "access denied" in outcome.text.lower():
        return (f"tailscale refused {user} (Access denied: `{shlex.join(argv)}`): run the"
                f" install with sudo, or let {user} manage Tailscale once with"
                f" `sudo tailscale set --operator={user}`, then rerun")
    if outcome.code == 124:
        return (f"`{shlex.join(argv)}` did not finish within {SERVE_TIMEOUT_S:g} s: tailscale"
                f" waits when HTTPS must first be enabled for the tailnet ({_ADMIN_DNS});"
                " enable it, then rerun")
    return f"`{shlex.join(argv)}` failed (exit {outcome.code}): {outcome.text}"


def plan_serve(plan: Plan, config: Config, user: str) -> None:
    """Add ``tailscale serve`` for the tailnet port unless it is already in place."""
    node = probe_node(plan)
    if node is None:
        return
    current = serve_config(user)
    if isinstance(current, str):
        plan.problems.append(current)
        return
    port, target = config.listen.serve_port, local_target(config.listen.tailnet_port)
    proxy = proxy_on(current, port)
    plan.checks.append(f"check: tailscale serve status --json -> port {port}: "
                       f"{proxy or 'not served'}")
    url = f"https://{node.dns_name}:{port}/"
    if proxy == target:
        plan.unchanged.append(f"unchanged: tailscale serve {url} -> {target}")
        return
    if proxy is not None:
        plan.notes.append(f"tailscale serve on port {port} proxied to {proxy}; it now goes to"
                          f" {target}")
    argv = ("tailscale", "serve", "--bg", "--yes", f"--https={port}", target)
    plan.steps.append(Run(argv, timeout_s=SERVE_TIMEOUT_S,
                          explain=lambda outcome: _refusal(outcome, argv, user),
                          confirm=_confirm_served(port, target, user)))
    plan.notes.append(f"the tailnet door: {url} -> {target}")


def _confirm_served(port: int, target: str, user: str) -> Callable[[], str | None]:
    def confirm() -> str | None:
        current = serve_config(user)
        if isinstance(current, str):
            return current
        if proxy_on(current, port) == target:
            return None
        return (f"tailscale serve exited 0 but port {port} is not served (HTTPS may need"
                f" enabling for the tailnet: {_ADMIN_DNS}); `tailscale serve status` shows"
                " what is configured")
    return confirm


def plan_unserve(plan: Plan, config: Config, user: str) -> None:
    """Add turning the tailnet door off, if it is Bothy's."""
    current = serve_config(user)
    if isinstance(current, str):
        if "not found" in current:
            plan.notes.append("tailscale is not installed: no tailscale serve to undo")
        else:
            plan.problems.append(current)
        return
    port, target = config.listen.serve_port, local_target(config.listen.tailnet_port)
    proxy = proxy_on(current, port)
    plan.checks.append(f"check: tailscale serve status --json -> port {port}: "
                       f"{proxy or 'not served'}")
    if proxy == target:
        argv = ("tailscale", "serve", f"--https={port}", "off")
        plan.steps.append(Run(argv, timeout_s=SERVE_TIMEOUT_S,
                              explain=lambda outcome: _refusal(outcome, argv, user)))
    elif proxy is None:
        plan.unchanged.append(f"absent: tailscale serve on port {port}")
    else:
        plan.notes.append(f"tailscale serve on port {port} goes to {proxy}, not to Bothy: left"
                          " alone")


def funnel_lines(config: Config, node: Node | None) -> list[str]:
    """The ``tailscale funnel`` commands the config implies, with the public URLs."""
    listen = config.listen
    public = {name: route for name, route in config.webhooks.items() if route.public}
    if listen.public_port is None:
        return ["# listen.public_port is not set: no route is public, there is nothing for"
                " Funnel to open"]
    target = local_target(listen.public_port)
    host = node.dns_name if node else "<node>.<tailnet>.ts.net"
    base = f"https://{host}" + ("" if listen.funnel_port == 443 else f":{listen.funnel_port}")
    lines = [f"# open the public listener (listen.public_port {listen.public_port}) to the"
             f" internet on port {listen.funnel_port}:",
             shlex.join(["tailscale", "funnel", "--bg", "--yes",
                         f"--https={listen.funnel_port}", target])]
    for name, route in sorted(public.items()):
        lines.append(f"# webhooks.{name}: {base}{route.path}")
    if not public:
        lines.append("# no webhook route is public yet (webhooks.<route>.public)")
    lines.append(f"# to close it: tailscale funnel --https={listen.funnel_port} off")
    return lines
