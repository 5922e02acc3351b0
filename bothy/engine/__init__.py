"""The engine: the gates, the worker and its process group, the audit chain (SPEC §11).

The names in ``__all__`` are its surface: what the other packages use, importable from the
package itself (``from bothy.engine import X``), each loaded on first use (:mod:`bothy.surface`).
"""

from __future__ import annotations

from bothy.surface import surface_attribute

TYPE_CHECKING = False  # typing is for mypy only here (bothy status: see bothy/cli.py)
if TYPE_CHECKING:
    from typing import Any

_SURFACE = {
    "Alerts": "bothy.engine.alerts",
    "AuditLog": "bothy.engine.audit",
    "NewRecord": "bothy.engine.audit",
    "Checklist": "bothy.engine.checklist",
    "frame": "bothy.engine.framing",
    "inline": "bothy.engine.framing",
    "new_token": "bothy.engine.framing",
    "Launch": "bothy.engine.launch",
    "build_launch": "bothy.engine.launch",
    "codex_version": "bothy.engine.launch",
    "WorkerPool": "bothy.engine.pool",
    "PriceTable": "bothy.engine.prices",
    "ProcessGroup": "bothy.engine.procgroup",
    "process_start_time": "bothy.engine.procgroup",
    "matches": "bothy.engine.proctable",
    "read_row": "bothy.engine.proctable",
    "Delivered": "bothy.engine.questions",
    "QuestionBoard": "bothy.engine.questions",
    "Recovery": "bothy.engine.recovery",
    "NO_REPLY": "bothy.engine.run",
    "Outcome": "bothy.engine.run",
    "RunRequest": "bothy.engine.run",
    "RunResult": "bothy.engine.run",
    "new_run_id": "bothy.engine.run",
    "RunRow": "bothy.engine.state",
    "StateDB": "bothy.engine.state",
    "Supervisor": "bothy.engine.supervisor",
    "workspace_problem": "bothy.engine.launch",
    "Asker": "bothy.engine.toolbox",
    "Verification": "bothy.engine.verification",
}
__all__ = [
    "NO_REPLY",
    "Alerts",
    "Asker",
    "AuditLog",
    "Checklist",
    "Delivered",
    "Launch",
    "NewRecord",
    "Outcome",
    "PriceTable",
    "ProcessGroup",
    "QuestionBoard",
    "Recovery",
    "RunRequest",
    "RunResult",
    "RunRow",
    "StateDB",
    "Supervisor",
    "Verification",
    "WorkerPool",
    "build_launch",
    "codex_version",
    "frame",
    "inline",
    "matches",
    "new_run_id",
    "new_token",
    "process_start_time",
    "read_row",
    "workspace_problem",
]


def __getattr__(name: str) -> Any:
    """Load a name of the surface from its module on first use (PEP 562)."""
    return surface_attribute(__name__, _SURFACE, name)

