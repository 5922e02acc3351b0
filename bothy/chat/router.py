"""What a chat message means, shared by every adapter (SPEC §5 "Chat", §6).

- A mention from an allowed account starts a run whose conversation is that thread: it is
  made durable in the inbox (source ``chat``) *before* ``on_message`` returns, so the adapter
  acknowledges the platform only once nothing can be lost; the platform's twins and retries
  carry one dedupe key and collapse there. The dispatcher then reacts, opens the thread, runs
  it in the lane ``<platform>:<thread>`` (one run at a time per thread) and posts the answer.
- A reply in a thread whose run holds a question answers it (``yes``/``no`` for approvals,
  free text for questions). A reply while the run works with nothing pending is recorded as
  late and answered with a note. A reply after the run finished continues the conversation:
  a new run in the same lane, told what it answered last.
- Anyone not on the allowlist is refused politely (a mention) or ignored (a reply); both are
  audited, and a held question stays pending.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

from bothy.chat.base import ChatAdapter, ChatMessage
from bothy.clock import Clock, to_us
from bothy.config import ChatConfig
from bothy.engine.audit import AuditLog
from bothy.engine.questions import Delivered, QuestionBoard
from bothy.engine.run import NO_REPLY, RunResult
from bothy.engine.state import StateDB
from bothy.errors import ChatError
from bothy.wakes.inbox import Delivery, Inbox

SOURCE = "chat"
SEEN = "eyes"
_REFUSAL = ("Sorry, I only take requests from the people this site's operator listed. "
            "Your message was recorded.")
_LATE = ("The run has moved on: nothing was waiting for an answer, so your reply was recorded "
         "as late.")


class ChatRouter:
    """Routes chat messages to the inbox, to held questions, or to a polite refusal."""

    def __init__(
        self,
        cfg: ChatConfig,
        adapters: dict[str, ChatAdapter],
        *,
        inbox: Inbox,
        board: QuestionBoard,
        db: StateDB,
        audit: AuditLog,
        clock: Clock,
        on_accepted: Any,
    ) -> None:
        self._cfg = cfg
        self.adapters = adapters
        self._inbox = inbox
        self._board = board
        self._db = db
        self._audit = audit
        self._clock = clock
        self._on_accepted = on_accepted
        self._replies: set[asyncio.Task[None]] = set()

    def allowed(self, platform: str, user: str) -> bool:
        section = self._cfg.slack if platform == "slack" else self._cfg.discord
        return section is not None and user in section.allowed_users

    def profile_for(self, platform: str) -> str | None:
        section = self._cfg.slack if platform == "slack" else self._cfg.discord
        return section.profile if section is not None else None

    async def post_alert(self, text: str) -> str:
        """Post an alert to the first configured alert channel; say where it went."""
        for platform, section in (("slack", self._cfg.slack), ("discord", self._cfg.discord)):
            if section is not None and section.alert_channel and platform in self.adapters:
                await self.adapters[platform].post_alert(section.alert_channel, text)
                return f"{platform}:{section.alert_channel}"
        raise ChatError("no connected platform has an alert channel", platform="-")

    async def on_message(self, message: ChatMessage) -> None:
        """Called by an adapter before it acknowledges the platform's delivery."""
        if message.in_thread and not message.mentioned:
            await self._reply(message)
        elif message.mentioned:
            await self._mention(message)

    async def _mention(self, message: ChatMessage) -> None:
        if not self.allowed(message.platform, message.user):
            await self._record("chat", "refused", "refused", message,
                               {"reason": "the author is not on the allowlist"})
            self._answer_later(message, _REFUSAL)
            return
        await self._enqueue(message, continued_from=None)

    async def _enqueue(self, message: ChatMessage, *, continued_from: str | None) -> None:
        body = json.dumps({**asdict(message), "continued_from": continued_from}).encode()
        await self._inbox.accept(Delivery(
            source=SOURCE, route=message.platform, key=message.dedupe_key, event="mention",
            action=None, headers={}, body=body, received_at=self._clock(),
        ))
        self._on_accepted()

    async def _reply(self, message: ChatMessage) -> None:
        key = thread_key(message.platform, message.channel, message.thread)
        row = await self._db.fetch_one(
            "SELECT last_run_id, last_answer FROM chat_threads WHERE thread_key = ?", (key,)
        )
        if row is None:
            return  # a thread Bothy never answered in: not its conversation
        if not self.allowed(message.platform, message.user):
            await self._record("answer", "ignored", "refused", message,
                               {"reason": "the author is not on the allowlist",
                                "run": row["last_run_id"]})
            return
        run_id = str(row["last_run_id"])
        by = f"{message.platform}:{message.user}"
        answered = await self._board.answer(run_id, message.text, by)
        if isinstance(answered, Delivered):
            await self._audit.record("answer", "received", "ok", subject=key, run_id=run_id,
                                     details={"by": by, "answer": message.text,
                                              "question": answered.question})
            return
        run = await self._db.run(run_id)
        if run is not None and run.status != "finished":
            await self._audit.record("answer", "late", "ok", subject=key, run_id=run_id,
                                     details={"by": by, "answer": message.text})
            self._answer_later(message, _LATE)
            return
        await self._enqueue(message, continued_from=str(row["last_answer"] or ""))

    async def codex_thread(self, message: ChatMessage, thread: str) -> str | None:
        """The Codex thread this conversation kept, to resume it (None for a new one)."""
        row = await self._db.fetch_one(
            "SELECT codex_thread FROM chat_threads WHERE thread_key = ?",
            (thread_key(message.platform, message.channel, thread),),
        )
        return str(row["codex_thread"]) if row is not None and row["codex_thread"] else None

    async def remember(self, message: ChatMessage, thread: str, run_id: str) -> None:
        """The thread's current run, so replies find it (kept across restarts)."""
        key = thread_key(message.platform, message.channel, thread)
        async with self._db.transaction():
            await self._db.execute(
                "INSERT INTO chat_threads (thread_key, platform, channel, thread, last_run_id,"
                " updated_us) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (thread_key) DO UPDATE SET"
                " last_run_id = excluded.last_run_id, updated_us = excluded.updated_us",
                (key, message.platform, message.channel, thread, run_id,
                 to_us(self._clock())),
            )

    async def deliver(self, message: ChatMessage, thread: str, result: RunResult) -> None:
        """Post a run's outcome in its thread; ``NO_REPLY`` is never posted."""
        key = thread_key(message.platform, message.channel, thread)
        async with self._db.transaction():
            await self._db.execute(
                "UPDATE chat_threads SET last_answer = ?,"
                " codex_thread = COALESCE(?, codex_thread) WHERE thread_key = ?",
                (result.final_text[-2000:], result.thread_id, key),
            )
        if result.outcome in ("completed", "verified"):
            text = result.answer
        else:
            text = f"({result.outcome}) {result.reason or ''}".strip()
        if not text or text.strip() == NO_REPLY:
            return
        await self.post(message.platform, message.channel, thread, text, run_id=result.run_id)

    async def post(
        self, platform: str, channel: str, thread: str, text: str, *, run_id: str | None
    ) -> None:
        adapter = self.adapters[platform]
        try:
            await adapter.post(channel, thread, text)
        except ChatError as exc:
            await self._audit.record("chat", "post-failed", "failed",
                                     subject=thread_key(platform, channel, thread),
                                     run_id=run_id, details={"reason": str(exc)})

    def _answer_later(self, message: ChatMessage, text: str) -> None:
        """Reply after the platform's delivery is acknowledged (never hold the ack on a post)."""
        task = asyncio.create_task(self._answer(message, text))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _answer(self, message: ChatMessage, text: str) -> None:
        """Reply in the message's thread: a Discord mention outside a thread has none until
        one is started from it (Slack's thread is the mention's own ts)."""
        try:
            thread = await self.adapters[message.platform].open_thread(message)
        except ChatError as exc:
            await self._record("chat", "post-failed", "failed", message, {"reason": str(exc)})
            return
        await self.post(message.platform, message.channel, thread, text, run_id=None)

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


def thread_key(platform: str, channel: str, thread: str) -> str:
    """The conversation's key. A Discord thread is a channel of its own: a reply in it arrives
    with the thread's id as its channel, while the mention that started it carried the parent
    channel's, so the thread's id alone (a snowflake, unique across Discord) names it. A Slack
    thread's ts is unique only within its channel."""
    if platform == "discord":
        return f"{platform}:{thread}"
    return f"{platform}:{channel}:{thread}"


def message_of(body: bytes) -> tuple[ChatMessage, str | None]:
    """The message a chat wake carries, and the answer it continues (if any)."""
    data = json.loads(body)
    continued_from = data.pop("continued_from", None)
    return ChatMessage(**data), continued_from
