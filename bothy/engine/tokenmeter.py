"""What one run used of its Codex thread: the tokens its cost, token limit and trace count.

Codex reports a thread's running totals (``thread/tokenUsage/updated``: ``total``, and the
latest response's own, ``last``). A thread continued from an earlier run (a chat
conversation resumed) carries that run's tokens in its totals, and Codex repeats them when
the thread is resumed, before this run's model output begins: a snapshot of where the thread
stands, with the earlier run's last response as ``last`` and the earlier turn's id (seen with
the pinned 0.171.0; tests/test_continued_cost.py). Summing ``last`` would count that response
again, so a turn is measured as the difference of the totals: now, less where they stood when
it began. A run is the sum of its turns.
"""

from __future__ import annotations

from bothy.engine.prices import TokenUsage


class TokenMeter:
    """One run's tokens, turn by turn, from the thread totals Codex reports."""

    def __init__(self) -> None:
        self._at_start: dict[str, TokenUsage] = {}  # turn id -> the thread's totals then
        self._seen: TokenUsage | None = None  # the thread's totals last reported
        self.turns: dict[str, TokenUsage] = {}  # turn id -> what that turn alone used

    def report(
        self, turn_id: str, total: TokenUsage, last: TokenUsage | None, *, answering: bool
    ) -> None:
        """Take one report for the running turn ``turn_id``.

        ``answering`` says whether the report is of the turn's own model output (it has
        begun, and the report names this turn): a report that is not is where the thread
        stands (a resumed thread's totals), used by no response of this run.
        Otherwise a turn begins where the one before it ended, and before the run's first
        report the thread stood at ``total - last``.
        """
        if not answering:
            self._at_start[turn_id] = total
            self._seen = total
            return
        if turn_id not in self._at_start:
            if self._seen is not None:
                self._at_start[turn_id] = self._seen
            elif last is not None:
                self._at_start[turn_id] = total.since(last)
            else:
                self._at_start[turn_id] = TokenUsage()
        self.turns[turn_id] = total.since(self._at_start[turn_id])
        self._seen = total

    @property
    def used(self) -> TokenUsage:
        """What the run used so far: the sum of its turns (none reported: nothing)."""
        used = TokenUsage()
        for turn in self.turns.values():
            used = used + turn
        return used
