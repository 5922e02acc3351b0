"""What each ``bothy`` command does. Returns exit codes; ``bothy.cli`` parses and exits.

Heavy imports (the engine, pydantic models) happen inside the command that needs them.
"""

from bothy.commands.foreground import cmd_answer, cmd_cancel, cmd_run
from bothy.commands.memory import cmd_memory
from bothy.commands.operate import (
    cmd_audit,
    cmd_checklist,
    cmd_daemon,
    cmd_doctor,
    cmd_profile,
)
from bothy.commands.schedules import cmd_schedule, cmd_sop
from bothy.commands.tracing import cmd_trace

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
]
