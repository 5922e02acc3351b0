"""What a person's chat message means, shared by every adapter (SPEC §5 "Chat", §6).

- A mention from an allowed account starts a run whose conversation is that thread: it is
  made durable in the inbox (source ``chat``) *before* ``on_message`` returns, so the adapter
  acknowledges the platform only once nothing can be lost; the platform's twins and retries
  carry one dedupe key and collapse there. The conversation (``chat/conversation.py``) then
  runs it and answers in the thread.
- A reply in a thread whose run holds a question answers it (``yes``/``no`` for approvals,
  free text for questions). A reply while the run works with nothing pending is recorded as
  late and answered with a note, naming the question that expired if one did. A reply after
  the run finished continues the conversation: a new run in the same lane, told what it
  answered last.
- Anyone not on the allowlist is refused politely (a mention) or ignored (a reply); both are
  audited, and a held question stays pending.
- A message an adapter took off a platform that will not send it again, but that could not be
  taken here (the inbox is full, say), is lost: :meth:`ChatRouter.on_lost` audits it
  (``chat lost``) and raises an alert, so somebody hears of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bothy.chat.base import ChatMessage
from bothy.chat.conversation import Conversations, thread_key
from bothy.config import ChatConfig
from bothy.engine.alerts import Alert, Alerts, AlertThread
from bothy.engine.audit import AuditLog
from bothy.engine.questions import Delivered, QuestionBoard
from bothy.engine.state import StateDB
from bothy.errors import ChatError
from bothy.wakes.inbox import Inbox
from bothy.wakes.reports import Reports

_REFUSAL = ("Sorry, I only take requests from the people this site's operator listed. "
            "Your message was recorded.")
_LATE = ("The run has moved on: nothing was waiting for an answer, so your reply was recorded "
         "as late.")
_LATE_FOR_REPORT = ("That run was unattended and has finished: nothing was waiting for an"
                    " answer, so your reply was recorded as late. Mention me to start a new"
                    " conversation.")


class ChatRouter:
    """Routes chat messages to the inbox, to held questions, or to a polite refusal."""

    def __init__(
        self,
        cfg: ChatConfig,
        conversations: Conversations,
        *,
        inbox: Inbox,
        board: QuestionBoard,
        db: StateDB,
        audit: AuditLog,
        alerts: Alerts,
        on_accepted: Callable[[], None],
        reports: Reports,
    ) -> None:
        self._cfg = cfg
        self._conversations = conversations
        self._inbox = inbox
        self._board = board
        self._db = db
        self._audit = audit
        self._alerts = alerts
        self._on_accepted = on_accepted
        self._reports = reports  # whose posts' threads a reply may be in
        self._replies: set[asyncio.Task[None]] = set()

    def allowed(self, platform: str, user: str) -> bool:
        section = self._cfg.slack if platform == "slack" else self._cfg.discord
        return section is not None and user in section.allowed_users

    async def post_alert(self, alert: Alert) -> str:
        """Post an alert to the first configured alert channel; say where it went."""
        adapters = self._conversations.adapters
        for platform, section in (("slack", self._cfg.slack), ("discord", self._cfg.discord)):
            if section is not None and section.alert_channel and platform in adapters:
                thread = alert.thread
                link = None
                if thread is not None and thread.platform in adapters:
                    link = await adapters[thread.platform].link(thread.channel, thread.thread)
                await adapters[platform].post_alert(section.alert_channel, alert.text(link))
                return f"{platform}:{section.alert_channel}"
        raise ChatError("no connected platform has an alert channel", platform="-")

    async def on_message(self, message: ChatMessage) -> None:
        """Called by an adapter before it acknowledges the platform's delivery."""
        if message.in_thread and not message.mentioned:
            await self._reply(message)
        elif message.mentioned:
            await self._mention(message)

    async def on_lost(self, message: ChatMessage, reason: str) -> None:
        """Called by an adapter for a message ``on_message`` failed and nobody will resend."""
        key = thread_key(message.platform, message.channel, message.thread)
        await self._record("chat", "lost", "failed", message,
                           {"message": message.message_id, "reason": reason})
        await self._alerts.raise_alert(
            f"chat message {message.platform}:{message.message_id}",
            f"a message from {message.platform}:{message.user} was lost before it was"
            f" recorded ({reason}); ask them to send it again", subject=key,
            thread=AlertThread(message.platform, message.channel, message.thread))

    async def _mention(self, message: ChatMessage) -> None:
        if not self.allowed(message.platform, message.user):
            await self._record("chat", "refused", "refused", message,
                               {"reason": "the author is not on the allowlist"})
            self._answer_later(message, _REFUSAL)
            return
        await self._enqueue(message, continued_from=None)

    async def _enqueue(self, message: ChatMessage, *, continued_from: str | None) -> None:
        await self._inbox.accept(self._conversations.wake_of(message,
                                                             continued_from=continued_from))
        self._on_accepted()

    async def _reply(self, message: ChatMessage) -> None:
        state = await self._conversations.state(message)
        if state is None:
            await self._reply_to_report(message)  # or a thread Bothy never posted in
            return
        if not self.allowed(message.platform, message.user):
            await self._record("answer", "ignored", "refused", message,
                               {"reason": "the author is not on the allowlist",
                                "run": state.last_run_id})
            return
        run_id = state.last_run_id
        key = thread_key(message.platform, message.channel, message.thread)
        by = f"{message.platform}:{message.user}"
        answered = await self._board.answer(run_id, message.text, by)
        if isinstance(answered, Delivered):
            await self._audit.record("answer", "received", "ok", subject=key, run_id=run_id,
                                     details={"by": by, "answer": message.text,
                                              "question": answered.question})
            return
        run = await self._db.run(run_id)
        if run is not None and run.status != "finished":
            expired = answered.expired
            await self._audit.record("answer", "late", "ok", subject=key, run_id=run_id,
                                     details={"by": by, "answer": message.text,
                                              "question": expired.text if expired else None})
            self._answer_later(message, _LATE if expired is None
                               else f"{expired.note()} Your reply was recorded as late.")
            return
        await self._enqueue(message, continued_from=state.last_answer)

    async def _reply_to_report(self, message: ChatMessage) -> None:
        """A reply in the thread of an unattended run's report or question: that run never
        waits, so the reply is late (and its Codex thread is never resumed)."""
        run_id = await self._reports.run_of_thread(message.platform, message.channel,
                                                   message.thread)
        if run_id is None:
            return  # a thread Bothy never posted in
        by = f"{message.platform}:{message.user}"
        if not self.allowed(message.platform, message.user):
            await self._record("answer", "ignored", "refused", message,
                               {"reason": "the author is not on the allowlist", "run": run_id})
            return
        await self._audit.record(
            "answer", "late", "ok",
            subject=thread_key(message.platform, message.channel, message.thread),
            run_id=run_id, details={"by": by, "answer": message.text,
                                    "note": "a reply to the report of an unattended run"})
        self._answer_later(message, _LATE_FOR_REPORT)

    def _answer_later(self, message: ChatMessage, text: str) -> None:
        """Reply after the platform's delivery is acknowledged (never hold the ack on a post)."""
        task = asyncio.create_task(self._conversations.answer(message, text))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _record(
        self, kind: str, event: str, outcome: str, message: ChatMessage, details: dict[str, Any]
    ) -> None:
        await self._audit.record(
            kind, event, outcome,
            subject=thread_key(message.platform, message.channel, message.thread),
            details={"user": f"{message.platform}:{message.user}", **details},
        )

    async def close(self) -> None:
        for task in list(self._replies):
            task.cancel()
        await asyncio.gather(*self._replies, return_exceptions=True)
