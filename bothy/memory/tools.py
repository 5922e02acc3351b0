"""The memory tools Bothy hosts for Codex on the worker's own connection (SPEC §8).

``bothy_memory`` (add / replace / remove entries of MEMORY.md or USER.md, several at once,
checked against the final size), ``bothy_memory_note`` (append to today's notes),
``bothy_memory_search`` and ``bothy_memory_get`` (read), and for a dream only
``bothy_memory_propose`` (the new MEMORY.md and USER.md, applied under the guard).

Each call ends in a :class:`ToolOutcome`: the text for the model, and the details for the
register, which for a write name the target, the rule and the length, never the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bothy.memory.index import snippet
from bothy.memory.preimages import Preimage
from bothy.memory.store import TARGETS, DreamStart, MemoryStore, Refused, Saved, size_of

MEMORY = "bothy_memory"
NOTE = "bothy_memory_note"
SEARCH = "bothy_memory_search"
GET = "bothy_memory_get"
PROPOSE = "bothy_memory_propose"
WRITE_TOOLS = frozenset({MEMORY, NOTE})
READ_TOOLS = frozenset({SEARCH, GET})
ALL_TOOLS = WRITE_TOOLS | READ_TOOLS | {PROPOSE}

_OPERATION: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["add", "replace", "remove"]},
        "content": {"type": "string", "description": "the entry's text, for add and replace"},
        "old_text": {"type": "string",
                     "description": "a short unique part of the entry, for replace and remove"},
    },
    "required": ["action"],
    "additionalProperties": False,
}

_SPECS: dict[str, dict[str, Any]] = {
    MEMORY: {
        "type": "function", "name": MEMORY,
        "description": (
            "Your curated long-term memory, shown in your prompt on every run: target=memory"
            " (MEMORY.md, facts and lessons) or target=user (USER.md, about the people you work"
            " for). Add, replace or remove one entry (action, content, old_text), or several"
            " at once with `operations`; all or nothing, checked against the file's cap."
            " Never store credentials."
        ),
        "inputSchema": {
            "type": "object",
            "properties": {"target": {"type": "string", "enum": ["memory", "user"]},
                           **_OPERATION["properties"],
                           "operations": {"type": "array", "items": _OPERATION}},
            "required": ["target"],
            "additionalProperties": False,
        },
    },
    NOTE: {
        "type": "function", "name": NOTE,
        "description": ("Append a note to today's notes (not shown in prompts; found later with"
                        " bothy_memory_search). Never store credentials."),
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}},
                        "required": ["text"], "additionalProperties": False},
    },
    SEARCH: {
        "type": "function", "name": SEARCH,
        "description": ("Search the day notes: every word of `query` must appear. Returns"
                        " references (YYYY-MM-DD#N) with the text, best first."),
        "inputSchema": {"type": "object",
                        "properties": {"query": {"type": "string"},
                                       "limit": {"type": "integer", "minimum": 1,
                                                 "maximum": 50}},
                        "required": ["query"], "additionalProperties": False},
    },
    GET: {
        "type": "function", "name": GET,
        "description": ("Read a day's notes (ref=YYYY-MM-DD), one note (ref=YYYY-MM-DD#N), or"
                        " a whole file (ref=memory or ref=user)."),
        "inputSchema": {"type": "object", "properties": {"ref": {"type": "string"}},
                        "required": ["ref"], "additionalProperties": False},
    },
    PROPOSE: {
        "type": "function", "name": PROPOSE,
        "description": ("Propose the new entries of MEMORY.md (`memory`) and/or USER.md"
                        " (`user`), each the complete list. Bothy applies it only if no file"
                        " loses more than 25 % of its entries or characters and caps hold."),
        "inputSchema": {"type": "object",
                        "properties": {"memory": {"type": "array", "items": {"type": "string"}},
                                       "user": {"type": "array", "items": {"type": "string"}}},
                        "additionalProperties": False},
    },
}


def tool_specs(names: frozenset[str] | set[str]) -> list[dict[str, Any]]:
    """The dynamic-tool specs of ``names``, in a stable order."""
    return [_SPECS[name] for name in sorted(names)]


@dataclass(frozen=True)
class ToolOutcome:
    """What a memory tool call did.

    ``event`` is the register's event (``written``, ``refused``, ``read``, ``applied``);
    ``details`` never hold the text of a write; ``alert`` is a reason the operator should hear,
    once, or None.
    """

    success: bool
    text: str
    event: str
    details: dict[str, Any] = field(default_factory=dict)
    alert: str | None = None
    preimage: Preimage | None = None


class MemoryTools:
    """The memory tools of one run."""

    def __init__(self, store: MemoryStore, *, run_id: str, trusted: bool,
                 offered: frozenset[str], dream: DreamStart | None = None) -> None:
        self._store = store
        self._run_id = run_id
        self._trusted = trusted
        self.offered = offered
        self._dream = dream

    def call(self, name: str, arguments: Any) -> ToolOutcome:
        """Carry out one call. Bad arguments are an error for the model, never an exception."""
        if name not in self.offered:
            return ToolOutcome(False, f"the tool '{name}' is not available in this run",
                               "refused", {"tool": name, "rule": "not-offered"})
        if not isinstance(arguments, dict):
            return ToolOutcome(False, f"arguments for '{name}' must be a JSON object",
                               "refused", {"tool": name, "rule": "invalid"})
        match name:
            case "bothy_memory":
                return self._memory(arguments)
            case "bothy_memory_note":
                text = arguments.get("text")
                if not isinstance(text, str):
                    return _refused(name, Refused("note", "invalid", 0, "'text' must be a string"))
                found = self._store.note(text, run_id=self._run_id, trusted=self._trusted)
                return _written(name, found, self._store)
            case "bothy_memory_search":
                return self._search(arguments)
            case "bothy_memory_get":
                ref = arguments.get("ref")
                got = self._store.get(ref) if isinstance(ref, str) else None
                if got is None:
                    return ToolOutcome(False, f"nothing found for ref {ref!r}", "read",
                                       {"tool": name, "found": 0})
                return ToolOutcome(True, got, "read", {"tool": name, "found": 1})
            case _:
                return self._propose(arguments)

    def _memory(self, arguments: dict[str, Any]) -> ToolOutcome:
        target = arguments.get("target")
        operations = arguments.get("operations")
        if operations is None:
            operations = [{key: arguments[key] for key in ("action", "content", "old_text")
                           if key in arguments}]
        if not isinstance(operations, list) or not all(isinstance(op, dict)
                                                       for op in operations) or not operations:
            return _refused(MEMORY, Refused(str(target), "invalid", 0,
                                            "'operations' must be a list of objects"))
        return _written(MEMORY, self._store.edit(str(target), operations), self._store)

    def _search(self, arguments: dict[str, Any]) -> ToolOutcome:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.split():
            return ToolOutcome(False, "'query' needs at least one word", "read",
                               {"tool": SEARCH, "found": 0})
        limit = arguments.get("limit", 10)
        limit = limit if isinstance(limit, int) and 1 <= limit <= 50 else 10
        notes = self._store.search(query, limit)
        text = "\n".join(f"[{note.ref}] {snippet(note.text)}" for note in notes)
        return ToolOutcome(True, text or f"no note matches {query!r}", "read",
                           {"tool": SEARCH, "found": len(notes),
                            "search": "fts5" if self._store.search_mode.fts5 else "scan"})

    def _propose(self, arguments: dict[str, Any]) -> ToolOutcome:
        if self._dream is None:
            return ToolOutcome(False, "only a dream may propose", "refused",
                               {"tool": PROPOSE, "rule": "not-a-dream"})
        proposal: dict[str, list[str]] = {}
        for target, name in TARGETS.items():
            entries = arguments.get(target)
            if entries is None:
                continue
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                return _refused(PROPOSE, Refused("dream", "invalid", 0,
                                                 f"'{target}' must be a list of strings"))
            proposal[name] = [entry.strip() for entry in entries if entry.strip()]
        if not proposal:
            return _refused(PROPOSE, Refused("dream", "invalid", 0,
                                             "propose 'memory', 'user' or both"))
        applied = self._store.apply_dream(self._dream, proposal)
        if isinstance(applied, Refused):
            outcome = _refused(PROPOSE, applied)
            details = {**outcome.details, "reason": applied.text.removeprefix("refused: ")}
            return ToolOutcome(False, outcome.text, "refused", details,
                               alert=f"dream of profile {self._store.profile} refused:"
                                     f" {applied.text.removeprefix('refused: ')}")
        sizes = {name: {"entries": len(entries), "chars": size_of(entries)}
                 for name, entries in proposal.items()}
        return ToolOutcome(True, f"applied; the files before it are kept as {applied.id}",
                           "applied", {"tool": PROPOSE, "preimage": applied.id,
                                       "files": sizes, "notes": len(self._dream.notes)},
                           preimage=applied)


def _written(tool: str, found: Saved | Refused, store: MemoryStore) -> ToolOutcome:
    if isinstance(found, Refused):
        outcome = _refused(tool, found)
        if found.full and store.first_alert(f"full:{found.target}", "1"):
            return ToolOutcome(False, outcome.text, "refused", outcome.details,
                               alert=f"memory of profile {store.profile} is full"
                                     f" ({found.target}): a write was refused over its cap")
        return outcome
    store.clear_alert(f"full:{found.target}")
    return ToolOutcome(True, found.text, "written",
                       {"tool": tool, "target": found.target, "rule": "ok",
                        "length": found.length, "entries": found.entries,
                        "chars": found.chars, "cap_chars": found.cap_chars})


def _refused(tool: str, refused: Refused) -> ToolOutcome:
    return ToolOutcome(False, refused.text, "refused",
                       {"tool": tool, "target": refused.target, "rule": refused.rule,
                        "length": refused.length})
