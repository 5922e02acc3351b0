"""The text of ``bothy profile list|show``: what each profile grants, resolved, for a person."""

from __future__ import annotations

from bothy.config import Config, Guide, ProfileConfig


def profile_lines(cfg: Config) -> list[str]:
    return [
        f"{name}  sandbox {profile.sandbox}, {len(profile.tools)} tools,"
        f" {len(profile.mcp_servers)} MCP servers"
        for name, profile in sorted(cfg.profiles.items())
    ]


def describe_profile(name: str, profile: ProfileConfig) -> str:
    lines = [
        f"profile {name}",
        f"  sandbox: {profile.sandbox}",
        "  tools (everything else is refused):",
    ]
    for tool in profile.tools or []:
        lines.append(f"    {tool}: {_verdict(profile, tool)}")
    if not profile.tools:
        lines.append("    (none: Codex's sandboxed built-ins only)")
    for server, spec in sorted(profile.mcp_servers.items()):
        passed = ", ".join(spec.env) or "nothing"
        lines.append(f"  mcp server {server}: {spec.command} {' '.join(spec.args)}".rstrip()
                     + f" (environment passed: {passed})")
    for root in profile.skills:
        lines.append(f"  skills: {root}")
    lines.append(f"  questions held up to {profile.question_hold_seconds} s"
                 " (foreground runs and chat threads; others never wait)")
    lines.append("  untrusted runs (webhooks, polls): "
                 + ("keep write-capable tools" if profile.allow_from_untrusted
                    else "write-capable tools withheld"))
    return "\n".join(lines)


def _verdict(profile: ProfileConfig, tool: str) -> str:
    rule = profile.approvals.get(tool)
    if isinstance(rule, Guide):
        return f"guide (refused, the model is told: {rule.guide})"
    if rule == "confirm":
        within = profile.unless_approved_within
        recent = f", or passes on an approval younger than {within} s" if within else ""
        return f"confirm (asks a person{recent})"
    if rule is not None:
        return rule
    if tool in profile.ask:
        return "ask without a rule (refused, and an alert is raised)"
    return "proceed (granted)"
