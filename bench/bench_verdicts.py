"""The verdict engine's added latency per tool call (target ≤ 2 ms median), no person's wait.

One ``item/tool/call`` for a granted ``bothy_checklist`` read goes through the real Toolbox:
the verdict, the audit record (fsynced, on disk), the tool itself, and the answer handed to a
responder that only keeps it. That is everything Bothy adds between Codex asking and Codex
getting its answer. A refused call (not granted) is measured too.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import Any

from bench._util import figure, median, percentile, scratch

CALLS = 400


class _Keep:
    """Stands where the worker's connection would: keeps the last answer."""

    async def respond(self, request_id: int | str, result: dict[str, Any]) -> None:
        self.last = result

    async def respond_error(self, request_id: int | str, code: int, message: str) -> None:
        self.last = {"error": message}


class _NoOne:
    def question(self, run_id: str, text: str) -> None: ...


async def _measure(tool: str) -> list[float]:
    from bothy.clock import utc_now
    from bothy.config import ProfileConfig
    from bothy.engine.alerts import Alerts
    from bothy.engine.audit import AuditLog
    from bothy.engine.checklist import Checklist
    from bothy.engine.questions import QuestionBoard
    from bothy.engine.rpc import ServerRequest
    from bothy.engine.state import StateDB
    from bothy.engine.toolbox import RunScope, Toolbox
    from bothy.engine.verdicts import ApprovalStore

    root = scratch("verdicts-")
    samples = []
    async with StateDB.open(root / "state.sqlite3") as db:
        profile = ProfileConfig(tools=["bothy_checklist"])
        scope = RunScope("run_bench", "bench", "bench", profile, True, False)

        async def never() -> str | None:
            return None

        audit = AuditLog(root / "audit.jsonl")
        toolbox = Toolbox(
            scope, audit=audit, board=QuestionBoard(db, clock=utc_now),
            approvals=ApprovalStore(db, clock=utc_now), checklist=Checklist(root / "c.md"),
            mcp=None, asker=_NoOne(), alerts=Alerts(audit, site="bench", clock=utc_now),
            should_stop=never, hold_left_s=lambda: 60.0,
        )
        keep = _Keep()
        for n in range(CALLS):
            request = ServerRequest(n, "item/tool/call", {
                "threadId": "t", "turnId": "u", "callId": f"c{n}", "namespace": None,
                "tool": tool, "arguments": {"action": "read"},
            })
            started = time.perf_counter()
            await toolbox.handle(request, keep)
            samples.append((time.perf_counter() - started) * 1000)
    shutil.rmtree(root, ignore_errors=True)
    return samples


def main() -> None:
    for tool, label in (("bothy_checklist", "granted call"), ("gmail__send", "refused call")):
        samples = asyncio.run(_measure(tool))
        figure(f"verdict + audit + answer, {label} (median)", median(samples), "ms", 2,
               higher_is_better=False)
        print(f"   p99 {percentile(samples, 99):.2f} ms over {len(samples)} calls")
