"""What a foreground ``bothy run`` shows while it works, on stderr.

On a terminal: the agent's text as it streams (each message held back while it could still be
``NO_REPLY``, which is never shown), then a live status line (elapsed time, tokens, cost)
redrawn in place. Elsewhere (a pipe, a log file): plain lines, one per step, so that a
log stays readable and greppable.

Each display is a :class:`~bothy.engine.run.Progress` (what the run shows) and also shows the
run's questions as an :class:`~bothy.engine.toolbox.Asker` does; reading the answer typed at
the terminal is ``commands/foreground.py``'s.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from bothy.engine.run import NO_REPLY
from bothy.money import format_usd


class PlainProgress:
    """One line per step, no escape codes."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._out = stream or sys.stderr

    def _line(self, text: str) -> None:
        print(f"bothy: {text}", file=self._out, flush=True)

    def admitted(self, run_id: str) -> None:
        self._line(f"admitted {run_id}")

    def waiting(self, reason: str) -> None:
        self._line(f"waiting: {reason}")

    def started(self, run_id: str, pid: int) -> None:
        self._line(f"started {run_id} (worker pid {pid})")

    def text(self, delta: str) -> None:
        """Plain output keeps the answer for the final line only."""

    def message_end(self) -> None:
        """Plain output shows no messages."""

    def usage(self, tokens: int, cost_micros: int) -> None:
        self._line(f"usage {tokens} tokens, {format_usd(cost_micros, 4)} usd")

    def question(self, run_id: str, text: str) -> None:
        self._line(f"question: {text}  (answer: bothy answer {run_id} yes|no|TEXT)")

    def declined(self, run_id: str, text: str) -> None:
        self._line(f"question declined: {text}  (this run cannot wait; it goes on without"
                   " an answer)")

    def finish(self) -> None:
        """Plain lines leave nothing to clear."""


class TerminalProgress:
    """Streams the agent's text and redraws a status line in place."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._out = stream or sys.stderr
        self._started = time.monotonic()
        self._tokens = 0
        self._cost_micros = 0
        self._status = "admitted"
        self._mid_text = False
        self._held = ""  # the current message's text while it could still be NO_REPLY
        self._holding = True  # the current message has shown nothing yet

    def admitted(self, run_id: str) -> None:
        self._status = run_id
        self._redraw()

    def waiting(self, reason: str) -> None:
        self._status = f"waiting: {reason}"
        self._redraw()

    def started(self, run_id: str, pid: int) -> None:
        self._status = f"{run_id} working (pid {pid})"
        self._redraw()

    def text(self, delta: str) -> None:
        """Stream ``delta``; a message's text is held while it could still be ``NO_REPLY``."""
        if self._holding:
            self._held += delta
            if NO_REPLY.startswith(self._held.strip()):
                return
            self._holding, delta, self._held = False, self._held, ""
        self._write(delta)

    def message_end(self) -> None:
        """A message complete: what was held is shown unless it is ``NO_REPLY``; the next
        message starts on a line of its own."""
        held, self._held, self._holding = self._held, "", True
        if held.strip() and held.strip() != NO_REPLY:
            self._write(held)
        if self._mid_text:
            self._write("\n")

    def _write(self, text: str) -> None:
        self._out.write("\r\033[K" + text if not self._mid_text else text)
        self._mid_text = not text.endswith("\n")
        self._out.flush()

    def usage(self, tokens: int, cost_micros: int) -> None:
        self._tokens, self._cost_micros = tokens, cost_micros
        self._redraw()

    def question(self, run_id: str, text: str) -> None:
        if self._mid_text:
            self._out.write("\n")
            self._mid_text = False
        self._out.write(f"\r\033[K? {text}\n  type yes/no (or an answer) and Enter, or run:"
                        f" bothy answer {run_id} yes|no|TEXT\n")
        self._out.flush()

    def declined(self, run_id: str, text: str) -> None:
        if self._mid_text:
            self._out.write("\n")
            self._mid_text = False
        self._out.write(f"\r\033[K? {text}\n  (this run cannot wait: it goes on without an"
                        " answer)\n")
        self._out.flush()

    def finish(self) -> None:
        self.message_end()  # a run cut short mid-message: what it held, unless NO_REPLY
        self._out.write("\r\033[K")
        self._out.flush()

    def _redraw(self) -> None:
        if self._mid_text:
            self._out.write("\n")
            self._mid_text = False
        elapsed = time.monotonic() - self._started
        self._out.write(
            f"\r\033[K[{elapsed:5.1f}s] {self._status} · {self._tokens} tokens · "
            f"{format_usd(self._cost_micros, 4)} usd"
        )
        self._out.flush()
