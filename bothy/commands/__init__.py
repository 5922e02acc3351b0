"""What each ``bothy`` command does. Returns exit codes; ``bothy.cli`` parses and exits.

Heavy imports (the engine, pydantic models) happen inside the command that needs them, and each
command's module is loaded on first use (PEP 562), so a read such as ``bothy trace`` loads
neither the other commands nor an event loop.
"""

from __future__ import annotations

from typing import Any

from bothy.surface import surface_attribute

_SURFACE = {
    "cmd_answer": "bothy.commands.foreground",
    "cmd_cancel": "bothy.commands.foreground",
    "cmd_run": "bothy.commands.foreground",
    "cmd_memory": "bothy.commands.memory",
    "cmd_audit": "bothy.commands.operate",
    "cmd_checklist": "bothy.commands.operate",
    "cmd_daemon": "bothy.commands.operate",
    "cmd_doctor": "bothy.commands.operate",
    "cmd_profile": "bothy.commands.operate",
    "read_audit": "bothy.commands.operate",
    "cmd_schedule": "bothy.commands.schedules",
    "cmd_sop": "bothy.commands.schedules",
    "cmd_trace": "bothy.commands.tracing",
}

__all__ = [
    "cmd_answer",
    "cmd_audit",
    "cmd_cancel",
    "cmd_checklist",
    "cmd_daemon",
    "cmd_doctor",
    "cmd_memory",
    "cmd_profile",
    "cmd_run",
    "cmd_schedule",
    "cmd_sop",
    "cmd_trace",
    "read_audit",
]


def __getattr__(name: str) -> Any:
    """Load a command from its module on first use (PEP 562)."""
    return surface_attribute(__name__, _SURFACE, name)
