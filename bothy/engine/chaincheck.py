"""The whole register verified for `bothy serve`'s start, beside the start, in a process of
its own (issue 18).

`bothy serve` verifies the whole chain before its first record (docs/AUDIT.md). The walk is
Python on one core (a JSON decode and a sha256 for each record): here ~285 ms for half a year
of a busy site's register (25 MB, 36,600 records), and it grows with the register. The rest
of the start, its imports above all, takes as long again on the same core, and neither can
run beside the other in one interpreter. So `bothy serve` first of all starts the walk in a
child interpreter (``python -m bothy.engine.chaincheck REGISTER``) that imports only the
register's reading modules, and takes its verdict where it would have made the walk itself:
on a machine with a second core the walk is done beside the imports.

The child makes the same walk as every other reader (:func:`verify_register`), reads only,
and prints its verdict as one line of JSON. If it gives none (it was killed, it crashed, its
line is not a verdict), serve logs why and walks the chain itself, as before: a start never
goes without the check. A register under :data:`BESIDE_FROM_BYTES`, or a machine with one
core, keeps the walk in-process: there a child's interpreter would cost more than it saves.

Whichever made it, the verdict is of the register as the walk read it. What another process
appends afterwards is checked by serve's first append, as every writer checks what was
appended since the checkpoint (engine/auditwriter.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.auditchain import Fault, VerifyReport
from bothy.engine.auditsegments import verify_register

__all__ = ["BESIDE_FROM_BYTES", "ChainCheck", "Checked"]

BESIDE_FROM_BYTES = 1 << 20  # 1 MiB: ~1,500 records, a walk of ~15 ms here

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """A verdict on the whole chain, and what it cost the start."""

    report: VerifyReport
    walk_ms: float  # the walk itself, wherever it ran
    waited_ms: float  # how long the start waited for it (the walk, when made in-process)
    beside: bool  # a process of its own made the walk


class ChainCheck:
    """The walk of one register, started beside the start when that gains (:meth:`start`)."""

    def __init__(self, register: Path, process: subprocess.Popen[bytes] | None) -> None:
        self._register = register
        self._process = process

    @classmethod
    def start(cls, register: Path) -> ChainCheck:
        """Start the walk of ``register`` in a child when it is large enough and a second
        core can take it; otherwise :meth:`checked` walks it in-process."""
        return cls(register, _spawned(register) if _worth_a_process(register) else None)

    @classmethod
    def in_process(cls, register: Path) -> ChainCheck:
        """The walk made by :meth:`checked` itself (a daemon run inside another program)."""
        return cls(register, None)

    @property
    def beside(self) -> bool:
        """Whether a child is making the walk."""
        return self._process is not None

    async def checked(self) -> Checked:
        """The verdict: the child's, or, when there is no child or it gave none, the walk
        made here (in a thread: the event loop goes on)."""
        import asyncio  # serve's already; the child, which only walks, goes without it

        waiting = time.perf_counter()
        process, self._process = self._process, None  # taken: close() leaves it to us
        if process is not None:
            try:
                verdict = await asyncio.to_thread(_verdict_of, process, self._register)
            except BaseException:  # cancelled: the thread waiting on it is freed, and reaps it
                process.kill()
                raise
            if verdict is not None:
                report, walk_ms = verdict
                return Checked(report, walk_ms, _ms_since(waiting), beside=True)
        report = await asyncio.to_thread(verify_register, self._register)
        elapsed_ms = _ms_since(waiting)
        return Checked(report, elapsed_ms, elapsed_ms, beside=False)

    def close(self) -> None:
        """End a child whose verdict nobody will take (serve stopped before its check)."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.communicate()  # reaped, and its pipes closed


def _worth_a_process(register: Path) -> bool:
    try:
        size = register.stat().st_size
    except OSError:  # none yet (a new site), or unreadable: the in-process walk says which
        return False
    return size >= BESIDE_FROM_BYTES and _cores() > 1


def _cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _spawned(register: Path) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, str(register)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        _log.warning("the register's check could not start beside the start (%s); serve walks"
                     " it itself", exc)
        return None


def _verdict_of(
    process: subprocess.Popen[bytes], register: Path
) -> tuple[VerifyReport, float] | None:
    """The child's verdict and its walk's time (ms), or None (logged) when it gave none."""
    out, err = process.communicate()
    code = process.returncode
    why = (None if code == 0 else f"it was ended by {signal.Signals(-code).name}" if code < 0
           else f"it exited with code {code}")
    if why is None:
        try:
            return _decoded(out)
        except (ValueError, KeyError, TypeError) as exc:
            why = f"its answer is not a verdict ({exc})"
    tail = err.decode("utf-8", "replace").strip()[-300:]
    _log.warning("the check of %s made beside the start gave no verdict: %s%s; serve walks the"
                 " chain itself", register, why, f" ({tail})" if tail else "")
    return None


# -- the verdict's line, between the child and serve -------------------------------------


def _encoded(report: VerifyReport, walk_ms: float) -> str:
    fields = dataclasses.asdict(report)
    fields["fault"] = report.fault.value if report.fault is not None else None
    fields["repaired_at"] = list(report.repaired_at)
    return json.dumps({"report": fields, "walk_ms": walk_ms})


def _decoded(out: bytes) -> tuple[VerifyReport, float]:
    answer = json.loads(out)
    fields = dict(answer["report"])
    fields["fault"] = Fault(fields["fault"]) if fields["fault"] is not None else None
    fields["repaired_at"] = tuple(fields["repaired_at"])
    return VerifyReport(**fields), float(answer["walk_ms"])


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def main(argv: list[str]) -> int:
    """The child: walk the register named in ``argv``, print the verdict as one line."""
    if len(argv) != 1:
        print("usage: python -m bothy.engine.chaincheck REGISTER", file=sys.stderr)
        return 2
    started = time.perf_counter()
    report = verify_register(Path(argv[0]))
    print(_encoded(report, _ms_since(started)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
