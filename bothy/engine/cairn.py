"""Cairn, the family's optional task ledger, spoken to through its command line (SPEC §9).

No public Cairn has the command line the product page assumes, so Bothy defines the contract
(``docs/CAIRN.md``) and runs the configured command (``cairn.command``, default ``["cairn"]``)
once per step::

    cairn claim REF --by RUN_ID      exit 0: claimed; exit 3: held by someone else (stdout: who)
    cairn show REF --brief           exit 0: the brief on stdout
    cairn note REF - --kind note     exit 0: the note (read from stdin) is written
    cairn release REF --by RUN_ID    exit 0: released, or was not held by RUN_ID

Any other exit is that step failing, its stderr the reason; output that is not UTF-8 text is
garbage, and that step failing too. Each step is a child like any other: its own process
group, a scrubbed environment, bounded by ``cairn.timeout_s`` (10 s at most), the group ended
whatever happens. Every answer is a value (:class:`Claimed`, :class:`Held`, :class:`Brief`,
:class:`Done`, :class:`StepFailed`): Cairn missing, slow or broken never raises.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bothy.config import CairnConfig
from bothy.engine.procgroup import ProcessGroup
from bothy.errors import ProcessGroupError

__all__ = [
    "BRIEF_MAX_CHARS",
    "HELD_EXIT_CODE",
    "Brief",
    "Cairn",
    "Claimed",
    "Done",
    "Held",
    "StepFailed",
    "ref_problem",
]

REF_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
BRIEF_MAX_CHARS = 6_000
HELD_EXIT_CODE = 3

# What a step's child may see: enough to run, no credential. ``cairn.env`` names the rest.
_BASELINE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
_OUTPUT_MAX_BYTES = 1 << 20  # kept of a step's stdout; the rest is read and dropped
_REASON_MAX_CHARS = 300
_STOP_GRACE_S = 1.0
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


def ref_problem(ref: str) -> str | None:
    """Why ``ref`` cannot name a task (it reaches Cairn's command line), or None."""
    if REF_PATTERN.fullmatch(ref):
        return None
    return (f"{ref[:80]!r} is not a task reference: expected 1 to 64 letters, digits, '.', '_'"
            " or '-', starting with a letter or digit (e.g. ACME-12)")


@dataclass(frozen=True)
class Claimed:
    """The task is this run's until it is released."""

    ref: str


@dataclass(frozen=True)
class Held:
    """Someone else holds the task (claim exit 3); ``holder`` is what Cairn said of them."""

    ref: str
    holder: str


@dataclass(frozen=True)
class Brief:
    """The task's brief, as Cairn printed it (untrusted: frame it before a model sees it)."""

    ref: str
    text: str


@dataclass(frozen=True)
class Done:
    """A note or a release that Cairn acknowledged."""

    step: str
    ref: str


@dataclass(frozen=True)
class StepFailed:
    """A step that did not happen as asked. ``ran`` is False when the command never started
    (missing, not executable): then Cairn cannot have done anything."""

    step: str
    ref: str
    reason: str
    ran: bool = True


@dataclass(frozen=True)
class _Exit:
    code: int
    stdout: bytes
    stderr: bytes


class Cairn:
    """The configured ``cairn`` command, one bounded child per step."""

    def __init__(
        self, cfg: CairnConfig, *, cwd: Path, environ: Mapping[str, str] | None = None
    ) -> None:
        env_in = os.environ if environ is None else environ
        self._argv = list(cfg.command)
        self._timeout_s = cfg.timeout_s
        self._cwd = cwd
        self._env = {name: env_in[name] for name in _BASELINE_ENV if name in env_in}
        self._env.update({name: env_in[name] for name in cfg.env if name in env_in})

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def missing(self) -> str | None:
        """Why the command cannot be run at all (not on PATH, not executable), or None."""
        name = self._argv[0]
        path = self._env.get("PATH", os.defpath)
        found = shutil.which(name, path=path) if os.sep not in name else name
        if found is None:
            return f"cairn command {name!r} not found on PATH"
        if not os.path.isfile(found) or not os.access(found, os.X_OK):
            return f"cairn command {found!r} is not an executable file"
        return None

    async def probe(self) -> str | None:
        """Why Cairn cannot be reached (``cairn --version`` within the timeout), or None."""
        answer = await self._call("probe", "", ["--version"])
        if isinstance(answer, StepFailed):
            return answer.reason
        return None if answer.code == 0 else self._failed("probe", "", answer).reason

    async def claim(self, ref: str, run_id: str) -> Claimed | Held | StepFailed:
        """Take the task for ``run_id``; :class:`Held` names whoever has it instead."""
        answer = await self._call("claim", ref, ["claim", ref, "--by", run_id])
        if isinstance(answer, StepFailed):
            return answer
        if answer.code == HELD_EXIT_CODE:
            return Held(ref, _holder(answer.stdout))
        if answer.code != 0:
            return self._failed("claim", ref, answer)
        return Claimed(ref)

    async def brief(self, ref: str) -> Brief | StepFailed:
        """The task's brief (stdout of ``cairn show REF --brief``)."""
        answer = await self._call("brief", ref, ["show", ref, "--brief"])
        if isinstance(answer, StepFailed):
            return answer
        if answer.code != 0:
            return self._failed("brief", ref, answer)
        return Brief(ref, answer.stdout.decode())  # _call proved it is UTF-8 text

    async def note(self, ref: str, text: str) -> Done | StepFailed:
        """Write ``text`` to the task as a note (on the command's stdin)."""
        answer = await self._call("note", ref, ["note", ref, "-", "--kind", "note"],
                                  stdin=text.encode())
        if isinstance(answer, StepFailed):
            return answer
        return Done("note", ref) if answer.code == 0 else self._failed("note", ref, answer)

    async def release(self, ref: str, run_id: str) -> Done | StepFailed:
        """Give the task back (a task ``run_id`` does not hold is left as it is)."""
        answer = await self._call("release", ref, ["release", ref, "--by", run_id])
        if isinstance(answer, StepFailed):
            return answer
        if answer.code != 0:
            return self._failed("release", ref, answer)
        return Done("release", ref)

    def _failed(self, step: str, ref: str, answer: _Exit) -> StepFailed:
        how = (f"was killed by signal {-answer.code}" if answer.code < 0
               else f"exited with code {answer.code}")
        said = _last_line(answer.stderr)
        return StepFailed(step, ref, f"cairn {step} {how}" + (f": {said}" if said else ""))

    async def _call(
        self, step: str, ref: str, args: Sequence[str], *, stdin: bytes | None = None
    ) -> _Exit | StepFailed:
        """Run one step under the timeout; the answer, or why there is none."""
        problem = self.missing()
        if problem is not None:
            return StepFailed(step, ref, problem, ran=False)
        try:
            group = await ProcessGroup.spawn(
                [*self._argv, *args], env=self._env, cwd=self._cwd,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            )
        except ProcessGroupError as exc:
            return StepFailed(step, ref, f"cairn {step} could not start: {exc}", ran=False)
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await _exchange(group, stdin)
        except TimeoutError:
            return StepFailed(step, ref, f"cairn {step} did not answer within"
                                         f" {self._timeout_s:g} s")
        finally:
            await asyncio.shield(group.stop(grace_s=_STOP_GRACE_S, kill_wait_s=_STOP_GRACE_S))
        garbage = _garbage(answer.stdout)
        if garbage is not None:
            return StepFailed(step, ref, f"cairn {step} answered garbage: {garbage}"
                                         f" (exit code {answer.code})")
        return answer


async def _exchange(group: ProcessGroup, stdin: bytes | None) -> _Exit:
    process = group.process
    assert process.stdout is not None and process.stderr is not None
    writing = asyncio.create_task(_write(process.stdin, stdin))
    try:
        stdout, stderr = await asyncio.gather(_read(process.stdout), _read(process.stderr))
        await writing
        code = await process.wait()
    finally:
        writing.cancel()
    return _Exit(code, stdout, stderr)


async def _write(pipe: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if pipe is None or data is None:
        return
    try:
        pipe.write(data)
        await pipe.drain()
        pipe.close()
        await pipe.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command did not read its stdin: its exit code will say how it went


async def _read(stream: asyncio.StreamReader) -> bytes:
    """The stream to its end, keeping the first ``_OUTPUT_MAX_BYTES``."""
    kept = bytearray()
    while chunk := await stream.read(65_536):
        room = _OUTPUT_MAX_BYTES - len(kept)
        if room > 0:
            kept += chunk[:room]
    return bytes(kept)


def _garbage(stdout: bytes) -> str | None:
    """What makes ``stdout`` garbage rather than text, or None."""
    try:
        text = stdout.decode()
    except UnicodeDecodeError as exc:
        return f"its output is not UTF-8 text (byte {exc.start})"
    if "\x00" in text:
        return "its output holds NUL bytes"
    return None


def _clean(text: str) -> str:
    return _CONTROL.sub("", text).strip()


def _last_line(raw: bytes) -> str:
    lines = [line for line in _clean(raw.decode(errors="replace")).splitlines() if line.strip()]
    return lines[-1][:_REASON_MAX_CHARS] if lines else ""


def _holder(stdout: bytes) -> str:
    lines = [line for line in _clean(stdout.decode()).splitlines() if line.strip()]
    return lines[0].strip()[:_REASON_MAX_CHARS] if lines else "someone else (Cairn did not say who)"
