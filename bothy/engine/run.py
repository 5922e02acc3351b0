"""The vocabulary of a run: what is asked, what comes back, what a foreground run shows.

Kept apart from the supervisor so that callers (the CLI, the dispatcher, the scheduler) can
build requests without importing the engine's machinery.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from bothy.clock import Clock
from bothy.engine.verification import Verification

NO_REPLY = "NO_REPLY"


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


@dataclass(frozen=True)
class RunResult:
    run_id: str
    outcome: str
    cost_micros: int
    final_text: str
    reason: str | None = None
    thread_id: str | None = None  # the Codex thread, when the run kept it

    @property
    def answer(self) -> str:
        """The text to show a person: never ``NO_REPLY``."""
        return "" if self.final_text.strip() == NO_REPLY else self.final_text


class Progress(Protocol):
    """What a foreground run shows while it works."""

    def admitted(self, run_id: str) -> None: ...
    def waiting(self, reason: str) -> None: ...
    def started(self, run_id: str, pid: int) -> None: ...
    def text(self, delta: str) -> None: ...
    def usage(self, tokens: int, cost_micros: int) -> None: ...
    def question(self, run_id: str, text: str) -> None: ...


class SilentProgress:
    def admitted(self, run_id: str) -> None: ...
    def waiting(self, reason: str) -> None: ...
    def started(self, run_id: str, pid: int) -> None: ...
    def text(self, delta: str) -> None: ...
    def usage(self, tokens: int, cost_micros: int) -> None: ...
    def question(self, run_id: str, text: str) -> None: ...


def new_run_id(clock: Clock) -> str:
    """``run_YYYYMMDDTHHMMSSZ_<8 hex>``."""
    return f"run_{clock():%Y%m%dT%H%M%SZ}_{secrets.token_hex(4)}"
