"""The turn cap (``limits.max_turns``): how many tool calls a run may make.

Every tool item Codex reports starting (``item/started`` of a command, a patch, an MCP or
dynamic tool call, a web search...) counts once. The one past the cap is not let through: if
it is a request to Bothy (an approval, a dynamic tool call) Bothy declines it; otherwise it
already runs inside Codex, and the turn is interrupted. Which of the two it is shows in what
Codex says next about it: its request, or anything else. Either way the run ends
``turn_limit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ThreadItem types that are a tool call (codex's schema: ThreadItem in item/started).
TOOL_ITEM_TYPES = frozenset({
    "commandExecution", "fileChange", "mcpToolCall", "dynamicToolCall", "collabAgentToolCall",
    "webSearch", "imageView", "imageGeneration",
})
# Server requests that ask Bothy about a tool item, and the param naming that item.
_REQUEST_ITEM_KEY = {
    "item/commandExecution/requestApproval": "itemId",
    "item/fileChange/requestApproval": "itemId",
    "item/permissions/requestApproval": "itemId",
    "item/tool/call": "callId",
}


@dataclass(frozen=True)
class Over:
    """The tool item past the cap, and how it was stopped."""

    item_id: str
    item_type: str
    limit: int
    declined: bool  # a request to Bothy, declined; else the turn is interrupted

    def reason(self) -> str:
        how = "declined" if self.declined else "interrupted"
        return (f"tool call {self.limit + 1} ({self.item_type}) {how}: the run may make"
                f" {self.limit} (limits.max_turns)")


class TurnCap:
    """Counts one run's tool items against ``limit`` (None: no cap)."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._pending: tuple[str, str] | None = None  # the item past the cap, not yet judged

    @property
    def count(self) -> int:
        return len(self._seen)

    def started(self, params: dict[str, Any]) -> None:
        """An ``item/started``: count it if it is a tool item (each item once)."""
        item = params.get("item")
        if not isinstance(item, dict) or item.get("type") not in TOOL_ITEM_TYPES:
            return
        item_id = str(item.get("id"))
        if item_id in self._seen:
            return
        self._seen.add(item_id)
        if self._limit is not None and len(self._seen) > self._limit and self._pending is None:
            self._pending = (item_id, str(item["type"]))

    def request(self, method: str, params: dict[str, Any]) -> Over | None:
        """A server request: the item past the cap asking Bothy, to be declined; or None."""
        if self._pending is None or self._limit is None:
            return None
        key = _REQUEST_ITEM_KEY.get(method)
        if key is None or str(params.get(key)) != self._pending[0]:
            return None
        return Over(*self._pending, self._limit, declined=True)

    def notice(self, method: str) -> Over | None:
        """Anything else Codex says while an item is past the cap: it runs; interrupt."""
        if self._pending is None or self._limit is None:
            return None
        if method in ("item/started", "thread/status/changed"):
            return None  # the item's own start, or a wait for its approval: not yet judged
        return Over(*self._pending, self._limit, declined=False)
