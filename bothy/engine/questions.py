"""Questions a run holds for a person: asked, answered, timed out, or answered too late.

A question is a row in the state database, so an answer may come from any shell
(``bothy answer RUN TEXT``), a terminal prompt, or (later) a chat thread. The run that asked
polls for it until its deadline. A deadline or a stop declines the question and is recorded
as ``timed_out`` / ``stopped``, never as a person's "no". An answer to a run with nothing
pending is recorded as late.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bothy.clock import Clock, to_us
from bothy.engine.state import StateDB

_POLL_S = 0.1


@dataclass(frozen=True)
class Answered:
    text: str
    by: str

    @property
    def approves(self) -> bool:
        return self.text.strip().lower() in {"yes", "y", "approve", "approved", "ok"}


@dataclass(frozen=True)
class Expired:
    status: str  # timed_out | stopped
    reason: str


@dataclass(frozen=True)
class Late:
    """Nothing was waiting: the run had moved on. ``expired`` is the run's last question that
    ended unanswered (timed out or stopped), which a late reply was most likely meant for."""

    run_id: str
    expired: ClosedQuestion | None = None


@dataclass(frozen=True)
class ClosedQuestion:
    """A question that ended without an answer."""

    text: str
    status: str  # timed_out | stopped
    hold_s: float  # how long it was held

    def note(self) -> str:
        """What a late reply is told about it, naming it."""
        ended = (f"had no answer within {self.hold_s:g} s and was declined"
                 if self.status == "timed_out" else "was declined when the run was stopped")
        return f"The question “{_quoted(self.text)}” {ended}; the run went on without it."


@dataclass(frozen=True)
class Delivered:
    question_id: int
    question: str


class QuestionBoard:
    """The shared board of pending questions."""

    def __init__(self, db: StateDB, *, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def post(self, run_id: str, kind: str, tool: str | None, text: str, hold_s: int) -> int:
        now_us = to_us(self._clock())
        async with self._db.transaction():
            await self._db.execute(
                "INSERT INTO questions (run_id, kind, tool, text, asked_us, deadline_us, status)"
                " VALUES (?, ?, ?, ?, ?, ?, 'pending')",
                (run_id, kind, tool, text, now_us, now_us + hold_s * 1_000_000),
            )
            return await self._db.scalar("SELECT last_insert_rowid()")

    async def wait(
        self,
        question_id: int,
        *,
        hold_s: float,
        should_stop: Callable[[], Awaitable[str | None]],
    ) -> Answered | Expired:
        """Wait for an answer, at most ``hold_s``; ``should_stop`` may end the wait early."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        while True:
            row = await self._db.fetch_one(
                "SELECT status, answer, answered_by FROM questions WHERE id = ?", (question_id,)
            )
            if row is not None and row["status"] == "answered":
                return Answered(str(row["answer"]), str(row["answered_by"]))
            stop = await should_stop()
            if stop is not None:
                return await self._close(question_id, "stopped", stop)
            if loop.time() >= deadline:
                return await self._close(
                    question_id, "timed_out", f"no answer within {hold_s:g} s"
                )
            await asyncio.sleep(_POLL_S)

    async def _close(self, question_id: int, status: str, reason: str) -> Answered | Expired:
        async with self._db.transaction():
            changed = await self._db.execute(
                "UPDATE questions SET status = ? WHERE id = ? AND status = 'pending'",
                (status, question_id),
            )
            if not changed:  # an answer landed between our last look and now: it counts
                row = await self._db.fetch_one(
                    "SELECT answer, answered_by FROM questions WHERE id = ?", (question_id,)
                )
                if row is not None and row["answer"] is not None:
                    return Answered(str(row["answer"]), str(row["answered_by"]))
        return Expired(status, reason)

    async def answer(self, run_id: str, text: str, by: str) -> Delivered | Late:
        """Answer the run's oldest pending question, or say the run had moved on."""
        async with self._db.transaction():
            row = await self._db.fetch_one(
                "SELECT id, text FROM questions WHERE run_id = ? AND status = 'pending'"
                " ORDER BY id LIMIT 1",
                (run_id,),
            )
            if row is None:
                return Late(run_id, await self._last_closed(run_id))
            await self._db.execute(
                "UPDATE questions SET status = 'answered', answer = ?, answered_by = ?,"
                " answered_us = ? WHERE id = ?",
                (text, by, to_us(self._clock()), row["id"]),
            )
        return Delivered(int(row["id"]), str(row["text"]))

    async def _last_closed(self, run_id: str) -> ClosedQuestion | None:
        row = await self._db.fetch_one(
            "SELECT text, status, asked_us, deadline_us FROM questions WHERE run_id = ?"
            " AND status IN ('timed_out', 'stopped') ORDER BY id DESC LIMIT 1",
            (run_id,),
        )
        if row is None:
            return None
        hold_s = (int(row["deadline_us"]) - int(row["asked_us"])) / 1_000_000
        return ClosedQuestion(str(row["text"]), str(row["status"]), hold_s)

    async def pending(self, run_id: str) -> list[str]:
        rows = await self._db.fetch_all(
            "SELECT text FROM questions WHERE run_id = ? AND status = 'pending' ORDER BY id",
            (run_id,),
        )
        return [str(row["text"]) for row in rows]


_QUOTED_MAX_CHARS = 200
APPROVAL_HINT = "Answer yes or no."


@dataclass(frozen=True)
class Option:
    """One option of a ``request_user_input`` question."""

    label: str
    description: str


@dataclass(frozen=True)
class InputQuestion:
    """One question of Codex's ``item/tool/requestUserInput`` (codex-app-server.md): shown
    with its options numbered and a hint that fits it; answered by an option's number, its
    label, or free text."""

    id: str
    text: str
    options: tuple[Option, ...]
    secret: bool  # isSecret: never asked (a reply would sit in the thread and the register)

    @classmethod
    def of(cls, raw: dict[str, Any]) -> InputQuestion:
        """The question as Codex sent it; a field of the wrong type counts as absent."""
        options = tuple(
            Option(str(option.get("label") or "").strip(),
                   str(option.get("description") or "").strip())
            for option in raw.get("options") or [] if isinstance(option, dict)
            and str(option.get("label") or "").strip())
        text = str(raw.get("question") or raw.get("header") or "?").strip() or "?"
        return cls(str(raw.get("id")), text, options, raw.get("isSecret") is True)

    def shown(self) -> str:
        """The question and its options, one numbered line each."""
        lines = [self.text]
        for number, option in enumerate(self.options, start=1):
            about = f" — {option.description}" if option.description else ""
            lines.append(f"{number}. {option.label}{about}")
        return "\n".join(lines)

    def hint(self) -> str:
        """How to answer it."""
        if self.options:
            numbers = "1" if len(self.options) == 1 else f"1–{len(self.options)}"
            return f"Answer with a number ({numbers}), an option's name, or your own words."
        return "Answer in your own words."

    def answer(self, reply: str) -> str:
        """The answer Codex gets: the label of the option a number or a label names, else
        the reply as it was written."""
        said = reply.strip()
        if said.isdigit() and 1 <= int(said) <= len(self.options):
            return self.options[int(said) - 1].label
        wanted = " ".join(said.split()).casefold()
        for option in self.options:
            if option.label.casefold() == wanted:
                return option.label
        return reply


def _quoted(text: str) -> str:
    """A question as a late note quotes it: one line, cut at 200 characters."""
    line = " ".join(text.split())
    return line if len(line) <= _QUOTED_MAX_CHARS else line[: _QUOTED_MAX_CHARS - 1] + "…"
