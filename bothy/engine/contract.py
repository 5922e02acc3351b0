"""What Bothy reads of Codex's app-server protocol: every field, per method.

The parsers (the worker's answers, the supervisor's notifications, the toolbox's server
requests, the plan gate's rate limits) read the fields listed here and no others. A test
walks each path through the JSON Schema that the pinned codex binary generates, so a field
that a Codex upgrade renamed or dropped fails the test naming the method and the field,
before a site meets it (``tests/test_codex_schema.py``). Whoever makes a parser read a new
field adds it here.

A path is dotted; ``name[]`` steps into the items of an array, and ``name{type=value}``
keeps only the alternatives of a tagged union whose ``type`` is ``value``.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["response", "notification", "request"]

# (kind, method) -> the fields read. "response" is the result of a request Bothy sends;
# "notification" and "request" are what Codex sends (params).
READS: dict[tuple[Kind, str], tuple[str, ...]] = {
    ("response", "initialize"): (),
    ("response", "thread/start"): ("thread.id", "thread.model"),
    ("response", "thread/resume"): ("thread.id", "thread.model"),
    ("response", "turn/start"): ("turn.id",),
    ("response", "turn/interrupt"): (),
    ("response", "skills/extraRoots/set"): (),
    ("notification", "item/agentMessage/delta"): ("delta",),
    ("notification", "thread/status/changed"): (),  # the turn cap only notes that it came
    ("notification", "item/started"): ("item.type", "item.id"),
    ("notification", "item/completed"): (
        "item.type", "item.id", "item{type=agentMessage}.text",
        "item{type=commandExecution}.status", "item{type=commandExecution}.command",
        "item{type=commandExecution}.exitCode", "item{type=commandExecution}.durationMs",
        "item{type=fileChange}.status", "item{type=fileChange}.changes[].path",
        "item{type=mcpToolCall}.status", "item{type=mcpToolCall}.server",
        "item{type=mcpToolCall}.tool",
    ),
    ("notification", "thread/tokenUsage/updated"): (
        "tokenUsage.total.inputTokens", "tokenUsage.total.cachedInputTokens",
        "tokenUsage.total.outputTokens", "tokenUsage.total.reasoningOutputTokens",
        # The latest response's own: where the thread stood before the run's first report.
        "tokenUsage.last.inputTokens", "tokenUsage.last.cachedInputTokens",
        "tokenUsage.last.outputTokens", "tokenUsage.last.reasoningOutputTokens",
    ),
    ("notification", "error"): ("error.message", "error.codexErrorInfo", "willRetry"),
    ("notification", "turn/completed"): (
        "turn.id", "turn.status", "turn.error.message", "turn.error.codexErrorInfo",
    ),
    ("notification", "account/rateLimits/updated"): (
        "rateLimits.primary.usedPercent", "rateLimits.primary.windowDurationMins",
        "rateLimits.primary.resetsAt", "rateLimits.secondary.usedPercent",
        "rateLimits.secondary.windowDurationMins", "rateLimits.secondary.resetsAt",
    ),
    ("request", "item/commandExecution/requestApproval"): ("command", "itemId"),
    ("request", "item/fileChange/requestApproval"): ("itemId",),
    ("request", "item/tool/call"): ("namespace", "tool", "arguments", "callId"),
    ("request", "item/tool/requestUserInput"): (
        "questions[].id", "questions[].question", "questions[].header", "questions[].isSecret",
        "questions[].options[].label", "questions[].options[].description",
    ),
    ("request", "item/permissions/requestApproval"): ("itemId",),
    ("request", "mcpServer/elicitation/request"): (),
    ("request", "execCommandApproval"): (),
    ("request", "applyPatchApproval"): (),
}

__all__ = ["READS", "Kind"]
