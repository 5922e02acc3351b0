"""Reports: what an unattended run found, posted where somebody reads it (SPEC §5, §6).

A schedule, a heartbeat, a webhook job or a poller runs with nobody watching. What it finds
must still reach a person, and :class:`Reports` is the one place that sees to it:

- its answer (never ``NO_REPLY``) is posted to the channel its job or schedule names
  (``report_to``: ``slack:C0OPS``, ``discord:1234…``), else to the alert channel, naming the
  site, the wake (its lane: ``schedule:NAME``, ``pr:42``), the outcome and the run;
- a run that ends in any outcome but completed, verified or cancelled raises an alert (an
  unverified run's is the supervisor's, which raises it for every run; a refusal is the
  dispatcher's, which retries it and abandons it out loud); a ``report_to`` channel is told
  of it too;
- a question the run could not wait for is posted there at once, saying it goes on without
  an answer (:meth:`Reports.asker`).

A post the platform refuses for now (429, 5xx, no answer in time) is tried again within a
bound; each post is audited ``report sent`` or ``report undelivered``, and an undelivered one
raises an alert, so the register says who heard nothing. The run is never affected: it has
settled before anything is posted.

Each post is kept (the ``report_posts`` table) so that a reply in its thread is known for what
it is — a reply to a finished, untrusted run: recorded late, never a continuation of that
run's Codex thread (:meth:`Reports.run_of_thread`, asked by the chat router). A new mention
starts a new conversation.

The platforms are reached through what the daemon hands over once chat is connected
(:meth:`Reports.connect`): the chat adapters, seen here only as :class:`Poster`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bothy.clock import Clock, to_us
from bothy.config import Config
from bothy.engine.alerts import Alerts
from bothy.engine.audit import AuditLog
from bothy.engine.run import NO_REPLY, Outcome, RunRequest, RunResult
from bothy.engine.state import StateDB
from bothy.errors import ChatError, ChatUnavailable

__all__ = ["Poster", "Reports", "RunQuestions"]

# Tried again after these pauses when the platform is unavailable for now: three tries in
# about three seconds, each bounded, so a post never holds a wake for long.
_RETRY_AFTER_S = (1.0, 2.0)
_ATTEMPT_S = 15.0
# Outcomes whose run found nothing to report and needs nobody: a person cancelled it, or a
# gate refused it (the dispatcher retries that, then abandons it with an alert of its own).
_QUIET_ENDINGS = (Outcome.CANCELLED, Outcome.REFUSED)
# Outcomes that raise an alert here; unverified raises its own in the supervisor.
_ALERTING = (Outcome.FAILED, Outcome.TIMED_OUT, Outcome.TOKEN_LIMIT, Outcome.BUDGET_LIMIT,
             Outcome.TURN_LIMIT)


class Poster(Protocol):
    """A connected chat platform, as reports need it (a chat adapter is one)."""

    async def post_alert(self, channel: str, text: str) -> list[str]:
        """Post ``text`` in ``channel`` (not in a thread); return the message ids."""
        ...


@dataclass(frozen=True)
class _Target:
    platform: str
    channel: str

    @classmethod
    def parse(cls, value: str) -> _Target:
        platform, _, channel = value.partition(":")
        return cls(platform, channel)

    def __str__(self) -> str:
        return f"{self.platform}:{self.channel}"


class Reports:
    """Posts the findings and questions of a site's unattended runs."""

    def __init__(self, cfg: Config, *, db: StateDB, audit: AuditLog, alerts: Alerts,
                 clock: Clock, retry_after_s: Sequence[float] = _RETRY_AFTER_S) -> None:
        self._cfg = cfg
        self._db = db
        self._audit = audit
        self._alerts = alerts
        self._clock = clock
        self._retry_after_s = tuple(retry_after_s)
        self._posters: dict[str, Poster] = {}

    def connect(self, posters: Mapping[str, Poster]) -> None:
        """The chat platforms connected now, by name (``slack``, ``discord``)."""
        self._posters = dict(posters)

    # -- a run's end --------------------------------------------------------------------------

    async def finished(self, request: RunRequest, result: RunResult,
                       report_to: str | None) -> None:
        """Tell whoever should know how an unattended run ended: its answer posted, and an
        alert for an ending that needs a person."""
        if result.outcome in _QUIET_ENDINGS:
            return
        alerting = result.outcome in _ALERTING
        if result.outcome.answers:
            if result.answer.strip():  # NO_REPLY (or nothing) posts nothing, anywhere
                await self._post(report_to, self._report_text(request, result), request, result)
        elif report_to is not None:  # the channel that expects its findings hears it failed
            await self._post(report_to, self._report_text(request, result), request, result)
        if alerting:
            await self._alerts.raise_alert(
                request.subject, f"run {result.run_id} ended {result.outcome}:"
                f" {result.reason or 'no reason given'}", subject=request.subject,
                run_id=result.run_id)

    def _report_text(self, request: RunRequest, result: RunResult) -> str:
        answer = result.answer.strip()
        lines = [_heading(self._cfg.site, request.subject, str(result.outcome), result.run_id)]
        if not result.outcome.answers and result.reason:
            lines.append(result.reason)
        if answer and answer != NO_REPLY:
            lines.append(answer)
        return "\n".join(lines)

    # -- questions ----------------------------------------------------------------------------

    def asker(self, request: RunRequest, report_to: str | None) -> RunQuestions:
        """The asker of an unattended run: each question it could not wait for is posted at
        once where its findings go."""
        return RunQuestions(self, request, report_to)

    async def question(self, request: RunRequest, run_id: str, report_to: str | None,
                       text: str) -> None:
        said = (f"? {text}\n{_heading(self._cfg.site, request.subject, 'asking', run_id)}"
                "\nThis run cannot wait for an answer: it goes on without one.")
        await self._post(report_to, said, request, None, run_id=run_id, kind="question")

    # -- replies ------------------------------------------------------------------------------

    async def run_of_thread(self, platform: str, channel: str, thread: str) -> str | None:
        """The run whose report or question started ``thread``, or None."""
        row = await self._db.fetch_one(
            "SELECT run_id FROM report_posts WHERE platform = ? AND channel = ? AND message = ?",
            (platform, channel, thread))
        return str(row["run_id"]) if row is not None else None

    # -- posting ------------------------------------------------------------------------------

    def _where(self, report_to: str | None) -> _Target | str:
        """Where a report goes, or why it cannot go anywhere."""
        if report_to is not None:
            target = _Target.parse(report_to)
            if target.platform not in self._posters:
                return f"{target.platform} is not connected"
            return target
        chat = self._cfg.chat
        for platform, section in (("slack", chat.slack), ("discord", chat.discord)):
            if section is not None and section.alert_channel and platform in self._posters:
                return _Target(platform, section.alert_channel)
        return "no report_to and no connected alert channel"

    async def _post(self, report_to: str | None, text: str, request: RunRequest,
                    result: RunResult | None, *, run_id: str | None = None,
                    kind: str = "answer") -> None:
        run_id = run_id or (result.run_id if result is not None else None)
        details: dict[str, Any] = {"what": kind, "report_to": report_to}
        if result is not None:
            details["outcome"] = str(result.outcome)
        where = self._where(report_to)
        if isinstance(where, str):
            # With no alert channel either, an alert would reach nobody: the record says it.
            await self._undelivered(request.subject, run_id, details, where,
                                    alert=report_to is not None)
            return
        posted = await self._try_posting(where, text)
        if isinstance(posted, str):
            await self._undelivered(request.subject, run_id, {**details, "route": str(where)},
                                    posted)
            return
        await self._keep(where, posted, run_id)
        await self._audit.record("report", "sent", "ok", subject=request.subject,
                                 run_id=run_id, details={**details, "route": str(where),
                                                         "message": posted[0]})

    async def _try_posting(self, where: _Target, text: str) -> list[str] | str:
        """The posted message ids, or why the post failed after every try."""
        poster = self._posters[where.platform]
        failure = ""
        for pause_s in (0.0, *self._retry_after_s):
            if pause_s:
                await asyncio.sleep(pause_s)
            try:
                async with asyncio.timeout(_ATTEMPT_S):
                    posted = await poster.post_alert(where.channel, text)
            except TimeoutError:
                failure = f"{where.platform} did not answer within {_ATTEMPT_S:g} s"
            except ChatUnavailable as exc:
                failure = str(exc)
            except ChatError as exc:  # refused for good (no such channel, not a member)
                return str(exc)
            else:
                if posted:
                    return posted
                failure = f"{where.platform} gave no message id"
        return f"{failure} (after {1 + len(self._retry_after_s)} tries)"

    async def _keep(self, where: _Target, posted: list[str], run_id: str | None) -> None:
        """Remember the post, so that a reply in its thread is known as one (Slack: the
        thread of a channel message is its ts)."""
        if run_id is None:
            return
        async with self._db.transaction():
            await self._db.execute(
                "INSERT OR IGNORE INTO report_posts (platform, channel, message, run_id,"
                " posted_us) VALUES (?, ?, ?, ?, ?)",
                (where.platform, where.channel, posted[0], run_id, to_us(self._clock())))

    async def _undelivered(self, subject: str, run_id: str | None, details: dict[str, Any],
                           reason: str, *, alert: bool = True) -> None:
        await self._audit.record("report", "undelivered", "failed", subject=subject,
                                 run_id=run_id, details={**details, "reason": reason})
        if not alert:
            return
        await self._alerts.raise_alert(
            f"report of run {run_id}", f"the {details['what']} of run {run_id} could not be"
            f" posted: {reason}", subject=subject, run_id=run_id)


class RunQuestions:
    """An unattended run's asker: each question is posted where its findings go, at once; the
    posts are its own (the run's end waits for them, a cancel ends them)."""

    def __init__(self, reports: Reports, request: RunRequest, report_to: str | None) -> None:
        self._reports = reports
        self._request = request
        self._report_to = report_to
        self._posts: set[asyncio.Task[None]] = set()

    def question(self, run_id: str, text: str) -> None:
        """Never held (an unattended run cannot wait): said like a declined one."""
        self.declined(run_id, text)

    def declined(self, run_id: str, text: str) -> None:
        task = asyncio.create_task(
            self._reports.question(self._request, run_id, self._report_to, text))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def posted(self) -> None:
        """Wait for the posts still under way (each failure is audited where it failed)."""
        await asyncio.gather(*self._posts, return_exceptions=True)

    def cancel(self) -> None:
        for task in self._posts:
            task.cancel()


def _heading(site: str, subject: str, outcome: str, run_id: str) -> str:
    """The first line of a report: the site, the wake's lane, the outcome, the run."""
    return f"{site} · {subject} · {outcome} · {run_id}"
