"""One verdict engine for every tool call a worker makes (SPEC §7).

Codex's own approval requests (a shell command asking to leave the sandbox is ``shell``, a
patch is ``apply_patch``), calls to Bothy's own tools and calls to granted MCP tools all come
here, and the answer is a value: :class:`Proceed`, :class:`Refuse` or :class:`NeedsPerson`
(a ``confirm`` tool where a person can be asked). Fail-closed: a tool that is not granted,
by name and exactly, is refused. The caller audits every verdict.

Rules, in order:
1. not in the profile's ``tools`` → refused (``not_granted``);
2. a write-capable call in a run woken by untrusted input, unless ``allow_from_untrusted``
   → refused (``untrusted``);
3. the profile's ``approvals`` rule: ``proceed``; ``deny``; ``guide`` (refused, the reason goes
   back to the model); ``confirm`` (passes on a person's approval of that tool younger than
   ``unless_approved_within``, else asks a person where a hold is possible, else refuses);
4. no rule, but listed in ``ask`` → refused, and an alert is raised (``ask_without_rule``);
5. no rule → proceed (granted).
"""

from __future__ import annotations

from dataclasses import dataclass

from bothy.clock import Clock, to_us
from bothy.config import Guide, ProfileConfig
from bothy.engine.state import StateDB

NO_HOLD = "no_hold"  # a refusal's code: a person was needed and the run cannot wait for one


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the verdict engine sees it."""

    tool: str  # the profile's name for it: shell, apply_patch, bothy_checklist, server.tool
    summary: str  # what is asked, for the question and the audit record
    write: bool  # may change something outside the run (withheld from untrusted runs)


@dataclass(frozen=True)
class Proceed:
    reason: str
    approved_by: str | None = None


@dataclass(frozen=True)
class Refuse:
    code: str  # not_granted | untrusted | denied | guided | no_hold | ask_without_rule |
    #            declined_by_person | timed_out | stopped
    reason: str  # for the audit record and the operator
    to_model: str  # what the model is told
    alert: bool = False


@dataclass(frozen=True)
class NeedsPerson:
    question: str
    hold_s: int


Verdict = Proceed | Refuse | NeedsPerson


class ApprovalStore:
    """People's approvals of tools, remembered so ``unless_approved_within`` can pass on them."""

    def __init__(self, db: StateDB, *, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def record(self, tool: str, approved_by: str, run_id: str) -> None:
        async with self._db.transaction():
            await self._db.execute(
                "INSERT INTO approvals (tool, approved_by, approved_us, run_id)"
                " VALUES (?, ?, ?, ?)",
                (tool, approved_by, to_us(self._clock()), run_id),
            )

    async def latest(self, tool: str, within_s: int) -> tuple[str, int] | None:
        """Who approved ``tool`` within the last ``within_s`` seconds, and how long ago."""
        if within_s <= 0:
            return None
        now_us = to_us(self._clock())
        row = await self._db.fetch_one(
            "SELECT approved_by, approved_us FROM approvals WHERE tool = ? AND approved_us >= ?"
            " ORDER BY approved_us DESC LIMIT 1",
            (tool, now_us - within_s * 1_000_000),
        )
        if row is None:
            return None
        return str(row["approved_by"]), (now_us - int(row["approved_us"])) // 1_000_000


class VerdictEngine:
    """Decides each tool call of one run under one profile (or none)."""

    def __init__(
        self,
        profile_name: str | None,
        profile: ProfileConfig | None,
        approvals: ApprovalStore,
        *,
        trusted: bool,
        can_hold: bool,
    ) -> None:
        self.profile_name = profile_name
        self._profile = profile
        self._approvals = approvals
        self._trusted = trusted
        self._can_hold = can_hold

    def grants(self, tool: str) -> bool:
        return self._profile is not None and tool in self._profile.tools

    async def decide(self, call: ToolCall) -> Verdict:
        profile = self._profile
        if profile is None or call.tool not in profile.tools:
            where = f"profile '{self.profile_name}'" if profile else "this run (no profile)"
            return Refuse(
                "not_granted",
                f"'{call.tool}' is not granted to {where}",
                f"The tool '{call.tool}' is not available to you in this run. Do not retry it.",
            )
        if call.write and not self._trusted and not profile.allow_from_untrusted:
            return Refuse(
                "untrusted",
                f"'{call.tool}' can write and this run was woken by untrusted input",
                f"The tool '{call.tool}' is withheld in runs started by untrusted input.",
            )
        rule = profile.approvals.get(call.tool)
        if rule is None:
            return self._no_rule(call, profile)
        if rule == "proceed":
            return Proceed("rule: proceed")
        if rule == "deny":
            return Refuse("denied", f"'{call.tool}' is denied by profile '{self.profile_name}'",
                          f"The tool '{call.tool}' is denied. Do not retry it.")
        if isinstance(rule, Guide):
            return Refuse("guided", f"'{call.tool}' refused with guidance: {rule.guide}",
                          f"The tool '{call.tool}' was refused: {rule.guide}")
        return await self._confirm(call, profile)

    def _no_rule(self, call: ToolCall, profile: ProfileConfig) -> Verdict:
        if call.tool in profile.ask:
            return Refuse(
                "ask_without_rule",
                f"'{call.tool}' is in ask but has no approvals rule: refused, alert raised",
                f"The tool '{call.tool}' needs a person and none is set up to answer it."
                " Do not retry.",
                alert=True,
            )
        return Proceed("granted")

    async def _confirm(self, call: ToolCall, profile: ProfileConfig) -> Verdict:
        recent = await self._approvals.latest(call.tool, profile.unless_approved_within)
        if recent is not None:
            who, age_s = recent
            return Proceed(f"approved by {who} {age_s} s ago", approved_by=who)
        if self._can_hold and profile.question_hold_seconds > 0:
            return NeedsPerson(
                f"May I use {call.tool}? {call.summary}", profile.question_hold_seconds
            )
        return Refuse(
            NO_HOLD,
            f"'{call.tool}' needs a person's approval and this run cannot wait for one",
            f"The tool '{call.tool}' needs a person's approval, and nobody can be asked from this"
            " run. Continue without it.",
        )
