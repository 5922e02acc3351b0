"""The exit codes of every ``bothy`` command, documented in docs/RUNBOOK.md.

75 and 78 are the sysexits codes service managers understand (contracts.md §4): 75 means
"temporary failure, restart me", 78 "configuration error, do not restart". Which code a run's
outcome exits with is said by :class:`bothy.engine.run.Outcome`.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0  # the run completed / the command succeeded
    FAILED = 1  # the run failed; a doctor check or audit verification failed
    REFUSED = 3  # the run was refused at a gate (budget, price, pool)
    LIMIT = 4  # the run was stopped at a limit: wall clock, tokens, its reservation
    CANCELLED = 5  # the run was cancelled (bothy cancel, a signal)
    USAGE = 64  # EX_USAGE: a command-line argument cannot be honoured
    STATE = 65  # EX_DATAERR: the state database is corrupt; move it aside, do not restart
    TEMPFAIL = 75  # EX_TEMPFAIL: a dependency is temporarily unavailable; restart me
    CONFIG = 78  # EX_CONFIG: configuration error; do not restart

