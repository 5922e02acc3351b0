"""The vocabulary of a run: what is asked, how it ends, what comes back, what is shown.

Kept apart from the supervisor so that callers (the CLI, the dispatcher, the scheduler, a
chat conversation) can build requests and read results without importing the engine's
machinery.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from bothy.clock import Clock
from bothy.engine.auditindex import wake_id_for as wake_id_for  # (its home: the index)
from bothy.exitcodes import ExitCode
from bothy.money import usd_to_micros

if TYPE_CHECKING:
    from bothy.config import Config
    from bothy.engine.verification import Verification  # (loaded by the runs that verify)

NO_REPLY = "NO_REPLY"


class Outcome(enum.StrEnum):
    """How a run ended: what the register records, what a person is told, the exit code."""

    COMPLETED = "completed"
    VERIFIED = "verified"  # completed, and its verification passed
    UNVERIFIED = "unverified"  # completed, but still failing verification after every try
    FAILED = "failed"
    REFUSED = "refused"  # a gate said no: nothing ran
    TIMED_OUT = "timed_out"
    TOKEN_LIMIT = "token_limit"
    BUDGET_LIMIT = "budget_limit"
    TURN_LIMIT = "turn_limit"  # limits.max_turns: the tool call past the cap was stopped
    CANCELLED = "cancelled"

    @property
    def answers(self) -> bool:
        """The run's final text is its answer (otherwise a person is told the reason)."""
        return self in (Outcome.COMPLETED, Outcome.VERIFIED)

    @property
    def recorded(self) -> str:
        """The outcome word of the run's ``run finished`` record: ``ok`` for a completed run
        (the product page's form), otherwise the outcome itself."""
        return "ok" if self is Outcome.COMPLETED else self.value

    @property
    def exit_code(self) -> ExitCode:
        """What a foreground run (``bothy run``) exits with."""
        return _EXIT[self]


_EXIT = {
    Outcome.COMPLETED: ExitCode.OK,
    Outcome.VERIFIED: ExitCode.OK,
    Outcome.UNVERIFIED: ExitCode.FAILED,
    Outcome.FAILED: ExitCode.FAILED,
    Outcome.REFUSED: ExitCode.REFUSED,
    Outcome.TIMED_OUT: ExitCode.LIMIT,
    Outcome.TOKEN_LIMIT: ExitCode.LIMIT,
    Outcome.BUDGET_LIMIT: ExitCode.LIMIT,
    Outcome.TURN_LIMIT: ExitCode.LIMIT,
    Outcome.CANCELLED: ExitCode.CANCELLED,
}


@dataclass(frozen=True)
class RunRequest:
    """What was asked, and the limits it runs under."""

    prompt: str
    subject: str
    source: str
    max_usd_micros: int
    wall_clock_s: int
    max_tokens: int | None = None
    profile: str | None = None  # a name in config's profiles; None grants nothing
    trusted: bool = True  # False for runs woken by webhooks and polls (rule 6)
    can_hold: bool = False  # a person can be asked and the run may wait for them
    run_id: str | None = None  # minted by the caller when it must know it before admission
    wake_details: dict[str, Any] = field(default_factory=dict)  # for the `wake received` record
    verify: Verification | None = None  # ends the run `verified` or `unverified`
    keep_thread: bool = False  # save the Codex thread so a later run can resume it
    resume_thread: str | None = None  # continue this kept Codex thread (a chat conversation)
    ref: str | None = None  # the run's task in Cairn (docs/CAIRN.md); checked by the supervisor
    dream: bool = False  # a memory consolidation of ``profile`` (bothy schedule add --dream)

    @classmethod
    def for_wake(
        cls,
        cfg: Config,
        *,
        prompt: str,
        subject: str,
        source: str,
        run_id: str,
        details: dict[str, Any],
        trusted: bool,
        can_hold: bool,
        asked_usd_micros: int | None = None,
        profile: str | None = None,
        verify: Verification | None = None,
        keep_thread: bool = False,
        resume_thread: str | None = None,
        ref: str | None = None,
        dream: bool = False,
    ) -> RunRequest:
        """The run a wake asks for, under the configured limits. What a job or schedule asks
        to reserve is capped at ``budget.per_run_usd``, not refused: nobody is there to be told
        (a person's ``bothy run --max-usd`` above it is a usage error instead)."""
        per_run = usd_to_micros(cfg.budget.per_run_usd)
        return cls(
            prompt=prompt, subject=subject, source=source,
            max_usd_micros=min(asked_usd_micros or per_run, per_run),
            wall_clock_s=cfg.limits.wall_clock_s, max_tokens=cfg.limits.max_tokens,
            profile=profile, trusted=trusted, can_hold=can_hold, run_id=run_id,
            wake_details=details, verify=verify, keep_thread=keep_thread,
            resume_thread=resume_thread, ref=ref, dream=dream,
        )


@dataclass(frozen=True)
class RunEnd:
    """How the work of an admitted run ended, before it is settled."""

    outcome: Outcome
    reason: str | None = None
    text: str = ""  # the agent's final message so far


@dataclass(frozen=True)
class RunResult:
    run_id: str
    outcome: Outcome
    cost_micros: int
    final_text: str
    reason: str | None = None
    thread_id: str | None = None  # the Codex thread, when the run kept it

    @property
    def answer(self) -> str:
        """The text to show a person: never ``NO_REPLY``."""
        return "" if self.final_text.strip() == NO_REPLY else self.final_text

    @property
    def reply(self) -> str:
        """What a person is told: the answer, or the outcome and why."""
        if self.outcome.answers:
            return self.answer
        return f"({self.outcome}) {self.reason or ''}".strip()


class Progress(Protocol):
    """What a run shows while it works (a terminal, a log); it decides nothing."""

    def admitted(self, run_id: str) -> None: ...
    def waiting(self, reason: str) -> None: ...
    def started(self, run_id: str, pid: int) -> None: ...
    def text(self, delta: str) -> None: ...
    def message_end(self) -> None:
        """The agent message whose text streamed since the last one is complete."""
        ...
    def usage(self, tokens: int, cost_micros: int) -> None: ...


class SilentProgress:
    """Shows nothing: a run nobody watches."""

    def admitted(self, run_id: str) -> None: ...
    def waiting(self, reason: str) -> None: ...
    def started(self, run_id: str, pid: int) -> None: ...
    def text(self, delta: str) -> None: ...
    def message_end(self) -> None: ...
    def usage(self, tokens: int, cost_micros: int) -> None: ...


def new_run_id(clock: Clock) -> str:
    """``run_YYYYMMDDTHHMMSSZ_<8 hex>``."""
    return f"run_{clock():%Y%m%dT%H%M%SZ}_{secrets.token_hex(4)}"

