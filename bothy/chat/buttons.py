"""Approval buttons: a ``confirm`` question asked with Approve / Decline beside the reply.

Every decision about a button message is made here, for every platform (the adapters only
draw the buttons and carry presses in and answers out):

- asking: an approval question is posted in its thread with two buttons whose value names
  the question and its run (:func:`button_value`); a question that is not an approval, or a
  post with buttons that fails, is asked as plain text (a reply answers it either way);
- a press (:meth:`Buttons.press`) is judged and, when it counts, written to the question's
  row (``answered``, by whom, when) *before* it returns, so the adapter acknowledges the
  platform only once the decision is durable. The row changes once (``WHERE status =
  'pending'``): Slack's retry of a press, a press replayed after a dropped socket or a
  Discord RESUME, finds the question answered by that press and changes nothing
  (``button repeated``);
- what does not count, and is audited: a press that is not this bot's (another workspace,
  app or guild: ``button forged``, not answered at all), a stranger's press (``button
  refused``, told privately, the question stays pending), a button of a question that no
  longer waits or of another run (``button stale``, told politely), a press while the run is
  being stopped (the question is declined as a stop declines it, ``button stopped``);
- the message's end: once its question is settled — by a button, a reply in the thread,
  ``bothy answer``, its deadline or a stop — the message is replaced by the question and
  who decided and when, or that it expired, without buttons (:meth:`Buttons.ask` follows it).
  A message that kept its buttons (the platform refused the update) is replaced when
  somebody presses it, after a restart too.
  The new thread message that says a question expired is not this module's.

Replies keep working beside the buttons: plain words (``yes``, ``approve``, ``no``,
``deny``), no leading ``/`` (the router answers them through the same board).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from bothy.chat.base import ChatAdapter, Press, PressAnswer
from bothy.clock import Clock, from_us
from bothy.engine.audit import AuditLog
from bothy.engine.questions import Answered, Question, QuestionBoard
from bothy.engine.state import StateDB
from bothy.errors import ChatError

APPROVE = "approve"
DECLINE = "decline"
CHOICES = (APPROVE, DECLINE)
ACTION_PREFIX = "bothy_question:"  # Slack action_id / Discord custom_id: the prefix + choice
_ASKING = "Press Approve or Decline, or answer yes or no in this thread."
_FOLLOW_S = 0.25  # how often a button message looks at its question's row
_VALUE = re.compile(r"([0-9]{1,18}):([A-Za-z0-9_.-]{1,100})")

_STRANGER = ("Only the people this site's operator listed can answer this question. "
             "Your press was recorded and changed nothing.")
_UNKNOWN = "That button is not one of this site's questions, so it changed nothing."
_GONE = "This question no longer exists here, so your press changed nothing."
_OTHER_RUN = "That button belongs to another run's question, so your press changed nothing."
_STOPPING = ("The run was stopped, so this question was declined, as on any stop. "
             "Nothing was approved.")


@dataclass(frozen=True)
class ButtonRef:
    """What a button carries: its question and the run that asked it."""

    question_id: int
    run_id: str


def button_value(question_id: int, run_id: str) -> str:
    """The value both buttons of a question carry (``"<question id>:<run id>"``)."""
    return f"{question_id}:{run_id}"


def parse_value(value: str) -> ButtonRef | None:
    """The question a button names, or None for a value Bothy never made."""
    match = _VALUE.fullmatch(value)
    if match is None:
        return None
    return ButtonRef(int(match.group(1)), match.group(2))


class Buttons:
    """The approval buttons of a site's conversations: asking with them, judging presses,
    and updating each message once its question is settled."""

    def __init__(
        self, adapters: Mapping[str, ChatAdapter], *, db: StateDB, audit: AuditLog,
        clock: Clock,
    ) -> None:
        self._adapters = adapters
        self._db = db
        self._audit = audit
        self._clock = clock
        self.board = QuestionBoard(db, clock=clock)
        self._updates: set[asyncio.Task[None]] = set()

    # -- asking -------------------------------------------------------------------------------

    async def ask(
        self, platform: str, channel: str, thread: str, run_id: str, text: str,
        *, hint: str, subject: str,
    ) -> None:
        """Post the run's question in its thread — an approval with buttons, anything else
        (or an approval whose buttons could not be posted) with ``hint``, how to answer it —
        and replace a button message once its question is settled."""
        adapter = self._adapters[platform]
        question = await self.board.latest(run_id)
        plain = f"? {text}\n{hint}"
        if question is None or question.kind != "approval":
            await self._post_plain(adapter, channel, thread, run_id, plain, subject)
            return
        try:
            message_id = await adapter.post_question(
                channel, thread, f"? {text}\n{_ASKING}",
                button_value(question.question_id, run_id))
        except ChatError as exc:
            await self._audit.record("chat", "post-failed", "failed", subject=subject,
                                     run_id=run_id, details={"reason": str(exc),
                                                             "question": question.question_id})
            await self._post_plain(adapter, channel, thread, run_id, plain, subject)
            return
        settled = await self._settled(question.question_id)
        await self._settle(adapter, channel, thread, message_id, settled, subject=subject)

    async def _post_plain(
        self, adapter: ChatAdapter, channel: str, thread: str, run_id: str, text: str,
        subject: str,
    ) -> None:
        try:
            await adapter.post(channel, thread, text)
        except ChatError as exc:
            await self._audit.record("chat", "post-failed", "failed", subject=subject,
                                     run_id=run_id, details={"reason": str(exc)})

    async def _settled(self, question_id: int) -> Question:
        """The question once it no longer waits (the run's own wait decides when), or once
        its run is over, whatever the row says (nothing waits for it any more)."""
        while True:
            question = await self.board.question(question_id)
            if question is None:
                raise RuntimeError(f"question {question_id} vanished from the board")
            if question.status != "pending":
                return question
            run = await self._db.run(question.run_id)
            if run is None or run.status == "finished":
                return question
            await asyncio.sleep(_FOLLOW_S)

    async def _settle(
        self, adapter: ChatAdapter, channel: str, thread: str, message_id: str,
        question: Question, *, subject: str,
    ) -> None:
        verdict = self.verdict_line(question, adapter.platform)
        try:
            await adapter.settle_question(channel, thread, message_id, f"? {question.text}",
                                          verdict)
        except ChatError as exc:
            await self._audit.record("button", "update-failed", "failed", subject=subject,
                                     run_id=question.run_id,
                                     details={"question": question.question_id,
                                              "message": message_id, "reason": str(exc)})

    def verdict_line(self, question: Question, platform: str) -> str:
        """Who decided and when, or how the question ended without anybody."""
        if question.status == "answered":
            who = _who(question.answered_by or "someone", platform)
            when = _hhmmss(from_us(question.answered_us or question.deadline_us))
            verb = "Approved" if _approves(question) else "Declined"
            return f"{verb} by {who} at {when} UTC."
        if question.status == "timed_out":
            when = _hhmmss(from_us(question.deadline_us))
            return f"Expired at {when} UTC: nobody answered in time, so nothing was approved."
        # No time: the row does not say when the stop closed it.
        return "Declined: the run was stopped, so nothing was approved."

    # -- a press ------------------------------------------------------------------------------

    async def press(self, press: Press, *, allowed: bool, subject: str, lane: str) -> PressAnswer:
        """Judge a press and record it; returns once what it decided is durable. ``subject``
        is the conversation's key (the audit's subject), ``lane`` its runs' subject."""
        user = f"{press.platform}:{press.user}"
        base: dict[str, object] = {"user": user, "press": press.press_id,
                                   "message": press.message_id,
                "choice": press.choice}
        if press.forged is not None:
            await self._audit.record("button", "forged", "refused", subject=subject,
                                     details={**base, "reason": press.forged})
            return PressAnswer(None)
        ref = parse_value(press.value)
        if ref is None or press.choice not in CHOICES:
            return await self._stale(subject, base, "not a Bothy question button", _UNKNOWN)
        question = await self.board.question(ref.question_id)
        if question is None:
            return await self._stale(subject, base, "no such question", _GONE,
                                     run_id=ref.run_id)
        details = {**base, "question": question.question_id}
        run = await self._db.run(question.run_id)
        if question.run_id != ref.run_id or run is None or run.subject != lane:
            return await self._stale(subject, details, "the question belongs to another run",
                                     _OTHER_RUN, run_id=question.run_id)
        if not allowed:
            await self._audit.record("button", "refused", "refused", subject=subject,
                                     run_id=question.run_id,
                                     details={**details,
                                              "reason": "the author is not on the allowlist"})
            return PressAnswer(_STRANGER)
        return await self._decide(press, question, subject, details)

    async def _decide(
        self, press: Press, question: Question, subject: str, details: dict[str, object],
    ) -> PressAnswer:
        by = f"{press.platform}:{press.user}"
        if question.status == "pending" and await self._stopping(question.run_id):
            ended = await self.board.decline_stopped(question.question_id,
                                                     "the run was being stopped")
            if not isinstance(ended, Answered):
                await self._audit.record("button", "stopped", "refused", subject=subject,
                                         run_id=question.run_id, details=details)
                return PressAnswer(_STOPPING)
        elif question.status == "pending":
            delivered = await self.board.answer_question(question.question_id, press.choice, by)
            if delivered is not None:
                await self._audit.record("answer", "received", "ok", subject=subject,
                                         run_id=question.run_id,
                                         details={"by": by, "answer": press.choice,
                                                  "question": delivered.question,
                                                  "via": "button", "press": press.press_id})
                return PressAnswer(None)
        # Settled before this press counted: a repeat of the press that settled it, or late.
        settled = await self.board.question(question.question_id)
        assert settled is not None  # questions are never deleted
        if settled.answered_by == by and settled.answer == press.choice:
            await self._audit.record("button", "repeated", "ok", subject=subject,
                                     run_id=question.run_id, details=details)
            return PressAnswer(None)
        self._resettle(press, settled, subject)
        if settled.status == "stopped":
            await self._audit.record("button", "stopped", "refused", subject=subject,
                                     run_id=question.run_id, details=details)
            return PressAnswer(_STOPPING)
        line = self.verdict_line(settled, press.platform)
        return await self._stale(subject, details, f"the question is {settled.status}",
                                 f"This question no longer waits for an answer: {line} "
                                 "Your press changed nothing.", run_id=question.run_id)

    def _resettle(self, press: Press, question: Question, subject: str) -> None:
        """Replace a settled question's message that still shows buttons (it was pressed),
        after the press is answered: never hold the acknowledgement on a platform call."""
        adapter = self._adapters.get(press.platform)
        if adapter is None or not press.message_id:
            return
        task = asyncio.create_task(self._settle(adapter, press.channel, press.thread,
                                                press.message_id, question, subject=subject))
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)

    async def close(self) -> None:
        """End the message updates still under way."""
        for task in list(self._updates):
            task.cancel()
        await asyncio.gather(*self._updates, return_exceptions=True)

    async def _stale(
        self, subject: str, details: dict[str, object], reason: str, tell: str,
        *, run_id: str | None = None,
    ) -> PressAnswer:
        await self._audit.record("button", "stale", "refused", subject=subject, run_id=run_id,
                                 details={**details, "reason": reason})
        return PressAnswer(tell)

    async def _stopping(self, run_id: str) -> bool:
        run = await self._db.run(run_id)
        return run is None or run.cancel_requested_us is not None or run.status == "finished"


def _approves(question: Question) -> bool:
    return Answered(question.answer or "", question.answered_by or "").approves


def _who(by: str, platform: str) -> str:
    """A decider as the platform shows a person (``<@id>``: Slack and Discord alike)."""
    prefix = f"{platform}:"
    return f"<@{by[len(prefix):]}>" if by.startswith(prefix) else by


def _hhmmss(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%H:%M:%S")
