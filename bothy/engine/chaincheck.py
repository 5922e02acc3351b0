"""The whole register verified for `bothy serve` in a process of its own, beside its start
and beside its event loop (issue 18).

`bothy serve` verifies the whole chain before its first record (docs/AUDIT.md). The walk is
Python on one core (a JSON decode and a sha256 for each record): here ~285 ms for half a year
of a busy site's register (25 MB, 36,600 records), and it grows with the register. The rest
of the start, its imports above all, takes as long again on the same core, and neither can
run beside the other in one interpreter. So `bothy serve` first of all starts the walk in a
child interpreter that imports only the register's reading modules (and a few of the standard
library's), and takes its verdict where it would have made the walk itself: on a machine with
a second core the walk is done beside the imports.

The child runs the very ``bothy`` the serve runs (its package directory first on the child's
path, the working directory left off it: ``-P``), makes the same walk as every other reader
(:func:`verify_register`), reads only, and prints its verdict as one line of JSON. If it gives
none (it was killed, it crashed, it took longer than :func:`_patience_s`, its line is not a
verdict), serve logs why and walks the chain itself, as before: a start never goes without the
check. A register under :data:`BESIDE_FROM_BYTES`, or a machine with one core, keeps the walk
in-process: there a child's interpreter would cost more than it saves.

The daily head (engine/headpublisher.py) walks the chain the same way: a long register's walk
then leaves serve's core to its event loop instead of taking turns with it for the GIL.

Whichever made it, the verdict is of the register as the walk read it, a few hundred
milliseconds before serve's first record at most. What another process appends meanwhile is
checked by serve's first append, as every writer checks what was appended since the checkpoint
(engine/auditwriter.py). A serve killed while it waits leaves its child to end its read and
exit on its own (it writes nothing; a service manager stopping the unit ends it with serve).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bothy
from bothy.engine.auditchain import Fault, VerifyReport
from bothy.engine.auditsegments import verify_register
from bothy.exitcodes import ExitCode

if TYPE_CHECKING:
    import asyncio

__all__ = ["BESIDE_FROM_BYTES", "ChainCheck", "Checked"]

BESIDE_FROM_BYTES = 1 << 20  # 1 MiB: ~1,500 records, a walk of ~15 ms here

# The child: the serve's own bothy first on its path (argv[1]), then main(register).
_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]);"
          " from bothy.engine.chaincheck import main; sys.exit(main(sys.argv[2:]))")
_BOTHY_ROOT = str(Path(bothy.__file__).resolve().parent.parent)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """A verdict on the whole chain, and what it cost the start."""

    report: VerifyReport
    walk_ms: float  # the walk itself, wherever it ran
    waited_ms: float  # how long the start waited for the verdict, from asking for it
    beside: bool  # a process of its own made the walk


class ChainCheck:
    """The walk of one register, started beside the start when that gains (:meth:`start`);
    its verdict taken once (:meth:`checked`), or the walk ended unread (:meth:`close`)."""

    def __init__(self, register: Path, child: asyncio.subprocess.Process | None,
                 patience_s: float = 0.0) -> None:
        self.register = register
        self._child = child
        self._patience_s = patience_s
        self._taken = False

    @classmethod
    async def start(cls, register: Path, *, patience_s: float | None = None) -> ChainCheck:
        """Start the walk of ``register`` in a child when it is large enough and a second
        core can take it; otherwise :meth:`checked` walks it in-process. ``patience_s``: how
        long the child may walk (default :func:`_patience_s`; an in-process caller, a test,
        may set it)."""
        if not _worth_a_process(register):
            return cls(register, None)
        patience = _patience_s(register) if patience_s is None else patience_s
        return cls(register, await _spawned(register), patience)

    @classmethod
    def in_process(cls, register: Path) -> ChainCheck:
        """The walk made by :meth:`checked` itself (a daemon run inside another program)."""
        return cls(register, None)

    @property
    def beside(self) -> bool:
        """Whether a child is making the walk."""
        return self._child is not None

    async def checked(self) -> Checked:
        """The verdict: the child's, or, when there is no child or it gave none, the walk
        made here (in a thread: the event loop goes on). Taken once."""
        import asyncio  # serve's already; the child, which only walks, goes without it

        if self._taken:
            raise RuntimeError(f"the check of {self.register} was taken already")
        self._taken = True
        asked = time.perf_counter()
        child, self._child = self._child, None
        if child is not None:
            verdict = await _verdict_of(child, self.register, self._patience_s)
            if verdict is not None:
                report, walk_ms = verdict
                return Checked(report, walk_ms, _ms_since(asked), beside=True)
        walking = time.perf_counter()
        report = await asyncio.to_thread(verify_register, self.register)
        return Checked(report, _ms_since(walking), _ms_since(asked), beside=False)

    async def close(self) -> None:
        """End a child whose verdict nobody took (a start that failed before its check)."""
        child, self._child = self._child, None
        if child is not None:
            await _ended(child)


def _worth_a_process(register: Path) -> bool:
    try:
        size = register.stat().st_size
    except OSError:  # none yet (a new site), or unreadable: the in-process walk says which
        return False
    return size >= BESIDE_FROM_BYTES and _cores() > 1


def _cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    import os

    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _patience_s(register: Path) -> float:
    """How long a child may walk: a minute, and a second more per MB (the walk reads ~100 MB
    a second here); past it, serve takes the walk back."""
    try:
        return 60.0 + register.stat().st_size / 1e6
    except OSError:
        return 60.0


async def _spawned(register: Path) -> asyncio.subprocess.Process | None:
    import asyncio

    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-c", _CHILD, _BOTHY_ROOT, str(register),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
    except (OSError, ValueError, TypeError) as exc:  # (no interpreter to name: TypeError)
        _log.warning("the register's check could not start beside the start (%s); serve walks"
                     " the chain itself", exc)
        return None


async def _verdict_of(
    child: asyncio.subprocess.Process, register: Path, patience_s: float
) -> tuple[VerifyReport, float] | None:
    """The child's verdict and its walk's time (ms), or None (logged) when it gave none.
    Cancelled, it ends the child first."""
    import asyncio

    try:
        async with asyncio.timeout(patience_s):
            out, err = await child.communicate()
    except TimeoutError:
        await _ended(child)
        why, err = f"it had not answered after {patience_s:g} s", b""
    except BaseException:
        await asyncio.shield(_ended(child))
        raise
    else:
        exited = _exit_problem(child.returncode)
        if exited is not None:
            why = exited
        else:
            try:
                return _decoded(out)
            except (ValueError, KeyError, TypeError) as exc:
                why = f"its answer is not a verdict ({exc})"
    tail = err.decode("utf-8", "replace").strip()[-300:]
    _log.warning("the check of %s made beside the start gave no verdict: %s%s; serve walks the"
                 " chain itself", register, why, f" ({tail})" if tail else "")
    return None


async def _ended(child: asyncio.subprocess.Process) -> None:
    """Kill ``child`` unless it has exited, and reap it."""
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # exited just now: reaped below
            child.kill()
    await child.wait()


def _exit_problem(code: int | None) -> str | None:
    """What the child's exit says went wrong; None for a clean exit."""
    if code == 0:
        return None
    if code is None or code > 0:
        return f"it exited with code {code}"
    try:
        return f"it was ended by {signal.Signals(-code).name}"
    except ValueError:  # a signal the enum does not name (a real-time one)
        return f"it was ended by signal {-code}"


# -- the verdict's line, between the child and serve -------------------------------------


def _encoded(report: VerifyReport, walk_ms: float) -> str:
    fields = dataclasses.asdict(report)
    fields["fault"] = report.fault.value if report.fault is not None else None
    fields["repaired_at"] = list(report.repaired_at)
    return json.dumps({"report": fields, "walk_ms": walk_ms})


def _decoded(out: bytes) -> tuple[VerifyReport, float]:
    """The child's line as a verdict; ValueError, KeyError or TypeError when it is not one."""
    answer = json.loads(out)
    fields = dict(answer["report"])
    _expect(fields, {"ok": (bool,), "count": (int,), "first_bad_seq": (int, type(None)),
                     "line_no": (int, type(None)), "problem": (str,),
                     "fault": (str, type(None)), "last_seq": (int,), "last_hash": (str,),
                     "repaired_at": (list,)})
    fields["fault"] = Fault(fields["fault"]) if fields["fault"] is not None else None
    fields["repaired_at"] = tuple(fields["repaired_at"])
    if not all(type(seq) is int for seq in fields["repaired_at"]):
        raise TypeError("repaired_at holds something other than record numbers")
    walk_ms = answer["walk_ms"]
    if type(walk_ms) not in (int, float):
        raise TypeError(f"walk_ms is {type(walk_ms).__name__}, not a number")
    return VerifyReport(**fields), float(walk_ms)


def _expect(fields: dict[str, Any], kinds: dict[str, tuple[type, ...]]) -> None:
    if set(fields) != set(kinds):
        raise KeyError(f"fields {sorted(fields)}, not {sorted(kinds)}")
    for name, allowed in kinds.items():
        if type(fields[name]) not in allowed:
            raise TypeError(f"{name} is {type(fields[name]).__name__}")


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def main(argv: list[str]) -> int:
    """The child (see ``_CHILD``): walk the register named in ``argv``, print the verdict as
    one line. Its exit code is read by :func:`_verdict_of` alone."""
    if len(argv) != 1:
        print("usage: the register's path, the only argument", file=sys.stderr)
        return ExitCode.USAGE
    started = time.perf_counter()
    report = verify_register(Path(argv[0]))
    print(_encoded(report, _ms_since(started)))
    return ExitCode.OK
