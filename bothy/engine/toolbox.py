"""A run's toolbox: every request a worker makes of Bothy goes through here.

Codex's approval requests (a command asking to leave the sandbox is ``shell``, a patch is
``apply_patch``), calls to dynamic tools (Bothy's own ``bothy_checklist`` and the granted
tools of MCP servers, offered as ``server__tool`` since function names take no dots) and
questions for a person all end
in one place: the :class:`~bothy.engine.verdicts.VerdictEngine` decides, a person is asked
where the verdict needs one and the run can wait, the call is carried out or refused, and
every decision is an audit record. Nothing here raises for a bad request: the model gets an
error it can read and the run goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from bothy.config import ProfileConfig
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.checklist import SPEC as CHECKLIST_SPEC
from bothy.engine.checklist import Checklist
from bothy.engine.questions import APPROVAL_HINT, Answered, InputQuestion, QuestionBoard
from bothy.engine.rpc import ServerRequest
from bothy.engine.task_link import NOTE_SPEC, TaskLink
from bothy.engine.verdicts import (
    NO_HOLD,
    ApprovalStore,
    NeedsPerson,
    Proceed,
    Refuse,
    ToolCall,
    VerdictEngine,
)

if TYPE_CHECKING:  # the MCP SDK takes half a second to import: only runs that use it pay
    from bothy.engine.mcp import HostedTool, McpHost, McpProblem
    from bothy.memory.session import MemorySession

# What a tool result may carry to the model; the rest is cut with a marker (see _cut).
TOOL_RESULT_MAX_CHARS = 100_000
NO_ANSWER = "No answer is coming: nobody can be asked from this run. Continue without it."
NO_SECRET = ("No answer is coming: Bothy does not ask a person for a secret (the reply would"
             " stay in the chat thread and the register). Continue without it.")


class Responder(Protocol):
    """The worker's side of a server request."""

    async def respond(self, request_id: int | str, result: dict[str, Any]) -> None: ...
    async def respond_error(self, request_id: int | str, code: int, message: str) -> None: ...


class Asker(Protocol):
    """Shows a question to whoever can answer it (a terminal, a chat thread)."""

    def question(self, run_id: str, text: str) -> None:
        """A question the run holds for an answer."""
        ...

    def declined(self, run_id: str, text: str) -> None:
        """A question the run could not wait for (SPEC §6: the channel is still told): the
        run has gone on without an answer, and any reply comes too late."""
        ...


@runtime_checkable
class HintedAsker(Protocol):
    """An asker that shows how to answer beside the question (a chat thread), instead of a
    hint of its own (a terminal's "type yes/no (or an answer)")."""

    def ask(self, run_id: str, text: str, hint: str) -> None: ...


@runtime_checkable
class ExpiryTeller(Protocol):
    """An asker that also says where it asked that a question expired unanswered (a chat
    thread: "No answer within 300 s — declined; the run goes on.")."""

    def expired(self, run_id: str, text: str, hold_s: float) -> None: ...


@dataclass(frozen=True)
class RunScope:
    """Who the toolbox works for."""

    run_id: str
    subject: str
    profile_name: str | None
    profile: ProfileConfig | None
    trusted: bool
    can_hold: bool


class Toolbox:
    """Bothy's side of one run's tool traffic."""

    def __init__(
        self,
        scope: RunScope,
        *,
        audit: AuditLog,
        board: QuestionBoard,
        approvals: ApprovalStore,
        checklist: Checklist,
        mcp: McpHost | None,
        asker: Asker,
        alerts: Alerts,
        should_stop: Callable[[], Awaitable[str | None]],
        hold_left_s: Callable[[], float],
        task: TaskLink | None = None,
        memory: MemorySession | None = None,
    ) -> None:
        self._scope = scope
        self._audit = audit
        self._board = board
        self._approvals = approvals
        self._checklist = checklist
        self._mcp = mcp
        self._asker = asker
        self._alerts = alerts
        self._should_stop = should_stop
        self._hold_left_s = hold_left_s
        self._task = task  # the run's task in Cairn, for bothy_note
        self.memory = memory  # the profile's memory, when it has it (bothy.memory)
        self.verdicts = VerdictEngine(
            scope.profile_name, scope.profile, approvals,
            trusted=scope.trusted, can_hold=scope.can_hold,
        )
        # Every tool the servers listed at start, kept after a server is lost, so that a call
        # of a granted tool on a dead server is told why it failed (not "not granted").
        self._listed: list[HostedTool] = []
        self._problems_audited: set[McpProblem] = set()

    @property
    def starts_anything(self) -> bool:
        """Whether :meth:`start` has work (memory, MCP servers), which it may record."""
        return self.memory is not None or self._mcp is not None

    async def start(self) -> None:
        """Prepare the run's memory; start the profile's MCP servers, auditing each one that
        could not start."""
        if self.memory is not None:
            await self._begin_memory(self.memory)
        if self._mcp is None:
            return
        await self._mcp.start()
        self._listed = self._mcp.tools()
        await self._audit_mcp_problems()

    async def stop(self) -> None:
        if self._mcp is not None:
            await self._mcp.stop()
            await self._audit_mcp_problems()

    async def _audit_mcp_problems(self) -> None:
        """Audit each MCP server that failed to start or was lost since the last look, once."""
        for problem in self._mcp.problems() if self._mcp else []:
            if problem not in self._problems_audited:
                self._problems_audited.add(problem)
                await self._record("mcp", "failed", "failed",
                                   {"server": problem.server, "problem": problem.message})

    async def _begin_memory(self, memory: MemorySession) -> None:
        """Prune old notes; audit (and alert once) each file kept out of the prompt."""
        begun = await asyncio.to_thread(memory.begin)
        profile = memory.store.profile
        if begun.pruned_days:
            await self._record("memory", "pruned", "ok",
                               {"profile": profile, "days": begun.pruned_days})
        for left in begun.left_out:
            await self._record("memory", "left-out", "failed",
                               {"profile": profile, "file": left.name, "rule": left.problem})
            if left.first_time:
                await self._alerts.raise_alert(
                    "memory", f"{left.name} of profile {profile} was left out of the prompt"
                    f" ({left.problem}): fix it by hand", subject=self._scope.subject,
                    run_id=self._scope.run_id)
        await self._record("memory", "loaded", "ok",
                           {"profile": profile, "files": begun.in_prompt,
                            "tools": sorted(memory.offered),
                            "dream": begun.dream is not None})

    def dynamic_tools(self) -> list[dict[str, Any]]:
        """The dynamic tools offered to Codex: only what the profile grants, and the memory
        tools of a profile with memory (offered without being listed under ``tools``)."""
        specs: list[dict[str, Any]] = []
        if self.memory is not None:
            from bothy.memory import tool_specs

            specs += tool_specs(self.memory.offered)
        if self.verdicts.grants("bothy_checklist"):
            specs.append(CHECKLIST_SPEC)
        if self.verdicts.grants("bothy_note"):
            specs.append(NOTE_SPEC)
        for tool in self._mcp.tools() if self._mcp else []:
            if self.verdicts.grants(tool.qualified):
                specs.append({
                    "type": "function",
                    "name": flat_name(tool),
                    "description": f"[MCP server {tool.server}] {tool.description}",
                    "inputSchema": tool.input_schema,
                })
        return specs

    async def handle(self, request: ServerRequest, worker: Responder) -> None:
        """Answer one server request, after a verdict where one applies."""
        params = request.params
        match request.method:
            case "item/commandExecution/requestApproval":
                command = str(params.get("command", "?"))
                verdict = await self._approve(ToolCall("shell", command, write=True))
                await worker.respond(request.request_id, _decision(verdict))
            case "item/fileChange/requestApproval":
                verdict = await self._approve(ToolCall("apply_patch", "apply a patch", True))
                await worker.respond(request.request_id, _decision(verdict))
            case "item/tool/call":
                success, text = await self._call(params)
                await worker.respond(request.request_id, {
                    "success": success,
                    "contentItems": [{"type": "inputText", "text": _cut(text)}],
                })
            case "item/tool/requestUserInput":
                await worker.respond(request.request_id, await self._user_input(params))
            case "item/permissions/requestApproval":
                await self._record("tool", "refused", "refused",
                                   {"tool": "permissions", "reason": "extra permissions are"
                                    " never granted at run time; use a profile's sandbox"})
                await worker.respond(request.request_id, {"permissions": {}})
            case "mcpServer/elicitation/request":
                await self._record("tool", "refused", "refused",
                                   {"tool": "elicitation", "reason": "Bothy is the MCP client"})
                await worker.respond(request.request_id, {"action": "decline"})
            case "execCommandApproval" | "applyPatchApproval":
                await self._record("tool", "refused", "refused",
                                   {"tool": request.method, "reason": "legacy request"})
                await worker.respond(request.request_id, {"decision": "denied"})
            case _:
                await self._record("tool", "refused", "refused",
                                   {"tool": request.method, "reason": "unsupported request"})
                await worker.respond_error(
                    request.request_id, -32601, f"Bothy does not support {request.method!r}"
                )

    async def decline(self, request: ServerRequest, worker: Responder, reason: str) -> None:
        """Refuse a tool request past the run's turn cap (``limits.max_turns``), audited."""
        await self._record("tool", "refused", "refused",
                           {"tool": _requested_tool(request), "code": "turn_limit",
                            "reason": reason})
        if request.method == "item/tool/call":
            await worker.respond(request.request_id, {
                "success": False,
                "contentItems": [{"type": "inputText", "text": f"Not run: {reason}."}],
            })
        elif request.method == "item/permissions/requestApproval":
            await worker.respond(request.request_id, {"permissions": {}})
        else:
            await worker.respond(request.request_id, {"decision": "decline"})

    async def _approve(self, call: ToolCall) -> Proceed | Refuse:
        verdict = await self.verdicts.decide(call)
        if isinstance(verdict, NeedsPerson):
            verdict = await self._hold(call, verdict)
        await self._record_verdict(call, verdict)
        return verdict

    async def _call(self, params: dict[str, Any]) -> tuple[bool, str]:
        """Carry out a dynamic tool call; return (success, text for the model)."""
        namespace, name = params.get("namespace"), params.get("tool")
        arguments = params.get("arguments")
        if not isinstance(name, str) or not name:
            return False, "the call names no tool"
        qualified = f"{namespace}.{name}" if isinstance(namespace, str) and namespace else name
        if qualified.startswith("bothy_memory"):
            return await self._memory_call(qualified, arguments)
        hosted = self._hosted(qualified)
        qualified = hosted.qualified if hosted else qualified
        if qualified == "bothy_checklist":
            write = Checklist.is_write(arguments)
            verdict = await self._approve(ToolCall(qualified, _brief(arguments), write))
            if isinstance(verdict, Refuse):
                return False, verdict.to_model
            found = await asyncio.to_thread(self._checklist.call, arguments)
            return found.success, found.text
        if qualified == "bothy_note":
            verdict = await self._approve(ToolCall(qualified, _brief(arguments), True))
            if isinstance(verdict, Refuse):
                return False, verdict.to_model
            return await self._note(arguments)
        write = hosted is None or not hosted.read_only
        verdict = await self._approve(ToolCall(qualified, _brief(arguments), write))
        if isinstance(verdict, Refuse):
            return False, verdict.to_model
        if hosted is None or self._mcp is None:
            return False, f"the tool '{qualified}' is not available in this run"
        if not isinstance(arguments, dict):
            return False, f"arguments for '{qualified}' must be a JSON object"
        result = await self._mcp.call(hosted.server, hosted.name, arguments)
        await self._audit_mcp_problems()  # a server lost mid-call is a record, not only an error
        return result.success, result.text

    async def _note(self, arguments: Any) -> tuple[bool, str]:
        """``bothy_note``: a note on the run's task in Cairn, if the run has one."""
        if self._task is None:
            return False, ("This run has no task in Cairn (it was started without a ref):"
                           " nothing was written.")
        text = arguments.get("text") if isinstance(arguments, dict) else None
        if not isinstance(text, str):
            return False, "bothy_note needs a 'text' string"
        return await self._task.note_from_model(text)

    async def _memory_call(self, name: str, arguments: Any) -> tuple[bool, str]:
        """A memory tool call: audited by target, rule and length, never by its text."""
        memory = self.memory
        if memory is None or memory.tools is None:
            await self._record("memory", "refused", "refused", {"tool": name, "rule": "memory-off"})
            return False, f"the tool '{name}' is not available: this profile has no memory"
        if name in memory.withheld:
            await self._record("memory", "refused", "refused", {"tool": name, "rule": "untrusted"})
            return False, (f"'{name}' is withheld in runs started by untrusted input"
                           " (the profile does not set allow_from_untrusted)")
        outcome = await asyncio.to_thread(memory.tools.call, name, arguments)
        await self._record("memory", outcome.event, "ok" if outcome.success else "refused",
                           {"profile": memory.store.profile, **outcome.details})
        if outcome.alert is not None:
            await self._alerts.raise_alert("memory", outcome.alert, subject=self._scope.subject,
                                           run_id=self._scope.run_id)
        return outcome.success, outcome.text

    def _hosted(self, called: str) -> HostedTool | None:
        """The MCP tool a call names, by its offered (flat) name or its qualified name."""
        return next((t for t in self._listed if called in (flat_name(t), t.qualified)), None)

    async def _hold(self, call: ToolCall, need: NeedsPerson) -> Proceed | Refuse:
        answer = await self._ask("approval", call.tool, need.question, need.hold_s)
        if isinstance(answer, Answered):
            if answer.approves:
                await self._approvals.record(call.tool, answer.by, self._scope.run_id)
                return Proceed(f"approved by {answer.by}", approved_by=answer.by)
            return Refuse("declined_by_person", f"{answer.by} answered {answer.text!r}",
                          f"A person declined the use of '{call.tool}'. Do not retry it.")
        return Refuse(answer, f"no approval for '{call.tool}': the question {answer}",
                      f"Nobody approved '{call.tool}' in time. Continue without it.")

    async def _ask(self, kind: str, tool: str | None, text: str, hold_s: int, *,
                   shown: str | None = None, hint: str = APPROVAL_HINT) -> Answered | str:
        """Post a question and hold for it; return the answer or how the hold ended.
        ``shown`` is the question as the person sees it (with its options), ``hint`` how to
        answer it; ``text`` is what the board and the register keep."""
        hold = min(float(hold_s), self._hold_left_s())
        question_id = await self._board.post(self._scope.run_id, kind, tool, text, int(hold))
        await self._record("run", "question", "pending",
                           {"kind": kind, "tool": tool, "question": text, "hold_s": hold})
        if isinstance(self._asker, HintedAsker):
            self._asker.ask(self._scope.run_id, shown or text, hint)
        else:
            self._asker.question(self._scope.run_id, shown or text)
        ended = await self._board.wait(question_id, hold_s=hold, should_stop=self._should_stop)
        if isinstance(ended, Answered):
            await self._record("question", "answered", "ok",
                               {"kind": kind, "tool": tool, "by": ended.by, "answer": ended.text})
            return ended
        await self._record("question", ended.status, "failed",
                           {"kind": kind, "tool": tool, "reason": ended.reason})
        if ended.status == "timed_out" and isinstance(self._asker, ExpiryTeller):
            self._asker.expired(self._scope.run_id, text, hold)
        return ended.status

    async def _user_input(self, params: dict[str, Any]) -> dict[str, Any]:
        """Codex's questions for a person, each shown with its options numbered; an answer
        by number or label becomes the option's label, anything else goes as written."""
        questions = [InputQuestion.of(q) for q in params.get("questions") or []
                     if isinstance(q, dict)]
        profile = self._scope.profile
        hold_s = profile.question_hold_seconds if profile else 0
        answers: dict[str, dict[str, list[str]]] = {}
        for question in questions:
            reply = NO_ANSWER
            if question.secret:
                await self._record("question", "declined", "refused",
                                   {"kind": "input", "question": question.text,
                                    "reason": "it asks for a secret, which a reply would leave"
                                              " in the thread and the register"})
                reply = NO_SECRET
            elif self._scope.can_hold and hold_s > 0:
                answer = await self._ask("input", None, question.text, hold_s,
                                         shown=question.shown(), hint=question.hint())
                if isinstance(answer, Answered):
                    reply = question.answer(answer.text)
            else:
                await self._record("question", "declined", "refused",
                                   {"kind": "input", "question": question.text,
                                    "reason": "this run cannot wait for a person"})
                self._asker.declined(self._scope.run_id, question.shown())
            answers[question.id] = {"answers": [reply]}
        return {"answers": answers}

    async def _record_verdict(self, call: ToolCall, verdict: Proceed | Refuse) -> None:
        if isinstance(verdict, Proceed):
            await self._record("tool", "allowed", "ok",
                               {"tool": call.tool, "call": call.summary, "why": verdict.reason,
                                "approved_by": verdict.approved_by})
            return
        await self._record("tool", "refused", "refused",
                           {"tool": call.tool, "call": call.summary, "code": verdict.code,
                            "reason": verdict.reason})
        if verdict.code == NO_HOLD:  # a person was needed and none could be waited for
            self._asker.declined(self._scope.run_id, f"May I use {call.tool}? {call.summary}")
        if verdict.alert:
            await self._alerts.raise_alert(call.tool, verdict.reason,
                                           subject=self._scope.subject,
                                           run_id=self._scope.run_id)

    async def item_done(self, item: dict[str, Any]) -> None:
        """Record a tool item Codex finished (``item/completed``): a command, a file change or
        an MCP call, including those it ran without asking anybody, so the run's story has it."""
        kind = item.get("type")
        if kind not in _RAN_ITEMS:
            return
        status = str(item.get("status") or "")
        details: dict[str, Any] = {"item": kind, "item_id": str(item.get("id") or ""),
                                   "status": status}
        if kind == "commandExecution":
            details |= {"command": str(item.get("command") or "")[:_SUMMARY_CHARS],
                        "exit_code": item.get("exitCode"), "duration_ms": item.get("durationMs")}
        elif kind == "fileChange":
            details["paths"] = [str(change.get("path")) for change in item.get("changes") or []
                                if isinstance(change, dict)]
        else:
            details |= {"server": str(item.get("server") or ""),
                        "tool": str(item.get("tool") or "")}
        await self._record("tool", "ran", "ok" if status == "completed" else "failed", details)

    async def _record(self, kind: str, event: str, outcome: str, details: dict[str, Any]) -> None:
        await self._audit.record(kind, event, outcome, subject=self._scope.subject,
                                 run_id=self._scope.run_id, details=details)


_RAN_ITEMS = frozenset({"commandExecution", "fileChange", "mcpToolCall"})
_SUMMARY_CHARS = 500


def flat_name(tool: HostedTool) -> str:
    """The function name an MCP tool is offered under: model APIs allow no dots in names."""
    return f"{tool.server}__{tool.name}"


def _requested_tool(request: ServerRequest) -> str:
    """The tool a request is about, as verdicts name it."""
    if request.method == "item/tool/call":
        return str(request.params.get("tool") or "?")
    return {"item/commandExecution/requestApproval": "shell",
            "item/fileChange/requestApproval": "apply_patch"}.get(request.method, request.method)


def _cut(text: str) -> str:
    """A tool result the model can take: above the cap, cut with a marker that says so (an MCP
    result may be as large as a frame, 16 MiB)."""
    if len(text) <= TOOL_RESULT_MAX_CHARS:
        return text
    dropped = len(text) - TOOL_RESULT_MAX_CHARS
    return text[:TOOL_RESULT_MAX_CHARS] + f"\n[truncated by bothy: {dropped} more characters]"


def _decision(verdict: Proceed | Refuse) -> dict[str, str]:
    return {"decision": "accept" if isinstance(verdict, Proceed) else "decline"}


def _brief(arguments: Any) -> str:
    text = repr(arguments)
    return text if len(text) <= 200 else text[:197] + "..."

