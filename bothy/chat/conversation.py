"""A chat conversation: one thread of a chat platform, run after run (SPEC §5 "Chat", §6).

Every decision about a conversation's runs is made here, and nowhere else:

- its key (:func:`thread_key`) and its lane, the subject ``<platform>:<thread>`` (one run at a
  time per thread);
- the chat wake itself: what a mention or a continuing reply puts in the inbox, and reads
  back out of it;
- the prompt: the Codex thread the conversation kept is resumed; without one, a continuing
  reply is told what the run answered last;
- remembering the thread's current run and last answer (the ``chat_threads`` table), so that
  replies find it across restarts;
- asking: a run's questions are posted in the thread, and so is a question's expiry (a new
  message); the answer waits for those posts;
- delivering: the answer (never ``NO_REPLY``), or the outcome and why; a refusal is told in
  the thread, not retried; a run a crash cut short is announced there; a run a stop came
  before is not cancelled in the thread: it is said to run when Bothy starts again.

The router (``chat/router.py``) hands people's messages in; the dispatcher hands each chat
wake to :class:`Conversations`, its handler for the ``chat`` source, which takes it from the
reaction through the engine to the answer in the thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from typing import Any

from bothy.chat.base import ChatAdapter, ChatMessage
from bothy.chat.buttons import Buttons
from bothy.clock import Clock, to_us
from bothy.config import Config
from bothy.engine.alerts import AlertThread
from bothy.engine.audit import AuditLog
from bothy.engine.questions import APPROVAL_HINT
from bothy.engine.recovery import settled_by_owner
from bothy.engine.run import NO_REPLY, Outcome, RunRequest, RunResult
from bothy.engine.state import RunRow, StateDB
from bothy.errors import ChatError
from bothy.wakes.delivery import Delivery
from bothy.wakes.handlers import WakeStart
from bothy.wakes.inbox import WakeRow
from bothy.wakes.jobs import Ignored

SOURCE = "chat"
SEEN = "eyes"
_ASKING = "Reply in this thread."
_NOT_WAITING = "This run cannot wait for an answer: it goes on without one."
_INTERRUPTED = ("Bothy was restarted while it worked on this, and the run was stopped before"
                " it finished. Mention me again to retry.")
_RUNS_AFTER = ("Bothy is stopping, so this has not started yet: it will run when Bothy starts"
               " again.")


@dataclass(frozen=True)
class ThreadState:
    """What a conversation remembers: its last run and that run's answer."""

    last_run_id: str
    last_answer: str


class Conversations:
    """The chat conversations of a site, over its connected adapters; the ``chat`` wakes'
    handler in the dispatcher's table."""

    retries_refused = False  # a refusal is told in the thread; the person may mention again

    def __init__(
        self,
        cfg: Config,
        adapters: dict[str, ChatAdapter],
        *,
        db: StateDB,
        audit: AuditLog,
        clock: Clock,
    ) -> None:
        self._cfg = cfg
        self.adapters = adapters
        self._db = db
        self._audit = audit
        self._clock = clock
        self.buttons = Buttons(adapters, db=db, audit=audit, clock=clock)  # approval questions

    # -- the inbox's side: a message becomes a durable wake -----------------------------------

    def wake_of(self, message: ChatMessage, *, continued_from: str | None) -> Delivery:
        """The chat wake a mention (or a reply continuing a finished run) puts in the inbox."""
        body = json.dumps({**asdict(message), "continued_from": continued_from}).encode()
        return Delivery(source=SOURCE, route=message.platform, key=message.dedupe_key,
                        event="mention", action=None, headers={}, body=body,
                        received_at=self._clock())

    async def state(self, message: ChatMessage) -> ThreadState | None:
        """What the conversation a reply belongs to remembers; None if Bothy never answered
        in that thread (not its conversation)."""
        row = await self._db.fetch_one(
            "SELECT last_run_id, last_answer FROM chat_threads WHERE thread_key = ?",
            (thread_key(message.platform, message.channel, message.thread),),
        )
        if row is None:
            return None
        return ThreadState(str(row["last_run_id"]), str(row["last_answer"] or ""))

    async def thread_of_run(self, run_id: str) -> AlertThread | None:
        """The thread a chat run belongs to (for an alert the run raised), if it is one."""
        row = await self._db.fetch_one(
            "SELECT platform, channel, thread FROM chat_threads WHERE last_run_id = ?",
            (run_id,))
        if row is None:
            return None
        return AlertThread(str(row["platform"]), str(row["channel"]), str(row["thread"]))

    # -- the dispatcher's side: a chat wake becomes a run -------------------------------------

    async def handle(
        self, wake: WakeRow, delivery: Delivery, start: WakeStart
    ) -> RunResult | Ignored:
        """A mention's run: seen, its thread opened, resumed or told what it answered last,
        remembered, its questions asked in the thread, and answered there."""
        message, continued_from = _message_of(delivery.body)
        adapter = self.adapters.get(message.platform)
        if adapter is None:
            return Ignored(f"{message.platform} is not connected")
        # "Seen" goes beside the run, not ahead of it: a reaction's round trip is not on the
        # answer's way. A refused one is audited by _seen; one still unanswered once the run
        # is over says nothing any more: it is given up, and that is audited too.
        seen = asyncio.ensure_future(self._seen(adapter, message, wake.route, start.details))
        try:
            return await self._answered(wake, message, continued_from, adapter, start)
        finally:
            await self._seen_or_given_up(seen, message, wake.route, start.details)

    async def _seen_or_given_up(self, seen: asyncio.Future[None], message: ChatMessage,
                                route: str, details: dict[str, Any]) -> None:
        if not seen.done():
            seen.cancel()
        await asyncio.wait({seen})
        if not seen.cancelled():
            seen.result()  # what broke it (a broken register) is not dropped
            return
        await self._audit.record("chat", "react-failed", "failed", subject=route, details={
            **details, "reason": f"{message.platform} had not answered the reaction by the"
                                 " time the run was over; it was given up"})

    async def _answered(self, wake: WakeRow, message: ChatMessage, continued_from: str | None,
                        adapter: ChatAdapter, start: WakeStart) -> RunResult:
        thread = _Thread(self, adapter, message, wake.route, start.details)
        resume, prompt = await self._resume_or_continue(message, thread.id, continued_from)
        request = RunRequest.for_wake(
            self._cfg, prompt=prompt, subject=subject(message.platform, thread.id),
            source=SOURCE,
            run_id=start.run_id, details={**start.details, "user": message.user},
            profile=self._profile_for(message.platform),
            trusted=True,  # an allowed account wrote it
            can_hold=True,  # someone is in the thread to answer
            keep_thread=True, resume_thread=resume,  # the thread is one Codex conversation
        )
        # The thread's row names this run while the run starts (its commit is not on the way
        # to the worker); nothing is posted in the thread, nor its answer kept, before it is.
        thread.remember(self._remember(message, thread.id, start.run_id))
        try:
            result = await self._run(start, request, thread)
        finally:
            await thread.remembered()
        if start.done:  # answered as soon as the run's end was recorded
            return result
        if await start.stopped_before_start():
            # Queued again (the dispatcher's rule): its answer comes after the restart, so the
            # thread hears that, not a cancellation.
            await thread.post(_RUNS_AFTER, run_id=result.run_id)
            return result
        await self._deliver(message, thread, result)
        return result

    async def _run(self, start: WakeStart, request: RunRequest, thread: _Thread) -> RunResult:
        """The run, its questions posted in the thread; the answer waits for those posts. A
        run that had a worker is answered as soon as its end is recorded, while its worker
        stops (``told``); one that never reached a worker, by the caller."""
        questions = _ThreadQuestions(thread)

        async def told(result: RunResult) -> None:
            # Remembered first: a reply in the thread, possible from `run finished` on, finds
            # the Codex thread to resume even while a question's post is still settling.
            await self._remember_answer(thread.message, thread, result)
            await questions.posted()
            await self._post_reply(thread, result)

        try:
            result = await start.run(request, asker=questions, told=told)
        except BaseException:
            questions.cancel()
            raise
        await questions.posted()
        return result

    async def _seen(
        self, adapter: ChatAdapter, message: ChatMessage, route: str, details: dict[str, Any]
    ) -> None:
        try:
            await adapter.react(message, SEEN)
        except ChatError as exc:  # a missing reaction must not cost the thread and the answer
            await self._audit.record("chat", "react-failed", "failed", subject=route,
                                     details={**details, "reason": str(exc)})

    async def _open_thread(
        self, adapter: ChatAdapter, message: ChatMessage, route: str, details: dict[str, Any]
    ) -> str:
        try:
            return await adapter.open_thread(message)
        except ChatError as exc:
            await self._audit.record("chat", "thread-failed", "failed", subject=route,
                                     details={**details, "reason": str(exc)})
            return message.thread

    async def _resume_or_continue(
        self, message: ChatMessage, thread: str, continued_from: str | None
    ) -> tuple[str | None, str]:
        """The kept Codex thread to resume (a reply continuing the conversation), and the
        prompt: the message, or, with no kept thread, the message after the last answer."""
        if continued_from is None:
            return None, message.text
        resume = await self._codex_thread(message, thread)
        if resume is not None or not continued_from:
            return resume, message.text
        # No kept thread to resume: at least tell the run what it said last.
        return None, (f"Earlier in this conversation you answered:\n{continued_from}\n\n"
                      f"The person now says:\n{message.text}")

    def _profile_for(self, platform: str) -> str | None:
        chat = self._cfg.chat
        section = chat.slack if platform == "slack" else chat.discord
        return section.profile if section is not None else None

    async def _codex_thread(self, message: ChatMessage, thread: str) -> str | None:
        """The Codex thread this conversation kept, to resume it (None for a new one)."""
        row = await self._db.fetch_one(
            "SELECT codex_thread FROM chat_threads WHERE thread_key = ?",
            (thread_key(message.platform, message.channel, thread),),
        )
        return str(row["codex_thread"]) if row is not None and row["codex_thread"] else None

    async def _remember(self, message: ChatMessage, thread: str, run_id: str) -> None:
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

    async def _deliver(self, message: ChatMessage, thread: _Thread, result: RunResult) -> None:
        """Keep the run's answer and Codex thread; post its reply (``NO_REPLY`` never is, and
        leaves no thread behind)."""
        await self._remember_answer(message, thread, result)
        await self._post_reply(thread, result)

    async def _remember_answer(self, message: ChatMessage, thread: _Thread,
                               result: RunResult) -> None:
        """The run's answer and Codex thread, kept for the replies that continue it."""
        await thread.remembered()  # the row this updates names the run
        key = thread_key(message.platform, message.channel, thread.id)
        async with self._db.transaction():
            await self._db.execute(
                "UPDATE chat_threads SET last_answer = ?,"
                " codex_thread = COALESCE(?, codex_thread) WHERE thread_key = ?",
                (result.final_text[-2000:], result.thread_id, key),
            )

    async def _post_reply(self, thread: _Thread, result: RunResult) -> None:
        text = result.reply
        if not text or text.strip() == NO_REPLY:
            return
        await thread.post(text, run_id=result.run_id)

    async def interrupted(self, wake: WakeRow, delivery: Delivery, run: RunRow) -> None:
        """Tell the thread whose run a crash cut short that it was stopped; or, if the run
        had finished and its answer was not yet out (the wake is done once it is), answer."""
        message, _ = _message_of(delivery.body)
        adapter = self.adapters.get(message.platform)
        if adapter is None:
            return
        if settled_by_owner(run):
            kept = RunResult(run.run_id, Outcome(run.outcome or Outcome.FAILED), run.spent_micros,
                             run.final_text or "", run.reason)
            await self._deliver(message, _Thread(self, adapter, message, wake.route, {}), kept)
            return
        row = await self._db.fetch_one(
            "SELECT thread FROM chat_threads WHERE last_run_id = ?", (run.run_id,))
        thread = str(row["thread"]) if row is not None else message.thread
        await self.post(message.platform, message.channel, thread, _INTERRUPTED,
                        run_id=run.run_id)

    # -- posting ------------------------------------------------------------------------------

    async def post(
        self, platform: str, channel: str, thread: str, text: str, *, run_id: str | None
    ) -> None:
        """Post in a thread; a failure is audited (the run and the conversation go on)."""
        try:
            await self.adapters[platform].post(channel, thread, text)
        except ChatError as exc:
            await self._audit.record("chat", "post-failed", "failed",
                                     subject=thread_key(platform, channel, thread),
                                     run_id=run_id, details={"reason": str(exc)})

    async def answer(self, message: ChatMessage, text: str) -> None:
        """Reply in the message's thread: a Discord mention outside a thread has none until
        one is started from it (Slack's thread is the mention's own ts)."""
        try:
            thread = await self.adapters[message.platform].open_thread(message)
        except ChatError as exc:
            await self._audit.record(
                "chat", "post-failed", "failed",
                subject=thread_key(message.platform, message.channel, message.thread),
                details={"user": f"{message.platform}:{message.user}", "reason": str(exc)},
            )
            return
        await self.post(message.platform, message.channel, thread, text, run_id=None)


class _Thread:
    """The thread a mention is answered in, opened at its first post: a mention answered
    ``NO_REPLY`` leaves no empty thread behind (Discord starts one from the message). Its id
    is known before: a Slack thread is the mention's ts, and a Discord thread started from a
    message has that message's id (``ChatMessage.thread`` either way)."""

    def __init__(self, conversations: Conversations, adapter: ChatAdapter, message: ChatMessage,
                 route: str, details: dict[str, Any]) -> None:
        self._conversations = conversations
        self._adapter = adapter
        self.message = message
        self._route = route
        self._details = details
        self.id = message.thread
        self._opening: asyncio.Task[str] | None = None
        self._remembering: asyncio.Future[None] | None = None

    def remember(self, remembering: Coroutine[Any, Any, None]) -> None:
        """Name the run in the thread's row beside the run (see :meth:`remembered`)."""
        self._remembering = asyncio.ensure_future(remembering)

    async def remembered(self) -> None:
        """Once the thread's row names the run (at once if there is nothing to wait for);
        what broke its commit is raised here."""
        if self._remembering is not None:
            await asyncio.shield(self._remembering)

    async def post(self, text: str, *, run_id: str) -> None:
        """Post in the thread, opening it first if this is its first post."""
        await self._conversations.post(self.message.platform, self.message.channel,
                                       await self._opened(), text, run_id=run_id)

    async def ask(self, run_id: str, text: str, hint: str) -> None:
        """Ask the run's question in the thread, opening it first: an approval with buttons
        (``chat/buttons.py``), anything else with ``hint``."""
        thread = await self._opened()
        platform, channel = self.message.platform, self.message.channel
        await self._conversations.buttons.ask(platform, channel, thread, run_id, text,
                                              hint=hint,
                                              subject=thread_key(platform, channel, thread))

    async def _opened(self) -> str:
        """The thread, opened once (concurrent posts share the opening), and only once its row
        names the run: a reply to what is posted finds the run."""
        await self.remembered()
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._conversations._open_thread(
                self._adapter, self.message, self._route, self._details))
        return await asyncio.shield(self._opening)


class _ThreadQuestions:
    """A chat run's asker: each question is posted in the thread. The posts are its own: the
    run's answer waits for them (a question never lands after the answer), a cancel ends them.
    """

    def __init__(self, thread: _Thread) -> None:
        self._thread = thread
        self._posts: set[asyncio.Task[None]] = set()

    def question(self, run_id: str, text: str) -> None:
        self.ask(run_id, text, APPROVAL_HINT)

    def ask(self, run_id: str, text: str, hint: str) -> None:
        """Post the question (its options numbered) and how to answer it, in the thread: an
        approval with buttons, followed until it is settled (``chat/buttons.py``)."""
        self._track(self._thread.ask(run_id, text, f"{hint} {_ASKING}"))

    def declined(self, run_id: str, text: str) -> None:
        """A question this run could not hold (its profile holds none): said in the thread."""
        self._post(run_id, f"? {text}\n{_NOT_WAITING}")

    def expired(self, run_id: str, text: str, hold_s: float) -> None:
        """Say in the thread, in a new message, that the question went unanswered."""
        self._post(run_id, expiry_note(hold_s))

    def _post(self, run_id: str, text: str) -> None:
        self._track(self._thread.post(text, run_id=run_id))

    def _track(self, post: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(post)
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def posted(self) -> None:
        """Wait for the posts still under way (a failed post is audited where it failed)."""
        await asyncio.gather(*self._posts, return_exceptions=True)

    def cancel(self) -> None:
        for task in self._posts:
            task.cancel()


def expiry_note(hold_s: float) -> str:
    """What the thread is told when its held question expires (issue 11)."""
    return f"No answer within {hold_s:g} s — declined; the run goes on."


def thread_key(platform: str, channel: str, thread: str) -> str:
    """The conversation's key. A Discord thread is a channel of its own: a reply in it arrives
    with the thread's id as its channel, while the mention that started it carried the parent
    channel's, so the thread's id alone (a snowflake, unique across Discord) names it. A Slack
    thread's ts is unique only within its channel."""
    if platform == "discord":
        return f"{platform}:{thread}"
    return f"{platform}:{channel}:{thread}"


def subject(platform: str, thread: str) -> str:
    """A conversation's lane: one run at a time per thread."""
    return f"{platform}:{thread}"


def _message_of(body: bytes) -> tuple[ChatMessage, str | None]:
    """The message a chat wake carries, and the answer it continues (if any)."""
    data = json.loads(body)
    continued_from = data.pop("continued_from", None)
    return ChatMessage(**data), continued_from

