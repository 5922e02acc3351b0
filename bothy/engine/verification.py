"""A job that checks its own work (SPEC §5 "Verification").

After a turn completes, an argv command runs in the workspace (exit 0 = good; it gets the
worker's scrubbed environment, never Bothy's secrets) or a regular expression is searched in
the final answer. On failure the run starts a new turn in the same thread telling the model
what failed, up to ``max_attempts``; the run ends ``verified`` or ``unverified``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bothy.engine.procgroup import ProcessGroup
from bothy.errors import ProcessGroupError

_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class Verification:
    """How a job checks its own work: an argv run in the workspace (exit 0 = good), or a
    regular expression the final answer must contain; up to ``max_attempts`` turns."""

    argv: list[str] | None = None
    regex: str | None = None
    max_attempts: int = 5
    timeout_s: float = 120.0



async def verification_failure(
    check: Verification, text: str, workspace: Path, *, env: Mapping[str, str]
) -> str | None:
    """What failed, or None when the work verifies."""
    if check.regex is not None and not re.search(check.regex, text, re.MULTILINE):
        return f"the final answer does not match /{check.regex}/"
    if check.argv is None:
        return None
    try:
        group = await ProcessGroup.spawn(check.argv, env=env, cwd=workspace,
                                         stdin=asyncio.subprocess.DEVNULL,
                                         stderr=asyncio.subprocess.STDOUT)
    except ProcessGroupError as exc:
        return f"the verification command could not start: {exc}"
    assert group.process.stdout is not None
    try:
        async with asyncio.timeout(check.timeout_s):
            output = await group.process.stdout.read(64_000)
            code = await group.process.wait()
    except TimeoutError:
        return f"the verification command did not finish within {check.timeout_s:g} s"
    finally:
        await group.stop(grace_s=2.0)
    if code == 0:
        return None
    tail = _CONTROL.sub("", output.decode(errors="replace"))[-1500:].strip()
    return f"`{' '.join(check.argv)}` exited with code {code}" + (f":\n{tail}" if tail else "")
