"""A heartbeat's preflight: a cheap command that decides whether the model is woken at all.

An idle site should cost nothing. ``bothy schedule add … --heartbeat --preflight-cmd ARGV``
runs ``ARGV`` first at every fire, like a ``--verify-cmd``: in the workspace, as the leader of
its own process group, with the worker's scrubbed environment (never Bothy's secrets), stdin
closed, stdout and stderr together. The model is woken only when the command exits non-zero,
or when its output differs from the last fire's (compared by SHA-256 of at most
:data:`OUTPUT_CAP_BYTES`), or when it cannot start or does not finish within
:data:`TIME_LIMIT_S` — a check that cannot tell is no reason to stay quiet. Otherwise the fire
is quiet: no run, no reservation, no cost.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.procgroup import ProcessGroup
from bothy.errors import ProcessGroupError

__all__ = ["OUTPUT_CAP_BYTES", "TIME_LIMIT_S", "Preflight", "PreflightSeen"]

TIME_LIMIT_S = 30.0
OUTPUT_CAP_BYTES = 64 * 1024
_CHUNK_BYTES = 16 * 1024
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class PreflightSeen:
    """What one fire's preflight saw: whether to wake the model, why, and what to keep."""

    woken: bool
    why: str  # e.g. "exited with code 1", "its output is unchanged"
    sha256: str | None  # the output's hash, for the next fire (None: nothing to compare)
    output: str  # what it printed (capped, control characters removed), for the prompt
    exit_code: int | None = None


class Preflight:
    """Runs a heartbeat's preflight command and compares it with the last fire's."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str],
                 time_limit_s: float = TIME_LIMIT_S) -> None:
        self._argv = list(argv)
        self._cwd = cwd
        self._env = env
        self._time_limit_s = time_limit_s

    @property
    def command(self) -> str:
        return " ".join(self._argv)

    async def check(self, last_sha256: str | None) -> PreflightSeen:
        """Run the command once; the model is woken unless it exits 0 with the output the
        last fire saw."""
        try:
            group = await ProcessGroup.spawn(self._argv, env=self._env, cwd=self._cwd,
                                             stdin=asyncio.subprocess.DEVNULL,
                                             stderr=asyncio.subprocess.STDOUT)
        except ProcessGroupError as exc:
            return PreflightSeen(True, f"could not start: {exc}", None, "")
        try:
            async with asyncio.timeout(self._time_limit_s):
                output, cut = await _read_capped(group)
                code = await group.process.wait()
        except TimeoutError:
            return PreflightSeen(True, f"did not finish within {self._time_limit_s:g} s",
                                 None, "")
        finally:
            await group.stop(grace_s=2.0)
        sha256 = hashlib.sha256(output).hexdigest()
        shown = _CONTROL.sub("", output.decode(errors="replace")).strip()
        if cut:
            shown += f"\n[output past {OUTPUT_CAP_BYTES} bytes not shown nor compared]"
        if code != 0:
            return PreflightSeen(True, f"exited with code {code}", sha256, shown, code)
        if last_sha256 is None:
            return PreflightSeen(True, "its output has no earlier fire to compare with",
                                 sha256, shown, code)
        if sha256 != last_sha256:
            return PreflightSeen(True, "its output changed since the last fire", sha256,
                                 shown, code)
        return PreflightSeen(False, "exited 0 with the output of the last fire", sha256,
                             shown, code)


async def _read_capped(group: ProcessGroup) -> tuple[bytes, bool]:
    """Everything the command prints up to the cap; the rest is read and dropped (a command
    blocked on a full pipe would only time out). True when something was dropped."""
    stdout = group.process.stdout
    assert stdout is not None
    kept = bytearray()
    cut = False
    while chunk := await stdout.read(_CHUNK_BYTES):
        room = OUTPUT_CAP_BYTES - len(kept)
        kept += chunk[:room]
        cut = cut or len(chunk) > room
    return bytes(kept), cut
