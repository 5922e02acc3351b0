"""A run tied to its task in Cairn: claimed and briefed before the first turn, noted and
released after the last (SPEC §9, docs/CAIRN.md).

:class:`TaskLink` holds one run's side of it and records every step in the register under the
run's id. A task held by someone else is a :class:`~bothy.engine.budget.Refused` at gate
``cairn``; anything else that goes wrong with Cairn (missing, slow, failing, garbage) is a
recorded step and the work goes on. :class:`TaskClaims` keeps each claim in the state database
from before ``cairn claim`` runs until the release succeeds, so that the next Bothy to start
releases a task whose run crashed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bothy.clock import Clock, to_us
from bothy.engine.audit import AuditLog
from bothy.engine.budget import Refused
from bothy.engine.framing import frame, new_token
from bothy.engine.procgroup import process_start_time
from bothy.engine.state import StateDB
from bothy.money import format_usd

if TYPE_CHECKING:
    from pathlib import Path

    from bothy.config import CairnConfig
    from bothy.engine.cairn import Cairn

# The Cairn client (engine/cairn.py, ~2 % of a whole `bothy run`'s instructions) is loaded by
# the first run that names a task, or the first claim left by a dead run: not by every run.

__all__ = ["NOTE_MAX_CHARS", "NOTE_SPEC", "TaskClaims", "TaskLink"]

NOTE_MAX_CHARS = 4_000

NOTE_SPEC: dict[str, Any] = {
    "type": "function",
    "name": "bothy_note",
    "description": (
        "Write a note to this run's task in Cairn, the task ledger, for the people who follow"
        " the task. `text` is the note (at most 4000 characters)."
    ),
    "inputSchema": {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "the note"}},
        "required": ["text"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True)
class _Ending:
    outcome: str
    cost_micros: int
    answer: str
    reason: str | None


class TaskLink:
    """One run's tie to one task. Steps are called in order: claim, briefed, finish."""

    def __init__(
        self, claims: TaskClaims, ref: str, *, run_id: str, subject: str
    ) -> None:
        self._claims = claims
        self.ref = ref
        self._run_id = run_id
        self._subject = subject
        self._holds = False  # the claim succeeded: brief and note go to the task
        self._may_hold = False  # a claim may have landed: release at the end

    async def claim(self) -> Refused | None:
        """Claim the task; a refusal at gate 'cairn' if someone else holds it, else None."""
        await self._claims.remember(self._run_id, self.ref, self._subject)
        self._may_hold = True  # from here on (a stop mid-claim included) the end releases
        answer = await self._claims.cairn.claim(self.ref, self._run_id)
        from bothy.engine.cairn import Held, StepFailed

        if isinstance(answer, Held):
            self._may_hold = False  # never release a task someone else holds
            await self._claims.forget(self._run_id)
            return Refused("cairn", f"task {self.ref} is held by {answer.holder}",
                           {"ref": self.ref, "holder": answer.holder})
        if isinstance(answer, StepFailed):
            self._may_hold = answer.ran
            if not answer.ran:
                await self._claims.forget(self._run_id)
            await self._record("claim_failed", "failed", {"reason": answer.reason})
            return None
        self._holds = self._may_hold = True
        await self._record("claimed", "ok", {})
        return None

    async def briefed(self, prompt: str, *, enabled: bool) -> str:
        """``prompt`` with the task's brief ahead of it, framed as untrusted data."""
        if not self._holds or not enabled:
            return prompt
        answer = await self._claims.cairn.brief(self.ref)
        from bothy.engine.cairn import BRIEF_MAX_CHARS, StepFailed

        if isinstance(answer, StepFailed):
            await self._record("brief_failed", "failed", {"reason": answer.reason})
            return prompt
        shown = min(len(answer.text), BRIEF_MAX_CHARS)
        await self._record("briefed", "ok", {"chars": len(answer.text), "shown_chars": shown})
        if not answer.text.strip():
            return prompt
        framed = frame(answer.text, token=new_token(), source=f"Cairn's brief of task {self.ref}",
                       limit_chars=BRIEF_MAX_CHARS)
        return f"Your task is {self.ref} in Cairn, the task ledger.\n{framed}\n\n{prompt}"

    async def finish(
        self, outcome: str, cost_micros: int, answer: str, reason: str | None
    ) -> None:
        """The note (outcome, cost, answer), then the release: last of all, in every ending."""
        if self._holds:
            ending = _Ending(outcome, cost_micros, answer, reason)
            await self._note(self._outcome_note(ending), by="bothy")
        if self._may_hold:
            await self._claims.release(self._run_id, self.ref, self._subject)

    async def note_from_model(self, text: str) -> tuple[bool, str]:
        """The ``bothy_note`` tool: (success, what the model is told)."""
        if not text.strip():
            return False, "the note is empty: give its text in 'text'"
        if len(text) > NOTE_MAX_CHARS:
            return False, f"a note is at most {NOTE_MAX_CHARS} characters, not {len(text)}"
        site = self._claims.site
        written = await self._note(f"run {self._run_id} on {site} (a note from the model):\n"
                                   f"{text}", by="model")
        if written is not None:
            return False, f"the note could not be written to task {self.ref}: {written}"
        return True, f"noted on task {self.ref}"

    def _outcome_note(self, ending: _Ending) -> str:
        cost = format_usd(ending.cost_micros, 4)
        head = f"run {self._run_id} on {self._claims.site}: {ending.outcome}, {cost} usd"
        body = ending.answer if ending.outcome in ("completed", "verified") else (
            f"reason: {ending.reason}" if ending.reason else "")
        if len(body) > NOTE_MAX_CHARS:
            dropped = len(body) - NOTE_MAX_CHARS
            body = body[:NOTE_MAX_CHARS] + f"\n[truncated by bothy: {dropped} more characters]"
        return f"{head}\n{body}".rstrip() + "\n"

    async def _note(self, text: str, *, by: str) -> str | None:
        """Write a note; None when written, else why not (recorded either way)."""
        answer = await self._claims.cairn.note(self.ref, text)
        from bothy.engine.cairn import StepFailed

        if isinstance(answer, StepFailed):
            await self._record("note_failed", "failed", {"by": by, "reason": answer.reason})
            return answer.reason
        await self._record("noted", "ok", {"by": by, "chars": len(text)})
        return None

    async def _record(self, event: str, outcome: str, details: dict[str, Any]) -> None:
        await self._claims.record(event, outcome, self._run_id, self._subject,
                                  {"ref": self.ref, **details})


class TaskClaims:
    """The site's claims in Cairn, kept in the state table ``task_claims``."""

    def __init__(
        self, cairn: CairnConfig, *, cwd: Path, db: StateDB, audit: AuditLog, clock: Clock,
        site: str,
    ) -> None:
        self._cairn_config = cairn
        self._cwd = cwd
        self._cairn: Cairn | None = None
        self.site = site
        self._db = db
        self._audit = audit
        self._clock = clock

    @property
    def cairn(self) -> Cairn:
        """The Cairn client (``cairn.command``), made on first use."""
        if self._cairn is None:
            from bothy.engine.cairn import Cairn

            self._cairn = Cairn(self._cairn_config, cwd=self._cwd)
        return self._cairn

    def link(self, ref: str, *, run_id: str, subject: str) -> TaskLink:
        return TaskLink(self, ref, run_id=run_id, subject=subject)

    async def refuse_ref(self, ref: str, problem: str, *, run_id: str, subject: str) -> None:
        """A ref from untrusted input that cannot name a task: recorded, the run goes on."""
        await self.record("ref_refused", "refused", run_id, subject,
                          {"ref": ref[:80], "reason": problem,
                           "then": "the run goes on without Cairn"})

    async def release_left(self) -> int:
        """Release every task whose run's bothy process died holding it; how many were."""
        rows = await self._db.fetch_all(
            "SELECT c.run_id, c.ref, c.subject, r.owner_pid, r.owner_start FROM task_claims c"
            " LEFT JOIN runs r ON r.run_id = c.run_id ORDER BY c.claimed_us"
        )
        released = 0
        for row in rows:
            owner = row["owner_pid"]
            if owner is not None and process_start_time(owner) == row["owner_start"]:
                continue  # its run is alive (or its owner finishes it): not ours to release
            if await self.release(row["run_id"], row["ref"], row["subject"],
                                  why="its run's bothy process died holding it"):
                released += 1
        return released

    async def release(self, run_id: str, ref: str, subject: str, *, why: str | None = None) -> bool:
        answer = await self.cairn.release(ref, run_id)
        from bothy.engine.cairn import StepFailed

        details: dict[str, Any] = {"ref": ref} | ({"why": why} if why else {})
        if isinstance(answer, StepFailed):
            # The row stays: the next start tries again.
            await self.record("release_failed", "failed", run_id, subject,
                              {**details, "reason": answer.reason})
            return False
        await self.forget(run_id)
        await self.record("released", "ok", run_id, subject, details)
        return True

    async def remember(self, run_id: str, ref: str, subject: str) -> None:
        async with self._db.transaction():
            await self._db.execute(
                "INSERT OR REPLACE INTO task_claims (run_id, ref, subject, claimed_us)"
                " VALUES (?, ?, ?, ?)", (run_id, ref, subject, to_us(self._clock())),
            )

    async def forget(self, run_id: str) -> None:
        async with self._db.transaction():
            await self._db.execute("DELETE FROM task_claims WHERE run_id = ?", (run_id,))

    async def record(
        self, event: str, outcome: str, run_id: str, subject: str, details: dict[str, Any]
    ) -> None:
        await self._audit.record("cairn", event, outcome, subject=subject, run_id=run_id,
                                 details=details)
