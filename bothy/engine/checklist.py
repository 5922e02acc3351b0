"""The standing checklist: a plain Markdown file under ``$BOTHY_HOME``, one ``- item`` per line.

Hosted for Codex as the dynamic tool ``bothy_checklist`` (read / add / remove) on the worker's
own connection: no subprocess, port or credential. Operators read it with ``bothy checklist``
and may edit the file by hand. Writes replace the file atomically (temporary file, fsync,
rename, fsync of the directory) so a crash never leaves half a checklist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bothy.atomicfile import write_atomically

MAX_ITEMS = 100
MAX_ITEM_CHARS = 300

SPEC: dict[str, Any] = {
    "type": "function",
    "name": "bothy_checklist",
    "description": (
        "The site's standing checklist of things to keep an eye on. action=read lists it;"
        " action=add appends `item`; action=remove deletes the item equal to `item`."
    ),
    "inputSchema": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["read", "add", "remove"]},
            "item": {"type": "string", "description": "the item text, for add and remove"},
        },
        "required": ["action"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True)
class ChecklistResult:
    success: bool
    text: str


class Checklist:
    """The checklist file and the three things a worker may do with it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def items(self) -> list[str]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        return [line[2:].strip() for line in lines if line.startswith("- ") and line[2:].strip()]

    def render(self) -> str:
        return "\n".join(f"- {item}" for item in self.items())

    @staticmethod
    def is_write(arguments: Any) -> bool:
        """Whether a call may change the checklist (anything but a well-formed read)."""
        return not (isinstance(arguments, dict) and arguments.get("action") == "read")

    def call(self, arguments: Any) -> ChecklistResult:
        """Run one tool call. Bad arguments are an error for the model, never an exception."""
        if not isinstance(arguments, dict):
            return ChecklistResult(False, "arguments must be an object with an 'action'")
        action = arguments.get("action")
        if action == "read":
            return ChecklistResult(True, self.render() or "(the checklist is empty)")
        item = arguments.get("item")
        if action not in ("add", "remove"):
            return ChecklistResult(False, f"unknown action {action!r}: use read, add or remove")
        if not isinstance(item, str) or not item.strip():
            return ChecklistResult(False, f"action {action} needs a non-empty 'item' string")
        item = " ".join(item.split())
        return self._add(item) if action == "add" else self._remove(item)

    def _add(self, item: str) -> ChecklistResult:
        if len(item) > MAX_ITEM_CHARS:
            return ChecklistResult(False, f"an item is at most {MAX_ITEM_CHARS} characters")
        items = self.items()
        if item in items:
            return ChecklistResult(True, f"already on the checklist: {item}")
        if len(items) >= MAX_ITEMS:
            return ChecklistResult(False, f"the checklist is full ({MAX_ITEMS} items)")
        self._write([*items, item])
        return ChecklistResult(True, f"added: {item}")

    def _remove(self, item: str) -> ChecklistResult:
        items = self.items()
        if item not in items:
            return ChecklistResult(False, f"not on the checklist: {item}")
        self._write([existing for existing in items if existing != item])
        return ChecklistResult(True, f"removed: {item}")

    def _write(self, items: list[str]) -> None:
        write_atomically(self.path, "".join(f"- {item}\n" for item in items).encode())
